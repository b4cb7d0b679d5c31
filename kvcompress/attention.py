"""Weighted attention (Alg. 3) on plain tensors: the PyTorch reference and the backend dispatch (Triton kernel)."""

from __future__ import annotations

import math

import torch

from kvcompress._checks import BACKENDS as _BASE_BACKENDS
from kvcompress._checks import (
    check_backend,
    check_bool,
    check_float_tensor,
    check_fold_from,
    check_int_range,
    check_positive,
)
from kvcompress._checks import check_finite as _check_finite

BACKENDS = (*_BASE_BACKENDS, "sdpa", "flex")  # weighted_attention's backends
# From this many new tokens a CPU call runs Alg. 3 through sdpa's fused kernel (_weighted_attention_sdpa), below it
# the reference: the crossover measured on the embedded model's shapes (docs/BENCHMARKS.md, "Long questions over a
# compressed cache on CPU").
SDPA_MIN_QUERIES = 16


def weighted_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor,
    *,
    scaling: float | None = None,
    v_min: torch.Tensor | None = None,
    v_max: torch.Tensor | None = None,
    causal_offset: int | None = None,
    key_mask: torch.Tensor | None = None,
    backend: str = "auto",
    check_finite: bool = True,
    fold_from: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """WtdAttn (Alg. 3): ``clip(sum_l e^{s_l} v_l / sum_l e^{s_l} w_l, v_min, v_max)``, ``s_l = beta <q, k_l>``.

    queries ``[b, h_q, m, d]``; keys ``[b, h_kv, n, d]``; values ``[b, h_kv, n, d_v]``; weights
    ``[b, h_kv, n]``; ``h_q`` a multiple of ``h_kv`` (GQA: query head j reads KV head j // (h_q / h_kv)).
    ``v_min`` / ``v_max``: optional ``[b, h_kv, d_v]`` clip range. Where the denominator is <= 0 the
    output is 0 before clipping. ``causal_offset=c``: query i may attend key j only if j <= c + i.
    ``key_mask``: optional ``[b, n]`` bool, False on keys no query of that batch row may see (padding,
    filler rows of a compressed cache); combined with ``causal_offset``. A query that sees no key gets 0.
    Accumulates in float32 (float64 for float64 inputs); returns ``values.dtype``, ``[b, h_q, m, d_v]``.

    ``backend``: ``"torch"`` (the PyTorch reference, which builds the whole logits tensor); ``"sdpa"`` (the
    weight as one more value column of torch's ``scaled_dot_product_attention``, whose fused kernel never builds
    the logits: on CPU FlashAttention-2's, about as fast as sdpa over the same keys; any device); ``"triton"``
    (the FlashAttention-2 style split-K Triton kernel of ``kvcompress.kernels.weighted_decode``, with decode
    tiles for 1..16 new tokens and through ``kvcompress.kernels.weighted_prefill`` for more; CUDA tensors, or
    CPU tensors under ``TRITON_INTERPRET=1``; float16/bfloat16/float32, head dims multiples of 16 up to 256; raises
    ``ValueError`` outside that, ``ImportError`` without triton); ``"flex"`` (torch's FlexAttention with a
    ``log w`` score bias, ``kvcompress.weighted_flex``: only where every visible weight is > 0, else
    ``ValueError``; compiled on CUDA, eager elsewhere); or ``"auto"`` (the Triton kernels for CUDA tensors
    they support when triton imports, else the reference; FlexAttention is not chosen automatically until
    GPU timings show where it is faster). ``check_finite``: reject NaN/Inf in queries, keys, values, weights
    and the clip range, and a clip range with ``v_min > v_max``, with a ``ValueError`` (one device sync; pass
    False where speed matters and the inputs are known to be valid). ``fold_from``: rows ``[fold_from, n)`` of
    ``values`` (those ``key_mask`` shows) are first folded into ``v_min`` / ``v_max`` in place (a caller's running
    clip range over the rows appended since its last call; needs both bounds): by the Triton kernel itself, with no
    launch of its own, or by :func:`fold_value_range_` on the other backends. A ``[b]`` int64 tensor instead: batch
    row ``i`` folds its one row ``fold_from[i]`` (a decode batch whose rows end at different lengths).
    """
    check_backend(backend, BACKENDS)
    check_bool("check_finite", check_finite)
    check_float_tensor("queries", queries, ndim=4)
    check_float_tensor("keys", keys, ndim=4)
    check_float_tensor("values", values, ndim=4)
    check_float_tensor("weights", weights, ndim=3)
    batch, heads_q, m, dim = queries.shape
    _, heads_kv, n, _ = keys.shape
    for name, x in (("keys", keys), ("values", values)):
        if x.dtype != queries.dtype or x.device != queries.device:
            raise ValueError(f"{name}: dtype/device must match queries ({queries.dtype}, {queries.device})")
    if keys.shape[0] != batch or keys.shape[-1] != dim:
        raise ValueError(f"keys: shape {tuple(keys.shape)} must be [{batch}, h_kv, n, {dim}]")
    if values.shape[:3] != keys.shape[:3]:
        raise ValueError(f"values: shape {tuple(values.shape)} must be [{batch}, {heads_kv}, {n}, d_v]")
    if weights.shape != keys.shape[:3]:
        raise ValueError(f"weights: shape {tuple(weights.shape)} must be {tuple(keys.shape[:3])}")
    if dim < 1:
        raise ValueError(f"queries: head dim d must be >= 1, got shape {tuple(queries.shape)}")
    if heads_kv < 1 or heads_q % heads_kv:
        raise ValueError(f"queries: h_q={heads_q} must be a multiple of the key heads h_kv={heads_kv}")
    if n < 1:
        raise ValueError(f"keys: need at least one key row (n >= 1), got shape {tuple(keys.shape)}")
    d_v = values.shape[-1]
    for name, bound in (("v_min", v_min), ("v_max", v_max)):
        if bound is not None:
            check_float_tensor(name, bound, ndim=3)
            if bound.shape != (batch, heads_kv, d_v):
                raise ValueError(f"{name}: shape {tuple(bound.shape)} must be {(batch, heads_kv, d_v)}")
    for name, x in (("weights", weights), ("v_min", v_min), ("v_max", v_max)):
        if x is not None and x.device != queries.device:
            raise ValueError(f"{name}: must be on the queries' device {queries.device}, got {x.device}")
    scaling = 1.0 / math.sqrt(dim) if scaling is None else check_positive("scaling", scaling)
    if causal_offset is not None:
        check_int_range("causal_offset", causal_offset, 0)
    check_fold_from(fold_from, batch, n, queries.device, v_min, v_max, read_indices=True)
    if key_mask is not None:
        if not isinstance(key_mask, torch.Tensor) or key_mask.dtype != torch.bool:
            kind = key_mask.dtype if isinstance(key_mask, torch.Tensor) else type(key_mask).__name__
            raise ValueError(f"key_mask: must be a bool torch.Tensor of shape [{batch}, {n}], got {kind}")
        if key_mask.shape != (batch, n) or key_mask.device != queries.device:
            raise ValueError(
                f"key_mask: shape {tuple(key_mask.shape)} on {key_mask.device} must be {(batch, n)} on {queries.device}"
            )
    if check_finite:
        for name, x in (("queries", queries), ("keys", keys), ("values", values), ("weights", weights),
                        ("v_min", v_min), ("v_max", v_max)):  # fmt: skip
            if x is not None:
                _check_finite(name, x)
        if v_min is not None and v_max is not None and bool((v_min > v_max).any()):
            raise ValueError("v_min: must be <= v_max in every entry (the clip range [v_min, v_max])")

    if batch * heads_q * m == 0:  # no query: nothing to attend (the fused backends do not take empty launches)
        fold_value_range_(v_min, v_max, values, fold_from, key_mask)
        return values.new_zeros(batch, heads_q, m, d_v)
    kwargs = dict(scaling=scaling, v_min=v_min, v_max=v_max, causal_offset=causal_offset, key_mask=key_mask)
    if backend == "flex":
        fold_value_range_(v_min, v_max, values, fold_from, key_mask)
        try:
            from kvcompress import weighted_flex
        except ImportError as exc:
            raise ImportError("backend='flex' needs torch.nn.attention.flex_attention (torch >= 2.9)") from exc

        reason = weighted_flex.unsupported_reason(weights, key_mask, values)
        if reason is not None:
            raise ValueError(f"backend='flex': {reason}; use backend='triton', 'torch' or 'auto'")
        return weighted_flex.flex_weighted_attention(queries, keys, values, weights, **kwargs)
    if backend == "triton" or (backend == "auto" and queries.device.type == "cuda"):
        kernel = _triton_kernel(queries, keys, values, weights, v_min, v_max, required=backend == "triton")
        if kernel is not None:
            return kernel(queries, keys, values, weights, **kwargs, fold_from=fold_from)
    v_min, v_max = _folded_for_torch(v_min, v_max, values, fold_from, key_mask)
    if backend == "sdpa":
        return _weighted_attention_sdpa(queries, keys, values, weights, scaling, v_min, v_max, causal_offset, key_mask)
    reference = _weighted_attention_torch if backend == "torch" else _weighted_attention_without_triton
    return reference(queries, keys, values, weights, scaling, v_min, v_max, causal_offset, key_mask)


