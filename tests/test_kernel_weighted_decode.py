"""Triton weighted decode kernel (kvcompress.kernels.weighted_decode) against the PyTorch reference.

Runs compiled on CUDA tensors where CUDA is present and in the Triton interpreter on CPU tensors elsewhere
(tests/triton_mode.py: ``DEVICE``).
"""

from __future__ import annotations

import sys

import pytest
import torch
from triton_mode import DEVICE, INTERPRET

pytest.importorskip("triton", reason="triton is not installed (the kernel tests need it, CPU interpreter mode)")

from kvcompress import weighted_attention  # noqa: E402
from kvcompress.attention import fold_value_range_  # noqa: E402
from kvcompress.kernels import weighted_decode  # noqa: E402

if weighted_decode.INTERPRET != INTERPRET:
    pytest.skip("kernel module was defined in the other Triton mode (imported too early)", allow_module_level=True)

# Absolute and relative, against the float64 reference on the same rounded inputs: 16-bit outputs are rounded to
# their dtype (unit roundoff u = 2^-11 fp16, 2^-8 bf16) after float32 sums, so 4u; float32 outputs carry the sums'
# rounding over n keys, about sqrt(n) u (n <= 32,768 here: 1.1e-5), and their exp's (a few ulp).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make_inputs(batch, heads_q, heads_kv, m, n, d, dtype, *, clip=False, seed=0, d_v=None, device=None):
    """Random decode inputs on ``device`` (default ``DEVICE``); some weights negative; KV head 0 of batch row 0
    has only negative weights."""
    gen = torch.Generator().manual_seed(seed)
    d_v = d if d_v is None else d_v
    q = torch.randn(batch, heads_q, m, d, generator=gen).to(dtype)
    k = torch.randn(batch, heads_kv, n, d, generator=gen).to(dtype)
    v = torch.randn(batch, heads_kv, n, d_v, generator=gen).to(dtype)
    w = torch.rand(batch, heads_kv, n, generator=gen) * 2 - 0.3
    w[0, 0] = -torch.rand(n, generator=gen) - 0.1  # denominator < 0 -> output 0 before clipping
    bounds = {}
    if clip:
        bounds["v_min"] = -0.05 - 0.1 * torch.rand(batch, heads_kv, d_v, generator=gen)
        bounds["v_max"] = 0.05 + 0.1 * torch.rand(batch, heads_kv, d_v, generator=gen)
    device = DEVICE if device is None else device
    bounds = {name: bound.to(device) for name, bound in bounds.items()}
    return q.to(device), k.to(device), v.to(device), w.to(device), bounds


