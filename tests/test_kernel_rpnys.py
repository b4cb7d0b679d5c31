"""Fused binned RPNys kernel (kvcompress.kernels.rpnys) behind ``compress_kv(backend="triton")`` vs the reference.

The kernel runs compiled on CUDA tensors where CUDA is present and in the Triton interpreter on CPU tensors
elsewhere (tests/triton_mode.py). The interpreter costs ~0.2-0.4 s per program (= per bin), so the shapes stay
small.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("triton", reason="triton is not installed (the kernel tests need it, CPU interpreter mode)")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton_mode import DEVICE, INTERPRET  # noqa: E402

from kvcompress import compress_kv, nystrom, rng, weighted_attention  # noqa: E402
from kvcompress.kernels import rpnys as rpnys_kernel  # noqa: E402

if rpnys_kernel.INTERPRET != INTERPRET:
    pytest.skip("kernel module was defined in the other Triton mode (imported too early)", allow_module_level=True)

# Relative agreement (max abs difference / max abs of the reference) of V_S and w in float32: the rank-one updates
# run in the same order as the reference; only reduction orders differ (measured: ~1e-6).
RTOL32 = 1e-4
# fp16 / bf16 outputs: V_S is rounded to the input dtype by both backends (<= 1 ulp apart); w stays float32.
RTOL_V = {torch.float32: RTOL32, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((ours.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def assert_same_compression(ours, ref, dtype=torch.float32):
    """Same pivots (K_S bit-exact), V_S and w within the stated tolerances; inert rows identical."""
    k_t, v_t, w_t = ours
    k_r, v_r, w_r = ref
    assert k_t.dtype == k_r.dtype and v_t.dtype == v_r.dtype and w_t.dtype == w_r.dtype == torch.float32
    assert torch.equal(k_t, k_r), "different pivots"
    assert rel_err(v_t, v_r) <= RTOL_V[dtype]
    assert rel_err(w_t, w_r) <= RTOL32
    assert torch.equal(w_t == 0, w_r == 0)


def make_inputs(lead, n, d, d_v, dtype=torch.float32, seed=0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    keys = (torch.randn(*lead, n, d, generator=gen) * 1.5 + 0.3).to(device, dtype)
    values = torch.randn(*lead, n, d_v, generator=gen).to(device, dtype)
    return keys, values


# ---------------------------------------------------------------- the hash (rng.py) in uint32


@triton.jit
def _mix32_probe(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs).to(tl.uint32, bitcast=True)
    tl.store(out_ptr + offs, rpnys_kernel._mix32(x).to(tl.int32, bitcast=True))


def test_uint32_mix32_equals_reference_hash():
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 2**32, (256,), generator=gen, dtype=torch.int64)
    x[:4] = torch.tensor([0, 1, 2**31, 2**32 - 1])
    out = torch.empty(256, dtype=torch.int32, device=DEVICE)
    _mix32_probe[(1,)](torch.where(x >= 2**31, x - 2**32, x).to(DEVICE, torch.int32), out, N=256)
    assert torch.equal(out.cpu().to(torch.int64) % 2**32, rng.mix32(x))


# ---------------------------------------------------------------- same pivots, same V_S and w


@pytest.mark.parametrize(
    ("lead", "n", "bins", "bin_rank", "strided"),
    [((2, 2), 203, 4, 12, True), ((1,), 500, 40, 12, False)],
    ids=["n203-bins4-k12-strided", "n500-bins40-k12"],
)
def test_triton_matches_torch_fp32(lead, n, bins, bin_rank, strided):
    keys, values = make_inputs(lead, n, 64, 48, seed=n)
    if strided:  # [..., n, d] views of [..., d, n] storage: the kernel takes strides, no copy
        keys = keys.transpose(-1, -2).contiguous().transpose(-1, -2)
        values = values.transpose(-1, -2).contiguous().transpose(-1, -2)
    rank = bins * bin_rank
    ref = compress_kv(keys, values, rank, bins=bins, seed=11, backend="torch")
    ours = compress_kv(keys, values, rank, bins=bins, seed=11, backend="triton")
    assert ours[0].shape == (*lead, rank, 64) and ours[1].shape == (*lead, rank, 48) and ours[2].shape == (*lead, rank)
    assert_same_compression(ours, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_matches_torch_half(dtype):
    keys, values = make_inputs((2,), 203, 64, 64, dtype=dtype, seed=3)
    ref = compress_kv(keys, values, 48, bins=4, seed=5, backend="torch")
    ours = compress_kv(keys, values, 48, bins=4, seed=5, backend="triton")
    assert_same_compression(ours, ref, dtype)


def test_query_radius_and_scaling():
    keys, values = make_inputs((2,), 64, 32, 16, seed=9)
    kwargs = {"bins": 2, "seed": 123, "scaling": 0.3, "query_radius": torch.tensor([1.0, 6.0], device=DEVICE)}
    assert_same_compression(
        compress_kv(keys, values, 16, backend="triton", **kwargs),
        compress_kv(keys, values, 16, backend="torch", **kwargs),
    )


def test_exhausted_bin_gives_inert_rows_like_reference():
    gen = torch.Generator().manual_seed(8)
    d, n, bins, bin_rank = 8, 41, 2, 8
    distinct = torch.randn(2, 3, d, generator=gen) * 2
    pick = torch.randint(0, 3, (n,), generator=gen)
    keys = torch.cat([distinct[0, pick[:21]], distinct[1, pick[21:]]])[None].to(DEVICE)  # 3 distinct keys per bin
    values = torch.randn(1, n, d, generator=gen).to(DEVICE)
    ours = compress_kv(keys, values, bins * bin_rank, bins=bins, seed=0, backend="triton")
    ref = compress_kv(keys, values, bins * bin_rank, bins=bins, seed=0, backend="torch")
    assert_same_compression(ours, ref)
    k_s, v_s, w = (x.reshape(bins, bin_rank, -1) for x in ours)
    inert = w[..., 0] == 0
    assert inert.sum(-1).tolist() == [5, 5]  # 3 pivots exhaust each bin's residual
    assert torch.all(v_s[inert] == 0)
    assert torch.equal(k_s[inert], k_s[:, :1].expand(bins, bin_rank, d)[inert])  # inert rows repeat pivot 1


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_float32_overflow_falls_back_like_reference():
    # Keys of norm ~110 in pairs (x, 1.2 x): exp(|y|^2 / 2) leaves float32, the reference redoes it in float64.
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(16, 64, generator=gen) * 14
    keys = torch.stack([base, base * 1.2], 1).reshape(1, 32, 64).to(DEVICE)
    values = torch.randn(1, 32, 16, generator=gen).to(DEVICE)
    ours = compress_kv(keys, values, 16, seed=3, backend="triton")
    ref = compress_kv(keys, values, 16, seed=3, backend="torch")
    assert torch.isfinite(ref[2]).all()
    for x, y in zip(ours, ref, strict=True):
        assert torch.equal(x, y)


def test_bins_past_float32s_range_fall_back_like_reference():
    """Log-normal key norms and a large query radius: the map-back factor leaves float32's range where float32
    flushes the Gaussian entries to 0. The kernel reports the bin as non-finite, as the float32 reference does, so
    both end in the same float64 computation."""
    gen = torch.Generator().manual_seed(39)
    keys = (torch.exp(1.5 * torch.randn(128, 1, generator=gen)) * torch.randn(128, 16, generator=gen)).to(DEVICE)
    values = torch.randn(128, 16, generator=gen).to(DEVICE)
    radius = float(keys.norm(dim=-1).max())
    ours = compress_kv(keys, values, 16, query_radius=radius, seed=0, backend="triton")
    ref = compress_kv(keys, values, 16, query_radius=radius, seed=0, backend="torch")
    assert torch.isfinite(ref[2]).all()
    for x, y in zip(ours, ref, strict=True):
        assert torch.equal(x, y)


# ---------------------------------------------------------------- the attention error is the same


def test_attention_error_statistically_equal():
    """Over 20 seeds: the same seed gives the same error; the means over disjoint seeds agree within 3 s.e."""
    gen = torch.Generator().manual_seed(42)
    n, d, rank = 64, 8, 8
    keys = torch.randn(1, 1, n, d, generator=gen).to(DEVICE)
    values = torch.randn(1, 1, n, d, generator=gen).to(DEVICE)
    queries = torch.randn(1, 2, 16, d, generator=gen).to(DEVICE)
    exact = torch.softmax(queries.double() @ keys.double().transpose(-1, -2) / math.sqrt(d), -1) @ values.double()

    def error(seed: int, backend: str) -> float:
        k_s, v_s, w = compress_kv(keys, values, rank, seed=seed, backend=backend)
        return (weighted_attention(queries, k_s, v_s, w).double() - exact).abs().max().item()

    ours = torch.tensor([error(s, "triton") for s in range(20)], dtype=torch.float64)
    same = torch.tensor([error(s, "torch") for s in range(20)], dtype=torch.float64)
    other = torch.tensor([error(s, "torch") for s in range(20, 40)], dtype=torch.float64)
    assert ((ours - same).abs() / same).max().item() <= 1e-3  # measured 3e-5
    assert (ours.mean() - same.mean()).abs().item() <= 1e-4 * same.mean().item()  # measured 2e-6
    se = math.sqrt(ours.var().item() / 20 + other.var().item() / 20)
    assert abs(ours.mean().item() - other.mean().item()) <= 3 * se
    # Sanity: better than the rank-free guess "every query attends uniformly" (the mean value).
    assert ours.mean().item() < (values.double().mean(-2, keepdim=True) - exact).abs().max().item()


# ---------------------------------------------------------------- backend selection


@pytest.mark.parametrize("backend", ["cuda", "Triton", "", None, 1])
def test_bad_backend_values(backend):
    keys, values = make_inputs((1,), 16, 8, 8)
    with pytest.raises(ValueError, match="backend"):
        compress_kv(keys, values, 4, seed=0, backend=backend)


def test_triton_refuses_what_it_cannot_run(monkeypatch):
    keys, values = make_inputs((1,), 300, 8, 8)
    with pytest.raises(ValueError, match="backend.*float64"):
        compress_kv(keys.double(), values.double(), 4, seed=0, backend="triton")
    with pytest.raises(ValueError, match="backend.*rank // bins <= 32"):
        compress_kv(keys, values, 33, seed=0, backend="triton")
    with pytest.raises(ValueError, match="backend.*bin length"):
        compress_kv(keys, values, 4, seed=0, backend="triton")  # one bin of 300 rows
    wide, _ = make_inputs((1,), 16, 512, 8)
    with pytest.raises(ValueError, match="backend.*head dims"):
        compress_kv(wide, values[..., :16, :], 4, seed=0, backend="triton")
    # Bins of 129-256 rows fit a tile only up to head dim 128 (a 256 x 256 fp32 tile overflows sm_90's shared memory).
    long_bins, long_values = make_inputs((1,), 2 * 200, 256, 8)
    with pytest.raises(ValueError, match=r"backend.*tiles up to 32768 elements.*256 x 256 \(bin length 200, d=256"):
        compress_kv(long_bins, long_values, 8, bins=2, seed=0, backend="triton")
    assert rpnys_kernel.unsupported(long_bins[..., :128], long_values, 2, 4) is None
    assert rpnys_kernel.unsupported(long_bins[..., :100, :], long_values[..., :100, :], 1, 4) is None  # 100 x 256
    monkeypatch.setattr(rpnys_kernel, "INTERPRET", False)
    with pytest.raises(ValueError, match="backend.*CUDA"):
        compress_kv(keys.cpu(), values.cpu(), 4, bins=2, seed=0, backend="triton")


def test_auto_is_torch_on_cpu_and_falls_back_outside_the_limits(monkeypatch):
    def no_kernel(*args, **kwargs):
        raise AssertionError("auto ran the kernel")

    monkeypatch.setattr(rpnys_kernel, "rpnys_compress", no_kernel)
    keys, values = make_inputs((2,), 300, 8, 8, device="cpu")
    for x, y in zip(
        compress_kv(keys, values, 8, bins=2, seed=1),
        compress_kv(keys, values, 8, bins=2, seed=1, backend="torch"),
        strict=True,
    ):
        assert torch.equal(x, y)
    # On a CUDA tensor "auto" would pick triton; outside the limits it stays on torch instead of raising.
    assert not nystrom._use_triton("auto", keys, values, 1, 8)
    assert not nystrom._use_triton("auto", keys.double(), values.double(), 2, 4)
