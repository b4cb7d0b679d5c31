"""kvpress presses that leave a weighted cache behind: CompressKVPress and UniformPress.

Both keep the first ``sink_size`` and last ``window_size`` context tokens exactly (weight 1) and
replace the middle by a weighted subset, per batch row and KV head, right after each layer's prefill.
The compressed layer (:class:`kvcompress.cache.WeightedLayer`) carries the weights, and the model is
switched to the "kvcompress" attention, which runs weighted attention (Alg. 3) over such layers and
stock sdpa everywhere else. The switch outlives the ``with press(model)`` block on purpose: the
question and the answer are computed after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvpress.presses.base_press import BasePress, is_prefilling
from kvpress.utils import get_prerope_query_states
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
from transformers.models.llama.modeling_llama import rotate_half
from transformers.utils import logging as hf_logging

from kvcompress.cache import WeightedLayer, install_compressed_layer
from kvcompress.hf_attention import use_weighted_attention
from kvcompress.nystrom import compress_kv

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


@dataclass
class WeightedSubsetPress(BasePress):
    """Shared frame: protected sink/window tokens, a weighted middle, the budget of kvpress's ScorerPress.

    After compression each head holds at most ``int(n * (1 - compression_ratio))`` rows, protected
    tokens included. A context whose budget cannot hold the protected tokens plus one middle row, or
    that needs no removal, is left untouched. Subclasses implement :meth:`compress_middle`.
    """

    compression_ratio: float = 0.0
    sink_size: int = 32
    window_size: int = 32
    seed: int | None = None

    def __post_init__(self) -> None:
        ratio = self.compression_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
            raise ValueError(f"compression_ratio: must be a number in [0, 1) (fraction removed), got {ratio!r}")
        for name in ("sink_size", "window_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: must be an int >= 0, got {value!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed: must be an int or None, got {self.seed!r}")

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

    def compress_middle(
        self, module: torch.nn.Module, keys: torch.Tensor, values: torch.Tensor, rows: int, kwargs: dict
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Middle keys/values ``[b, h_kv, L, d]`` -> ``(K [b, h_kv, rows, d], V, w [b, h_kv, rows])``."""
        raise NotImplementedError

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        raise NotImplementedError(
            f"{type(self).__name__} stores per-row weights with the cache; it cannot run through kvpress's "
            "compress() protocol (e.g. inside ComposedPress or another press's wrapper). Use it on its own."
        )

    def forward_hook(self, module: torch.nn.Module, input: list, kwargs: dict, output: list) -> list:
        hidden_states = kwargs["hidden_states"]
        if getattr(module, "is_sliding", False) or not is_prefilling(kwargs["cache_position"], hidden_states.shape[1]):
            return output  # Gemma3 sliding layers stay exact; only the prefill is compressed
        cache = kwargs["past_key_values"]
        layer = cache.layers[module.layer_idx]
        keys, values = layer.keys, layer.values
        n = keys.shape[-2]
        budget = self.budget(n)
        protected = self.sink_size + self.window_size
        if budget >= n:
            return output
        if budget <= protected:
            logger.warning_once(
                f"{type(self).__name__}: a {n}-token context at compression_ratio={self.compression_ratio} keeps "
                f"{budget} rows, not more than the {protected} protected tokens; left uncompressed"
            )
            return output
        end = n - self.window_size
        middle_keys, middle_values, middle_weights = self.compress_middle(
            module, keys[:, :, self.sink_size : end], values[:, :, self.sink_size : end], budget - protected, kwargs
        )
        ones = middle_weights.new_ones(*middle_weights.shape[:2], 1)
        compressed = WeightedLayer(
            keys=torch.cat([keys[:, :, : self.sink_size], middle_keys, keys[:, :, end:]], dim=2),
            values=torch.cat([values[:, :, : self.sink_size], middle_values, values[:, :, end:]], dim=2),
            row_weights=torch.cat(
                [ones.expand(-1, -1, self.sink_size), middle_weights, ones.expand(-1, -1, self.window_size)], dim=2
            ),
            value_min=values.amin(2).float(),
            value_max=values.amax(2).float(),
            tokens=n,
        )
        install_compressed_layer(cache, module.layer_idx, compressed)
        return output


@dataclass
class CompressKVPress(WeightedSubsetPress):
    """CompressKV (WildCat Alg. 2) on the middle of the context, ``bin_rank`` pivots per bin.

    ``query_radius``: "keys" uses R_Q = R_K per bin (the authors' code); "queries" uses the max norm of
    this layer's post-RoPE prefill queries in the KV head's group.
    """

    bin_rank: int = 12
    query_radius: str = "keys"

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.bin_rank, bool) or not isinstance(self.bin_rank, int) or self.bin_rank < 1:
            raise ValueError(f"bin_rank: must be an int >= 1, got {self.bin_rank!r}")
        if self.query_radius not in ("keys", "queries"):
            raise ValueError(f'query_radius: must be "keys" or "queries", got {self.query_radius!r}')

    def compress_middle(self, module, keys, values, rows, kwargs):
        bins = max(1, rows // self.bin_rank)
        radius = self.prefill_query_radius(module, kwargs) if self.query_radius == "queries" else None
        return compress_kv(
            keys,
            values,
            bins * (rows // bins),
            bins=bins,
            scaling=module.scaling,
            query_radius=radius,
            seed=self.layer_seed(module.layer_idx),
        )

    @staticmethod
    def prefill_query_radius(module: torch.nn.Module, kwargs: dict) -> torch.Tensor:
        """Max post-RoPE query norm per (batch row, KV head) over the prefill: ``[b, h_kv]`` float32."""
        queries = get_prerope_query_states(module, kwargs["hidden_states"])  # [b, h_q, n, d]
        cos, sin = kwargs["position_embeddings"]
        queries = queries * cos.unsqueeze(1) + rotate_half(queries) * sin.unsqueeze(1)
        norms = queries.float().norm(dim=-1).amax(-1)  # [b, h_q]
        return norms.view(norms.shape[0], -1, module.num_key_value_groups).amax(-1)


@dataclass
class UniformPress(WeightedSubsetPress):
    """A uniformly random subset of the middle, kept in position order (per batch row and KV head).

    ``weighted=True`` turns the subset into the unbiased Monte-Carlo estimate of the middle's softmax
    sums: each kept row stands for ``L / kept`` middle rows, so both its weight and its value are
    scaled by that factor (``w = L / kept``, ``V_S = (L / kept) v``). ``weighted=False`` is plain
    eviction (``w = 1``).
    """

    weighted: bool = False

    def compress_middle(self, module, keys, values, rows, kwargs):
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
