"""UniformPress: a uniformly random subset of each head's middle rows, plain or weighted (CompressKVPress's
baseline; both build on :class:`kvcompress.weighted_press.WeightedSubsetPress`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress import rng
from kvcompress._checks import check_bool
from kvcompress.weighted_press import WeightedSubsetPress


@dataclass
class UniformPress(WeightedSubsetPress):
    """A uniformly random subset of the middle, kept in position order (per batch row and KV head; the draws
    depend on the seed, layer, KV head and position only, so a batch row keeps what it keeps alone).

    ``weighted=True`` turns the subset into the unbiased Monte-Carlo estimate of the middle's softmax
    sums: each kept row stands for ``L / kept`` middle rows, so both its weight and its value are
    scaled by that factor (``w = L / kept``, ``V_S = (L / kept) v``). ``weighted=False`` is plain
    eviction (``w = 1``).
    """

    weighted: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bool("weighted", self.weighted)

    def compress_middle(self, module, keys, values, start, end, rows, reference):
        keys, values = keys[:, :, start:end], values[:, :, start:end]
        batch, heads, length, _ = keys.shape
        seed = self.layer_seed(module.layer_idx)
        if seed is None:  # one draw per call, shared by the rows
            seed = int(torch.randint(0, 2**62, (1,)).item())
        # Counter-based draws of (seed, layer, KV head, position): a row's subset does not depend on its batch place.
        streams = torch.arange(heads, device=keys.device, dtype=torch.int64).expand(batch, heads)
        scores = rng.gumbel(rng.stream_step_key(rng.seed_key(seed), streams, 0), length, torch.float64)
        index = scores.topk(rows, dim=-1).indices.sort(-1).values  # uniform subset, in position order
        kept_keys = keys.gather(2, index[..., None].expand(-1, -1, -1, keys.shape[-1]))
        kept_values = values.gather(2, index[..., None].expand(-1, -1, -1, values.shape[-1]))
        scale = length / rows if self.weighted else 1.0
        weights = torch.full((batch, heads, rows), scale, device=keys.device)
        return kept_keys, kept_values * scale if self.weighted else kept_values, weights