def check_close(out, ref, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(
    "dtype, d, heads_q, heads_kv, m, n, clip",
    [
        (torch.float32, 64, 2, 2, 1, 1000, False),  # group 1
        (torch.float32, 128, 8, 2, 5, 1237, True),  # group 4, 5 new tokens
        (torch.float16, 128, 7, 1, 5, 1237, True),  # group 7 (not a power of two)
        (torch.float16, 64, 8, 2, 1, 1000, False),
        (torch.bfloat16, 64, 7, 1, 1, 333, True),
    ],
)
def test_triton_matches_torch_and_float64(dtype, d, heads_q, heads_kv, m, n, clip):
    q, k, v, w, bounds = make_inputs(2, heads_q, heads_kv, m, n, d, dtype, clip=clip, seed=n + m)
    kwargs = {"causal_offset": n - m, **bounds}
    out = weighted_attention(q, k, v, w, backend="triton", **kwargs)
    ref = weighted_attention(q, k, v, w, backend="torch", **kwargs)
    assert out.dtype == dtype and out.shape == (2, heads_q, m, d)
    check_close(out, ref, dtype)
    exact = weighted_attention(q.double(), k.double(), v.double(), w.double(), backend="torch", **kwargs)
    check_close(ref, exact, dtype)
    group = heads_q // heads_kv
    negative_head = out[0, :group].float()  # KV head 0 of batch row 0: den < 0 -> 0, then clipped
    expected = torch.zeros_like(negative_head)
    if clip:
        expected = expected.clamp(bounds["v_min"][0, 0], bounds["v_max"][0, 0]).to(dtype).float()
    assert torch.equal(negative_head, expected)


def test_split_counts_and_early_causal_offset_agree():
    """One split (single-launch path), a few, and > 16 splits (chunked merge); keys past c + m - 1 unread."""
    q, k, v, w, bounds = make_inputs(2, 8, 2, 3, 1237, 64, torch.float32, clip=True, seed=7)
    for offset in (1234, 600):
        ref = weighted_attention(q, k, v, w, causal_offset=offset, backend="torch", **bounds)
        for splits in (1, 3, 20):
            out = weighted_decode.weighted_decode_attention(
                q, k, v, w, scaling=0.125, causal_offset=offset, num_splits=splits, block_n=64, **bounds
            )
            check_close(out, ref, torch.float32)
    ref = weighted_attention(q, k, v, w, backend="torch")  # no causal rule: every key visible
    check_close(weighted_attention(q, k, v, w, backend="triton"), ref, torch.float32)


def test_causal_offset_read_on_device_equals_the_host_int():
    """A one-element int64 tensor as causal offset (static caches: no host value per step) gives the int's
    result, split or not, for one and several new tokens."""
    for m, offset in ((1, 1236), (5, 1000), (3, 0)):
        q, k, v, w, bounds = make_inputs(2, 8, 2, m, 1237, 64, torch.float32, clip=True, seed=m)
        ref = weighted_attention(q, k, v, w, causal_offset=offset, backend="torch", **bounds)
        device_offset = torch.tensor([offset], device=q.device)
        for splits in (None, 1, 5):
            out = weighted_decode.weighted_decode_attention(
                q, k, v, w, scaling=0.125, causal_offset=device_offset, num_splits=splits, **bounds
            )
            check_close(out, ref, torch.float32)


@pytest.mark.parametrize("splits, fused", [(1, False), (4, False), (4, True)])
def test_a_causal_offset_per_batch_row_reads_no_key_past_its_row(splits, fused):
    """A ``[b]`` causal offset (a decode batch's rows of different lengths, each new row at its own length): batch
    row i sees keys ``<= offset[i]``, as with the equivalent key mask, and its programs never read past them: the
    rows past each offset hold NaN, which any read would carry into the output (0 x NaN), and the outputs equal the
    reference over clean rows (float64, and the PyTorch path's [b] offset bit for bit against the key mask's).
    Each row's new row is folded into the clip range, as the server's step does."""
    n, batch, heads_kv = 300, 3, 2
    q, k, v, w, _ = make_inputs(batch, 3 * heads_kv, heads_kv, 1, n, 32, torch.bfloat16, clip=True, seed=31)
    offsets = torch.tensor([117, 299, 40], device=DEVICE)  # one row ends in the first of 4 splits, one in the last
    visible = torch.arange(n, device=DEVICE)[None, :] <= offsets[:, None]
    v_max = 0.5 + torch.rand(batch, heads_kv, 32, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    v_min = -v_max
    kwargs = dict(scaling=0.2, v_min=v_min, v_max=v_max)
    by_mask = weighted_attention(q, k, v, w, causal_offset=n - 1, key_mask=visible, backend="torch", **kwargs)
    exact = weighted_attention(q.double(), k.double(), v.double(), w.double(), causal_offset=n - 1,
                               key_mask=visible, backend="torch", **kwargs)  # fmt: skip
    check_close(by_mask, exact, torch.bfloat16)
    from kvcompress.attention import weighted_attention_unchecked

    cpu_bounds = {name: x.cpu() for name, x in kwargs.items() if name != "scaling"}
    torch_rows = weighted_attention_unchecked(q.cpu(), k.cpu(), v.cpu(), w.cpu(), causal_offset=offsets.cpu(),
                                              **cpu_bounds, scaling=0.2)  # fmt: skip
    by_mask_cpu = weighted_attention(q.cpu(), k.cpu(), v.cpu(), w.cpu(), causal_offset=n - 1, key_mask=visible.cpu(),
                                     backend="torch", **cpu_bounds, scaling=0.2)  # fmt: skip
    assert torch.equal(torch_rows, by_mask_cpu)  # both on the CPU: bit for bit is a claim about one device's path
    poisoned_k, poisoned_v = k.clone(), v.clone()
    poisoned_k[~visible[:, None, :, None].expand_as(k)] = float("nan")
    poisoned_v[~visible[:, None, :, None].expand_as(v)] = float("nan")
    want_min, want_max = v_min.clone(), v_max.clone()
    fold_value_range_(want_min, want_max, v, offsets)
    lo, hi = v_min.clone(), v_max.clone()
    out = weighted_decode.weighted_decode_attention(q, poisoned_k, poisoned_v, w, scaling=0.2, v_min=lo, v_max=hi,
                                                    causal_offset=offsets, fold_from=offsets, num_splits=splits,
                                                    fused_merge=fused)  # fmt: skip
    assert torch.isfinite(out).all()
    assert torch.equal(lo, want_min) and torch.equal(hi, want_max)
    check_close(out, weighted_attention(q, k, v, w, causal_offset=n - 1, key_mask=visible, backend="torch",
                                        scaling=0.2, v_min=want_min, v_max=want_max), torch.bfloat16)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_mask_padding_and_filler(dtype):
    """Left-padded, right-padded and filler keys (split across several splits) are invisible, as in the reference."""
    batch, n, m = 3, 700, 4
    q, k, v, w, bounds = make_inputs(batch, 6, 2, m, n, 64, dtype, clip=True, seed=5)
    mask = torch.ones(batch, n, dtype=torch.bool, device=q.device)
    mask[0, :250] = False  # left padding longer than a split
    mask[1, 300:400] = False  # filler rows inside the compressed context
    mask[2, n - m - 30 : n - m] = False  # right padding before the new tokens
    kwargs = {"causal_offset": n - m, "key_mask": mask, **bounds}
    ref = weighted_attention(q, k, v, w, backend="torch", **kwargs)
    check_close(ref, weighted_attention(q.double(), k.double(), v.double(), w.double(), **kwargs), dtype)
    for splits in (1, 4):
        out = weighted_decode.weighted_decode_attention(q, k, v, w, scaling=0.125, num_splits=splits, **kwargs)
        check_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 4])
