"""One prefill of a context under a press, then every metric on that cache (kvpress's pipeline protocol).

* prefill: ``with press(model): model.model(input_ids=context_ids, past_key_values=cache)``, the whole block
  timed (our presses and KVzip work when the block or the forward ends);
* ``kl`` / ``top1``: the true continuation teacher-forced at its true positions on a deepcopy of the cache;
  mean KL(exact || press) of the next-token distributions, and how often the argmax agrees with the exact's;
* ``needle``: each question answered by the pipeline's own ``generate_answer`` on the cache, then
  ``_remove_answer_from_cache`` back to the pre-answer rows (``KVPressTextGenerationPipeline._forward``);
* ``layer_errors``: per layer, the continuation's post-RoPE queries (recorded in the exact pass) attend the
  exact context rows and the press's context rows (weighted attention with row weights and value clipping
  on our ``WeightedLayer``s, zero weight on rows a head-wise press masks); relative Frobenius error;
* ``cache_bytes`` / ``peak_bytes``: storage the cache holds after the prefill, and the most it held during it.
"""

from __future__ import annotations

import contextlib
import copy
import re
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kvcompress.attention import weighted_attention
from kvcompress.cache import WeightedLayer
from kvcompress.fidelity.contexts import Context
from kvcompress.fidelity.probes import PeakSampler, QueryRecorder, cache_bytes, masked_rows

MASKED_FRACTION = 0.99  # a press holding >= this fraction of the full cache's bytes kept everything


def found(code: int, answer: str) -> bool:
    """True if ``code`` is one of the whole numbers in ``answer`` ("1234567890" does not contain 7890)."""
    return str(code) in re.findall(r"\d+", answer)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def prefill(model, press, ids: torch.Tensor, sampler: PeakSampler | None = None) -> tuple[DynamicCache, float]:
    """Prefill context ``ids [1, n]`` under ``press`` (None: exact) as kvpress's pipeline does: ``(cache, seconds)``.

    ``sampler``: a :class:`PeakSampler` attached inside the block and detached after it (its hooks follow
    the press's own and see the press's end-of-block work); it samples once more after the block.
    """
    cache = DynamicCache()
    ids = ids.to(model.device)
    _synchronize(model.device)
    start = time.perf_counter()
    try:
        with press(model) if press is not None else contextlib.nullcontext():
            if sampler is not None:
                sampler.cache = cache
                sampler.attach(model)
            model.model(input_ids=ids, past_key_values=cache)
    finally:
        if sampler is not None:
            sampler.detach()
    _synchronize(model.device)
    seconds = time.perf_counter() - start
    if sampler is not None:
        sampler.sample()
    return cache, seconds


@torch.no_grad()
def continuation_logprobs(model, cache, context_len: int, continuation: torch.Tensor) -> torch.Tensor:
    """Teacher-forced log-probs ``[c, vocab]`` float32 of ``continuation [1, c]`` at positions ``context_len...``."""
    positions = torch.arange(context_len, context_len + continuation.shape[1], device=model.device)[None]
    logits = model(input_ids=continuation.to(model.device), past_key_values=cache, position_ids=positions).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def continuation_kl(exact: torch.Tensor, approx: torch.Tensor) -> float:
    """Mean over the continuation's tokens of ``KL(exact || approx)`` for log-probs ``[c, vocab]`` (e.g. the full
    cache's and a press's :func:`continuation_logprobs`)."""
    return torch.sum(exact.exp() * (exact - approx), dim=-1).mean().item()


@torch.no_grad()
def answer_questions(pipe, cache, ctx: Context, max_new_tokens: int) -> list[str]:
    """Each question of ``ctx`` answered on ``cache`` exactly as ``KVPressTextGenerationPipeline._forward`` does
    after its prefill (for presses that are not decoding, rerotation or RestoreKV presses)."""
    answers = []
    for question_ids in ctx.questions:
        rows = [cache.get_seq_length(layer_idx) for layer_idx in range(len(cache))]
        answers.append(
            pipe.generate_answer(question_ids.to(pipe.model.device), cache, ctx.ids.shape[1], max_new_tokens)
        )
        pipe._remove_answer_from_cache(cache, rows)
    return answers


