"""Weighted attention through torch's FlexAttention, for caches whose visible weights are all > 0.

Alg. 3 divides ``sum_l e^{s_l} Vt_l`` by ``sum_l e^{s_l} w_l``, where a compressed row stores ``Vt = V_S``
(already a weighted sum of values). Where every visible ``w_l > 0`` this is ordinary softmax attention
with the bias ``log w_l`` on each key's logit over the values ``Vt_l / w_l``:
``sum e^{s + log w} (Vt / w) / sum e^{s + log w}``. Exact rows have ``w = 1`` and keep their values. Zero
or negative weights have no such form: they need the numerator/denominator path (``backend="triton"`` or
``"torch"``), and ``unsupported_reason`` says so. The division costs one pass over V per call (a cache
storing ``V_S / w`` would not need it).

FlexAttention (``torch.nn.attention.flex_attention``) gets a ``score_mod`` adding ``log w`` (``-inf`` on keys
``key_mask`` hides) and a block mask for the causal rule among new rows, so tiles past it are skipped. On
CUDA it runs compiled (``torch.compile(flex_attention, dynamic=False)``: one compilation, a few seconds,
per new shape; past torch._dynamo's recompile limit, 8 by default, torch falls back to the unfused eager
path, so callers with many shapes raise ``torch._dynamo.config.cache_size_limit``); elsewhere eagerly
(torch's unfused implementation that builds the logits: for tests). The block mask is built on every call.
"""

from __future__ import annotations

import warnings

import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

_compiled = None


def unsupported_reason(weights: torch.Tensor, key_mask: torch.Tensor | None, values: torch.Tensor) -> str | None:
    """Why the FlexAttention path cannot run these (validated) inputs, or None (one device sync)."""
    visible = torch.ones_like(weights, dtype=torch.bool)
    visible = visible if key_mask is None else visible & key_mask[:, None, :]
    bad = (weights <= 0) & visible
    # The values it attends over, V / w, in the values' dtype: a small weight on a 16-bit row can overflow it.
    largest = values.float().abs().amax(-1) / weights.float().clamp_min(torch.finfo(torch.float32).tiny)
    overflow = (largest > torch.finfo(values.dtype).max) & visible & ~bad
    bad_weight, too_large = torch.stack([bad.any(), overflow.any()]).tolist()
    if bad_weight:
        return "every visible weight must be > 0 (log w bias); zero or negative weights need numerator/denominator"
    if too_large:
        return f"values / weights overflow {values.dtype} (a weight too small for its row's values)"
    return None


def _flex():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def flex_weighted_attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, weights: torch.Tensor, *, scaling: float,
    v_min: torch.Tensor | None = None, v_max: torch.Tensor | None = None, causal_offset: int | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Alg. 3 for visible weights > 0 as FlexAttention with a ``log w`` score bias; shapes as in
    :func:`kvcompress.weighted_attention` (validated inputs that pass :func:`unsupported_reason`). Returns
    ``[b, h_q, m, d_v]`` in ``values.dtype``; a query that sees no key gets 0 before clipping."""
    batch, heads_q, m, _ = queries.shape
    heads_kv, n = keys.shape[1], keys.shape[2]
    group = heads_q // heads_kv
    w = weights.float()
    if key_mask is not None:  # hidden keys: bias -inf, and any weight there is harmless
        w = w.masked_fill(~key_mask[:, None, :], 1.0)
    log_w = w.log()
    if key_mask is not None:
        log_w = log_w.masked_fill(~key_mask[:, None, :], -torch.inf)
    unit_values = (values.float() / w[..., None]).to(values.dtype)

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + log_w[b, h // group, kv_idx]

    block_mask = None
    if causal_offset is not None:
        offset = causal_offset

        def causal(b, h, q_idx, kv_idx):
            return kv_idx <= offset + q_idx

        block_mask = create_block_mask(causal, batch, None, m, n, device=queries.device)
    run = _flex() if queries.device.type == "cuda" else flex_attention
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out, aux = run(
            queries, keys, unit_values, score_mod=score_mod, block_mask=block_mask, scale=scaling,
            enable_gqa=group > 1, return_aux=AuxRequest(lse=True),
        )  # fmt: skip
    lse = aux.lse
    # Rows with no visible mass: FlexAttention gives 0 (lse = -inf); keep that exact 0 as Alg. 3 does.
    out = torch.where(torch.isfinite(lse)[..., None], out, 0.0)
    for bound, pick in ((v_min, torch.maximum), (v_max, torch.minimum)):
        if bound is not None:
            out = pick(out, bound.repeat_interleave(group, 1)[:, :, None, :].to(out.dtype))
    return out.to(values.dtype)
