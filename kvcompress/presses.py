"""CompressKVPress: the kvpress press that leaves a weighted cache behind (its baseline, UniformPress, is in
:mod:`kvcompress.uniform_press`).

It builds on :class:`kvcompress.weighted_press.WeightedSubsetPress` (budget, protected tokens, hooks, padded
batches, the repeat pass) and says how the middle of a context is replaced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvcompress._checks import check_bool, check_choice, check_int_range, check_layer_list, check_number
from kvcompress.calibration import layers_at
from kvcompress.methods import compress_by_attention, compress_by_rpnys, compress_hybrid, mixed_scores
from kvcompress.press_guards import check_layer_options
from kvcompress.reference import (
    QUERY_SOURCES,
    SOURCES,
    LayerReference,
    novel_pieces,
    prefill_query_radius,
    record_prefill,
    spread_pieces,
)
from kvcompress.weighted_press import RowPlan, WeightedSubsetPress, logger, split_budget

SELECTIONS = ("attention", "hybrid", "rpnys")
SCORE_POOLINGS = ("sum", "max")
FITS = ("none", "weights", "values")
REPEAT_PIECES = ("spread", "novel")

MIN_PAYING_ROWS = 3  # the fewest rows a layer paying for wider ones keeps in the budget (its first token among them)


@dataclass
class CompressKVPress(WeightedSubsetPress):
    """Query-aware CompressKV: a weighted subset of the context chosen and fitted by reference queries.

    ``selection``: ``"attention"`` keeps the middle rows with the most attention from the reference queries
    (exact rows); ``"rpnys"`` is the WildCat paper's query-agnostic binned RPNys coreset with Nystrom
    weights (Alg. 2, ``bin_rank`` pivots a bin); ``"hybrid"`` keeps ``hybrid_fraction`` of the middle rows
    by attention and summarises the rest by an RPNys coreset. ``reference``: query sources
    (:mod:`kvcompress.reference`), each one's attention mass normalised per head and mixed with weight 1
    (``repeat_weight`` for ``"repeat"``); window scores are average-pooled over ``pool_kernel`` keys; the
    query-free ``"novelty"`` prior reserves ``novelty_share`` of the kept middle rows for the keys least like their
    head's mean (weighted by their value's norm: ``novelty_value_norm``), and the ``"induction"`` prior (prefill
    queries, no extra forward) ``induction_share`` of them for the keys the token before each one already picks out
    most sharply (what reading the text again would recall), both before the query sources choose the rest. The
    default, window + novelty + induction, costs about a SnapKV prefill (1.10x the no-press one on an H200 at 32k):
    the window's queries keep what the text right after the context needs, the two priors keep the facts asked about
    later (the outlying keys, and the keys the text itself would recall).
    ``repeat_fraction`` < 1: the repeat pass re-reads only that fraction of the context, in pieces of
    ``repeat_span`` tokens (cost in proportion): ``repeat_pieces="spread"`` spreads them evenly, ``"novel"`` takes
    the pieces with the most novel keys (needs ``"novelty"`` in ``reference``), so the second reading goes over
    the outlying facts and its queries find their rows.
    ``fit`` (``"attention"`` selection only): ``"values"`` fits each kept row's mass ``w`` and value
    ``V_S`` to the reference queries (:mod:`kvcompress.fitting`), ``"weights"`` only ``w`` (``V_S = w v``),
    ``"none"`` keeps ``w = 1``. ``score_pooling``: a key's score from one source is the softmax attention its
    queries give it, ``"sum"`` summed over the queries and the GQA group (normalised mass), ``"max"`` the largest
    of them (KVzip's score: a key needed by one query counts fully). ``CompressKVPress.paper()`` is the paper's
    configuration, ``CompressKVPress.kvzip()`` KVzip's scoring, ``CompressKVPress.thorough()`` the repeat pass with max
    pooling for contexts asked many questions, ``CompressKVPress.balanced()`` the default plus a repeat pass over the
    most novel quarter of the context.
    ``retrieval_layers``: layers whose middle gets ``retrieval_rows`` times the uniform row count (at most the whole
    middle), the other full-attention layers giving up an equal share each, so the cache's total rows stay the same up
    to rounding; in those layers the priors take their shares of the uniform middle plus ``retrieval_prior_share`` of
    the extra rows, the query sources get the rest (1, the default: the priors' shares of the whole widened middle, as
    in any other layer; 0: the priors keep their uniform row counts).
    For a model with a layer that reads facts back (on SmolLM2-135M-Instruct, layer 18: without the priors there no
    needle is found), whose rows must hold both the facts and the text a continuation copies (docs/BENCHMARKS.md,
    "The worst continuation context"). ``"auto"`` (the default, and ``balanced()``'s; the other presets name none):
    the layers ``kvcompress calibrate`` found for the model (:mod:`kvcompress.calibration`; shipped for the embedded
    model), none for a model without a calibration, where the press is the uniform one. Measured on the embedded
    model (layer 18, 25% kept): continuation KL 0.74x SnapKV's [0.64, 0.87] against the uniform press's 0.97x on 48
    contexts; RULER-style 58.1 against its 55.2 (24 per task), the priors' share of the extra rows +3.6 [+1.3, +6.3]
    of that at no KL cost (``docs/BENCHMARKS.md``, "The retrieval layer's extra rows shared with the priors").
    ``full_layers``: layers kept whole, every context row exactly as the prefill left it (weight 1, no fit: their
    attention is the uncompressed one); the other full-attention layers outside ``retrieval_layers`` give up an equal
    share of the rows that costs, so the cache's total rows stay the same up to rounding (at least one middle row left
    in each). For a layer the answers need whole (DuoAttention, Xiao et al., arXiv 2410.10819, keeps whole caches for
    its retrieval heads for the same reason). ``"auto"`` (the default, and ``balanced()``'s; the other presets name
    none): the layers of the model's calibration for the context's length (``kvcompress calibrate --full-lengths``:
    the fewest layers whose uncompressed rows give back most of the answers a multi-fact task loses, per scanned
    length; a context takes the nearest length's: on the embedded model layers 23 and 7 up to 1448 tokens, layer 7
    beyond), none for a model without one (:meth:`full_layers_at`). Measured on the embedded model (25% kept): layer
    7 whole, continuation KL 0.90x the default's without it [0.85, 0.95] on 48 contexts, RULER-style +3.8 at 2048
    tokens (``docs/BENCHMARKS.md``, "Layer 7 kept whole by default"); layer 23 too at 1024 tokens, +3.7 [+0.9, +6.3]
    over layer 7 alone on 48 per task ("The layers kept whole by context length"). ``full_layers_by_length=False``
    (``balanced()``'s): only the layers the calibration names at every scanned length (layer 7).
    """

    sink_size: int = 4
    window_size: int = 64
    selection: str = "attention"
    reference: tuple[str, ...] = ("window", "novelty", "induction")
    repeat_weight: float = 2.0
    observation_window: int = 64
    pool_kernel: int = 5
    fit: str = "values"
    fit_bin_rows: int = 16
    fit_ridge: float = 0.1
    fit_queries: int = 256
    repeat_chunk: int = 2048
    repeat_fraction: float = 1.0
    repeat_span: int = 128
    repeat_pieces: str = "spread"
    hybrid_fraction: float = 0.5
    bin_rank: int = 12
    query_radius: str = "keys"
    score_pooling: str = "max"
    novelty_share: float = 0.5
    novelty_value_norm: bool = True
    induction_share: float = 0.25
    retrieval_layers: tuple[int, ...] | str = "auto"
    retrieval_rows: float = 2.0
    retrieval_prior_share: float = 1.0
    full_layers: tuple[int, ...] | str = "auto"
    full_layers_by_length: bool = True
    _retrieval: tuple = field(default=(), init=False, repr=False, compare=False)  # the layers in use
    _full: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # by context length

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("selection", self.selection, SELECTIONS)
        check_choice("fit", self.fit, FITS)
        if isinstance(self.reference, str) or not isinstance(self.reference, (tuple, list)):
            raise ValueError(f"reference: must be a list of sources from {SOURCES}, got {self.reference!r}")
        self.reference = tuple(self.reference)
        for source in self.reference:
            check_choice("reference", source, SOURCES)
        if self.selection != "rpnys" and not self.reference:
            raise ValueError(f"reference: selection={self.selection!r} needs at least one source of {SOURCES}")
        if self.fit != "none" and self.selection != "attention":
            raise ValueError(f"fit: {self.fit!r} needs selection='attention'; use fit='none' with {self.selection!r}")
        if self.fit != "none" and not set(self.reference) & set(QUERY_SOURCES):
            raise ValueError(f"fit: {self.fit!r} needs a query source in reference, one of {QUERY_SOURCES}")
        check_number("repeat_weight", self.repeat_weight, 0)
        check_number("fit_ridge", self.fit_ridge, 0, low_open=True)
        check_number("hybrid_fraction", self.hybrid_fraction, 0, 1)
        check_number("repeat_fraction", self.repeat_fraction, 0, 1, low_open=True)
        check_choice("repeat_pieces", self.repeat_pieces, REPEAT_PIECES)
        if self.repeat_pieces == "novel" and not {"novelty", "repeat"} <= set(self.reference):
            raise ValueError(
                f"repeat_pieces: 'novel' needs 'novelty' and 'repeat' in reference, got reference={self.reference!r}"
            )
        check_number("novelty_share", self.novelty_share, 0, 1)
        check_bool("novelty_value_norm", self.novelty_value_norm)
        check_number("induction_share", self.induction_share, 0, 1)
        self.retrieval_layers = check_layer_list("retrieval_layers", self.retrieval_layers)
        self._retrieval = () if self.retrieval_layers == "auto" else self.retrieval_layers
        self.full_layers = check_layer_list("full_layers", self.full_layers)
        self._full = {0: self.full_layers} if self.full_layers not in ("auto", ()) else {}
        check_bool("full_layers_by_length", self.full_layers_by_length)
        check_number("retrieval_rows", self.retrieval_rows, 1)
        check_number("retrieval_prior_share", self.retrieval_prior_share, 0, 1)
        for name, low in (
            ("observation_window", 1),
            ("pool_kernel", 1),
            ("fit_bin_rows", 1),
            ("fit_queries", 2),
            ("repeat_chunk", 1),
            ("repeat_span", 1),
            ("bin_rank", 1),
        ):
            check_int_range(name, getattr(self, name), low)
        if self.pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel: must be an odd int >= 1, got {self.pool_kernel!r}")
        check_choice("query_radius", self.query_radius, ("keys", "queries"))
        check_choice("score_pooling", self.score_pooling, SCORE_POOLINGS)

    @classmethod
    def paper(cls, compression_ratio: float = 0.0, seed: int | None = None, **overrides: Any) -> CompressKVPress:
        """The WildCat paper's CompressKV (Alg. 2): 32 sink + 32 window tokens exact, the middle a binned RPNys
        coreset with 12 pivots a bin and Nystrom weights, R_Q = R_K per bin; no reference queries, no fit.
        ``overrides`` change single fields of that setting (e.g. ``window_size=128``)."""
        settings = dict(
            sink_size=32, window_size=32, selection="rpnys", reference=(), fit="none", bin_rank=12, query_radius="keys",
            retrieval_layers=(), full_layers=(),
        )
        return cls(compression_ratio=compression_ratio, seed=seed, **{**settings, **overrides})

    @classmethod
    def kvzip(cls, compression_ratio: float = 0.0, seed: int | None = None, **overrides: Any) -> CompressKVPress:
        """KVzip's scoring (Kim et al., arXiv 2505.23416) in this press: each key scored by the MAX softmax attention
        the repeat pass's queries give it (per KV head, over the GQA group and the query positions), the top keys kept
        exactly, 4 sink tokens, no recent window, no fit. Unlike KVzip the repeat pass re-reads the context without
        its reconstruction prompt, and the softmax runs over the context keys only."""
        settings = dict(sink_size=4, window_size=0, reference=("repeat",), score_pooling="max", fit="none",
                        retrieval_layers=(), full_layers=())
        return cls(compression_ratio=compression_ratio, seed=seed, **{**settings, **overrides})

    @classmethod
    def thorough(cls, compression_ratio: float = 0.0, seed: int | None = None, **overrides: Any) -> CompressKVPress:
        """For a context compressed once and asked many questions (a server's stored contexts): the repeat pass
        (about one more prefill) beside the window, each key scored by the MAX attention any of their queries gives
        it, the kept rows fitted to those queries. Keeps what later questions ask for where cheaper scoring loses
        it (``docs/BENCHMARKS.md``, RULER-style). The pass is streamed layer by layer (one layer's full cache held at
        a time) on models without sliding-window layers; elsewhere, and for padded batches, the full cache is held
        until it ends."""
        settings = dict(reference=("window", "repeat"), score_pooling="max", retrieval_layers=(), full_layers=())
        return cls(compression_ratio=compression_ratio, seed=seed, **{**settings, **overrides})

    @classmethod
    def balanced(cls, compression_ratio: float = 0.0, seed: int | None = None, **overrides: Any) -> CompressKVPress:
        """Between the default and ``thorough()``: the default's window, novelty and induction priors, plus a repeat
        pass over the quarter of the context whose keys are most novel, in pieces of 32 tokens
        (``repeat_pieces="novel"``), max-pooled as ``thorough()``'s: the priors reserve their shares of the middle
        rows, the window's and the second reading's queries choose the rest. About a quarter of ``thorough()``'s
        extra forward; the fit on the 64 window queries and 64 of the repeat pass's (``fit_queries=64``: 1.88x the
        no-press prefill on an H200 at 32k tokens; ``docs/BENCHMARKS.md``). Its pieces are chosen
        from every layer's novelty, so the pass runs after the prefill, layer by layer; on CUDA each layer's full
        cache waits in pinned host memory until its turn (host memory of the full cache's size, up to twice that:
        :mod:`kvcompress.offload`), elsewhere every layer holds its full cache until its turn.
        ``repeat_fraction=0.125, repeat_span=8`` (the most novel eighth, in pieces of 8 tokens) halves the second
        reading; on the embedded model it answers about 3 points under the quarter, level with KVzip's scoring.
        As the default, it widens the model's retrieval layers and keeps its full layers whole
        (``retrieval_layers="auto"``, ``full_layers="auto"``; on the embedded model, 25% kept and 1024 tokens: the
        retrieval layer +2.1 RULER-style and KL 0.79x the uniform ``balanced()``'s, then layer 7 whole +3.0 more,
        about the full cache's score, and KL 0.91x; level at 50% kept), but only those the calibration names at
        every scanned length (``full_layers_by_length=False``: layer 7; its second reading finds what a second
        whole layer would give back, and layers 7 and 23 whole answered 1.4 [-3.4, +0.6] fewer at 1024 tokens)."""
        settings = dict(
            reference=("window", "novelty", "induction", "repeat"), repeat_fraction=0.25, repeat_span=32,
            repeat_pieces="novel", fit_queries=64, full_layers_by_length=False,
        )  # fmt: skip
        return cls(compression_ratio=compression_ratio, seed=seed, **{**settings, **overrides})

    def reference_sources(self) -> tuple[str, ...]:
        return () if self.selection == "rpnys" else self.reference

    def repeat_samples(self) -> int:
        return self.fit_queries if self.fit != "none" else 0

    def repeat_reads_references(self) -> bool:
        return self.repeat_pieces == "novel"

    def repeat_positions(self, n: int, device, references: list[LayerReference]) -> torch.Tensor | None:
        if self.repeat_pieces == "novel":
            novelty = [reference.mass["novelty"] for reference in references]
            return novel_pieces(novelty, self.repeat_fraction, self.repeat_span, device)
        return spread_pieces(n, self.repeat_fraction, self.repeat_span, device)

    def prefill_output_rows(self) -> int:
        fitted = self.fit != "none" and self.selection == "attention" and "window" in self.reference
        return self.observation_window if fitted else 0  # the window queries' exact outputs: the fit's targets

    def reads_values(self) -> bool:
        return self.novelty_value_norm and "novelty" in self.reference and self.selection != "rpnys"

    def chunk_refusal(self) -> str | None:
        if self.selection == "rpnys" and self.query_radius == "queries":
            return "reads query_radius='queries' (every prefill query's norm at once); use query_radius='keys'"
        return super().chunk_refusal()

    def chunk_tail_rows(self) -> int:
        return max(1, self.observation_window) if "window" in self.reference_sources() else 1

    def record_reference(self, module, kwargs, keys, values, chunked=None) -> LayerReference:
        sources = self.reference_sources()
        if not self.scores_layer(module.layer_idx, keys.shape[-2]):  # kept whole: no rows to score or fit
            # but balanced()'s repeat pass re-reads the pieces most novel over every layer, this one included
            sources = ("novelty",) if "novelty" in sources and self.repeat_reads_references() else ()
        elif self.selection == "rpnys":
            radius = prefill_query_radius(module, kwargs) if self.query_radius == "queries" else None
            return LayerReference(query_radius=radius)
        return record_prefill(
            module, kwargs, keys, sources, self.observation_window, self.fit_queries, self.score_pooling,
            novelty_values=values, chunked=chunked,
        )  # fmt: skip

    def check_model(self, model, windows: list[int | None]) -> None:
        """Resolve ``retrieval_layers="auto"`` and ``full_layers="auto"`` from the model's calibration
        (:func:`kvcompress.calibration.find`; none found: no such layers) and check both against the model's
        full-attention layers."""
        source = ""
        if "auto" in (self.retrieval_layers, self.full_layers):
            from kvcompress.calibration import find

            found = find(model)
            source = f" (from the calibration of {found.model})" if found is not None else ""
            if self.retrieval_layers == "auto":
                self._retrieval = found.retrieval_layers if found is not None else ()
            if self.full_layers == "auto":
                self._full = dict(found.full_layers) if found is not None else {}
                if not self.full_layers_by_length and len(self._full) > 1:  # the layers named at every length
                    common = set.intersection(*(set(layers) for layers in self._full.values()))
                    self._full = {0: tuple(sorted(common))} if common else {}
        for full in set(self._full.values()) or {()}:  # each length's layers
            check_layer_options(windows, [
                ("retrieval_layers", self._retrieval, source if self.retrieval_layers == "auto" else ""),
                ("full_layers", full, source if self.full_layers == "auto" else ""),
            ])  # fmt: skip

    @property
    def active_retrieval_layers(self) -> tuple[int, ...]:
        """The retrieval layers in use: ``retrieval_layers``, or for ``"auto"`` those of the model's calibration
        (known once the press has met the model: ``with press(model)`` or :meth:`check_model`)."""
        return self._retrieval

    @property
    def active_full_layers(self) -> dict[int, tuple[int, ...]]:
        """The layers kept whole by context length (:attr:`kvcompress.calibration.Calibration.full_layers`: ``{0:
        layers}`` at every length): ``full_layers``, or for ``"auto"`` those of the model's calibration (known once
        the press has met the model)."""
        return self._full

    def full_layers_at(self, tokens: int) -> tuple[int, ...]:
        """The layers kept whole for a ``tokens``-token context (those of the scanned length nearest it)."""
        return layers_at(self._full, tokens)

    def scores_layer(self, layer_idx: int, tokens: int) -> bool:
        return layer_idx not in self.full_layers_at(tokens)

    def layer_plan(self, plan: RowPlan | None, layer_idx: int) -> RowPlan | None:
        """The whole middle in ``full_layers``, ``retrieval_rows`` times the uniform middle in ``retrieval_layers``;
        each other full-attention layer gives up an equal share of the rows they gain, its sink and window shrinking
        as a short context's where that leaves no middle row (:func:`split_budget`), so the cache keeps its budget.
        A layer that would keep fewer than ``MIN_PAYING_ROWS`` keeps its sink, window and one middle row instead,
        over the budget, with a warning."""
        full = self.full_layers_at(plan.tokens) if plan is not None else ()
        if plan is None or not (self._retrieval or full):
            return plan
        span = plan.tokens - plan.sink - plan.window
        wider = min(span, round(self.retrieval_rows * plan.middle))
        if layer_idx in full:
            middle = span
        elif layer_idx in self._retrieval:
            middle = wider
        else:
            others = sum(window is None for window in self._windows) - len(self._retrieval) - len(full)
            gained = (wider - plan.middle) * len(self._retrieval) + (span - plan.middle) * len(full)
            budget = plan.rows - round(gained / others)
            if budget >= MIN_PAYING_ROWS:  # short of a middle row: its sink and window shrink, as a short context's
                return split_budget(plan.tokens, budget, plan.sink, plan.window)
            logger.warning_once(
                f"{type(self).__name__}: the layers outside retrieval_layers and full_layers cannot pay for them "
                f"at compression_ratio={self.compression_ratio} (each keeps one middle row): the cache holds more "
                "rows than the budget; name fewer layers or keep more"
            )
            middle = 1
        return RowPlan(plan.tokens, plan.sink, plan.window, middle)

    def _prior_rows(self, n: int, rows: int) -> int:
        """The middle rows the priors' shares are taken of: ``rows``, where a retrieval layer has more than the uniform
        middle only ``retrieval_prior_share`` of the extra ones."""
        uniform = self.plan(n).middle if self._retrieval else rows
        return rows if rows <= uniform else uniform + round(self.retrieval_prior_share * (rows - uniform))

    def _reserved_rows(self, rows: int) -> dict[str, int]:
        """Middle rows each prior reserves: ``novelty_share`` of them for novelty, then ``induction_share`` of them
        for induction, at most what novelty leaves (``novelty_share=1.0`` leaves none)."""
        novelty = round(self.novelty_share * rows) if "novelty" in self.reference else 0
        return {"novelty": novelty, "induction": min(round(self.induction_share * rows), rows - novelty)}

    def compress_middle(self, module, keys, values, start, end, rows, reference):
        if not self.scores_layer(module.layer_idx, keys.shape[-2]):  # kept whole: its rows as they are, weight 1
            weights = torch.ones(*keys.shape[:2], end - start, dtype=torch.float32, device=keys.device)
            return keys[:, :, start:end], values[:, :, start:end], weights
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
        scores = mixed_scores(
            reference,
            start,
            end,
            {"repeat": self.repeat_weight},
            {"window": self.pool_kernel},
            reserved=self._reserved_rows(self._prior_rows(keys.shape[-2], rows)),
        )
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
