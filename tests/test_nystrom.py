"""CompressKV math (Alg. 1, 2, eq. (7), (8), (12), App. L) against direct float64 evaluations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.special import lambertw
from scipy.stats import chi2

from kvcompress import compress_kv, lambert_w0, rng, rpnys, temperature, weighted_attention
from kvcompress.bin_temperature import kernel_coefficient
from kvcompress.lambert import RHO0
from kvcompress.nystrom import bin_bounds


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    q, k, v = q.double(), k.double(), v.double()
    return torch.softmax(scaling * q @ k.transpose(-1, -2), -1) @ v


# ---------------------------------------------------------------- Lambert W and temperature (App. L, eq. 12)


def test_lambert_w0_matches_scipy_to_1e12_relative():
    z = torch.logspace(-8, 8, 4001, dtype=torch.float64)
    z = z * (1 + 0.01 * torch.rand(z.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    ours = lambert_w0(z)
    ref = torch.from_numpy(lambertw(z.numpy()).real)
    assert ((ours - ref).abs() / ref).max().item() <= 1e-12
    assert lambert_w0(torch.tensor([0.0], dtype=torch.float64)).item() == 0.0
    # W0(z) e^W0(z) = z is the definition.
    assert torch.allclose(ours * ours.exp(), z, rtol=1e-12)


def test_lambert_w0_rejects_negative_input():
    with pytest.raises(ValueError, match="z"):
        lambert_w0(torch.tensor([-0.1]))


def test_rho0_value():
    assert RHO0 == pytest.approx(math.sqrt(1 + math.exp(lambertw(2 / math.e**2).real + 2)), rel=1e-14)
    assert RHO0 == pytest.approx(3.19, abs=0.01)


def test_temperature_matches_direct_eq12():
    gen = np.random.default_rng(7)
    beta = gen.uniform(0.05, 0.5, 200)
    r_q = gen.uniform(0.1, 40.0, 200)
    r_k = gen.uniform(0.1, 40.0, 200)
    n = gen.integers(1, 100_000, 200).astype(np.float64)
    b0 = np.log(n) / (beta * r_q * r_k) + 2
    direct = np.sqrt(r_k / r_q * b0 / (2 * lambertw(b0 / (2 * RHO0)).real))
    ours = temperature(*(torch.from_numpy(x) for x in (beta, r_q, r_k, n)))
    np.testing.assert_allclose(ours.numpy(), direct, rtol=1e-12)


@pytest.mark.parametrize(
    "args, name",
    [
        ((-0.1, 1.0, 1.0, 10), "scaling"),
        ((0.1, 0.0, 1.0, 10), "query_radius"),
        ((0.1, 1.0, torch.tensor([1.0, -2.0]), 10), "key_radius"),
        ((0.1, 1.0, 1.0, 0.5), "n"),
        ((0.1, math.nan, 1.0, 10), "query_radius"),
        ((0.1, 1.0, math.inf, 10), "key_radius"),
        ((True, 1.0, 1.0, 10), "scaling"),
        ((0.1, "1", 1.0, 10), "query_radius"),
        ((0.1, torch.ones(3), torch.ones(2), 10), "temperature: shapes"),
    ],
)
def test_temperature_rejects_values_outside_eq12s_domain(args, name):
    """Out of its domain eq. (12) gives NaN (or a complex root): the public function names the argument instead."""
    with pytest.raises(ValueError, match=f"^{name}"):
        temperature(*args)


def _rpnys_inputs(lead=(2, 3), length=20, rank=5, seed=3):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(*lead, length, 8, generator=gen)
    coefficient = torch.rand(*lead, generator=gen, dtype=torch.float64) * 0.1 + 0.01
    step_keys = torch.randint(0, 2**62, (*lead, rank), generator=gen)
    return keys, rank, coefficient, step_keys


@pytest.mark.parametrize(
    "change, name",
    [
        (lambda a: {**a, "keys": a["keys"].long()}, "keys"),
        (lambda a: {**a, "keys": a["keys"][0, 0, 0]}, "keys"),
        (lambda a: {**a, "keys": a["keys"].index_fill(-1, torch.tensor([2]), math.nan)}, "keys"),
        (lambda a: {**a, "rank": 0}, "rank"),
        (lambda a: {**a, "rank": 21}, "rank"),
        (lambda a: {**a, "coefficient": -a["coefficient"]}, "coefficient"),
        (lambda a: {**a, "coefficient": a["coefficient"].fill_(math.inf)}, "coefficient"),
        (lambda a: {**a, "coefficient": torch.ones(4)}, "coefficient"),
        (lambda a: {**a, "step_keys": a["step_keys"].float()}, "step_keys"),
        (lambda a: {**a, "step_keys": a["step_keys"][..., :3]}, "step_keys"),
        (lambda a: {**a, "valid": torch.ones(2, 3, 20)}, "valid"),
        (lambda a: {**a, "valid": torch.ones(2, 3, 19, dtype=torch.bool)}, "valid"),
    ],
)
def test_rpnys_rejects_bad_arguments(change, name):
    """Each bad argument is named: before, a negative coefficient was clamped to 0 (a constant kernel, silently) and
    wrong shapes failed inside a reshape or an einsum."""
    keys, rank, coefficient, step_keys = _rpnys_inputs()
    args = change({"keys": keys, "rank": rank, "coefficient": coefficient, "step_keys": step_keys})
    with pytest.raises(ValueError, match=f"^{name}:"):
        rpnys(**args)


def test_rpnys_broadcasts_a_scalar_coefficient():
    keys, rank, coefficient, step_keys = _rpnys_inputs()
    full = rpnys(keys, rank, torch.full((2, 3), 0.05, dtype=torch.float64), step_keys)
    scalar = rpnys(keys, rank, 0.05, step_keys)
    assert torch.equal(full.pivots, scalar.pivots) and torch.equal(full.weights, scalar.weights)


# ---------------------------------------------------------------- exactness at full rank


@pytest.mark.parametrize("lead", [(2, 3), (4,)])
def test_full_rank_reproduces_exact_softmax_attention(lead):
    gen = torch.Generator().manual_seed(11)
    n, d = 32, 16
    keys = torch.randn(*lead, n, d, generator=gen, dtype=torch.float64)
    values = torch.randn(*lead, n, d, generator=gen, dtype=torch.float64)
    queries = torch.randn(*lead[:1], 6, 5, d, generator=gen, dtype=torch.float64)
    k4, v4 = keys.reshape(lead[0], -1, n, d), values.reshape(lead[0], -1, n, d)
    k_s, v_s, w = compress_kv(keys, values, n, seed=3)
    out = weighted_attention(
        queries, k_s.reshape(k4.shape), v_s.reshape(v4.shape), w.reshape(k4.shape[:3]), scaling=0.25
    )
    exact = exact_attention(queries.reshape(lead[0], k4.shape[1], -1, d), k4, v4, 0.25)
    assert (out.reshape(exact.shape) - exact).abs().max().item() <= 1e-8
    # Every row was selected once, so the weights are a permutation: w = 1.
    assert torch.allclose(w, torch.ones_like(w), atol=1e-8)


# ---------------------------------------------------------------- RPNys (Alg. 1, eq. 7-8)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rank_one_update_weights_equal_direct_nystrom(dtype):
    """Alg. 1's weights against the direct solve h(K_S, K_S)^-1 h(K_S, K) in float64. Tolerance from the solve's
    perturbation bound: relative error <= cond(h(K_S, K_S)) x the relative error of the entries, which ``rank``
    rank-one updates in ``dtype`` leave at about rank x u (u: its unit roundoff)."""
    gen = torch.Generator().manual_seed(5)
    problems, length, d, rank = 3, 40, 8, 10
    x = torch.randn(problems, length, d, generator=gen, dtype=torch.float64)
    x = x - x.mean(1, keepdim=True)
    a = torch.tensor([0.05, 0.1, 0.2], dtype=torch.float64)
    step_keys = torch.stack([rng.stream_step_key(rng.seed_key(9), torch.arange(problems), i) for i in range(rank)], -1)
    result = rpnys(x.to(dtype), rank, a, step_keys)
    assert (result.pivots >= 0).all()
    assert all(len(set(p.tolist())) == rank for p in result.pivots)
    for p in range(problems):
        h = torch.exp(a[p] * x[p] @ x[p].T)
        s = result.pivots[p]
        chol = torch.linalg.cholesky(h[s][:, s])
        direct = torch.cholesky_solve(h[s], chol)  # h(K_S, K_S)^-1 h(K_S, K)
        rtol = torch.linalg.cond(h[s][:, s]).item() * rank * torch.finfo(dtype).eps / 2
        err = (result.weights[p].double() - direct).abs().max() / direct.abs().max()
        assert err.item() <= rtol
        # Nystrom interpolates at the pivots: W[:, s] is the identity.
        assert torch.allclose(result.weights[p][:, s].double(), torch.eye(rank, dtype=torch.float64), atol=rtol * 10)


def _second_pivot_probabilities(x: torch.Tensor, a: float) -> np.ndarray:
    """P(first = i, second = j) from the residual diagonal of h(x, y) = exp(a <x, y>) (eq. 6, 8)."""
    h = torch.exp(a * x @ x.T)
    diag = h.diagonal()
    n = len(diag)
    probs = np.zeros((n, n))
    for i in range(n):
        residual = diag - h[:, i] ** 2 / h[i, i]
        residual[i] = 0
        probs[i] = (diag[i] / diag.sum() * residual / residual.sum()).numpy()
    return probs


def test_pivot_sampling_follows_residual_diagonal():
    x = torch.tensor([[0.0, 0.0], [1.0, 0.2], [-0.8, 1.1], [1.5, -1.0], [0.3, 0.9]], dtype=torch.float64)
    a, draws, n = 0.7, 30_000, x.shape[0]
    streams = torch.arange(draws)
    step_keys = torch.stack([rng.stream_step_key(rng.seed_key(2024), streams, i) for i in range(2)], -1)
    result = rpnys(x.expand(draws, n, 2), 2, torch.full((draws,), a, dtype=torch.float64), step_keys)
    counts = np.zeros((n, n))
    np.add.at(counts, (result.pivots[:, 0].numpy(), result.pivots[:, 1].numpy()), 1)
    expected = _second_pivot_probabilities(x, a) * draws
    off_diagonal = ~np.eye(n, dtype=bool)
    assert counts[~off_diagonal].sum() == 0  # a pivot is never drawn twice
    stat = ((counts - expected)[off_diagonal] ** 2 / expected[off_diagonal]).sum()
    p_value = chi2.sf(stat, off_diagonal.sum() - 1)
    assert p_value > 1e-3, f"chi2={stat:.1f}, p={p_value:.2e}"
    # The same draws against uniform sampling must be rejected: the test has power.
    uniform = np.full((n, n), draws / (n * (n - 1)))
    stat_uniform = ((counts - uniform)[off_diagonal] ** 2 / uniform[off_diagonal]).sum()
    assert chi2.sf(stat_uniform, off_diagonal.sum() - 1) < 1e-6


# ---------------------------------------------------------------- binning (Alg. 2)


def test_bins_equal_separate_per_bin_compression():
    gen = torch.Generator().manual_seed(21)
    lead, n, d, bins, rank, seed = (2, 3), 203, 16, 4, 24, 77
    keys = torch.randn(*lead, n, d, generator=gen, dtype=torch.float64) * 1.5 + 0.3
    values = torch.randn(*lead, n, d, generator=gen, dtype=torch.float64)
    k_s, v_s, w = compress_kv(keys, values, rank, bins=bins, seed=seed, scaling=0.2)

    per_bin, problems = rank // bins, 6
    flat_k, flat_v = keys.reshape(problems, n, d), values.reshape(problems, n, d)
    centred = flat_k - flat_k.mean(1, keepdim=True)
    bounds = bin_bounds(n, bins)
    assert sorted({e - s for s, e in bounds}) == [50, 51]
    key = rng.seed_key(seed)
    for p in range(problems):
        for b, (start, end) in enumerate(bounds):
            x = centred[p, start:end]
            r_k = x.norm(dim=-1).max()
            a = kernel_coefficient(torch.tensor(0.2, dtype=torch.float64), r_k, r_k, torch.tensor(end - start))
            steps = torch.stack([rng.stream_step_key(key, torch.tensor(p * bins + b), i) for i in range(per_bin)])
            alone = rpnys(x, per_bin, a, steps)
            rows = slice(b * per_bin, (b + 1) * per_bin)
            torch.testing.assert_close(k_s.reshape(problems, rank, d)[p, rows], flat_k[p, start + alone.pivots])
            torch.testing.assert_close(
                v_s.reshape(problems, rank, d)[p, rows], alone.weights @ flat_v[p, start:end], rtol=1e-10, atol=1e-10
            )
            torch.testing.assert_close(
                w.reshape(problems, rank)[p, rows], alone.weights.sum(-1), rtol=1e-10, atol=1e-10
            )


def test_seed_reproducible_and_varies():
    gen = torch.Generator().manual_seed(4)
    keys, values = torch.randn(2, 2, 300, 32, generator=gen), torch.randn(2, 2, 300, 32, generator=gen)
    first = compress_kv(keys, values, 48, bins=4, seed=1)
    again = compress_kv(keys, values, 48, bins=4, seed=1)
    other = compress_kv(keys, values, 48, bins=4, seed=2)
    for x, y in zip(first, again, strict=True):
        assert torch.equal(x, y)
    assert not torch.equal(first[0], other[0])


def test_exhausted_bin_gives_inert_rows_and_stays_exact():
    gen = torch.Generator().manual_seed(8)
    d = 8
    distinct = torch.randn(3, d, generator=gen, dtype=torch.float64)
    keys = distinct[torch.randint(0, 3, (64,), generator=gen)][None, None]  # 64 rows, 3 distinct keys
    values = torch.randn(1, 1, 64, d, generator=gen, dtype=torch.float64)
    k_s, v_s, w = compress_kv(keys, values, 8, seed=0)
    inert = w == 0
    assert inert.sum().item() == 5  # 3 pivots exhaust the residual, 5 rows stay inert
    assert torch.all(v_s[inert] == 0)
    queries = torch.randn(1, 2, 7, d, generator=gen, dtype=torch.float64)
    out = weighted_attention(queries, k_s, v_s, w)
    assert (out - exact_attention(queries, keys, values, 1 / math.sqrt(d))).abs().max().item() <= 1e-8


def test_query_radius_tensor_and_dtypes():
    gen = torch.Generator().manual_seed(13)
    keys = torch.randn(2, 3, 128, 64, generator=gen).to(torch.bfloat16)
    values = torch.randn(2, 3, 128, 64, generator=gen).to(torch.bfloat16)
    radius = torch.tensor([[1.0], [4.0]])  # broadcast over the 3 heads
    k_s, v_s, w = compress_kv(keys, values, 24, bins=2, query_radius=radius, seed=0)
    assert k_s.dtype == v_s.dtype == torch.bfloat16 and w.dtype == torch.float32
    assert k_s.shape == (2, 3, 24, 64) and v_s.shape == (2, 3, 24, 64) and w.shape == (2, 3, 24)
    # K_S are original rows of the input.
    assert all((keys[0, 0] == row).all(-1).any() for row in k_s[0, 0])
    assert torch.isfinite(v_s.float()).all() and torch.isfinite(w).all()


def test_each_problem_gets_its_own_query_radius():
    """A ``[b, h]`` radius gives problem (b, h) what a scalar radius of that entry gives it in the same call (the
    same draws, the same float64 arithmetic: equal to float64 rounding); a radius that reached the wrong problem,
    or every problem's largest, would change that problem's coreset (checked: the radii are far enough apart)."""
    gen = torch.Generator().manual_seed(17)
    keys = torch.randn(2, 3, 96, 16, generator=gen, dtype=torch.float64) * 1.5
    values = torch.randn(2, 3, 96, 8, generator=gen, dtype=torch.float64)
    radius = torch.rand(2, 3, generator=gen, dtype=torch.float64) * 6 + 0.5
    per_problem = compress_kv(keys, values, 16, bins=2, query_radius=radius, seed=5)
    changed = 0
    for b, h in np.ndindex(2, 3):
        alone = compress_kv(keys, values, 16, bins=2, query_radius=float(radius[b, h]), seed=5)
        for got, want in zip(per_problem, alone, strict=True):
            torch.testing.assert_close(got[b, h], want[b, h], rtol=1e-12, atol=1e-12)
        largest = compress_kv(keys, values, 16, bins=2, query_radius=float(radius.max()), seed=5)
        changed += not torch.allclose(largest[1][b, h], alone[1][b, h], rtol=1e-6, atol=1e-9)
    assert changed >= 4  # all but the largest radius's problem, unless a coreset ignores R_Q


@pytest.mark.parametrize("n, rank, bins", [(1, 1, 1), (8, 2, 1), (8, 2, 2)])
def test_keys_that_recentre_to_zero_compress_exactly(n, rank, bins):
    """One key, or equal keys: every recentred key is 0 (R_K = 0), and with the default query radius (R_Q = R_K)
    the temperature formula would divide 0 by 0 (it raised in lambert_w0). The kernel is constant there: the
    coreset carries the whole mass, and its attention is the exact one (every logit equal) to float64 rounding."""
    gen = torch.Generator().manual_seed(n + bins)
    keys = torch.randn(1, 1, 1, 16, generator=gen, dtype=torch.float64).expand(1, 1, n, 16).contiguous()
    values = torch.randn(1, 1, n, 8, generator=gen, dtype=torch.float64)
    k_s, v_s, w = compress_kv(keys, values, rank, bins=bins, seed=0)
    assert w.sum().item() == pytest.approx(n, abs=1e-12)
    queries = torch.randn(1, 2, 3, 16, generator=gen, dtype=torch.float64)
    out = weighted_attention(queries, k_s, v_s, w)
    torch.testing.assert_close(out, exact_attention(queries, keys, values, 0.25), rtol=1e-12, atol=1e-12)


def test_large_key_norms_stay_finite():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(1, 2, 512, 64, generator=gen) * torch.logspace(-1, 1.8, 512)[:, None]  # norms up to ~500
    values = torch.randn(1, 2, 512, 64, generator=gen)
    queries = torch.randn(1, 4, 9, 64, generator=gen) * 5
    k_s, v_s, w = compress_kv(keys, values, 64, bins=4, seed=0)
    out = weighted_attention(queries, k_s, v_s, w, v_min=values.amin(2), v_max=values.amax(2))
    assert torch.isfinite(out).all() and torch.isfinite(w).all()


# ---------------------------------------------------------------- approximation quality


def test_error_falls_with_rank_and_beats_uniform_subset():
    gen = torch.Generator().manual_seed(99)
    heads, n, d, m = 4, 1024, 64, 64
    keys = torch.randn(1, heads, n, d, generator=gen)
    values = torch.randn(1, heads, n, d, generator=gen)
    queries = torch.randn(1, heads, m, d, generator=gen)
    exact = exact_attention(queries, keys, values, 1 / math.sqrt(d))
    v_min, v_max = values.amin(2), values.amax(2)
    errors = []
    for rank in (32, 128, 512):
        k_s, v_s, w = compress_kv(keys, values, rank, seed=rank)
        ours = weighted_attention(queries, k_s, v_s, w, v_min=v_min, v_max=v_max)
        subset = torch.randperm(n, generator=gen)[:rank]
        uniform = exact_attention(queries, keys[:, :, subset], values[:, :, subset], 1 / math.sqrt(d))
        ours_err = (ours - exact).abs().amax((-1, -2)).mean().item()
        uniform_err = (uniform - exact).abs().amax((-1, -2)).mean().item()
        assert ours_err < uniform_err, f"rank {rank}: compresskv {ours_err:.4f} >= uniform {uniform_err:.4f}"
        errors.append(ours_err)
    assert errors[0] > errors[1] > errors[2], errors


# ---------------------------------------------------------------- bad input


def _kv(n=64, d=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, n, d, generator=gen, dtype=dtype), torch.randn(2, n, d, generator=gen, dtype=dtype)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(rank=0), "rank"),
        (dict(rank=-3), "rank"),
        (dict(rank=65), "rank"),
        (dict(rank=2.5), "rank"),
        (dict(rank=12, bins=5), "rank"),
        (dict(rank=8, bins=0), "bins"),
        (dict(rank=65, bins=65), "bins"),
        (dict(rank=8, scaling=0.0), "scaling"),
        (dict(rank=8, scaling=float("nan")), "scaling"),
        (dict(rank=8, query_radius=-1.0), "query_radius"),
        (dict(rank=8, query_radius=torch.ones(3)), "query_radius"),
        (dict(rank=8, seed=1.5), "seed"),
    ],
)
def test_compress_kv_rejects_out_of_range_arguments(kwargs, name):
    keys, values = _kv()
    with pytest.raises(ValueError, match=f"^{name}:"):
        compress_kv(keys, values, **kwargs)


@pytest.mark.parametrize("rank, bins", [(64, 1), (40, 2), (63, 3), (64, 64)])
def test_compress_kv_accepts_boundary_arguments(rank, bins):
    keys, values = _kv()
    k_s, v_s, w = compress_kv(keys, values, rank, bins=bins, seed=0)
    assert k_s.shape == v_s.shape == (2, rank, 8) and w.shape == (2, rank) and torch.isfinite(w).all()


def test_bin_shorter_than_pivot_count_is_rejected():
    keys, values = _kv(n=50)
    with pytest.raises(ValueError, match="bins: the shortest bin has 16 rows, fewer than its 17 pivots"):
        compress_kv(keys, values, 51, bins=3)
    with pytest.raises(ValueError, match="bins: the shortest bin has 12 rows, fewer than its 13 pivots"):
        compress_kv(keys, values, 52, bins=4)


@pytest.mark.parametrize(
    "mutate, name",
    [
        (lambda k, v: (k, v[..., :-1, :]), "values"),
        (lambda k, v: (k, v.double()), "values"),
        (lambda k, v: (k.int(), v), "keys"),
        (lambda k, v: (k[0, 0], v[0, 0]), "keys"),
        (lambda k, v: (k.index_fill(1, torch.tensor([3]), float("nan")), v), "keys"),
        (lambda k, v: (k, v.index_fill(1, torch.tensor([5]), float("inf"))), "values"),
    ],
)
def test_compress_kv_rejects_bad_tensors(mutate, name):
    keys, values = mutate(*_kv())
    with pytest.raises(ValueError, match=name):
        compress_kv(keys, values, 8)


def test_unchecked_inputs_give_the_same_coreset_and_non_finite_output_for_non_finite_input():
    """``check_inputs=False`` (the paper press's path: no value reads before the kernel) computes the same coreset
    on finite inputs, and hands non-finite keys or values back as non-finite values and weights, not an error."""
    keys, values = _kv()
    radius = torch.rand(2, dtype=torch.float64) + 0.5
    checked = compress_kv(keys, values, 8, bins=2, query_radius=radius, seed=3)
    unchecked = compress_kv(keys, values, 8, bins=2, query_radius=radius, seed=3, check_inputs=False)
    for a, b in zip(checked, unchecked, strict=True):
        assert torch.equal(a, b)
    bad = keys.index_fill(1, torch.tensor([3]), float("nan"))
    with pytest.raises(ValueError, match="^keys: contains NaN"):
        compress_kv(bad, values, 8)
    k_s, v_s, w = compress_kv(bad, values, 8, check_inputs=False)
    assert k_s.shape == v_s.shape == (2, 8, 8) and w.shape == (2, 8) and w.dtype == torch.float32
    assert not torch.isfinite(w).any() and not torch.isfinite(v_s).any()
    with pytest.raises(ValueError, match="^check_inputs"):
        compress_kv(keys, values, 8, check_inputs=1)


def test_the_paper_press_leaves_the_input_checks_to_its_read_after_the_prefill(monkeypatch):
    """compress_kv's finiteness checks are host-device syncs on a GPU (two a layer and batch row, before the
    kernel): the paper press skips them and relies on its one read after the prefill (the NaN-key test in
    test_presses.py checks that read names the layer)."""
    from transformers import DynamicCache

    from kvcompress import CompressKVPress, nystrom
    from kvcompress.cache import WeightedLayer
    from tests.tiny_models import tiny_model

    def refuse(name, x):
        raise AssertionError(f"compress_kv checked {name}")

    monkeypatch.setattr(nystrom, "check_finite", refuse)
    model = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache()
    with torch.no_grad(), CompressKVPress.paper(0.75, seed=0)(model):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    assert isinstance(cache.layers[0], WeightedLayer) and cache.layers[0].keys.shape[-2] == 50


def test_float32_overflow_falls_back_to_float64_selection():
    # Log-normal key norms with a large query radius push exp(|y|^2 / 2) past the float32 range.
    gen = torch.Generator().manual_seed(39)
    keys = torch.exp(1.5 * torch.randn(128, 1, generator=gen)) * torch.randn(128, 16, generator=gen)
    values = torch.randn(128, 16, generator=gen)
    radius = float(keys.norm(dim=-1).max())
    k_s, v_s, w = compress_kv(keys, values, 16, query_radius=radius, seed=0)
    assert k_s.dtype == v_s.dtype == w.dtype == torch.float32
    assert torch.isfinite(v_s).all() and torch.isfinite(w).all()
    k_ref, v_ref, w_ref = compress_kv(keys.double(), values.double(), 16, query_radius=radius, seed=0)
    torch.testing.assert_close(k_s.double(), k_ref)  # same pivots as an all-float64 run

    # Why the weights may differ, and by how much (a tolerance from the math, not one machine's rounding):
    # (1) the fallback selects in float64 from keys recentred (and R_K measured) in float32; (2) the weights
    # W_h = h(K_S, K_S)^-1 h(K_S, K) of this near-singular kernel amplify float64 rounding itself; (3) the
    # outputs are rounded to float32. The float64 run's own W_h, same draws (2D input, one bin: stream 0):
    n, d = keys.shape
    rank, u32, u64 = 16, 2.0**-24, 2.0**-53
    x = keys.double() - keys.double().mean(0)
    beta, key_radius = torch.tensor(d**-0.5, dtype=torch.float64), x.norm(dim=-1).max()
    q_radius, count = torch.tensor(radius, dtype=torch.float64), torch.tensor(float(n), dtype=torch.float64)
    a = kernel_coefficient(beta, q_radius, key_radius, count)
    steps = torch.stack([rng.stream_step_key(rng.seed_key(0), torch.tensor(0), i) for i in range(rank)])
    ref = rpnys(x, rank, a, steps)
    pivots = ref.pivots
    torch.testing.assert_close(keys.double()[pivots], k_ref)
    # (1) Each key moves by |dx| <= sqrt(d) (log2 n + 2) u32 max|k| (the mean's pairwise sum, the subtraction),
    # so y = sqrt(a) x by |dy| <= sqrt(a) |dx|; R_K (a float32 norm) by dR <= |dx| + sqrt(d) u32 R_K, which
    # moves a relatively by rho = |dlog a / dlog R_K| dR / R_K. W_h[s, l] = W_G[s, l] exp((|y_l|^2 - |y_s|^2) / 2)
    # with W_G = G_SS^-1 G_Sb, G = exp(-|y_i - y_j|^2 / 2): the exponent moves by <= 2 Y |dy| + Y^2 rho / 2
    # (Y = max |y|), the entries of G relatively by <= 4 Y |dy| + 2 Y^2 rho, amplified by cond(G_SS) at most.
    # So every W_h[s, l] moves relatively by <= eps (first order), except W_h[s, s] = 1 (Nystrom interpolates).
    dx = math.sqrt(d) * (math.log2(n) + 2) * u32 * keys.abs().max().item()
    y = x * a.sqrt()
    dy, big_y = math.sqrt(a.item()) * dx, y.norm(dim=-1).max().item()
    slope = (kernel_coefficient(beta, q_radius, key_radius * (1 + 1e-6), count) / a).log().abs().item() / 1e-6
    rho = slope * (dx + math.sqrt(d) * u32 * key_radius.item()) / key_radius.item()
    gram = torch.exp(-torch.cdist(y[pivots], y[pivots]) ** 2 / 2)
    eps = 2 * big_y * dy + big_y**2 * rho / 2 + torch.linalg.cond(gram).item() * (4 * big_y * dy + 2 * big_y**2 * rho)
    eps *= 1 + eps  # the second-order remainder
    moved = ref.weights.abs()
    moved[torch.arange(rank), pivots] = 0
    # (2) Each run builds M = G_SS^-1 by `rank` rank-one updates of length-`rank` dot products and takes M G_Sb:
    # absolute errors <= gamma (|M| |G_Sb|)[s, l] with gamma = 2 (rank^2 + rank) u64 (with the divisions by the
    # residual), then scaled by exp((|y_l|^2 - |y_s|^2) / 2): huge here, which is what makes this kernel extreme.
    sq = (y * y).sum(-1)
    paths = torch.linalg.inv(gram).abs() @ torch.exp(-torch.cdist(y[pivots], y) ** 2 / 2)
    amplified = 2 * 2 * (rank**2 + rank) * u64 * torch.exp(paths.log() + (sq[None, :] - sq[pivots, None]) / 2)
    # (3) float32 outputs: u32 relative. w_s = sum_l W_h[s, l] and V_S[s] = sum_l W_h[s, l] v_l then move by:
    tol_w = u32 * w_ref.abs() + eps * moved.sum(-1) + amplified.sum(-1)
    tol_v = u32 * v_ref.abs() + (eps * moved + amplified) @ values.double().abs()
    assert tol_w.max() < 0.05 and eps < 0.1  # the check has teeth: a lost factor or a wrong row is an O(1) error
    assert ((w.double() - w_ref).abs() <= tol_w).all(), ((w.double() - w_ref).abs(), tol_w)
    assert ((v_s.double() - v_ref).abs() <= tol_v).all(), ((v_s.double() - v_ref).abs().amax(-1), tol_v.amax(-1))


def test_bins_past_float32s_range_run_in_float64(monkeypatch):
    """RPNys maps its Gaussian-kernel weights back by exp((|y_l|^2 - |y_s|^2) / 2). Past float32's range that factor
    is inf where float32 flushed the Gaussian entry to 0, and 0 * inf is hidden as 0: a lost weight that no
    finiteness check would see (how many entries flush differs between CPUs' exp). So float32 RPNys reports such a
    bin as non-finite and compress_kv redoes it in float64; bins well inside the range keep float32."""
    import kvcompress.nystrom as nystrom

    seen = []
    original = nystrom._rpnys

    def recording(keys, *args, **kwargs):
        result = original(keys, *args, **kwargs)
        seen.append((keys.dtype, bool(torch.isfinite(result.weights).all())))
        return result

    monkeypatch.setattr(nystrom, "_rpnys", recording)
    gen = torch.Generator().manual_seed(39)
    keys = torch.exp(1.5 * torch.randn(128, 1, generator=gen)) * torch.randn(128, 16, generator=gen)
    values = torch.randn(128, 16, generator=gen)
    compress_kv(keys, values, 16, query_radius=float(keys.norm(dim=-1).max()), seed=0)  # spread in the thousands
    assert seen == [(torch.float32, False), (torch.float64, True)]
    seen.clear()
    plain = torch.randn(128, 16, generator=gen)
    k_s, v_s, w = compress_kv(plain, values, 16, seed=0)  # gaussian keys, R_Q = R_K: a spread of a few units
    assert seen == [(torch.float32, True)] and w.dtype == torch.float32 and torch.isfinite(v_s).all()
