"""Query-aware selection and attention-matching fits on plain tensors, against float64 references."""

from __future__ import annotations

import pytest
import torch

from kvcompress import selection
from kvcompress.fitting import fit_kept_rows
from kvcompress.selection import attention_mass, normalise, pool_scores, top_rows
from tests.references import float64_attention_mass, float64_bin_fit


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_mass_matches_float64_reference_with_gqa(causal, monkeypatch):
    g = _generator(1)
    queries, keys = torch.randn(2, 6, 9, 16, generator=g) * 2, torch.randn(2, 2, 40, 16, generator=g) * 2
    positions = torch.randint(0, 40, (9,), generator=g) if causal else None
    expected = float64_attention_mass(queries, keys, 0.25, positions)
    got = attention_mass(queries, keys, 0.25, query_positions=positions)
    assert got.dtype == torch.float32 and got.shape == (2, 2, 40)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.sum(-1), torch.full((2, 2), 27.0))  # every query gives 1, 3 heads x 9 queries
    monkeypatch.setattr(selection, "_CHUNK_ELEMENTS", 100)  # one query at a time: same result
    torch.testing.assert_close(attention_mass(queries, keys, 0.25, query_positions=positions), got)


@pytest.mark.parametrize("kernel_size", [3, 5, 7])
def test_pool_scores_is_snapkvs_zero_padded_average(kernel_size):
    """Every position, the edges included: the mean over ``kernel_size`` neighbours, the missing ones past either
    end counted as zeros (avg_pool1d's ``count_include_pad``, as SnapKV pools), on random scores in float64."""
    scores = torch.rand(2, 3, 11, generator=_generator(4), dtype=torch.float64)
    half = kernel_size // 2
    padded = torch.nn.functional.pad(scores, (half, half))
    expected = torch.stack([padded[..., i : i + kernel_size].sum(-1) / kernel_size for i in range(11)], -1)
    torch.testing.assert_close(pool_scores(scores, kernel_size), expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(pool_scores(scores.float(), kernel_size), expected.float(), rtol=1e-6, atol=0)


def test_pool_normalise_and_top_rows():
    scores = torch.tensor([[0.0, 0.0, 5.0, 0.0, 0.0, 1.0, 1.0, 1.0]])
    assert torch.equal(pool_scores(scores, 1), scores)
    assert torch.equal(normalise(torch.zeros(2, 5)), torch.zeros(2, 5))
    torch.testing.assert_close(normalise(scores).sum(), torch.tensor(1.0))
    # Highest first, ties toward the earlier position, returned in position order.
    assert top_rows(scores, 2).tolist() == [[2, 5]]
    assert top_rows(torch.ones(1, 6), 3).tolist() == [[0, 1, 2]]
    with_nan = torch.tensor([[0.5, float("nan"), 0.9, 0.1]])
    assert top_rows(with_nan, 2).tolist() == [[0, 2]] and top_rows(with_nan, 4).tolist() == [[0, 1, 2, 3]]
    for rows in (-1, 9, True, 2.0):  # was: -1 gave n - 1 rows, 9 gave n, True gave 1
        with pytest.raises(ValueError, match=r"^rows: must be an int in \[0, 8\]"):
            top_rows(scores, rows)
    for kernel in (4, 0, 2.0):  # an even kernel crashed in a reshape
        with pytest.raises(ValueError, match="^kernel_size: must be an odd int >= 1"):
            pool_scores(scores, kernel)


@pytest.mark.parametrize(
    "batch, heads_kv, group, r, bin_rows, protect, causal",
    [(1, 1, 1, 6, 4, 2, False), (1, 1, 1, 7, 3, 2, True), (2, 2, 3, 9, 4, 2, False), (1, 1, 2, 10, 4, 0, False)],
)
def test_fit_equals_its_float64_definition(batch, heads_kv, group, r, bin_rows, protect, causal):
    """The accepted fits' weights and values against the documented equations in float64 (tests/references.py),
    bins that do not divide the kept rows included (the ridge's mean then counts the last bin's empty slots as
    copies of its last row). Tolerance: float32 probabilities and sums (~1e-7 relative) through the ridge-bounded
    solves: 1e-5."""
    gen = _generator(40 + r)
    n, m, d = 24, 12, 16
    keys = torch.randn(batch, heads_kv, n, d, generator=gen)
    values = torch.randn(batch, heads_kv, n, d, generator=gen)
    queries = torch.randn(batch, heads_kv * group, m, d, generator=gen)
    protected = torch.zeros(n, dtype=torch.bool)
    protected[:protect], protected[n - protect :] = True, True
    free = (~protected).nonzero()[:, 0]
    kept = torch.stack([torch.stack([free[torch.randperm(len(free), generator=gen)[:r]].sort().values
                                     for _ in range(heads_kv)]) for _ in range(batch)])  # fmt: skip
    positions = torch.arange(n - m, n) if causal else None
    result = fit_kept_rows(keys, values, kept, protected, queries, 0.25, query_positions=positions,
                           bin_rows=bin_rows, backend="torch")  # fmt: skip
    weights, fitted = float64_bin_fit(keys, values, kept, protected, queries, 0.25, positions, bin_rows=bin_rows)
    assert result.accepted.all()
    torch.testing.assert_close(result.weights.double(), weights, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(result.values.double(), fitted, rtol=1e-5, atol=1e-5)


def _exact_output(queries, keys, values, scaling):
    grouped = queries.double().reshape(keys.shape[0], keys.shape[1], -1, queries.shape[-1])
    probs = torch.softmax(scaling * grouped @ keys.double().transpose(-1, -2), -1)
    return probs @ values.double()


def _weighted_output(queries, keys, values, weights, scaling):
    grouped = queries.double().reshape(keys.shape[0], keys.shape[1], -1, queries.shape[-1])
    logits = scaling * grouped @ keys.double().transpose(-1, -2)
    e = torch.exp(logits - logits.amax(-1, keepdim=True))
    return (e @ values.double()) / (e @ weights.double()[..., None])


def _compressed(keys, values, kept, protected, result):
    """Protected rows exact (w = 1) followed by the kept rows with the fit's weights and values."""
    index = protected.nonzero()[:, 0].expand(*kept.shape[:2], -1)
    rows = torch.cat([index, kept], -1)
    k = keys.gather(2, rows[..., None].expand(-1, -1, -1, keys.shape[-1]))
    v = torch.cat([values.gather(2, index[..., None].expand(-1, -1, -1, values.shape[-1])), result.values], 2)
    w = torch.cat([torch.ones(index.shape), result.weights], -1)
    return k, v, w


def _paired_problem(seed: int, pairs: int = 48, dim: int = 16):
    """Keys in near-duplicate pairs (rows 2i, 2i+1) after 4 protected rows; the even row of each pair is kept."""
    g = _generator(seed)
    base = torch.randn(1, 2, pairs, dim, generator=g) * 1.5
    twins = torch.stack([base, base + 0.01 * torch.randn(base.shape, generator=g)], 3).reshape(1, 2, 2 * pairs, dim)
    keys = torch.cat([torch.randn(1, 2, 4, dim, generator=g), twins], 2)
    values = torch.randn(1, 2, keys.shape[2], dim, generator=g)
    n = keys.shape[2]
    protected = torch.arange(n) < 4
    kept = (4 + 2 * torch.arange(pairs)).expand(1, 2, -1).contiguous()
    return keys, values, kept, protected


def test_fit_merges_near_duplicate_rows_and_generalises_to_new_queries():
    keys, values, kept, protected = _paired_problem(0)
    g = _generator(1)
    reference = torch.randn(1, 4, 64, 16, generator=g)  # GQA: 2 query heads per KV head
    fresh = torch.randn(1, 4, 64, 16, generator=g)
    result = fit_kept_rows(keys, values, kept, protected, reference, 0.25, ridge=1e-4)
    assert result.accepted.all()
    # Each kept row stands for itself and its twin: mass ~2, value ~ v_even + v_odd.
    torch.testing.assert_close(result.weights, torch.full_like(result.weights, 2.0), rtol=0.02, atol=0.02)
    pair_sum = values[:, :, 4::2] + values[:, :, 5::2]
    value_error = (result.values - pair_sum).abs()
    assert value_error.mean() < 0.02 and value_error.max() < 0.15  # |v| ~ 1-5; the twins differ by ~1%
    exact = _exact_output(fresh, keys, values, 0.25)
    unfitted = fit_kept_rows(keys, values, kept, protected, reference, 0.25, ridge=1e30)  # the prior: eviction
    evicted = _weighted_output(fresh, *_compressed(keys, values, kept, protected, unfitted), 0.25)
    fitted = _weighted_output(fresh, *_compressed(keys, values, kept, protected, result), 0.25)
    assert (fitted - exact).norm() < 0.05 * (evicted - exact).norm()


@pytest.mark.parametrize("seed", range(4))
def test_fit_never_raises_the_error_on_its_own_reference_queries(seed):
    g = _generator(seed)
    keys, values = torch.randn(2, 3, 120, 16, generator=g) * 1.5, torch.randn(2, 3, 120, 16, generator=g)
    queries = torch.randn(2, 6, 24, 16, generator=g) * 1.5
    protected = (torch.arange(120) < 4) | (torch.arange(120) >= 110)
    scores = torch.rand(2, 3, 120, generator=g).masked_fill(protected, -1)
    kept = top_rows(scores, 30)
    result = fit_kept_rows(keys, values, kept, protected, queries, 0.25, bin_rows=8)
    unfitted = fit_kept_rows(keys, values, kept, protected, queries, 0.25, ridge=1e30)
    assert torch.equal(unfitted.weights, torch.ones_like(unfitted.weights))
    exact = _exact_output(queries, keys, values, 0.25)
    fitted_err = (_weighted_output(queries, *_compressed(keys, values, kept, protected, result), 0.25) - exact).pow(2)
    plain_err = (_weighted_output(queries, *_compressed(keys, values, kept, protected, unfitted), 0.25) - exact).pow(2)
    per_head_fitted, per_head_plain = fitted_err.sum((-1, -2)), plain_err.sum((-1, -2))
    assert (result.weights > 0).all() and torch.isfinite(result.values).all()
    # Rejected heads keep the plain rows: the same tensors, the same float64 error up to its own rounding.
    rejected = ~result.accepted
    torch.testing.assert_close(per_head_fitted[rejected], per_head_plain[rejected], rtol=1e-12, atol=0)
    # Accepted heads lowered the error on all queries in the fit's float32 checks, which score the very float32
    # w and V_S stored. Those checks round: a logit by <= delta = gamma_d s max sum_c |q_c k_c| (gamma_d =
    # d u / (1 - d u), u the float32 unit roundoff), so a probability by a relative 2 delta and an output or the
    # exact output, each a ratio of such sums, by 4 delta times its sums over |V| or |v| (o_abs, e_abs); the
    # sums themselves (<= n + r terms) and the division by a further (n + r + 8) u. With eps the total, a head's
    # squared error moves by <= 2 sqrt(err) D + D^2, D = eps ||o_abs + e_abs|| (Cauchy-Schwarz); fitted and
    # plain errors may each move so.
    u = 2.0**-24
    gamma_d = 16 * u / (1 - 16 * u)
    grouped = queries.double().reshape(2, 3, -1, 16)
    logit_error = gamma_d * 0.25 * (grouped.abs() @ keys.double().abs().transpose(-1, -2)).amax((-1, -2))
    eps = 4 * logit_error + (120 + 30 + 8) * u

    def moved(compressed, err):
        k, v, w = compressed
        spread = _weighted_output(queries, k, v.abs(), w, 0.25) + _exact_output(queries, keys, values.abs(), 0.25)
        bound = eps * spread.pow(2).sum((-1, -2)).sqrt()
        return 2 * err.sqrt() * bound + bound**2

    slack = moved(_compressed(keys, values, kept, protected, result), per_head_fitted) + moved(
        _compressed(keys, values, kept, protected, unfitted), per_head_plain
    )
    assert (per_head_fitted[result.accepted] <= (per_head_plain + slack)[result.accepted]).all()
    if seed == 0:  # this seed exercises both kinds of head
        assert result.accepted.any() and rejected.any()


def test_fit_is_exact_when_nothing_is_dropped():
    g = _generator(5)
    keys, values = torch.randn(1, 2, 50, 8, generator=g), torch.randn(1, 2, 50, 8, generator=g)
    queries = torch.randn(1, 2, 16, 8, generator=g)
    protected = torch.arange(50) < 2
    kept = torch.arange(2, 50).expand(1, 2, -1).contiguous()
    result = fit_kept_rows(keys, values, kept, protected, queries, 0.3)
    k, v, w = _compressed(keys, values, kept, protected, result)
    torch.testing.assert_close(
        _weighted_output(queries, k, v, w, 0.3), _exact_output(queries, keys, values, 0.3), rtol=1e-6, atol=1e-6
    )


def test_weights_only_fit_scales_kept_values_and_low_precision_stays_finite():
    keys, values, kept, protected = _paired_problem(3)
    queries = torch.randn(1, 2, 40, 16, generator=_generator(4))
    result = fit_kept_rows(keys, values, kept, protected, queries, 0.25, fit_values=False, ridge=1e-4)
    kept_values = values.gather(2, kept[..., None].expand(-1, -1, -1, 16))
    torch.testing.assert_close(result.values, kept_values * result.weights[..., None])
    for dtype in (torch.bfloat16, torch.float16):
        low = fit_kept_rows(keys.to(dtype), values.to(dtype), kept, protected, queries.to(dtype), 0.25)
        assert low.values.dtype == dtype and low.weights.dtype == torch.float32
        assert torch.isfinite(low.values).all() and (low.weights > 0).all()


def test_fit_is_batched_over_heads_and_position_blocks(monkeypatch):
    """No per-head logic: fitting all (batch row, KV head) problems at once equals fitting each alone, and
    cutting the positions into many blocks (some holding only protected rows) changes only rounding."""
    from kvcompress import fit_equations

    g = _generator(9)
    keys, values = torch.randn(2, 3, 200, 16, generator=g) * 1.5, torch.randn(2, 3, 200, 16, generator=g)
    queries = torch.randn(2, 6, 20, 16, generator=g) * 1.5
    protected = (torch.arange(200) < 40) | (torch.arange(200) >= 180)
    kept = top_rows(torch.rand(2, 3, 200, generator=g).masked_fill(protected, -1), 30)
    batched = fit_kept_rows(keys, values, kept, protected, queries, 0.25, bin_rows=8)
    assert batched.accepted.any()
    for b in range(2):
        for h in range(3):
            alone = fit_kept_rows(
                keys[b : b + 1, h : h + 1], values[b : b + 1, h : h + 1], kept[b : b + 1, h : h + 1], protected,
                queries[b : b + 1, 2 * h : 2 * h + 2], 0.25, bin_rows=8,
            )  # fmt: skip
            assert bool(alone.accepted) == bool(batched.accepted[b, h])
            torch.testing.assert_close(alone.weights[0, 0], batched.weights[b, h], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(alone.values[0, 0], batched.values[b, h], rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(fit_equations, "_CHUNK_ELEMENTS", 100)  # blocks of 8 positions
    blocked = fit_kept_rows(keys, values, kept, protected, queries, 0.25, bin_rows=8)
    assert torch.equal(blocked.accepted, batched.accepted)
    torch.testing.assert_close(blocked.weights, batched.weights, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(blocked.values, batched.values, rtol=1e-5, atol=1e-6)


def test_fit_holds_the_probabilities_a_chunk_of_queries_at_a_time(monkeypatch):
    """The sums and checks are over queries: cutting the queries into chunks (the last one partial) bounds the
    probabilities held at once and changes only rounding."""
    from kvcompress import fit_equations

    g = _generator(11)
    keys, values = torch.randn(1, 2, 160, 16, generator=g) * 1.5, torch.randn(1, 2, 160, 16, generator=g)
    queries = torch.randn(1, 6, 23, 16, generator=g) * 1.5  # 3 x 23 = 69 queries per KV head: halves of 35 and 34
    protected = (torch.arange(160) < 4) | (torch.arange(160) >= 140)
    kept = top_rows(torch.rand(1, 2, 160, generator=g).masked_fill(protected, -1), 40)
    positions = torch.arange(137, 160)
    whole = fit_kept_rows(keys, values, kept, protected, queries, 0.25, query_positions=positions, bin_rows=8)
    held = []
    probabilities = fit_equations._probabilities

    def recording(queries, *args):
        held.append(queries.shape[1])
        return probabilities(queries, *args)

    monkeypatch.setattr(fit_equations, "_probabilities", recording)
    monkeypatch.setattr(fit_equations, "_QUERY_CHUNK_ELEMENTS", 2 * 160 * 8)  # 8 queries of 2 problems x 160 keys
    chunked = fit_kept_rows(keys, values, kept, protected, queries, 0.25, query_positions=positions, bin_rows=8)
    assert held == [8, 8, 8, 8, 3, 8, 8, 8, 8, 2]
    assert whole.accepted.any() and torch.equal(chunked.accepted, whole.accepted)
    torch.testing.assert_close(chunked.weights, whole.weights, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked.values, whole.values, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: a bf16 context's fit runs TF32 products there")
def test_fit_on_cuda_with_tensor_core_products_matches_the_float32_fit():
    g = _generator(7)
    n, d = 2048, 64
    keys = (torch.randn(1, 2, n, d, generator=g) + 2 * torch.randn(1, 2, 1, d, generator=g)).bfloat16()
    values = torch.randn(1, 2, n, d, generator=g).bfloat16()
    queries = (1.5 * torch.randn(1, 8, 64, d, generator=g)).bfloat16()
    protected = (torch.arange(n) < 4) | (torch.arange(n) >= n - 64)
    scores = torch.rand(1, 2, n, generator=g).masked_fill(protected, -1)
    kept = top_rows(scores, n // 4 - 68).sort(-1).values
    precision = torch.get_float32_matmul_precision()
    on_cpu = fit_kept_rows(keys, values, kept, protected, queries, d**-0.5)
    on_gpu = fit_kept_rows(keys.cuda(), values.cuda(), kept.cuda(), protected, queries.cuda(), d**-0.5)
    assert torch.get_float32_matmul_precision() == precision  # the process's setting is restored
    assert torch.equal(on_gpu.accepted.cpu(), on_cpu.accepted) and on_cpu.accepted.any()
    # bf16 inputs are exact in TF32; each probability in a product is rounded by <= 2^-11 relative, and the
    # ridge solve (condition <~ 10 times the bins' spread, see test_reference_sources) amplifies it: 20 units.
    weights = on_cpu.weights
    torch.testing.assert_close(on_gpu.weights.cpu(), weights, rtol=0, atol=20 * 2**-11 * weights.abs().max().item())
    values_bound = (20 * 2**-11 + 2**-8) * on_cpu.values.float().abs().max().item()  # plus one bf16 rounding
    torch.testing.assert_close(on_gpu.values.float().cpu(), on_cpu.values.float(), rtol=0, atol=values_bound)


def test_fit_arguments_are_checked_by_name():
    """Bad arguments are ValueErrors naming them (were: a TypeError for one query per KV head, a ZeroDivisionError
    for bin_rows=0, index errors deep in the sums for a wrong ``protected``, negative ridges accepted)."""
    gen = _generator(9)
    keys, values = torch.randn(1, 1, 20, 8, generator=gen), torch.randn(1, 1, 20, 8, generator=gen)
    queries, kept = torch.randn(1, 1, 6, 8, generator=gen), torch.tensor([[[5, 9, 12]]])
    protected = torch.zeros(20, dtype=torch.bool)
    args = (keys, values, kept, protected, queries, 0.3)
    assert fit_kept_rows(*args).weights.shape == (1, 1, 3)
    for change, options, name in (
        ({"queries": queries[:, :, :1]}, {}, "queries"),
        ({"kept": kept.int()}, {}, "kept"),
        ({"kept": kept[0]}, {}, "kept"),
        ({"protected": protected[:10]}, {}, "protected"),
        ({"protected": protected.long()}, {}, "protected"),
        ({"values": values[:, :, :5]}, {}, "values"),
        ({}, {"bin_rows": 0}, "bin_rows"),
        ({}, {"ridge": -0.1}, "ridge"),
        ({}, {"max_log_weight": float("nan")}, "max_log_weight"),
        ({"scaling": 0.0}, {}, "scaling"),
    ):
        named = dict(zip(("keys", "values", "kept", "protected", "queries", "scaling"), args, strict=True)) | change
        with pytest.raises(ValueError, match=f"^{name}: "):
            fit_kept_rows(*named.values(), **options)