def test_fused_merge_equals_the_two_launches_and_float64(dtype, m):
    """The last split of each row block merges the partials (one launch): the two-launch result within the merge's
    float32 rounding, float64 within the dtype's tolerance, across key masks, clips, a causal offset read on the
    device and several row blocks (float32: 16 rows a block); called twice, since its counters must be zero again
    after each launch for the next one to merge."""
    batch, heads_q, heads_kv, n = 2, 12, 2, 700
    q, k, v, w, bounds = make_inputs(batch, heads_q, heads_kv, m, n, 64, dtype, clip=True, seed=40 + m)
    mask = torch.ones(batch, n, dtype=torch.bool, device=q.device)
    mask[0, :300] = False  # padding over whole splits
    mask[1, 450:470] = False
    exact_kwargs = {"causal_offset": n - m, "key_mask": mask, **bounds}
    exact = weighted_attention(q.double(), k.double(), v.double(), w.double(), backend="torch", **exact_kwargs)
    for splits, offset in ((3, n - m), (20, torch.tensor([n - m], device=q.device))):
        kwargs = dict(scaling=0.125, causal_offset=offset, key_mask=mask, num_splits=splits, **bounds)
        two = weighted_decode.weighted_decode_attention(q, k, v, w, fused_merge=False, **kwargs)
        for _ in range(2):
            one = weighted_decode.weighted_decode_attention(q, k, v, w, fused_merge=True, **kwargs)
            torch.testing.assert_close(one.float(), two.float(), rtol=1e-5, atol=TOL[dtype] / 8)
            check_close(one, exact, dtype)
    from kvcompress.kernels.launch import _WORKSPACES

    assert all(not space[3].any() for space in _WORKSPACES.values())  # every counter back to zero


