"""Weighted attention as a torch custom op, so ``torch.compile(fullgraph=True)`` captures a decode step over a
static compressed cache (:mod:`kvcompress.static_cache`) without graph breaks.

``torch.ops.kvcompress.weighted_attention_rows`` is Alg. 3 of WildCat (arXiv 2602.10056) over a cache whose
visibility is given on the device: ``key_mask [b, n]`` and a causal offset tensor ``c``, one element or one per
batch row (query ``i`` of row ``r`` sees key ``j`` iff ``j <= c[r] + i`` and ``key_mask[r, j]``; the server's static
decode batch gives each row its own). No host value changes per step, so one compiled graph
(or CUDA graph) serves every step. CUDA tensors the Triton kernel supports run it (the offset is read on the
device); anything else runs :func:`kvcompress.attention._weighted_attention_without_triton`. Inputs are
model activations: no validation or finiteness check here (``kvcompress.weighted_attention`` is the validating
entry point).
"""

from __future__ import annotations

import torch

from kvcompress.attention import _triton_kernel, _weighted_attention_without_triton


@torch.library.custom_op("kvcompress::weighted_attention_rows", mutates_args=())
def weighted_attention_rows(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor,
    key_mask: torch.Tensor,
    causal_offset: torch.Tensor,
    v_min: torch.Tensor,
    v_max: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """queries ``[b, h_q, m, d]``; keys ``[b, h_kv, n, d]``; values ``[b, h_kv, n, d_v]``; weights ``[b, h_kv, n]``
    (float32); key_mask ``[b, n]`` bool; causal_offset ``[1]`` or ``[b]`` int64; v_min / v_max ``[b, h_kv, d_v]``
    float32.
    Returns ``[b, h_q, m, d_v]`` in ``values.dtype``."""
    if queries.device.type == "cuda":
        kernel = _triton_kernel(queries, keys, values, weights, v_min, v_max, required=False)
        if kernel is not None:
            return kernel(
                queries,
                keys,
                values,
                weights,
                scaling=scaling,
                v_min=v_min,
                v_max=v_max,
                causal_offset=causal_offset,
                key_mask=key_mask,
                reuse_buffers=False,  # a compiled step's CUDA graph records this call: its buffers come from its pool
            )
    return _weighted_attention_without_triton(
        queries, keys, values, weights, scaling, v_min, v_max, causal_offset, key_mask
    )


@weighted_attention_rows.register_fake
def _(queries, keys, values, weights, key_mask, causal_offset, v_min, v_max, scaling):
    batch, heads_q, m, _ = queries.shape
    return values.new_empty(batch, heads_q, m, values.shape[-1])