def weighted_attention_unchecked(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor,
    *,
    scaling: float,
    v_min: torch.Tensor | None = None,
    v_max: torch.Tensor | None = None,
    causal_offset: int | torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
    fold_from: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """``weighted_attention(..., backend="auto", check_finite=False)`` without its argument checks: for callers
    whose inputs are model activations of known shapes (the attention function runs this every layer and step).
    ``causal_offset`` may also be an int64 tensor on the inputs' device, of one element or ``[b]`` (each batch row's
    offset: the Triton kernel then reads no key past a row's own)."""
    if queries.is_cuda:
        kernel = _triton_kernel(queries, keys, values, weights, v_min, v_max, required=False)
        if kernel is not None:
            return kernel(queries, keys, values, weights, scaling=scaling, v_min=v_min, v_max=v_max,
                          causal_offset=causal_offset, key_mask=key_mask, check=False, fold_from=fold_from)  # fmt: skip
    v_min, v_max = _folded_for_torch(v_min, v_max, values, fold_from, key_mask)
    return _weighted_attention_without_triton(
        queries, keys, values, weights, scaling, v_min, v_max, causal_offset, key_mask
    )


def _weighted_attention_without_triton(
    queries, keys, values, weights, scaling, v_min, v_max, causal_offset, key_mask=None
) -> torch.Tensor:
    """:func:`_weighted_attention_torch`'s arguments where no Triton kernel runs them: on CPU from
    ``SDPA_MIN_QUERIES`` queries on sdpa's fused kernel (:func:`_weighted_attention_sdpa`), else the reference (the
    leaner of the two for a decode step's few queries)."""
    if queries.device.type == "cpu" and queries.shape[2] >= SDPA_MIN_QUERIES:
        return _weighted_attention_sdpa(queries, keys, values, weights, scaling, v_min, v_max, causal_offset, key_mask)
    return _weighted_attention_torch(queries, keys, values, weights, scaling, v_min, v_max, causal_offset, key_mask)


def _folded_for_torch(v_min, v_max, values, fold_from, key_mask):
    """:func:`fold_value_range_`, then the range the PyTorch path clips with: a copy where autograd may save it for
    the backward pass (the next call's fold changes the running range in place)."""
    fold_value_range_(v_min, v_max, values, fold_from, key_mask)
    if fold_from is not None and torch.is_grad_enabled():  # fold_from comes with both bounds
        return v_min.clone(), v_max.clone()
    return v_min, v_max


@torch.no_grad()
def fold_value_range_(
    v_min: torch.Tensor | None,
    v_max: torch.Tensor | None,
    values: torch.Tensor,
    fold_from: int | torch.Tensor | None,
    key_mask: torch.Tensor | None = None,
) -> None:
    """Fold rows ``[fold_from, n)`` of ``values [b, h_kv, n, d_v]`` (those ``key_mask [b, n]`` shows) into the
    clip range ``v_min`` / ``v_max [b, h_kv, d_v]`` in place, rounded to their dtype; nothing when ``fold_from`` is
    None or n. A ``[b]`` int64 tensor: batch row ``i`` folds its one row ``fold_from[i]``. The PyTorch form of the
    Triton kernel's fold (three launches on a GPU, none there); outside autograd, as the kernel's is."""
    n = values.shape[-2]
    if isinstance(fold_from, torch.Tensor):
        new = values[torch.arange(values.shape[0], device=values.device), :, fold_from]  # [b, h_kv, d_v]
        torch.minimum(v_min, new.to(v_min.dtype), out=v_min)
        torch.maximum(v_max, new.to(v_max.dtype), out=v_max)
        return
    if fold_from is None or fold_from >= n:
        return
    new = values[:, :, fold_from:]
    if key_mask is None:
        new_low, new_high = torch.aminmax(new, dim=-2)
    else:  # padded later rows do not widen the range
        hidden = ~key_mask[:, None, fold_from:, None]
        new_low = new.masked_fill(hidden, float("inf")).amin(-2)
        new_high = new.masked_fill(hidden, float("-inf")).amax(-2)
    # Rounding to the range's dtype first is exact: rounding is monotonic, so it commutes with min and max.
    torch.minimum(v_min, new_low.to(v_min.dtype), out=v_min)
    torch.maximum(v_max, new_high.to(v_max.dtype), out=v_max)


_KERNEL_MODULES: tuple | ImportError | None = None  # (weighted_decode, weighted_prefill) once imported


def _triton_kernel(queries, keys, values, weights, v_min, v_max, required: bool):
    """The Triton launcher for these validated inputs (decode kernel up to ``MAX_NEW_TOKENS`` new tokens, the
    multi-token kernel above), or None where it cannot run them; ``required``: raise instead of None."""
    global _KERNEL_MODULES
    if _KERNEL_MODULES is None:  # imported once: an import statement per call costs a decode step's host time
        try:
            from kvcompress.kernels import weighted_decode, weighted_prefill

            _KERNEL_MODULES = (weighted_decode, weighted_prefill)
        except ImportError as exc:
            _KERNEL_MODULES = exc
    if isinstance(_KERNEL_MODULES, ImportError):
        if required:
            raise ImportError("backend='triton' needs the triton package (pip install triton)") from _KERNEL_MODULES
        return None
    weighted_decode, weighted_prefill = _KERNEL_MODULES
    module = weighted_decode if queries.shape[2] <= weighted_decode.MAX_NEW_TOKENS else weighted_prefill
    reason = module.unsupported_reason(queries, keys, values, weights, v_min, v_max)
    if reason is None:
        return module.weighted_decode_attention if module is weighted_decode else module.weighted_prefill_attention
    if required:
        raise ValueError(f"backend='triton': {reason}; use backend='torch' or 'auto'")
    return None


def _weighted_attention_torch(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor,
    scaling: float,
    v_min: torch.Tensor | None,
    v_max: torch.Tensor | None,
    causal_offset: int | torch.Tensor | None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The PyTorch reference of ``weighted_attention`` on validated inputs (any device, float32/float64 math);
    ``causal_offset`` also an int64 tensor of one element or ``[b]`` (each batch row's), as the kernel takes it.

    When nothing is hidden (no key mask, and an int ``causal_offset`` at or past the last key: a decode step over
    its own cache) every row sees a key, so a fused softmax stands in for the masked max-subtracted exponentials
    (:func:`_visible_exponentials`): the normalisation cancels in the ratio of Alg. 3, and the step issues about a
    third of the operators."""
    batch, heads_q, m, _ = queries.shape
    d_v = values.shape[-1]
    compute = _compute_dtype(queries, weights)
    probs = _visible_exponentials(queries, keys, scaling, causal_offset, key_mask, compute)
    numerator = probs @ _as(values, compute)
    denominator = probs @ _as(weights, compute).unsqueeze(-1)
    out = numerator.div_(denominator).masked_fill_(denominator <= 0, 0.0)  # a denominator <= 0 gives 0 (Alg. 3)
    return _clipped(out, v_min, v_max).reshape(batch, heads_q, m, d_v).to(values.dtype)


def _visible_exponentials(queries, keys, scaling, causal_offset, key_mask, compute: torch.dtype) -> torch.Tensor:
    """``[b, h_kv, g*m, n]`` in ``compute``: each query's ``e^{s - c}`` over the keys it sees (0 elsewhere), ``c`` a
    constant per query row (it cancels in every ratio taken of them), the query heads of a KV head's group as rows.

    When nothing is hidden (no key mask, and an int ``causal_offset`` at or past the last key: a decode step over
    its own cache) a fused softmax stands in for the masked max-subtracted exponentials."""
    batch, heads_q, m, dim = queries.shape
    _, heads_kv, n, _ = keys.shape
    group = heads_q // heads_kv
    q = _as(queries, compute).reshape(batch, heads_kv, group * m, dim)
    logits = (q @ _as(keys, compute).transpose(-1, -2)).mul_(scaling)  # [b, h_kv, g*m, n]
    hides_keys = isinstance(causal_offset, torch.Tensor) or (causal_offset is not None and causal_offset < n - 1)
    if key_mask is None and not hides_keys:
        return torch.softmax(logits, -1)
    if causal_offset is not None:
        rows = torch.arange(m, device=queries.device).repeat(group)
        if isinstance(causal_offset, torch.Tensor):  # [1] or [b]: [b or 1, 1, g*m, 1]
            causal_offset = causal_offset.view(-1, 1, 1, 1)
        allowed = torch.arange(n, device=queries.device)[None, :] <= causal_offset + rows[:, None]
        logits = logits.masked_fill(~allowed, -math.inf)
    if key_mask is not None:
        logits = logits.masked_fill(~key_mask[:, None, None, :], -math.inf)
    # Subtract the row max (it cancels); a row with no visible key has max -inf and gets all 0.
    row_max = logits.amax(-1, keepdim=True)
    return torch.exp(logits - torch.where(torch.isfinite(row_max), row_max, 0.0))


def weighted_attention_probabilities(
    queries: torch.Tensor,
    keys: torch.Tensor,
    weights: torch.Tensor,
    *,
    scaling: float,
    causal_offset: int | torch.Tensor | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each query's distribution over the weighted rows in Alg. 3, ``a_j = w_j e^{s_j} / sum_i w_i e^{s_i}`` over the
    keys it sees: the share of the attention mass of the tokens row ``j`` stands for (what ``output_attentions``
    reports over a compressed cache). The output before clipping is ``sum_j a_j v_j / w_j`` (a row's value is ``w_j``
    times the value it stands for). Arguments as :func:`weighted_attention`'s; returns ``[b, h_q, m, n]`` in
    ``queries.dtype`` (float32 math, float64 for float64 inputs), 0 on hidden keys and on a query whose denominator
    is <= 0 (weights may be negative, and so may a share)."""
    batch, heads_q, m, _ = queries.shape
    compute = _compute_dtype(queries, weights)
    probs = _visible_exponentials(queries, keys, scaling, causal_offset, key_mask, compute)
    shares = probs * _as(weights, compute).unsqueeze(-2)
    denominator = shares.sum(-1, keepdim=True)
    shares = shares.div_(denominator).masked_fill_(denominator <= 0, 0.0)
    return shares.reshape(batch, heads_q, m, keys.shape[-2]).to(queries.dtype)


def _weighted_attention_sdpa(
    queries, keys, values, weights, scaling, v_min, v_max, causal_offset, key_mask=None
) -> torch.Tensor:
    """Alg. 3 through one call of ``scaled_dot_product_attention``, whose fused kernels never build the ``m x n``
    logits: with ``p = softmax(s)`` over the visible keys, ``sum e^s v / sum e^s w = (sum p v) / (sum p w)``, so
    the weight rides as one more value column and the output is the ratio of the two averages (0 where the
    denominator is <= 0 or no key is visible). The queries and keys get zero columns up to the values' width (a
    dot product unchanged) because the fused kernels take one head dim. Arguments, output and math dtype as
    :func:`_weighted_attention_torch`'s (float32 for 16-bit inputs)."""
    batch, heads_q, m, dim = queries.shape
    heads_kv, n, d_v = keys.shape[1], keys.shape[2], values.shape[-1]
    compute = _compute_dtype(queries, weights)
    width = max(dim, d_v + 1)
    q = torch.nn.functional.pad(_as(queries, compute), (0, width - dim))
    k = torch.nn.functional.pad(_as(keys, compute), (0, width - dim))
    v = torch.nn.functional.pad(torch.cat((_as(values, compute), _as(weights, compute)[..., None]), -1),
                                (0, width - d_v - 1))  # fmt: skip
    visible = None
    if isinstance(causal_offset, torch.Tensor) or (causal_offset is not None and causal_offset < n - 1):
        offset = causal_offset.view(-1, 1, 1, 1) if isinstance(causal_offset, torch.Tensor) else causal_offset
        rows = torch.arange(m, device=queries.device)[:, None]
        visible = torch.arange(n, device=queries.device)[None, :] <= offset + rows  # [m, n] or [b, 1, m, n]
    if key_mask is not None:
        shown = key_mask[:, None, None, :]
        visible = shown if visible is None else visible & shown
    averages = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=visible, scale=scaling, enable_gqa=heads_q != heads_kv
    )
    numerator, denominator = averages[..., :d_v], averages[..., d_v : d_v + 1]
    positive = denominator > 0  # False where no key is visible (the fused kernels give 0 there, the math one NaN)
    out = torch.where(positive, numerator / torch.where(positive, denominator, 1.0), 0.0)
    grouped = out.reshape(batch, heads_kv, -1, d_v)  # each KV head's group of query heads, as the reference's rows
    return _clipped(grouped, v_min, v_max).reshape(batch, heads_q, m, d_v).to(values.dtype)


def _compute_dtype(queries: torch.Tensor, weights: torch.Tensor) -> torch.dtype:
    """The math dtype of both PyTorch paths: float64 if the queries or the weights are, else float32."""
    return torch.float64 if torch.float64 in (queries.dtype, weights.dtype) else torch.float32


def _clipped(out: torch.Tensor, v_min: torch.Tensor | None, v_max: torch.Tensor | None) -> torch.Tensor:
    """``out [b, h_kv, group * m, d_v]`` clipped to each KV head's ``[b, h_kv, d_v]`` range (either bound may be
    None), the range cast to ``out``'s dtype."""
    if v_min is None and v_max is None:
        return out
    low = None if v_min is None else _as(v_min, out.dtype).unsqueeze(2)
    high = None if v_max is None else _as(v_max, out.dtype).unsqueeze(2)
    return torch.clamp(out, low, high)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def merge_partial_attentions(
    lse: torch.Tensor, out: torch.Tensor, *, base2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """One attention from its parts over disjoint sets of keys (FlashDecoding's split-K combination): ``lse [S, ...]``
    each part's log-sum-exp (natural log, or log2 with ``base2``; -inf where a part saw no key), ``out [S, ..., d]``
    each part's normalised output (not read where its lse is -inf: 0 there, or a softmax's NaN). Returns the whole's
    log-sum-exp ``[...]`` (-inf where no part saw a key) and output ``[..., d]`` (0 there), in the inputs' dtype:
    pass float32 or wider."""
    top = lse.amax(0)
    top = torch.where(top == -math.inf, 0.0, top)
    share = torch.exp2(lse - top) if base2 else torch.exp(lse - top)  # each part's share of a row's denominator
    total = share.sum(0)
    denominator = total.clamp_min(torch.finfo(total.dtype).tiny)[..., None]
    out = torch.where((lse == -math.inf)[..., None], 0.0, out)  # a part that saw no key: its NaN (0/0) counts 0
    merged = torch.einsum("s...,s...d->...d", share, out).div_(denominator)
    log_total = torch.log2(total) if base2 else torch.log(total)
    return torch.where(total > 0, top + log_total, -math.inf), merged