@pytest.mark.parametrize("fused", [False, True])
def test_buffers_of_a_recorded_call_are_its_own(fused):
    """``reuse_buffers=False`` (the custom op's calls, which a CUDA graph records): the same result as a call on the
    cached buffers, bit for bit, with nothing taken from or added to the per-shape cache (a cached buffer allocated
    while a graph records belongs to its pool: torch's CUDA-graph trees refuse it)."""
    from kvcompress.kernels.launch import _DUMMIES, _WORKSPACES

    q, k, v, w, bounds = make_inputs(2, 8, 2, 1, 900, 64, torch.float32, clip=True, seed=71)
    kwargs = dict(scaling=0.125, causal_offset=torch.tensor([700], device=q.device), num_splits=4,
                  fused_merge=fused, **bounds)  # fmt: skip
    _WORKSPACES.clear()
    _DUMMIES.clear()
    own = weighted_decode.weighted_decode_attention(q, k, v, w, reuse_buffers=False, **kwargs)
    assert not _WORKSPACES and not _DUMMIES
    cached = weighted_decode.weighted_decode_attention(q, k, v, w, **kwargs)
    assert len(_WORKSPACES) == 1 and len(_DUMMIES) == 1
    assert torch.equal(own, cached)
    exact = weighted_attention(q.double(), k.double(), v.double(), w.double(), backend="torch",
                               causal_offset=700, **bounds)  # fmt: skip
    check_close(own, exact, torch.float32)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="programs run concurrently only on a GPU")
@pytest.mark.parametrize("cached", [False, True], ids=["tritons_launch", "cached_launch"])
def test_fused_merge_under_concurrency_on_a_gpu(monkeypatch, cached):
    """Qwen2.5-7B's decode shape at 32k rows (4 KV heads, 7 query heads each, about 66 splits of one launch running
    at once): 50 fused calls in a row, each with its own queries, equal the two-launch results. The partials'
    buffers are reused from call to call, so a merge that read a split's partial before its program stored it
    would read the previous call's, another query's, and differ. Launched Triton's way and through CACHED_LAUNCH."""
    monkeypatch.setattr(weighted_decode, "CACHED_LAUNCH", cached)
    _, k, v, w, bounds = make_inputs(1, 28, 4, 1, 32768, 128, torch.bfloat16, clip=False, seed=11)
    gen = torch.Generator().manual_seed(12)
    queries = [torch.randn(1, 28, 1, 128, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(50)]
    kwargs = dict(scaling=128**-0.5, causal_offset=32767, **bounds)
    two = [weighted_decode.weighted_decode_attention(q, k, v, w, fused_merge=False, **kwargs) for q in queries]
    fused = [weighted_decode.weighted_decode_attention(q, k, v, w, fused_merge=True, **kwargs) for q in queries]
    for one, expected in zip(fused, two, strict=True):
        torch.testing.assert_close(one.float(), expected.float(), rtol=1e-5, atol=TOL[torch.bfloat16] / 8)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="programs run concurrently only on a GPU")
@pytest.mark.parametrize("fused", [False, True], ids=["two_launches", "fused_merge"])
def test_fold_under_concurrency_on_a_gpu(fused):
    """Qwen2.5-7B's decode shape (4 KV heads, 7 query heads each) over 8k context rows: 30 decode steps, each
    appending a row outside the range so far and folding it in inside the kernel (``fold_from``), where every
    program finishing rows of a KV head stores the same folded range at once. After each step the range equals the
    PyTorch fold bit for bit and the output the reference's over it."""
    n, steps = 8192, 30
    q, k, v, w, _ = make_inputs(1, 28, 4, 1, n + steps, 128, torch.bfloat16, seed=13)
    gen = torch.Generator().manual_seed(14)
    v[:, :, n:] = (torch.randn(1, 4, steps, 128, generator=gen) * 4).to(DEVICE, torch.bfloat16)  # new rows: wide
    v_min, v_max = v[:, :, :n].amin(2).float(), v[:, :, :n].amax(2).float()
    want_min, want_max = v_min.clone(), v_max.clone()
    for step in range(1, steps + 1):
        rows = n + step
        args = (q, k[:, :, :rows], v[:, :, :rows], w[:, :, :rows])
        fold_value_range_(want_min, want_max, args[2], rows - 1)
        out = weighted_decode.weighted_decode_attention(*args, scaling=128**-0.5, causal_offset=rows - 1,
                                                        v_min=v_min, v_max=v_max, fold_from=rows - 1,
                                                        fused_merge=fused)  # fmt: skip
        assert torch.equal(v_min, want_min) and torch.equal(v_max, want_max), step
        ref = weighted_attention(*args, causal_offset=rows - 1, v_min=want_min, v_max=want_max, backend="torch")
        check_close(out, ref, torch.bfloat16)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the interpreter launches through Triton either way")
