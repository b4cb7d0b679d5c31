"""What the study reads off a model and its cache: post-RoPE queries, peak bytes (``cache_bytes`` is the library's,
:func:`kvcompress.cache.cache_bytes`), masked rows."""

from __future__ import annotations

import torch

from kvcompress.cache import cache_bytes
from kvcompress.reference import post_rope_queries


class PeakSampler:
    """Largest :func:`cache_bytes` of ``cache`` seen after any attention module's forward (and at :meth:`sample`).

    Attach inside ``with press(model):`` so these hooks run after the press's own, and detach only once
    the ``with`` block has exited, so that work a press does when its block ends is sampled too.
    """

    def __init__(self, cache):
        self.cache = cache
        self.peak = 0
        self.hooks: list = []

    def sample(self) -> None:
        self.peak = max(self.peak, cache_bytes(self.cache))

    def attach(self, model: torch.nn.Module) -> None:
        self.hooks = [layer.self_attn.register_forward_hook(lambda *_: self.sample()) for layer in model.model.layers]

    def detach(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []


class QueryRecorder:
    """Forward hooks keeping every layer's post-RoPE queries ``[b, h_q, m, d]`` of the last forward pass.

    ``last``: keep only the last ``last`` positions of the pass (None: all of them).
    """

    def __init__(self, model: torch.nn.Module, last: int | None = None):
        self.queries: dict[int, torch.Tensor] = {}
        self.last = last
        self.hooks = [
            layer.self_attn.register_forward_hook(self._record, with_kwargs=True) for layer in model.model.layers
        ]

    def _record(self, module, args, kwargs, output) -> None:
        start = -self.last if self.last else 0
        hidden = kwargs["hidden_states"][:, start:]
        cos, sin = (x[:, start:] for x in kwargs["position_embeddings"])
        self.queries[module.layer_idx] = post_rope_queries(module, hidden, (cos, sin))

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()


def masked_rows(model: torch.nn.Module) -> dict[int, tuple[torch.Tensor, ...]]:
    """Per layer, the ``(batch, head, row)`` indices kvpress's head-wise presses mask (AdaKV, KVzip) instead of
    removing them; kvpress's attention patch gives those rows zero attention in every later forward pass."""
    rows = {}
    for layer in model.model.layers:
        indices = getattr(layer.self_attn, "masked_key_indices", None)
        if indices is not None:
            rows[layer.self_attn.layer_idx] = tuple(indices)
    return rows
