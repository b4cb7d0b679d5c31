"""kvpress presses that leave a weighted cache behind: CompressKVPress and UniformPress.

Both keep the first ``sink_size`` and last ``window_size`` context tokens exactly (weight 1) and replace
the middle by a weighted subset, per batch row and KV head. The compressed layer
(:class:`kvcompress.cache.WeightedLayer`) carries the weights, and the model is switched to the
"kvcompress" attention, which runs weighted attention (Alg. 3) over such layers and stock sdpa
everywhere else. The switch outlives the ``with press(model)`` block on purpose: the question and the
answer are computed after it.

A layer is compressed right after its prefill, as in kvpress, unless the press reads the context a second
time (``reference`` with ``"repeat"``): then every layer keeps its full cache until the prefill forward has
returned, the repeat pass runs, and all layers are compressed before the forward call gives control back.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from kvpress.presses.base_press import BasePress, is_prefilling
from transformers import (
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    LlamaForCausalLM,
    MistralForCausalLM,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from transformers.utils import logging as hf_logging

from kvcompress._checks import check_int_range
from kvcompress.cache import WeightedLayer, check_cache, install_compressed_layer
from kvcompress.hf_attention import use_weighted_attention
from kvcompress.methods import compress_by_attention, compress_by_rpnys, compress_hybrid, mixed_scores
from kvcompress.reference import (
    SOURCES,
    LayerReference,
    prefill_query_radius,
    record_prefill,
    record_repeat,
    repeat_context,
    restore_layer,
    snapshot_layers,
)

logger = hf_logging.get_logger(__name__)

SUPPORTED_MODELS = (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Phi3ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
)


def _check_number(name: str, value: Any, low: float, high: float | None = None, low_open: bool = False) -> None:
    bad = isinstance(value, bool) or not isinstance(value, (int, float)) or value != value
    bad = bad or (value <= low if low_open else value < low) or (high is not None and value > high)
    if bad:
        bounds = (
            f"{'(' if low_open else '['}{low}, {high if high is not None else 'inf'}{']' if high is not None else ')'}"
        )
        raise ValueError(f"{name}: must be a number in {bounds}, got {value!r}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: must be one of {', '.join(map(repr, choices))}, got {value!r}")


@dataclass
class WeightedSubsetPress(BasePress):
    """Shared frame: protected sink/window tokens, a weighted middle, the budget of kvpress's ScorerPress.

    After compression each head holds at most ``int(n * (1 - compression_ratio))`` rows, protected tokens
    included. A context whose budget cannot hold the protected tokens plus one middle row, or that needs no
    removal, is left untouched. Subclasses implement :meth:`compress_middle`, and :meth:`reference_sources`
    when they need reference queries.
    """

    compression_ratio: float = 0.0
    sink_size: int = 32
    window_size: int = 32
    seed: int | None = None
    _pending: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _repeating: bool = field(default=False, init=False, repr=False, compare=False)
    _snapshot: list = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_number("compression_ratio", self.compression_ratio, 0, 1)
        if self.compression_ratio == 1:
            raise ValueError("compression_ratio: must be a number in [0, 1) (fraction removed), got 1")
        check_int_range("sink_size", self.sink_size, 0)
        check_int_range("window_size", self.window_size, 0)
        if self.seed is not None:
            check_int_range("seed", self.seed, -(2**63))

    def post_init_from_model(self, model: PreTrainedModel) -> None:
        if not isinstance(model, SUPPORTED_MODELS):
            names = ", ".join(cls.__name__ for cls in SUPPORTED_MODELS)
            raise ValueError(f"model: {type(model).__name__} is not supported by {type(self).__name__}; use {names}")
        use_weighted_attention(model)

    def budget(self, n: int) -> int:
        """Rows kept per head for an n-token context (kvpress ScorerPress's count)."""
        return int(n * (1 - self.compression_ratio))

    def layer_seed(self, layer_idx: int) -> int | None:
        return None if self.seed is None else self.seed * 1_000_003 + layer_idx

    def reference_sources(self) -> tuple[str, ...]:
        """Reference-query sources this press reads (see :mod:`kvcompress.reference`); none by default."""
        return ()

    def record_reference(self, module: torch.nn.Module, kwargs: dict, keys: torch.Tensor) -> LayerReference:
        """What :meth:`compress_middle` needs from this layer's prefill call (hook ``kwargs``)."""
        return LayerReference()

    def compress_middle(
        self,
        module: torch.nn.Module,
        keys: torch.Tensor,
        values: torch.Tensor,
        start: int,
        end: int,
        rows: int,
        reference: LayerReference,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Replace context rows ``[start, end)`` of keys/values ``[b, h_kv, n, d]`` by ``rows`` weighted rows:
        ``(K [b, h_kv, rows, d], V [b, h_kv, rows, d_v], w [b, h_kv, rows])``."""
        raise NotImplementedError

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        raise NotImplementedError(
            f"{type(self).__name__} stores per-row weights with the cache; it cannot run through kvpress's "
            "compress() protocol (e.g. inside ComposedPress or another press's wrapper). Use it on its own."
        )

    @contextmanager
    def __call__(self, model: PreTrainedModel):
        self._pending, self._repeating = {}, False
        with super().__call__(model):
            hook = None
            if "repeat" in self.reference_sources():
                decoder = model.model.language_model if hasattr(model.model, "language_model") else model.model
                hook = decoder.register_forward_hook(self._after_prefill, with_kwargs=True)
            try:
                yield
            finally:
                if hook is not None:
                    hook.remove()
                self._pending, self._repeating = {}, False

    def forward_hook(self, module: torch.nn.Module, input: list, kwargs: dict, output: list) -> list:
        if getattr(module, "is_sliding", False):
            return output  # Gemma3 sliding layers stay exact
        hidden_states, cache = kwargs["hidden_states"], kwargs["past_key_values"]
        if self._repeating:
            if module.layer_idx in self._pending:
                pending = self._pending[module.layer_idx]
                keys = cache.layers[module.layer_idx].keys[:, :, : pending["tokens"]]
                record_repeat(module, kwargs, keys, pending["reference"], self.repeat_samples(), pending["tokens"])
            restore_layer(cache, module.layer_idx, self._snapshot)
            return output
        if not is_prefilling(kwargs["cache_position"], hidden_states.shape[1]):
            return output  # only the prefill is compressed
        layer = cache.layers[module.layer_idx]
        n = layer.keys.shape[-2]
        budget, protected = self.budget(n), self.sink_size + self.window_size
        if budget >= n:
            return output
        if budget <= protected:
            logger.warning_once(
                f"{type(self).__name__}: a {n}-token context at compression_ratio={self.compression_ratio} keeps "
                f"{budget} rows, not more than the {protected} protected tokens; left uncompressed"
            )
            return output
        reference = self.record_reference(module, kwargs, layer.keys)
        if "repeat" in self.reference_sources():
            check_cache(cache)
            self._pending[module.layer_idx] = dict(module=module, reference=reference, tokens=n)
            return output
        self._compress_layer(module, cache, reference)
        return output

    def repeat_samples(self) -> int:
        """Repeat-pass queries kept per layer for a fit (subclasses with a fit override it)."""
        return 0

    def _after_prefill(self, decoder: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """Decoder forward hook: after a prefill whose layers wait for the repeat pass, run it and compress."""
        if self._repeating or not self._pending:
            return
        cache = kwargs.get("past_key_values") or getattr(output, "past_key_values", None)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        pending, self._pending = self._pending, {}
        if input_ids is None:
            raise ValueError(
                f"input_ids: {type(self).__name__} with reference 'repeat' reads the context's token ids a second "
                "time; call the model with input_ids (not inputs_embeds), or drop 'repeat' from reference"
            )
        self._pending, self._repeating, self._snapshot = pending, True, snapshot_layers(cache)
        try:
            repeat_context(decoder, input_ids, cache, self.repeat_chunk, self._snapshot)
        finally:
            self._pending, self._repeating, self._snapshot = {}, False, []
        for state in pending.values():
            self._compress_layer(state["module"], cache, state["reference"])

    def _compress_layer(self, module: torch.nn.Module, cache, reference: LayerReference) -> None:
        layer = cache.layers[module.layer_idx]
        keys, values = layer.keys, layer.values
        n = keys.shape[-2]
        start, end = self.sink_size, n - self.window_size
        rows = self.budget(n) - self.sink_size - self.window_size
        middle_keys, middle_values, middle_weights = self.compress_middle(
            module, keys, values, start, end, rows, reference
        )
        ones = middle_weights.new_ones(*middle_weights.shape[:2], 1)
        compressed = WeightedLayer(
            keys=torch.cat([keys[:, :, :start], middle_keys, keys[:, :, end:]], dim=2),
            values=torch.cat([values[:, :, :start], middle_values, values[:, :, end:]], dim=2),
            row_weights=torch.cat(
                [ones.expand(-1, -1, start), middle_weights, ones.expand(-1, -1, self.window_size)], dim=2
            ),
            value_min=values.amin(2).float(),
            value_max=values.amax(2).float(),
            tokens=n,
        )
        install_compressed_layer(cache, module.layer_idx, compressed)


SELECTIONS = ("attention", "hybrid", "rpnys")
FITS = ("none", "weights", "values")


@dataclass
class CompressKVPress(WeightedSubsetPress):
    """Query-aware CompressKV: a weighted subset of the context chosen and fitted by reference queries.

    ``selection``: ``"attention"`` keeps the middle rows with the most attention from the reference queries
    (exact rows); ``"rpnys"`` is the WildCat paper's query-agnostic binned RPNys coreset with Nystrom
    weights (Alg. 2, ``bin_rank`` pivots a bin); ``"hybrid"`` keeps ``hybrid_fraction`` of the middle rows
    by attention and summarises the rest by an RPNys coreset. ``reference``: query sources
    (:mod:`kvcompress.reference`), each one's attention mass normalised per head and mixed with weight 1
    (``repeat_weight`` for ``"repeat"``); window scores are average-pooled over ``pool_kernel`` keys.
    ``fit`` (``"attention"`` selection only): ``"values"`` fits each kept row's mass ``w`` and value
    ``V_S`` to the reference queries (:mod:`kvcompress.fitting`), ``"weights"`` only ``w`` (``V_S = w v``),
    ``"none"`` keeps ``w = 1``. ``CompressKVPress.paper()`` is the paper's configuration.
    """

    sink_size: int = 4
    window_size: int = 64
    selection: str = "attention"
    reference: tuple[str, ...] = ("window", "repeat")
    repeat_weight: float = 2.0
    observation_window: int = 64
    pool_kernel: int = 5
    fit: str = "values"
    fit_bin_rows: int = 16
    fit_ridge: float = 0.1
    fit_queries: int = 256
    repeat_chunk: int = 2048
    hybrid_fraction: float = 0.5
    bin_rank: int = 12
    query_radius: str = "keys"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice("selection", self.selection, SELECTIONS)
        _check_choice("fit", self.fit, FITS)
        if isinstance(self.reference, str) or not isinstance(self.reference, (tuple, list)):
            raise ValueError(f"reference: must be a list of sources from {SOURCES}, got {self.reference!r}")
        self.reference = tuple(self.reference)
        for source in self.reference:
            _check_choice("reference", source, SOURCES)
        if self.selection != "rpnys" and not self.reference:
            raise ValueError(f"reference: selection={self.selection!r} needs at least one source of {SOURCES}")
        if self.fit != "none" and self.selection != "attention":
            raise ValueError(f"fit: {self.fit!r} needs selection='attention'; use fit='none' with {self.selection!r}")
        _check_number("repeat_weight", self.repeat_weight, 0)
        _check_number("fit_ridge", self.fit_ridge, 0, low_open=True)
        _check_number("hybrid_fraction", self.hybrid_fraction, 0, 1)
        for name, low in (
            ("observation_window", 1),
            ("pool_kernel", 1),
            ("fit_bin_rows", 1),
            ("fit_queries", 2),
            ("repeat_chunk", 1),
            ("bin_rank", 1),
        ):
            check_int_range(name, getattr(self, name), low)
        if self.pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel: must be an odd int >= 1, got {self.pool_kernel!r}")
        _check_choice("query_radius", self.query_radius, ("keys", "queries"))

    @classmethod
    def paper(cls, compression_ratio: float = 0.0, seed: int | None = None, **overrides: Any) -> CompressKVPress:
        """The WildCat paper's CompressKV (Alg. 2): 32 sink + 32 window tokens exact, the middle a binned RPNys
        coreset with 12 pivots a bin and Nystrom weights, R_Q = R_K per bin; no reference queries, no fit.
        ``overrides`` change single fields of that setting (e.g. ``window_size=128``)."""
        settings = dict(
            sink_size=32, window_size=32, selection="rpnys", reference=(), fit="none", bin_rank=12, query_radius="keys"
        )
        return cls(compression_ratio=compression_ratio, seed=seed, **{**settings, **overrides})

    def reference_sources(self) -> tuple[str, ...]:
        return () if self.selection == "rpnys" else self.reference

    def repeat_samples(self) -> int:
        return self.fit_queries if self.fit != "none" else 0

    def record_reference(self, module, kwargs, keys) -> LayerReference:
        if self.selection == "rpnys":
            radius = prefill_query_radius(module, kwargs) if self.query_radius == "queries" else None
            return LayerReference(query_radius=radius)
        return record_prefill(module, kwargs, keys, self.reference, self.observation_window, self.fit_queries)

    def compress_middle(self, module, keys, values, start, end, rows, reference):
        if self.selection == "rpnys":
            return compress_by_rpnys(
                module,
                keys[:, :, start:end],
                values[:, :, start:end],
                rows,
                self.bin_rank,
                reference.query_radius,
                self.layer_seed(module.layer_idx),
            )
        scores = mixed_scores(reference, start, end, {"repeat": self.repeat_weight}, {"window": self.pool_kernel})
        if self.selection == "hybrid":
            return compress_hybrid(
                module,
                keys,
                values,
                start,
                end,
                rows,
                scores,
                self.hybrid_fraction,
                self.bin_rank,
                self.layer_seed(module.layer_idx),
            )
        fit = (
            None
            if self.fit == "none"
            else dict(fit_values=self.fit == "values", bin_rows=self.fit_bin_rows, ridge=self.fit_ridge)
        )
        return compress_by_attention(module, keys, values, start, end, rows, scores, reference, fit)


@dataclass
class UniformPress(WeightedSubsetPress):
    """A uniformly random subset of the middle, kept in position order (per batch row and KV head).

    ``weighted=True`` turns the subset into the unbiased Monte-Carlo estimate of the middle's softmax
    sums: each kept row stands for ``L / kept`` middle rows, so both its weight and its value are
    scaled by that factor (``w = L / kept``, ``V_S = (L / kept) v``). ``weighted=False`` is plain
    eviction (``w = 1``).
    """

    weighted: bool = False

    def compress_middle(self, module, keys, values, start, end, rows, reference):
        keys, values = keys[:, :, start:end], values[:, :, start:end]
        batch, heads, length, _ = keys.shape
        generator = None
        if self.seed is not None:
            generator = torch.Generator(device=keys.device).manual_seed(self.layer_seed(module.layer_idx))
        scores = torch.rand(batch, heads, length, generator=generator, device=keys.device)
        index = scores.topk(rows, dim=-1).indices.sort(-1).values  # uniform subset, in position order
        kept_keys = keys.gather(2, index[..., None].expand(-1, -1, -1, keys.shape[-1]))
        kept_values = values.gather(2, index[..., None].expand(-1, -1, -1, values.shape[-1]))
        scale = length / rows if self.weighted else 1.0
        weights = torch.full((batch, heads, rows), scale, device=keys.device)
        return kept_keys, kept_values * scale if self.weighted else kept_values, weights