@pytest.mark.parametrize("fused", [False, True], ids=["two_launches", "fused_merge"])
def test_cached_launch_equals_tritons_launch(monkeypatch, fused):
    """``CACHED_LAUNCH``: the same outputs, bit for bit, as Triton's own launches, call after call, while the inputs
    change what a compiled kernel is specialized on: the cache length's residue mod 16, a query view 2 bytes past
    a 16-byte boundary whose row stride 16 does not divide, float16 against float32. Each setting is called twice
    (the second launch goes through the kept kernel). Compiled on a GPU only: under the interpreter both switches
launch through Triton (tests/test_cached_launch.py checks the cached path's bookkeeping on CPU)."""
    monkeypatch.setattr(weighted_decode, "FUSED_MERGE", fused)
    for dtype, n, offset in ((torch.float16, 320, 0), (torch.float16, 327, 1), (torch.float32, 336, 1)):
        q, k, v, w, bounds = make_inputs(1, 8, 2, 1, n, 32, dtype, clip=True, seed=n)
        q = torch.cat([torch.randn_like(q[..., :1]), q], dim=-1)[..., offset : offset + 32] if offset else q
        kwargs = dict(scaling=32**-0.5, causal_offset=n - 1, num_splits=3, **bounds)
        for _ in range(2):
            monkeypatch.setattr(weighted_decode, "CACHED_LAUNCH", False)
            expected = weighted_decode.weighted_decode_attention(q, k, v, w, **kwargs)
            monkeypatch.setattr(weighted_decode, "CACHED_LAUNCH", True)
            assert torch.equal(weighted_decode.weighted_decode_attention(q, k, v, w, **kwargs), expected)


@pytest.mark.parametrize(
    "dtype, range_dtype, m, splits, fused, masked, fold_back",
    [
        (torch.float32, torch.float32, 1, 1, False, False, 1),  # one split: stage 1 finishes and folds
        (torch.bfloat16, torch.bfloat16, 1, 4, False, False, 1),  # the merge kernel folds
        (torch.float16, torch.float32, 1, 4, True, False, 3),  # the fused merge's last split folds; fp32 range
        (torch.bfloat16, torch.float32, 5, 3, False, True, 37),  # padded rows; more rows than one fold step
        (torch.float32, torch.float32, 3, 1, False, True, 0),  # nothing to fold (fold_from = n)
    ],
)
def test_fold_from_folds_the_new_rows_into_the_range_in_place(dtype, range_dtype, m, splits, fused, masked, fold_back):
    """``fold_from``: the finishing programs fold values [fold_from, n) into [v_min, v_max] in place and clip with the
    folded range. The stored range equals the PyTorch fold exactly (a min or max of the inputs, rounded once to the
    range's dtype), and the output the reference's over the folded range; a second call changes nothing. The
    context's range is narrow and the new rows wide, so a fold that missed a row would clip its answer."""
    n, batch, heads_kv = 300, 2, 2
    q, k, v, w, _ = make_inputs(batch, 4 * heads_kv, heads_kv, m, n, 64, dtype, seed=7 + n + m)
    gen = torch.Generator().manual_seed(11)
    v_min = (-0.05 - 0.1 * torch.rand(batch, heads_kv, 64, generator=gen)).to(range_dtype).to(DEVICE)
    v_max = (0.05 + 0.1 * torch.rand(batch, heads_kv, 64, generator=gen)).to(range_dtype).to(DEVICE)
    fold_from = n - fold_back
    key_mask = None
    if masked:
        key_mask = torch.ones(batch, n, dtype=torch.bool)
        key_mask[1, fold_from + 1 :: 2] = False  # some new rows of batch row 1 are padding
        key_mask = key_mask.to(DEVICE)
    expected_min, expected_max = v_min.clone(), v_max.clone()
    fold_value_range_(expected_min, expected_max, v, fold_from, key_mask)
    if fold_back:
        assert not torch.equal(expected_min, v_min)  # the new rows widen the range
    kwargs = dict(scaling=0.125, causal_offset=n - m, key_mask=key_mask)
    ref = weighted_attention(q, k, v, w, backend="torch", v_min=expected_min, v_max=expected_max, **kwargs)
    for call in range(2):
        out = weighted_decode.weighted_decode_attention(
            q, k, v, w, v_min=v_min, v_max=v_max, fold_from=fold_from, num_splits=splits, fused_merge=fused, **kwargs
        )
        assert torch.equal(v_min, expected_min) and torch.equal(v_max, expected_max), call
        check_close(out, ref, dtype)


