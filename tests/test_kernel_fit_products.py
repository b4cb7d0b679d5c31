"""The fit's fused kernels (kvcompress.kernels.fit_products) against float64 definitions, and the fit through them
against the PyTorch path's fit.

The kernels run compiled on CUDA tensors where CUDA is present and in the Triton interpreter on CPU tensors
elsewhere (tests/triton_mode.py). The float64 reference takes the same rounded inputs, so the input dtype's own
rounding cancels: the logits' products of 16-bit inputs are exact in fp32 and only their fp32 accumulation differs
(relative ~1e-6 of |s| <= ~10 here). What remains is the probabilities' products: TF32 for a 16-bit context on a GPU,
which rounds (or truncates) each probability by up to 2^-10 relative, so a sum of non-negative terms is within
2^-10 of itself and an attention output within 2^-10 max|v| (values in bf16 / fp16 are exact in TF32); IEEE fp32
for a float32 context and in the interpreter (~1e-6). TOL is twice those bounds; sums are compared relative to
their largest entry.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("triton", reason="triton is not installed (the kernel tests need it)")

import torch  # noqa: E402
from triton_mode import DEVICE, INTERPRET  # noqa: E402

from kvcompress import fit_equations, fitting  # noqa: E402
from kvcompress.kernels import fit_products as kernel  # noqa: E402
from tests.references import float64_fit_rows

if kernel.INTERPRET != INTERPRET:
    pytest.skip("kernel module was defined in the other Triton mode (imported too early)", allow_module_level=True)

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-3}
LOG2E = 1 / math.log(2)


def make_inputs(problems, m, n, d, d_v, dtype, seed, strided=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(problems, 2 * m if strided else m, d, generator=gen) * 1.2
    k = torch.randn(problems, n, d, generator=gen) * 1.2
    v = torch.randn(problems, n, d_v, generator=gen)
    q = q.to(DEVICE, dtype)
    if strided:  # every other row: the fit's even/odd split of its queries, a view with row stride 2 d
        q = q[:, ::2]
        assert not q.is_contiguous()
    return q, k.to(DEVICE, dtype), v.to(DEVICE, dtype)


CASES = [  # dtype, problems, m, n, d, d_v, causal, strided
    (torch.float32, 2, 37, 91, 32, 32, False, False),  # odd lengths, one key tile per row block
    (torch.float32, 3, 70, 150, 64, 48, True, True),  # several row blocks, d_v not a power of two, strided
    (torch.float16, 1, 23, 77, 16, 16, True, False),
    (torch.bfloat16, 2, 40, 131, 64, 64, False, True),
    (torch.bfloat16, 2, 33, 65, 48, 32, True, False),
]


def _positions(m, n, causal, seed):
    if not causal:
        return None
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, (m,), generator=gen).to(DEVICE)  # unsorted, some rows see a few keys only


@pytest.mark.parametrize("dtype, problems, m, n, d, d_v, causal, strided", CASES)
@pytest.mark.parametrize("splits", [1, 3])  # 3: every case has n > 64, so 3 key splits of 32; causal rows miss some
def test_attention_rows_match_float64(dtype, problems, m, n, d, d_v, causal, strided, splits):
    q, k, v = make_inputs(problems, m, n, d, d_v, dtype, seed=m + n, strided=strided)
    positions = _positions(m, n, causal, seed=n)
    lse, out = kernel.attention_rows(q, k, v, 0.3, positions, block_m=32, block_n=32, splits=splits)
    _, lse64, out64 = float64_fit_rows(q, k, v, 0.3, positions)
    assert lse.dtype == out.dtype == torch.float32 and out.shape == (problems, m, d_v)
    torch.testing.assert_close(lse.cpu().double() / LOG2E, lse64, rtol=0, atol=1e-4)  # fp32 sums of exact logits
    torch.testing.assert_close(out.cpu().double(), out64, rtol=0, atol=TOL[dtype] * v.abs().amax().item())


@pytest.mark.parametrize("dtype, problems, m, n, d, d_v, causal, strided", CASES)
@pytest.mark.parametrize("k, span", [(16, 64), (8, 24), (1, 16)])
def test_block_sums_match_float64(dtype, problems, m, n, d, d_v, causal, strided, k, span):
    """Each block's products c[j, w] = sum_r p_rj a[r, low * k + w] over a set of rows, kept where column w's bin
    (w // k) is position j's owner less the block's first bin, summed over the block's positions alone (the mass)
    and times v_j (the values). The sums of non-negative products are within TOL of their largest; the values'
    sums have signs, so their bound is TOL times the largest sum of |c| |v| (cancellation leaves the error)."""
    q, keys, v = make_inputs(problems, m, n, d, d_v, dtype, seed=m * n + k, strided=strided)
    positions = _positions(m, n, causal, seed=n + 1)
    prob, lse64, _ = float64_fit_rows(q, keys, v, 0.3, positions)
    gen = torch.Generator().manual_seed(k)
    columns = 5 * k + 3  # fewer columns than some blocks' windows reach: those read as 0
    kept_prob = torch.rand(problems, m, columns, generator=gen)
    width = span if k == 1 else (span // k + 1) * k
    blocks = -(-n // span)
    lows = torch.randint(0, columns // k + 1, (problems, blocks), generator=gen).sort(-1).values
    # Owners near each block's first bin, some of them -1 (protected) and some past the block's bins (never kept).
    offsets = torch.randint(-1, width // k + 1, (problems, blocks * span), generator=gen)
    owners = lows.repeat_interleave(span, 1) + offsets
    owners[torch.rand(problems, blocks * span, generator=gen) < 0.2] = -1
    lse = (lse64 * LOG2E).float().to(DEVICE)
    set_rows = (m + 1) // 2  # the fit's two query halves: the second set one row shorter where m is odd

    def launch(**options):
        return kernel.block_sums(
            q, keys, v, 0.3, positions, lse, kept_prob.to(DEVICE), lows.to(DEVICE), owners.to(DEVICE), k, span,
            width, **options,
        )  # fmt: skip

    mass, vals = launch(set_rows=set_rows, block_m=16)
    assert mass.dtype == vals.dtype == torch.float32
    assert mass.shape == (problems, 2, blocks, width) and vals.shape == (problems, 2, blocks, width, d_v)
    padded_prob = torch.nn.functional.pad(prob, (0, blocks * span - n)).reshape(problems, m, blocks, span)
    index = lows[..., None] * k + torch.arange(width)  # [P, blocks, width]
    near = torch.nn.functional.pad(kept_prob.double(), (0, blocks * k + width))  # columns past the end: 0
    near = near.gather(2, index.reshape(problems, 1, -1).expand(-1, m, -1)).reshape(problems, m, blocks, width)
    products = padded_prob[..., None] * near[:, :, :, None, :]  # [P, m, blocks, span, width]
    c = torch.stack([products[:, :set_rows].sum(1), products[:, set_rows:].sum(1)], 1)  # [P, 2, blocks, span, w]
    block_owner = owners.reshape(problems, 1, blocks, span, 1) - lows.reshape(problems, 1, blocks, 1, 1)
    own = (block_owner == torch.arange(width) // k) & (owners.reshape(problems, 1, blocks, span, 1) >= 0)
    c = c * own
    values = torch.nn.functional.pad(v.cpu().double(), (0, 0, 0, blocks * span - n))
    values = values.reshape(problems, 1, blocks, span, -1)
    expected_mass, expected_vals = c.sum(3), c.transpose(-1, -2) @ values
    bound_vals = (c.transpose(-1, -2) @ values.abs()).amax().clamp_min(1e-12)
    scale = expected_mass.abs().amax().clamp_min(1e-12)
    torch.testing.assert_close(mass.cpu().double() / scale, expected_mass / scale, rtol=0, atol=TOL[dtype])
    torch.testing.assert_close(vals.cpu().double() / bound_vals, expected_vals / bound_vals, rtol=0, atol=TOL[dtype])
    if k != 16:
        return
    whole_mass, whole_vals = launch()  # one set of every row: the sets' sums
    assert whole_mass.shape == (problems, 1, blocks, width)
    torch.testing.assert_close(whole_mass.cpu().double()[:, 0] / scale, expected_mass.sum(1) / scale, rtol=0,
                               atol=2 * TOL[dtype])  # fmt: skip
    torch.testing.assert_close(whole_vals.cpu().double()[:, 0] / bound_vals, expected_vals.sum(1) / bound_vals,
                               rtol=0, atol=2 * TOL[dtype])  # fmt: skip


def test_block_sums_errors_name_the_parameter():
    q, keys, v = make_inputs(1, 8, 40, 16, 16, torch.float32, seed=1)
    lse = torch.zeros(1, 8, device=DEVICE)
    kept_prob, lows = torch.rand(1, 8, 16, device=DEVICE), torch.zeros(1, 1, dtype=torch.int64, device=DEVICE)
    owners = torch.zeros(1, 64, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"set_rows: must be in \[1, 8\]"):
        kernel.block_sums(q, keys, v, 0.3, None, lse, kept_prob, lows, owners, 16, 64, 80, set_rows=9)
    with pytest.raises(ValueError, match=r"owners: must have shape \(1, 64\), got \(1, 40\)"):
        kernel.block_sums(q, keys, v, 0.3, None, lse, kept_prob, lows, owners[:, :40], 16, 64, 80)


def _fit_problem(dtype, seed, causal, bin_rows, heads_kv=2, group=3, m=24, n=260, d=32):
    gen = torch.Generator().manual_seed(seed)
    keys = (torch.randn(1, heads_kv, n, d, generator=gen) * 1.2).to(DEVICE, dtype)
    values = torch.randn(1, heads_kv, n, d, generator=gen).to(DEVICE, dtype)
    queries = (torch.randn(1, heads_kv * group, m, d, generator=gen) * 1.2).to(DEVICE, dtype)
    protected = torch.zeros(n, dtype=torch.bool)
    protected[:4] = True
    protected[-16:] = True
    free = (~protected).nonzero()[:, 0]
    kept = torch.stack(
        [free[torch.randperm(len(free), generator=gen)[: n // 4]].sort().values for _ in range(heads_kv)]
    )
    positions = torch.arange(n - m, n).to(DEVICE) if causal else None
    return keys, values, kept[None].to(DEVICE), protected, queries, d**-0.5, positions, bin_rows


@pytest.mark.parametrize("causal, bin_rows, dtype", [(True, 16, torch.float32), (False, 8, torch.float32),
                                                     (True, 1, torch.float32), (True, 16, torch.bfloat16)])  # fmt: skip
def test_fit_through_the_fused_kernels_matches_the_pytorch_fit(causal, bin_rows, dtype, monkeypatch):
    """The same fit problem through the kernels and through the held probabilities (forced on either path)."""
    keys, values, kept, protected, queries, scaling, positions, bin_rows = _fit_problem(dtype, 7, causal, bin_rows)
    args = (keys, values, kept, protected, queries, scaling)
    options = dict(query_positions=positions, bin_rows=bin_rows, ridge=0.01)
    fused = fitting.fit_kept_rows(*args, **options, backend="triton")
    held = fitting.fit_kept_rows(*args, **options, backend="torch")
    # "auto": the kernels on CUDA tensors they can run, the PyTorch path elsewhere.
    assert (fit_equations.fused_kernels(keys, values, bin_rows, "auto") is not None) == (DEVICE.type == "cuda")
    # The blocks' partials a launch per block (each launch over its own keys, the rows' positions shifted with them)
    # and the right-hand sides summed run by run: the same fit up to the sums' float32 order.
    monkeypatch.setattr(fit_equations, "_CHUNK_ELEMENTS", 100)
    blocked = fitting.fit_kept_rows(*args, **options, backend="triton")
    assert torch.equal(blocked.accepted, fused.accepted)
    torch.testing.assert_close(blocked.weights, fused.weights, rtol=1e-5, atol=1e-6)
    monkeypatch.undo()
    assert fused.accepted.any() and torch.equal(fused.accepted, held.accepted)
    # Both solve the same ridge systems from sums that differ by the probabilities' rounding: ~1e-6 relative in fp32
    # (interpreter, float32 context), up to 2^-10 on a GPU's TF32 products, which both paths use there for a 16-bit
    # context (the PyTorch path through _tensor_core_products). The solves amplify it (ridge 0.01 of the mean Gram
    # diagonal): bounds of 100x (fp32) and 20 x 2^-10 (16-bit, the bound of the TF32 fit's own test), and the
    # values' final rounding to the context's dtype.
    tol = 1e-4 if dtype == torch.float32 else 20 * 2**-10
    for got, want, rounding in (
        (fused.weights, held.weights, 0.0),
        (fused.values, held.values, 2 * torch.finfo(dtype).eps),
    ):
        scale = want.float().abs().amax()
        torch.testing.assert_close(got.float() / scale, want.float() / scale, rtol=0, atol=tol + rounding)


def test_query_sets_in_one_pass_equal_each_set_alone(monkeypatch):
    """The fit's two query halves through the kernels in one pass (one launch of each kernel, one set of right-hand
    sides) give each half's sums and validation parts as that half alone does: the same sums of the same products,
    float32 reordering at most (1e-5 relative to each tensor's largest entry)."""
    keys, values, kept, protected, queries, scaling, positions, bin_rows = _fit_problem(torch.float32, 5, True, 16)
    calls = []
    original = fit_equations.normal_equations

    def both(kernels, query_sets, *rest):
        assert kernels is not None and len(query_sets) == 2
        first, second = query_sets
        assert first[0].shape[1] == second[0].shape[1] + 1  # 3 x 23 queries per KV head: halves of 35 and 34
        together = original(kernels, query_sets, *rest)
        sums, parts = together  # copied: the fit adds the halves' sums in place
        calls.append((([s.clone() for s in sums], parts), [original(kernels, [one], *rest) for one in query_sets]))
        mismatched = [(first[0][:, :3], first[1][:3], None), (second[0][:, :5], second[1][:5], None)]
        with pytest.raises(ValueError, match="query_sets: every set but the last must have the first one's rows"):
            original(kernels, mismatched, *rest)
        return together

    monkeypatch.setattr(fitting, "normal_equations", both)
    fitting.fit_kept_rows(keys, values, kept, protected, queries[:, :, 1:], scaling, query_positions=positions[1:],
                          bin_rows=bin_rows, backend="triton")  # fmt: skip
    ((sums, parts), alone) = calls[0]
    start = 0
    for index, (set_sums, set_parts) in enumerate(alone):
        for got, want in zip(sums, set_sums, strict=True):
            scale = want.abs().amax()
            torch.testing.assert_close(got[index] / scale, want[0] / scale, rtol=0, atol=1e-5)
        rows = slice(start, start + set_parts[0].shape[1])
        start = rows.stop
        for got, want in zip(parts, set_parts, strict=True):
            scale = want.abs().amax()
            torch.testing.assert_close(got[:, rows] / scale, want / scale, rtol=0, atol=1e-5)


def test_fit_backend_errors_name_the_parameter():
    keys, values, kept, protected, queries, scaling, _, _ = _fit_problem(torch.float32, 3, False, 16)
    with pytest.raises(ValueError, match="backend: must be one of 'auto', 'torch', 'triton', got 'cuda'"):
        fitting.fit_kept_rows(keys, values, kept, protected, queries, scaling, backend="cuda")
    with pytest.raises(
        ValueError, match="backend='triton': bin_rows: must be at most 64 for the fused kernels, got 65"
    ):
        fitting.fit_kept_rows(keys, values, kept, protected, queries, scaling, bin_rows=80, backend="triton")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_fit_from_known_rows_equals_the_fit_that_computes_them(backend, monkeypatch):
    """Rows whose log-sum-exp and exact outputs an attention already gave (here their float64 definition, rounded to
    float32) fit as the rows the fit computes itself: the same decisions, weights and values within the paths' own
    rounding (1e-4 of the largest, as above), and the fused path launches no first kernel for them."""
    keys, values, kept, protected, queries, scaling, positions, bin_rows = _fit_problem(torch.float32, 11, True, 16)
    batch, heads_q, m, dim = queries.shape
    heads_kv = keys.shape[1]
    grouped = queries.reshape(heads_kv, heads_q // heads_kv * m, dim)
    _, lse, exact = float64_fit_rows(grouped, keys[0], values[0], scaling, positions.repeat(heads_q // heads_kv))
    known = (lse.float().reshape(batch, heads_q, m).to(DEVICE), exact.float().reshape(batch, heads_q, m, -1).to(DEVICE))
    args = (keys, values, kept, protected, queries, scaling)
    options = dict(query_positions=positions, bin_rows=bin_rows, ridge=0.01, backend=backend)
    computed = fitting.fit_kept_rows(*args, **options)

    def no_first_pass(*_, **__):
        raise AssertionError("attention_rows ran for rows whose outputs were given")

    seen = []
    original = fitting.normal_equations

    def spy(*call):
        sums, parts = original(*call)
        seen.append(parts[1])  # the validation's exact outputs, the even queries' rows then the odd ones'
        return sums, parts

    monkeypatch.setattr(kernel, "attention_rows", no_first_pass)
    monkeypatch.setattr(fitting, "normal_equations", spy)
    given = fitting.fit_kept_rows(*args, **options, known_rows=known)
    rows = exact.float().to(DEVICE)
    assert torch.equal(seen[0], torch.cat([rows[:, 0::2], rows[:, 1::2]], 1))  # each query's own output
    assert computed.accepted.any() and torch.equal(given.accepted, computed.accepted)
    for got, want in ((given.weights, computed.weights), (given.values, computed.values)):
        scale = want.abs().amax()
        torch.testing.assert_close(got / scale, want / scale, rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match=r"known_rows: its exact outputs must be floating, of shape \[1, 6, 24, 32\]"):
        fitting.fit_kept_rows(*args, **options, known_rows=(known[0], known[1][:, :, 1:]))