def layer_errors(
    model, reference, cache, queries: dict[int, torch.Tensor], masked: dict[int, tuple] | None = None
) -> list[float]:
    """Relative Frobenius error per layer of attention over ``cache``'s context rows vs ``reference``'s.

    ``queries``: per layer ``[b, h_q, m, d]`` post-RoPE; ``masked``: per layer ``(batch, head, row)`` indices
    of rows left out, as if removed (see :func:`~kvcompress.fidelity.probes.masked_rows`). Attention is not
    causal: every query sees every context row. Computed in float32.
    """
    masked = masked or {}
    errors = []
    for idx, (full, layer) in enumerate(zip(reference.layers, cache.layers, strict=True)):
        scaling = model.model.layers[idx].self_attn.scaling
        q = queries[idx].float()
        keys, values = full.keys.float(), full.values.float()
        exact = weighted_attention(q, keys, values, keys.new_ones(keys.shape[:3]), scaling=scaling)
        keys, values = layer.keys.float(), layer.values.float()
        bounds = {}
        if isinstance(layer, WeightedLayer):
            weights = layer.row_weights.to(keys.device).clone()
            bounds = dict(v_min=layer.value_min.float(), v_max=layer.value_max.float())
        else:
            weights = keys.new_ones(keys.shape[:3])
        if idx in masked:  # a masked row drops out of both sums of Alg. 3 (its value is not weighted there)
            rows = tuple(i.to(weights.device) for i in masked[idx])
            weights[rows] = 0.0
            values = values.clone()
            values[rows] = 0.0
        approx = weighted_attention(q, keys, values, weights, scaling=scaling, **bounds)
        errors.append(((approx - exact).norm() / exact.norm()).item())
    return errors


@dataclass
class Reference:
    """The exact cache's results on one context."""

    cache: DynamicCache  # the exact context cache, [b, h_kv, n, d] per layer
    logp: torch.Tensor  # [c, vocab] float32 continuation log-probs
    queries: dict[int, torch.Tensor]  # per layer [b, h_q, c, d] post-RoPE continuation queries
    seconds: float  # exact prefill time, no hooks
    full_bytes: int
    answers: list[str]


def exact_reference(pipe, ctx: Context, max_new_tokens: int) -> Reference:
    """Prefill ``ctx`` exactly (timed without hooks), teacher-force the continuation recording its queries, and
    answer the questions."""
    model = pipe.model
    cache, seconds = prefill(model, None, ctx.ids)
    recorder = QueryRecorder(model)
    try:
        logp = continuation_logprobs(model, copy.deepcopy(cache), ctx.ids.shape[1], ctx.continuation)
    finally:
        recorder.remove()
    full_bytes = cache_bytes(cache)
    answers = answer_questions(pipe, cache, ctx, max_new_tokens)
    return Reference(cache, logp, recorder.queries, seconds, full_bytes, answers)


def exact_row(ref: Reference, ctx: Context) -> dict:
    """The metrics of the exact cache itself (its peak is its final size: an exact cache only grows)."""
    layers = len(ref.cache.layers)
    return _row(ctx, 0.0, 1.0, ref.answers, [0.0] * layers, ref.full_bytes, ref.full_bytes, ref.full_bytes, 1.0)


def _row(ctx, kl, top1, answers, errors, held, full, peak, ratio, kept_everything=False) -> dict:
    hits = [int(found(n.code, a)) for n, a in zip(ctx.needles, answers, strict=True)]
    return dict(
        kl=kl,
        top1=top1,
        needle=sum(hits) / len(hits),
        needle_hits=hits,
        answers=answers,
        layer_err=sum(errors) / len(errors),
        layer_errors=errors,
        cache_bytes=held,
        full_bytes=full,
        cache_mib=held / 2**20,
        peak_cache_mib=peak / 2**20,
        prefill_ratio=ratio,
        kept_everything=kept_everything,
    )


def measure(pipe, press, ctx: Context, ref: Reference, kept: float, max_new_tokens: int) -> dict:
    """One prefill of ``ctx`` under ``press`` (kept fraction ``kept``), then every metric against ``ref``."""
    model = pipe.model
    sampler = PeakSampler(None)
    cache, seconds = prefill(model, press, ctx.ids, sampler)
    masked = masked_rows(model)
    held = cache_bytes(cache)
    errors = layer_errors(model, ref.cache, cache, ref.queries, masked)
    logp = continuation_logprobs(model, copy.deepcopy(cache), ctx.ids.shape[1], ctx.continuation)
    kl = continuation_kl(ref.logp, logp)
    top1 = (logp.argmax(-1) == ref.logp.argmax(-1)).float().mean().item()
    answers = answer_questions(pipe, cache, ctx, max_new_tokens)
    everything = kept < 1 and held >= MASKED_FRACTION * ref.full_bytes
    return _row(ctx, kl, top1, answers, errors, held, ref.full_bytes, sampler.peak, seconds / ref.seconds, everything)