@pytest.mark.parametrize("splits, fused", [(1, False), (4, False), (4, True)])
def test_fold_from_a_tensor_folds_each_batch_rows_own_row(splits, fused):
    """A decode batch's new rows sit at each batch row's own length: ``fold_from`` as a ``[b]`` tensor folds row
    ``fold_from[i]`` of batch row ``i`` only (read by the kernel), equal to the PyTorch fold bit for bit; rows past
    it are masked, as in the server's batch, and must not widen the range."""
    n, batch, heads_kv = 200, 3, 2
    q, k, v, w, _ = make_inputs(batch, 2 * heads_kv, heads_kv, 1, n, 32, torch.bfloat16, seed=23)
    where = torch.tensor([120, 199, 57], device=DEVICE)
    key_mask = torch.arange(n, device=DEVICE)[None, :] <= where[:, None]
    v = v.clone()
    v[:, :, 150:] *= 50  # unused rows of the shorter batch rows: far outside any range
    v[torch.arange(batch, device=DEVICE), :, where] = 3.0  # the new rows: outside the context's range
    v_max = 0.1 * torch.ones(batch, heads_kv, 32, device=DEVICE)
    v_min = -v_max
    want_min, want_max = v_min.clone(), v_max.clone()
    fold_value_range_(want_min, want_max, v, where)
    assert torch.equal(want_max, torch.full_like(want_max, 3.0)) and torch.equal(want_min, v_min)
    kwargs = dict(scaling=0.2, causal_offset=n - 1, key_mask=key_mask)
    out = weighted_decode.weighted_decode_attention(q, k, v, w, v_min=v_min, v_max=v_max, fold_from=where,
                                                    num_splits=splits, fused_merge=fused, **kwargs)  # fmt: skip
    assert torch.equal(v_min, want_min) and torch.equal(v_max, want_max)
    check_close(out, weighted_attention(q, k, v, w, v_min=want_min, v_max=want_max, backend="torch", **kwargs),
                torch.bfloat16)  # fmt: skip


def test_fold_from_tensor_is_checked():
    q, k, v, w, bounds = make_inputs(2, 2, 1, 1, 300, 16, torch.float32, clip=True)
    for bad, match in ((torch.tensor([3, 4], dtype=torch.int32), "int64 of shape"), (torch.tensor([3]), "shape"),
                       (torch.tensor([3, 300]), r"every index must be in \[0, 299\]")):  # fmt: skip
        with pytest.raises(ValueError, match=f"fold_from: .*{match}"):
            weighted_attention(q, k, v, w, causal_offset=299, fold_from=bad.to(q.device), **bounds)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(fold_from=301), r"fold_from: must be an int in \[0, 300\]"),
        (dict(fold_from=-1), r"fold_from: must be an int in \[0, 300\]"),
        (dict(fold_from=True), r"fold_from: must be an int"),
        (dict(fold_from=10, v_max=None), "fold_from: needs both v_min and v_max"),
    ],
)
def test_fold_from_is_checked(change, match):
    q, k, v, w, bounds = make_inputs(1, 2, 1, 1, 300, 16, torch.float32, clip=True)
    kwargs = {**bounds, "causal_offset": 299, **change}
    with pytest.raises(ValueError, match=match):
        weighted_attention(q, k, v, w, backend="torch", **kwargs)
    with pytest.raises(ValueError, match=match):
        weighted_decode.weighted_decode_attention(q, k, v, w, scaling=0.25, **kwargs)


