"""Attention matching on plain tensors: fit the mass ``w`` and values ``V_S`` of kept rows to reference queries.

After a selection keeps rows ``S`` of a context (the protected sink/window rows ``P`` stay exact), weighted
attention over ``P`` and ``S`` should reproduce exact attention over all rows for the queries to come.
With reference queries ``q`` and their exact probabilities ``p_j(q)`` over the whole context (softmax
over all n rows), the kept rows are fitted bin by bin (cf. Zweiger et al., "Fast KV Compaction via
Attention Matching", arXiv 2602.16284, which fits one global system per head):

* Bins: the kept rows, in position order, are cut into groups of ``bin_rows``; bin ``t`` owns the
  non-protected positions from its first kept row up to the next bin's first kept row (the first bin
  also owns the positions before it). Every dropped row thus belongs to the bin of its nearest kept
  rows on the left, and each bin's kept rows must stand for the rows it owns.
* Mass (denominator): ``sum_{i in t} p_i(q) w_i ~ z_t(q) = sum_{j owned by t} p_j(q)``.
* Values (numerator): ``sum_{i in t} p_i(q) V_S[i] ~ sum_{j owned by t} p_j(q) v_j``.

Both are linear least squares over the queries with the same Gram matrix ``G_t = sum_q a_t a_t^T``
(``a_t(q)`` = the kept rows' probabilities), regularised toward eviction (``w = 1``, ``V_S = v``) by a
ridge ``ridge * mean(diag G)`` over the problem's ``bins x k`` slots (a partial last bin's empty slots count as
copies of its last kept row: for budgets of hundreds of rows a few percent of the mean, and the published results
were made so): one batched Cholesky solve per layer, ``[problems, bins, k, k]``.
``w`` is clamped to ``[e^-c, e^c]`` (``c = max_log_weight``) so that every weight stays positive.

A fit memorises its queries, so it is validated per (batch row, KV head): fitted on the even-numbered
queries, it must lower the attention-output error on the odd ones, and fitted on all queries it must
lower the error on all of them; otherwise that head keeps the unfitted rows. Cost per head: O(m n (k + d))
for the sums (m queries, n rows) and O(r k^2) for the solves (r kept rows).

The sums over the queries are :mod:`kvcompress.fit_equations`'s: on CPU from the probabilities held a chunk of
queries at a time, on a GPU from two fused Triton kernels that never hold them. Every step is a batched tensor op
with static shapes and no host sync: the n-long products run in float32 (on TF32 tensor cores for a bf16/fp16
context), only the ``k x k`` systems and their right-hand sides in float64 (cheap at any GPU's float64 rate), and
each system is solved through its inverse from a batched Cholesky and one batched triangular solve with ``k``
right-hand sides (``torch.cholesky_solve`` with several right-hand sides loops over the batch on some CUDA builds:
one library call per bin).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvcompress._checks import check_backend, check_float_tensor, check_int_range, check_positive
from kvcompress.fit_equations import KeptBins, fused_kernels, normal_equations


@contextlib.contextmanager
def _tensor_core_products(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """float32 products on a GPU's TF32 tensor cores for a bf16/fp16 context (CUDA only; restored after).

    Keys, values and queries in bf16/fp16 are exact in TF32 (10-bit mantissa), so the logits lose nothing; the
    probabilities' products round each probability to 2^-11, below the rounding the model's own bf16/fp16
    attention already has. A float32 context keeps float32 products (cuBLAS's non-tensor-core kernels there ran
    at 7-35 TFLOP/s on an H200: most of the fit's time). Process-wide while active, like torch's own setting.
    """
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def _sent(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on ``device`` without making the host wait: on CUDA pinned and copied asynchronously (a blocking
    copy waits for every kernel queued so far, the layer's forward included, and the fit's kernels would then be
    launched one by one behind an idle GPU)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class FitResult:
    """weights ``[b, h_kv, r]`` float32 (> 0); values ``[b, h_kv, r, d_v]`` in the input dtype; accepted
    ``[b, h_kv]`` bool: where False the rows are the unfitted ones (``w = 1``, ``V_S = v``)."""

    weights: torch.Tensor
    values: torch.Tensor
    accepted: torch.Tensor


def _solve(
    gram: torch.Tensor,
    mass: torch.Tensor,
    value_rhs: torch.Tensor,
    prior_values: torch.Tensor,
    pad: torch.Tensor,
    ridge: float,
    fit_values: bool,
    max_log_weight: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge solve toward ``w = 1``, ``V_S = w v`` in float64; padded slots stay at the prior. Systems ``[..., P, T,
    k, k]`` with any leading dimensions (the held-out and the full fit in one batch); returns ``[..., P, T, k]``,
    ``[..., P, T, k, d]``."""
    k = gram.shape[-1]
    diag = gram.diagonal(dim1=-2, dim2=-1)
    scale = diag.mean(dim=(-1, -2), keepdim=True).clamp_min(1e-300)[..., None]  # per problem
    eye = torch.eye(k, dtype=gram.dtype, device=gram.device)
    system = gram * ~pad[..., :, None] * ~pad[..., None, :] + ridge * scale * eye
    # No error check (a device sync): the system is SPD (ridge > 0); a factor that failed anyway gives a fit the
    # held-out error checks judge like any other (NaN never passes them: that head keeps its unfitted rows).
    factor = torch.linalg.cholesky_ex(system).L
    # The inverse L^-T L^-1 from one triangular solve with k right-hand sides, then every solve is a batched matmul:
    # triangular solves with the values' d columns were a sixth of the fit's GPU time at 32k (H200 profile). The
    # ridge bounds the systems' condition, so the explicit inverse costs no accuracy that float64 would show.
    lower_inverse = torch.linalg.solve_triangular(factor, eye.expand_as(factor), upper=False)
    inverse = lower_inverse.mT @ lower_inverse

    prior = ridge * scale[..., 0]
    weights = (inverse @ (mass + prior)[..., None])[..., 0]
    weights = torch.where(pad, torch.ones_like(weights), weights).clamp(
        math.exp(-max_log_weight), math.exp(max_log_weight)
    )
    values = prior_values * weights[..., None]
    if fit_values:  # value_rhs + prior * (w v), built in the product's buffer (no float64 temporaries of its size)
        values = inverse @ values.mul_(prior[..., None]).add_(value_rhs)
        values = torch.where(pad[..., None], prior_values, values)
    return weights, values


@dataclass
class _QuerySets:
    """Sets of reference queries, precomputed to score candidate fits (float32): the kept rows' probabilities
    ``[P, M, r]``, the exact outputs ``[P, M, d]`` and the protected rows' numerators ``[P, M, d]`` and
    denominators ``[P, M]``, the rows of set s after those of sets before it (``counts``: rows per set)."""

    kept_prob: torch.Tensor
    exact: torch.Tensor
    numerator: torch.Tensor
    denominator: torch.Tensor
    counts: list[int]

    @staticmethod
    def stack(candidates: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """C candidate fits ``(weights [P, r], kept_values [P, r, d])`` float32 as one ``[P, r, C (d + 1)]``
        matrix for :meth:`errors`, its width padded to a multiple of 8 (cuBLAS's tensor-core kernels need it to run
        at speed: 129 columns ran at about 3 TFLOP/s on an H100)."""
        columns = [part for w, v in candidates for part in (v, w[..., None])]
        width = sum(part.shape[-1] for part in columns)
        if width % 8:
            columns.append(columns[0].new_zeros(*columns[0].shape[:-1], -width % 8))
        return torch.cat(columns, -1)

    def errors(self, stacked: torch.Tensor, count: int) -> torch.Tensor:
        """Squared error ``[S, C, P]`` of weighted attention over protected + kept rows against exact attention, per
        set of queries, for the ``count`` candidate fits :meth:`stack` put in ``stacked``, from one product over all
        of them (one read of ``kept_prob``)."""
        columns = count * (self.exact.shape[-1] + 1)
        kept = (self.kept_prob @ stacked)[..., :columns].unflatten(-1, (count, -1))  # [P, M, C, d + 1]
        numerator = self.numerator[:, :, None] + kept[..., :-1]
        denominator = self.denominator[:, :, None] + kept[..., -1]
        out = numerator / denominator.clamp_min(torch.finfo(denominator.dtype).tiny)[..., None]
        squared = (out - self.exact[:, :, None]) ** 2
        return torch.stack([part.sum(dim=(1, 3)).T for part in squared.split(self.counts, 1)])


def fit_kept_rows(
    keys: torch.Tensor,
    values: torch.Tensor,
    kept: torch.Tensor,
    protected: torch.Tensor,
    queries: torch.Tensor,
    scaling: float,
    *,
    query_positions: torch.Tensor | None = None,
    bin_rows: int = 16,
    ridge: float = 0.1,
    fit_values: bool = True,
    max_log_weight: float = 3.0,
    backend: str = "auto",
    known_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> FitResult:
    """Fit the kept rows of a context to reference queries (module docstring).

    Probabilities, their products and the error checks run in float32 (TF32 tensor cores on a GPU for a
    bf16/fp16 context: :func:`_tensor_core_products`); the ``k x k`` systems are solved in float64.

    keys ``[b, h_kv, n, d]``, values ``[b, h_kv, n, d_v]``: the whole context. kept ``[b, h_kv, r]`` int64,
    sorted positions of the kept non-protected rows. protected ``[n]`` bool: rows kept exact and outside the
    fit (pass it on the CPU: its row list is then read without a device sync). queries ``[b, h_q, m, d]``
    (post-RoPE, ``h_q`` a multiple of ``h_kv``; every query head of a group is a reference query of its KV
    head); ``query_positions`` ``[m]`` as in :func:`kvcompress.selection.attention_mass`. ``fit_values=False``
    fits only the mass and scales the kept values with it (``V_S = w v``). Needs at least 2 queries per KV
    head (the validation split). ``backend``: ``"torch"`` holds the probabilities a chunk of queries at a time;
    ``"triton"`` never holds them (:mod:`kvcompress.kernels.fit_products`: CUDA tensors, or CPU ones under
    ``TRITON_INTERPRET=1``); ``"auto"``: the kernels on CUDA where they can run, else the PyTorch path.
    ``known_rows``: the queries' ``(log-sum-exp [b, h_q, m]`` (natural log, over the keys each one sees), ``exact
    attention outputs [b, h_q, m, d_v])`` where an attention that already ran over these keys gave them (the
    prefill's own call, for the window's queries): the fused path then skips its first kernel, the PyTorch path its
    product with the values; the fit's validation compares against those outputs.
    """
    check_backend(backend)
    _check_shapes(keys, values, kept, protected, queries)
    check_int_range("bin_rows", bin_rows, 1)
    for name, value in (("scaling", scaling), ("ridge", ridge), ("max_log_weight", max_log_weight)):
        check_positive(name, value)
    if known_rows is not None:
        _check_known_rows(known_rows, queries, values)
    with _tensor_core_products(keys.device, keys.dtype):
        return _fit(
            keys, values, kept, protected, queries, scaling, query_positions, bin_rows, ridge, fit_values,
            max_log_weight, backend, known_rows,
        )  # fmt: skip


def _check_shapes(keys, values, kept, protected, queries) -> None:
    """The arguments' kinds and shapes (host checks only: which rows ``kept`` names is the caller's contract)."""
    for name, x in (("keys", keys), ("values", values), ("queries", queries)):
        check_float_tensor(name, x, ndim=4)
    batch, heads_kv, n, dim = keys.shape
    if values.shape[:3] != keys.shape[:3]:
        raise ValueError(f"values: shape {tuple(values.shape)} must be [{batch}, {heads_kv}, {n}, d_v]")
    if queries.shape[0] != batch or queries.shape[-1] != dim or queries.shape[1] % heads_kv:
        raise ValueError(f"queries: shape {tuple(queries.shape)} must be [{batch}, h_q, m, {dim}], h_q a multiple of "
                         f"{heads_kv}")  # fmt: skip
    if queries.shape[1] // heads_kv * queries.shape[2] < 2:
        raise ValueError("queries: the fit needs at least 2 queries per KV head (its validation splits them)")
    if not isinstance(kept, torch.Tensor) or kept.dtype != torch.int64 or kept.dim() != 3 or kept.shape[:2] != (
        batch, heads_kv
    ) or kept.shape[2] < 1:
        got = f"{kept.dtype} {tuple(kept.shape)}" if isinstance(kept, torch.Tensor) else type(kept).__name__
        raise ValueError(f"kept: must be int64 [{batch}, {heads_kv}, r >= 1] (sorted kept positions), got {got}")
    if not isinstance(protected, torch.Tensor) or protected.dtype != torch.bool or protected.shape != (n,):
        got = f"{protected.dtype} {tuple(protected.shape)}" if isinstance(protected, torch.Tensor) else protected
        raise ValueError(f"protected: must be a bool tensor of shape [{n}], got {got}")


def _check_known_rows(known_rows, queries: torch.Tensor, values: torch.Tensor) -> None:
    if not isinstance(known_rows, (tuple, list)) or len(known_rows) != 2:
        raise ValueError("known_rows: must be a pair (log-sum-exp [b, h_q, m], exact outputs [b, h_q, m, d_v])")
    lse, exact = known_rows
    rows, d_v = tuple(queries.shape[:3]), values.shape[-1]
    for name, x, shape in (("log-sum-exp", lse, rows), ("exact outputs", exact, (*rows, d_v))):
        if not x.is_floating_point() or tuple(x.shape) != shape or x.device != queries.device:
            want = f"floating, of shape {list(shape)} on {queries.device}"
            raise ValueError(f"known_rows: its {name} must be {want}, got {x.dtype} {tuple(x.shape)} on {x.device}")


def _fit(
    keys, values, kept, protected, queries, scaling, query_positions, bin_rows, ridge, fit_values, max_log_weight,
    backend, known_rows,
) -> FitResult:  # fmt: skip
    """:func:`fit_kept_rows`'s work, with its arguments."""
    batch, heads_kv, n, dim = keys.shape
    r, d_v = kept.shape[-1], values.shape[-1]
    heads_q, m = queries.shape[1], queries.shape[2]
    group = heads_q // heads_kv
    problems = batch * heads_kv
    flat_values = values.reshape(problems, n, d_v).float()
    flat_kept = kept.reshape(problems, r)
    grouped = queries.reshape(batch, heads_kv, group * m, dim).reshape(problems, group * m, dim)
    positions = None if query_positions is None else query_positions.to(keys.device).repeat(group)
    if known_rows is not None:  # as the queries: [P, group * m] and [P, group * m, d_v]
        lse, exact = known_rows
        known_rows = (lse.float().reshape(problems, group * m), exact.float().reshape(problems, group * m, d_v))

    k = min(bin_rows, r)
    bins = -(-r // k)
    padded = torch.cat([flat_kept, flat_kept[:, -1:].expand(-1, bins * k - r)], dim=1)
    pad = (torch.arange(bins * k, device=keys.device) >= r).reshape(bins, k).expand(problems, -1, -1)
    # Bin of every position: (number of kept rows at or before it, minus one) // k; protected: -1.
    at_or_before = torch.searchsorted(
        flat_kept, torch.arange(n, device=keys.device).expand(problems, n).contiguous(), right=True
    )
    protected = protected.cpu()
    owner = ((at_or_before - 1).clamp_min(0) // k).masked_fill(_sent(protected, keys.device)[None, :], -1)
    kept_bins = KeptBins(padded, owner, _sent(protected.nonzero()[:, 0], keys.device), bins, k, r)

    # Fit on the even queries, validate on the odd ones (the sums are over queries: fit_equations).
    kernels = fused_kernels(keys, values, k, backend)
    context_keys = keys.reshape(problems, n, dim)
    if kernels is None:  # the held probabilities' float32 products: convert once, not per half
        context_keys = context_keys.float()
    halves = [
        (
            grouped[:, start::2],
            None if positions is None else positions[start::2],
            None if known_rows is None else tuple(x[:, start::2] for x in known_rows),
        )
        for start in (0, 1)
    ]
    sums, parts = normal_equations(
        kernels, halves, context_keys, values.reshape(problems, n, d_v), flat_values, scaling, kept_bins
    )
    checks = _QuerySets(*parts, counts=[queries.shape[1] for queries, _, _ in halves])
    prior_values = flat_values.gather(1, padded[..., None].expand(-1, -1, d_v)).reshape(problems, bins, k, d_v)

    def flat(w: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights ``[..., P, r]`` and values ``[..., P, r, d]`` float32, unpadded, with a leading fit dimension."""
        return (
            w.reshape(-1, problems, bins * k)[..., :r].float(),
            v.reshape(-1, problems, bins * k, d_v)[..., :r, :].float(),
        )

    (ones,), (unfitted,) = flat(torch.ones(problems, bins, k, device=keys.device), prior_values)
    # The held-out fit (even queries) and the full fit (all) as one batch of systems, [2, P, T, k, k]: one solve.
    for halves_sums in sums:
        halves_sums[1] += halves_sums[0]
    solved = _solve(*sums, prior_values.double(), pad, ridge, fit_values, max_log_weight)
    (held_w, fit_w), (held_v, fit_v) = flat(*solved)
    candidates = [(ones, unfitted), (held_w, held_v), (fit_w, fit_v)]
    (plain_even, _, fit_even), (plain_odd, held_odd, fit_odd) = checks.errors(
        _QuerySets.stack(candidates), len(candidates)
    )
    better_held_out = held_odd < plain_odd
    better_in_sample = fit_even + fit_odd < plain_even + plain_odd
    accepted = better_held_out & better_in_sample
    weights = torch.where(accepted[:, None], fit_w, ones)
    kept_values = torch.where(accepted[:, None, None], fit_v, unfitted).to(values.dtype)
    return FitResult(
        weights=weights.reshape(batch, heads_kv, r),
        values=kept_values.reshape(batch, heads_kv, r, d_v),
        accepted=accepted.reshape(batch, heads_kv),
    )
