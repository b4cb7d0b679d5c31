"""Reference queries for query-aware compression, collected per layer while the context is prefilled.

Sources, each giving every context key an attention mass (:func:`kvcompress.selection.attention_mass`)
and a few queries for the fit (:mod:`kvcompress.fitting`):

* ``"window"``: the last ``observation_window`` context queries, causal (what SnapKV scores with).
* ``"prefill"``: ``samples`` prefill queries spread evenly over the context, causal.
* ``"context"``: every prefill query against every context key, non-causally (each context query also sees
  the keys after it): no extra forward, one fused pass over the layer's own queries.
* ``"accumulated"``: every prefill query, causal: the attention each key accumulated during the prefill
  (H2O, Zhang et al., arXiv 2306.14048), without the eviction along the way.
* ``"novelty"``: no queries: each key's distance from its head's mean key (KeyDiff, Park et al., arXiv
  2504.15364), weighted by its value's norm where the values are given (VATP, arXiv 2406.12335;
  :func:`kvcompress.selection.key_novelty`), a query-free prior that keeps outlying facts. It gives the fit no
  queries, so it is used beside a query source.
* ``"induction"``: no fit queries either: how sharply the prefill's query of the token before each key already
  picks that key out of the context before it (:func:`kvcompress.selection.induction_score`), what an induction
  head does when the text is read again: the repeat pass's signal, from the prefill's own queries.
* ``"repeat"``: a second pass over the context's own tokens right after it, in chunks, each chunk cropped
  away again. Reading the text again, the model's queries look back at the rows it needs to reproduce it
  (the reconstruction idea of KVzip, Kim et al., arXiv 2505.23416, without its prompt, so no tokenizer is
  needed). It costs about one more prefill; each layer's full cache is held until the pass is through that layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from kvpress.utils import get_prerope_query_states
from transformers.models.llama.modeling_llama import rotate_half

from kvcompress.hf_attention import new_tokens_see_all_cached, take_context_rows, take_prefill_rows
from kvcompress.selection import attention_mass, induction_score, key_novelty

if TYPE_CHECKING:
    from kvcompress.context_chunks import ChunkedReference

SOURCES = ("window", "prefill", "repeat", "context", "accumulated", "novelty", "induction")
PRIORS = ("novelty", "induction")  # scores without fit queries: a share of the rows each (methods.mixed_scores)
QUERY_SOURCES = tuple(source for source in SOURCES if source not in PRIORS)


def post_rope_queries(module: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings) -> torch.Tensor:
    """The attention module's queries for ``hidden_states [b, m, hidden]`` with RoPE: ``[b, h_q, m, d]``. A partial
    rotary embedding (``cos`` / ``sin`` narrower than the head, e.g. Phi-4-mini's ``partial_rotary_factor``) rotates
    the first channels only, as the model's own attention does."""
    queries = get_prerope_query_states(module, hidden_states)
    cos, sin = (x.unsqueeze(1) for x in position_embeddings)
    rotary = cos.shape[-1]
    if rotary == queries.shape[-1]:
        return queries * cos + rotate_half(queries) * sin
    rotated, passed = queries[..., :rotary], queries[..., rotary:]
    return torch.cat([rotated * cos + rotate_half(rotated) * sin, passed], dim=-1)


def even_sample(length: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``min(count, length)`` indices spread evenly over ``range(length)``, ending at the last one."""
    count = min(count, length)
    return torch.linspace(length - 1, 0, count, device=device).round().long().flip(0)


@dataclass
class LayerReference:
    """One layer's view of the reference queries.

    mass: source -> ``[b, h_kv, n]`` float32 attention mass over the n context keys (summed over queries).
    queries: ``[b, h_q, m_i, d]`` samples for the fit; positions: their ``[m_i]`` int64 positions
    (context length - 1 for queries after the context: they see every context key).
    outputs: per part of the queries, their ``([b, h_q, m_i]`` float32 log-sum-exp, ``[b, h_q, m_i, d_v]`` exact
    attention output) over the context where an attention that already ran gave them (else None).
    query_radius: ``[b, h_kv]`` max post-RoPE prefill query norm per KV head group (RPNys's R_Q), if asked.
    reduce: how a source's queries pool into a key's mass (``"sum"`` or ``"max"``, see
    :func:`kvcompress.selection.attention_mass`); later parts of a source (repeat chunks) are combined the same way.
    """

    mass: dict[str, torch.Tensor] = field(default_factory=dict)
    queries: list[torch.Tensor] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    outputs: list[tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=list)
    query_radius: torch.Tensor | None = None
    reduce: str = "sum"

    def add(
        self,
        source: str,
        mass: torch.Tensor,
        queries: torch.Tensor,
        positions: torch.Tensor,
        outputs: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        if source in self.mass:
            combine = torch.maximum if self.reduce == "max" else torch.add
            mass = combine(self.mass[source], mass)
        self.mass[source] = mass
        self.queries.append(queries)
        self.positions.append(positions)
        self.outputs.append(outputs)

    def fit_queries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All fit queries ``[b, h_q, m, d]`` and their positions ``[m]``."""
        return torch.cat(self.queries, dim=2), torch.cat(self.positions)

    def fit_outputs(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fit queries' log-sum-exp ``[b, h_q, m]`` and exact outputs ``[b, h_q, m, d_v]`` where every part has
        them (:func:`kvcompress.fitting.fit_kept_rows`'s ``known_rows``), else None."""
        if not self.outputs or any(part is None for part in self.outputs):
            return None
        return torch.cat([lse for lse, _ in self.outputs], 2), torch.cat([out for _, out in self.outputs], 2)


def record_prefill(
    module: torch.nn.Module,
    kwargs: dict,
    keys: torch.Tensor,
    sources: tuple[str, ...],
    observation_window: int,
    samples: int,
    reduce: str = "sum",
    novelty_values: torch.Tensor | None = None,
    chunked: ChunkedReference | None = None,
) -> LayerReference:
    """The sources of one layer that its prefill call (hook ``kwargs``) gives: all but ``"repeat"``. ``reduce``
    pools each source's queries (:func:`kvcompress.selection.attention_mass`) and is kept for the repeat pass;
    ``novelty_values``: the layer's values ``[b, h_kv, n, d_v]``, to weight the novelty prior by their norms.
    ``chunked``: the last call of a context read in several (:mod:`kvcompress.context_chunks`): its last rows and
    induction scores stand for the whole context's prefill (``"window"``, ``"novelty"``, ``"induction"`` only)."""
    reference = LayerReference(reduce=reduce)
    if "novelty" in sources:
        reference.mass["novelty"] = key_novelty(keys, novelty_values)
    hidden, (cos, sin) = kwargs["hidden_states"], kwargs["position_embeddings"]
    n = keys.shape[-2]
    first = 0  # the position of the handed rows' first query
    if chunked is not None:  # rows None: the press reads no query of the prefill (a repeat pass alone)
        handed = chunked.rows
        first = 0 if handed is None else n - handed.queries.shape[-2]
    else:
        handed = take_prefill_rows(module.layer_idx) if "induction" in sources else None
        if handed is not None and handed.queries.shape[-2] != n:  # a generate() chunk's last call, read as one
            handed = None
    picks = {}
    if "window" in sources:
        picks["window"] = torch.arange(max(0, n - observation_window), n, device=keys.device)
    if "prefill" in sources:
        picks["prefill"] = even_sample(n, samples, keys.device)
    for source, index in picks.items():
        lse = outputs = None
        if handed is None:
            queries = post_rope_queries(module, hidden[:, index], (cos[:, index], sin[:, index]))
        else:  # the prefill's attention already ran these rows: its queries and normalisers (and outputs) serve
            queries, lse = handed.queries[:, :, index - first], handed.lse[:, :, index - first]
            last, window = handed.last_outputs, min(n, observation_window)  # the window: the context's last rows
            if source == "window" and last is not None and last.shape[2] >= window:
                outputs = (lse, last[:, :, last.shape[2] - window :])
        mass = attention_mass(queries, keys, module.scaling, query_positions=index, reduce=reduce, row_lse=lse)
        reference.add(source, mass, queries, index, outputs)
    if chunked is not None:  # the other sources need every prefill query at once: refused (ContextChunks)
        if "induction" in sources:
            reference.mass["induction"] = chunked.induction
        return reference
    if {"context", "accumulated", "induction"} & set(sources):  # all n prefill queries
        queries = post_rope_queries(module, hidden, (cos, sin)) if handed is None else handed.queries
        if "induction" in sources:
            lse = None if handed is None else handed.lse
            reference.mass["induction"] = induction_score(queries, keys, module.scaling, row_lse=lse)
        fit = even_sample(n, samples, keys.device)
        everything = torch.full((len(fit),), n - 1, dtype=torch.long, device=keys.device)
        if "context" in sources:
            mass = attention_mass(queries, keys, module.scaling, reduce=reduce)
            reference.add("context", mass, queries[:, :, fit], everything)
        if "accumulated" in sources:
            causal = torch.arange(n, device=keys.device)
            mass = attention_mass(queries, keys, module.scaling, query_positions=causal, reduce=reduce)
            reference.add("accumulated", mass, queries[:, :, fit], fit)
        del queries
    return reference


def prefill_query_radius(module: torch.nn.Module, kwargs: dict) -> torch.Tensor:
    """Max post-RoPE query norm per (batch row, KV head) over the prefill: ``[b, h_kv]`` float32."""
    queries = post_rope_queries(module, kwargs["hidden_states"], kwargs["position_embeddings"])
    norms = queries.float().norm(dim=-1).amax(-1)  # [b, h_q]
    return norms.view(norms.shape[0], -1, module.num_key_value_groups).amax(-1)


def record_repeat(
    module: torch.nn.Module, kwargs: dict, keys: torch.Tensor, reference: LayerReference, samples: int, total: int
) -> None:
    """Add one repeat chunk's queries (hook ``kwargs`` of the chunk's forward) to ``reference``.

    ``keys``: the layer's context keys ``[b, h_kv, n, d]`` (without the chunk's own rows). ``samples`` of the
    ``total`` repeat queries are kept for the fit, spread evenly over the chunks in proportion to their size. The
    softmax is over the context keys; where the chunk's attention handed over its log-sum-exp and output over them
    (:func:`kvcompress.hf_attention.handing_over_context_rows`) the mass reuses the one and the fit both.
    """
    hidden = kwargs["hidden_states"]
    queries = post_rope_queries(module, hidden, kwargs["position_embeddings"])
    handed = take_context_rows(module.layer_idx)
    lse, outputs = handed if handed is not None and handed[0].shape == queries.shape[:3] else (None, None)
    mass = attention_mass(queries, keys, module.scaling, reduce=reference.reduce, row_lse=lse)
    keep = even_sample(hidden.shape[1], max(1, round(samples * hidden.shape[1] / total)), keys.device)
    positions = torch.full((len(keep),), keys.shape[-2] - 1, dtype=torch.long, device=keys.device)
    known = None if lse is None else (lse[:, :, keep], outputs[:, :, keep])
    reference.add("repeat", mass, queries[:, :, keep], positions, known)


def snapshot_layers(cache) -> list[dict]:
    """The attribute state of every cache layer (references to its tensors, no copies)."""
    return [dict(vars(layer)) for layer in cache.layers]


def restore_layer(cache, layer_idx: int, snapshot: list[dict]) -> None:
    """Put layer ``layer_idx`` back as it was in ``snapshot``.

    Layers are restored from references to their tensors, not cropped: cache updates concatenate into new
    tensors, and a sliding-window layer that has seen more than its window cannot be cropped.
    """
    vars(cache.layers[layer_idx]).update(snapshot[layer_idx])


def spread_pieces(n: int, fraction: float, span: int, device: torch.device | str = "cpu") -> torch.Tensor | None:
    """Positions of the context pieces a partial repeat pass re-reads: the context cut into pieces of ``span``
    tokens, ``round(fraction * pieces)`` of them (at least 1) spread evenly, in order; None for all of it."""
    if fraction >= 1:
        return None
    pieces = -(-n // span)
    return _piece_positions(even_sample(pieces, max(1, round(fraction * pieces)), device), span, n)


def _piece_positions(chosen: torch.Tensor, span: int, n: int) -> torch.Tensor:
    """The positions (< n) of pieces ``chosen`` (sorted indices) of ``span`` tokens."""
    positions = (chosen[:, None] * span + torch.arange(span, device=chosen.device)).reshape(-1)
    return positions[positions < n]


def novel_pieces(
    novelty: list[torch.Tensor], fraction: float, span: int, device: torch.device | str = "cpu"
) -> torch.Tensor | None:
    """Positions of the context pieces a partial repeat pass re-reads when it targets the outlying facts: the
    context cut into pieces of ``span`` tokens, the ``round(fraction * pieces)`` (at least 1) whose keys are most
    novel, in order; None for all of it. ``novelty``: each layer's ``[1, h_kv, n]`` key novelty
    (:func:`kvcompress.selection.key_novelty`); a position's score is the mean over layers and heads of its
    novelty min-max normalised per head, a piece's score its top position's."""
    if fraction >= 1:
        return None
    scores = []
    for layer in novelty:
        layer = layer.reshape(-1, layer.shape[-1]).float()
        low, high = layer.amin(-1, keepdim=True), layer.amax(-1, keepdim=True)
        scores.append(((layer - low) / (high - low).clamp_min(1e-12)).mean(0))
    score = torch.stack(scores).mean(0).to(device)
    n = score.shape[0]
    pieces = -(-n // span)
    score = torch.nn.functional.pad(score, (0, pieces * span - n), value=-1.0).view(pieces, span).amax(-1)
    return _piece_positions(score.topk(max(1, round(fraction * pieces))).indices.sort().values, span, n)


def repeat_through_layer(
    layer: torch.nn.Module,
    decoder: torch.nn.Module,
    hidden: list[torch.Tensor],
    cache,
    layer_idx: int,
    shift: torch.Tensor | None = None,
) -> None:
    """The repeat pass through one decoder layer (the streamed form of :func:`repeat_context`): each chunk's hidden
    states ``[b, c, hidden]`` entering ``layer`` are replaced, in ``hidden``, by the layer's output, the chunk
    placed after the layer's cached rows as :func:`repeat_context` places it. The layer's hooks record the queries
    and restore the layer, as in the whole-model pass; positions, rotary embeddings and the mask are the ones the
    decoder would build for that call (a model without sliding-window layers). ``shift [b]``: added to each batch
    row's positions (see :func:`repeat_context`)."""
    rows = cache.layers[layer_idx].keys.shape[-2]
    masks = {}
    with torch.no_grad(), new_tokens_see_all_cached():
        for i, chunk in enumerate(hidden):
            size = chunk.shape[1]
            positions = torch.arange(rows, rows + size, device=chunk.device)
            position_ids = positions[None] if shift is None else positions[None] + shift[:, None]
            if size not in masks:  # transformers' bool mask, for the stock path where the lower-right one cannot run
                visible = torch.ones(size, rows + size, dtype=torch.bool, device=chunk.device)
                masks[size] = visible.tril(rows)[None, None]
            out = layer(
                chunk,
                attention_mask=masks[size],
                position_embeddings=decoder.rotary_emb(chunk, position_ids),
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                cache_position=positions,
            )
            hidden[i] = out[0] if isinstance(out, tuple) else out


def repeat_context(
    decoder: torch.nn.Module,
    input_ids: torch.Tensor,
    cache,
    chunk_size: int,
    snapshot: list,
    shift: torch.Tensor | None = None,
) -> None:
    """Feed ``input_ids [b, n]`` again after the cached context rows, ``chunk_size`` tokens at a time
    (the layers' hooks record the queries and restore their layer from ``snapshot`` as soon as its attention
    has run, so only one layer at a time holds the chunk's rows); every layer is restored after each chunk.

    Positions continue the cached rows' count; ``shift [b]`` (int64, the cache's device) is added to each batch
    row's: where the prefill placed a row's context at other positions (a left-padded batch called without
    position ids), its repeated tokens keep the same distance to the context as in the prefill."""
    n, rows = input_ids.shape[1], cache.get_seq_length()
    with torch.no_grad(), new_tokens_see_all_cached():  # unpadded rows: each chunk sees all its context
        for start in range(0, n, chunk_size):
            chunk = input_ids[:, start : start + chunk_size]
            slots = torch.arange(rows, rows + chunk.shape[1], device=chunk.device)
            positions = slots[None] if shift is None else slots[None] + shift[:, None]
            decoder(input_ids=chunk, position_ids=positions, cache_position=slots, past_key_values=cache,
                    use_cache=True)  # fmt: skip
            for layer_idx in range(len(cache.layers)):
                restore_layer(cache, layer_idx, snapshot)