def test_many_rows_strided_cache_and_odd_dims():
    """group * m = 256 rows (two row blocks); a [b, n, h, d] cache viewed as [b, h, n, d]; d = 80, d_v = 48."""
    batch, heads_kv, n = 2, 1, 150
    q, _, _, w, _ = make_inputs(batch, 16, heads_kv, 16, n, 80, torch.float32, seed=3)
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(batch, n, heads_kv, 80, generator=gen).to(DEVICE).transpose(1, 2)
    v = torch.randn(batch, n, heads_kv, 48, generator=gen).to(DEVICE).transpose(1, 2)
    w = w.transpose(1, 2).contiguous().transpose(1, 2)  # non-contiguous weights, same values
    out = weighted_attention(q, k, v, w, causal_offset=n - 16, backend="triton")
    check_close(out, weighted_attention(q, k, v, w, causal_offset=n - 16, backend="torch"), torch.float32)


def test_auto_uses_torch_on_cpu(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("auto must not call the kernel on CPU tensors")

    monkeypatch.setattr(weighted_decode, "weighted_decode_attention", fail)
    q, k, v, w, bounds = make_inputs(1, 4, 2, 1, 50, 16, torch.float32, clip=True, device="cpu")
    out = weighted_attention(q, k, v, w, **bounds)
    assert torch.equal(out, weighted_attention(q, k, v, w, backend="torch", **bounds))


@pytest.mark.parametrize("backend", ["cuda", "Triton", "", None])
def test_bad_backend_raises(backend):
    q, k, v, w, _ = make_inputs(1, 2, 1, 1, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="backend"):
        weighted_attention(q, k, v, w, backend=backend)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"d": 8}, "head dim"),
        ({"d": 40}, "head dim"),
        ({"d": 272}, "head dim"),
        ({"d_v": 24}, "value dim"),
        ({"dtype": torch.float64}, "dtype"),
        ({"weights": torch.float64}, "weights"),
    ],
)
def test_triton_unsupported_inputs_raise(change, match):
    shape = {"m": 1, "d": 16, "d_v": None, "dtype": torch.float32}
    shape.update({key: val for key, val in change.items() if key != "weights"})
    q, k, v, w, _ = make_inputs(1, 2, 1, shape["m"], 20, shape["d"], shape["dtype"], d_v=shape["d_v"])
    w = w.to(change.get("weights", torch.float32))
    with pytest.raises(ValueError, match=rf"backend='triton'.*{match}"):
        weighted_attention(q, k, v, w, backend="triton")
    out = weighted_attention(q, k, v, w)  # auto falls back to the reference
    assert torch.equal(out, weighted_attention(q, k, v, w, backend="torch"))


def test_decode_launcher_rejects_more_than_16_new_tokens():
    """weighted_attention sends m > 16 to the multi-token kernel; the decode launcher itself refuses them."""
    q, k, v, w, _ = make_inputs(1, 2, 1, 17, 20, 16, torch.float32)
    with pytest.raises(ValueError, match=r"1\.\.16 new tokens"):
        weighted_decode.weighted_decode_attention(q, k, v, w, scaling=0.25)


def test_launcher_rejects_a_fused_merge_that_is_not_a_bool():
    q, k, v, w, _ = make_inputs(1, 2, 1, 1, 40, 16, torch.float32)
    with pytest.raises(ValueError, match=r"fused_merge: must be True, False or None, got 'yes'"):
        weighted_decode.weighted_decode_attention(q, k, v, w, scaling=0.25, fused_merge="yes")


