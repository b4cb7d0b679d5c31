"""Weighted attention (Alg. 3 of WildCat) for many new tokens at once: question prefill, speculative or
batched decode over a compressed cache (``m`` new query rows per head, any ``m >= 1``; the dispatch in
``kvcompress.weighted_attention`` sends ``m > MAX_NEW_TOKENS`` here).

The Triton kernel is the FlashAttention-2 style split-K kernel of :mod:`kvcompress.kernels.weighted_decode`
(one implementation): programs over (batch * KV head, key split, block of rows), a row being one (query
head of the GQA group, new token) pair, so the queries of a block share every K/V/w tile they load;
causal among the new rows (tiles past a block's causal limit are skipped, tiles it sees in full run
unmasked), ``key_mask``, fp32 accumulation, Alg. 3's numerator / denominator, any strides. Long caches with
few programs are split over the keys and merged by stage 2. This module is its multi-token entry point,
with prefill tiles: 128 rows per program (64 for head dims > 128) and, for 16-bit inputs up to head dim
128, three pipeline stages.

Work and bytes per (batch, KV head): ``4 * group * m * n * d`` FLOPs (QK^T and PV, before the causal
skip); K/V/w are read once per row block (``ceil(group * m / 128)`` blocks, mostly served from L2).
Set ``TRITON_INTERPRET=1`` before importing this module to run it on CPU tensors.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvcompress.kernels.weighted_decode import unsupported_reason as _decode_unsupported_reason
from kvcompress.kernels.weighted_decode import weighted_decode_attention as _launch

# Why the kernel cannot run these (validated) inputs, or None: the decode kernel's checks, any m >= 1.
unsupported_reason = functools.partial(_decode_unsupported_reason, max_new_tokens=None)


def weighted_prefill_attention(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, weights: torch.Tensor, **options: Any
) -> torch.Tensor:
    """Launcher for any number of new tokens: ``options`` as for
    :func:`kvcompress.kernels.weighted_decode.weighted_decode_attention` (``scaling`` and the optional
    ``v_min``, ``v_max``, ``causal_offset``, ``key_mask``, ``num_splits``, ``block_n``, ``block_r``,
    ``num_warps``), with prefill tiles by default. Returns ``[b, h_q, m, d_v]`` contiguous in ``values.dtype``."""
    stages = pipeline_stages(queries.shape[3], values.shape[3], queries.dtype)
    return _launch(queries, keys, values, weights, **{"num_stages": stages, **options, "max_new_tokens": None})


def pipeline_stages(dim: int, d_v: int, dtype: torch.dtype) -> int:
    """Key/value tiles in flight: three for 16-bit tiles up to head dim 128, two otherwise (shared memory)."""
    return 3 if max(dim, d_v) <= 128 and dtype.itemsize <= 2 else 2