@pytest.mark.parametrize("warps", [3, 0, 32])
def test_launcher_rejects_a_bad_warp_count(warps):
    q, k, v, w, _ = make_inputs(1, 2, 1, 1, 20, 16, torch.float32)
    with pytest.raises(ValueError, match=rf"num_warps: must be 1, 2, 4, 8 or 16, got {warps}"):
        weighted_decode.weighted_decode_attention(q, k, v, w, scaling=0.25, num_warps=warps)


def test_triton_needs_cuda_outside_interpreter(monkeypatch):
    monkeypatch.setattr(weighted_decode, "INTERPRET", False)
    q, k, v, w, _ = make_inputs(1, 2, 1, 1, 20, 16, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="CUDA"):
        weighted_attention(q, k, v, w, backend="triton")


def test_triton_without_triton_raises_import_error(monkeypatch):
    import kvcompress.attention
    import kvcompress.kernels

    monkeypatch.setattr(kvcompress.attention, "_KERNEL_MODULES", None)  # the dispatch imports the kernels again
    monkeypatch.setitem(sys.modules, "triton", None)  # a fresh import of the kernel module now fails
    monkeypatch.delitem(sys.modules, "kvcompress.kernels.weighted_decode")
    monkeypatch.delattr(kvcompress.kernels, "weighted_decode")
    q, k, v, w, _ = make_inputs(1, 2, 1, 1, 20, 16, torch.float32)
    with pytest.raises(ImportError, match="triton"):
        weighted_attention(q, k, v, w, backend="triton")
    assert torch.equal(weighted_attention(q, k, v, w), weighted_attention(q, k, v, w, backend="torch"))


def test_choose_num_splits():
    # batch 1, 4 KV heads, 32k keys, 132 SMs: ~2 programs per SM.
    assert weighted_decode.choose_num_splits(32768, 4, 64, 132) == 66
    # Short caches keep >= 256 keys per split; large batches need no split.
    assert weighted_decode.choose_num_splits(300, 4, 64, 132) == 2
    assert weighted_decode.choose_num_splits(32768, 512, 64, 132) == 1
    assert weighted_decode.choose_num_splits(10**7, 1, 64, 132) == weighted_decode.MAX_SPLITS


def test_host_integer_helpers_equal_tritons():
    import triton

    from kvcompress.kernels.launch import cdiv, next_power_of_2

    for a in [*range(0, 300), 2**31 - 1, 2**31, 2**40 + 3]:
        assert next_power_of_2(a) == triton.next_power_of_2(a), a
        for b in (1, 2, 3, 16, 17, 64, 256):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("on_device", [False, True])
def test_a_growing_cache_plans_as_a_fresh_one(dtype, on_device):
    """A dynamic cache's call is one row longer each step: its plan reuses the tiles of the last step's shape and
    must equal the plan made with every cache empty (same splits, grid, offsets and options)."""
    from kvcompress.kernels import launch

    queries = torch.empty(2, 28, 1, 128, dtype=dtype, device="meta")

    def plans(lengths):
        out = []
        for n in lengths:
            keys = torch.empty(2, 4, n, 128, dtype=dtype, device="meta")
            offset = torch.empty(2, dtype=torch.int64, device="meta") if on_device else n - 1
            plan = launch.launch_plan(queries, keys, keys, offset, None, None, None)
            options = launch.kernel_options(plan, 128, 128, has_vmin=True, has_vmax=True, has_mask=False,
                                            offset_on_device=on_device, num_stages=2, fused_merge=True, fold=True)
            out.append((plan, options))
        return out

    lengths = [*range(250, 700, 7), *range(32700, 32800, 3), 300]
    grown = plans(lengths)
    fresh = []
    for n in lengths:
        launch._PLANS.clear(), launch._TILES.clear(), launch._options.cache_clear()
        fresh.extend(plans([n]))
    assert grown == fresh
    splits = {plan.num_splits for plan, _ in grown}
    assert len(splits) > 3  # the lengths cross several split counts, so a stale plan would differ
    for plan, _ in grown:
        assert plan.grid == (8, plan.num_splits, plan.tiles.row_blocks)
        assert plan.split_len * (plan.num_splits - 1) < plan.n_read <= plan.split_len * plan.num_splits
