"""The repeat pass streamed layer by layer (``WeightedSubsetPress._repeat_streamed``) against the whole-model pass
it replaces: the same cache on every family without sliding-window layers, one full layer at a time instead of
all of them, and the whole-model pass kept wherever streaming cannot run."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvcompress import CompressKVPress, reference
from kvcompress.weighted_press import WeightedSubsetPress
from tests.test_press_options import compressed_cache, tokens
from tests.tiny_models import tiny_model

CONTEXT = 320
PRESSES = {
    "thorough": lambda: CompressKVPress.thorough(compression_ratio=0.6, seed=0, repeat_chunk=128),
    "kvzip": lambda: CompressKVPress.kvzip(compression_ratio=0.7, repeat_chunk=100),
    "spread half": lambda: CompressKVPress(
        compression_ratio=0.75, reference=("window", "repeat"), repeat_fraction=0.5, repeat_span=40, repeat_chunk=64
    ),
}


def _count_streamed(monkeypatch) -> list[int]:
    """Layers the repeat pass streamed through, in order."""
    layers, original = [], reference.repeat_through_layer

    def spy(layer, decoder, hidden, cache, layer_idx):
        layers.append(layer_idx)
        return original(layer, decoder, hidden, cache, layer_idx)

    monkeypatch.setattr("kvcompress.repeat_hooks.repeat_through_layer", spy)
    return layers


def _whole_pass(monkeypatch) -> None:
    monkeypatch.setattr(WeightedSubsetPress, "_stream_start", lambda self, layer_idx, state: False)


@pytest.mark.parametrize("press", sorted(PRESSES))
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "phi3"])
def test_streamed_repeat_keeps_the_whole_pass_cache(family, press, monkeypatch):
    model, context = tiny_model(family), tokens(CONTEXT, 7)
    streamed_layers = _count_streamed(monkeypatch)
    streamed = compressed_cache(model, PRESSES[press](), context)
    assert streamed_layers == list(range(model.config.num_hidden_layers))
    _whole_pass(monkeypatch)
    whole = compressed_cache(model, PRESSES[press](), context)
    assert streamed_layers == list(range(model.config.num_hidden_layers))  # no streaming in the second run
    for a, b in zip(streamed.layers, whole.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)  # the same rows (and fitted values)
        torch.testing.assert_close(a.row_weights, b.row_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("streamed", [True, False])
def test_one_full_layer_at_a_time_when_streamed(streamed, monkeypatch):
    """At each layer's prefill attention: the layers holding all n rows (the streamed pass: that layer alone; the
    whole pass: every layer so far)."""
    model, context = tiny_model("qwen2", num_hidden_layers=4), tokens(CONTEXT, 8)
    if not streamed:
        _whole_pass(monkeypatch)
    full_layers = []

    def count(module, args, kwargs, output):  # registered before the press's hook: sees the prefill's cache
        cache = kwargs["past_key_values"]
        if kwargs["hidden_states"].shape[1] == CONTEXT:
            full_layers.append(sum(layer.keys.shape[-2] == CONTEXT for layer in cache.layers))

    hooks = [layer.self_attn.register_forward_hook(count, with_kwargs=True) for layer in model.model.layers]
    try:
        compressed_cache(model, PRESSES["thorough"](), context)
    finally:
        for hook in hooks:
            hook.remove()
    assert full_layers == ([1, 1, 1, 1] if streamed else [1, 2, 3, 4])


def test_the_whole_pass_stays_where_streaming_cannot(monkeypatch):
    streamed_layers = _count_streamed(monkeypatch)
    # Pieces chosen from every layer's novelty (balanced()), sliding-window layers (gemma3): the whole pass.
    compressed_cache(
        tiny_model("qwen2"), CompressKVPress.balanced(compression_ratio=0.6, repeat_chunk=64), tokens(320, 9)
    )
    compressed_cache(tiny_model("gemma3"), PRESSES["thorough"](), tokens(320, 9))
    # A padded batch: each row re-reads its own tokens through the whole model.
    model = tiny_model("llama")
    ids = torch.cat([tokens(CONTEXT, 10), tokens(CONTEXT, 11)])
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    with torch.no_grad(), PRESSES["thorough"]()(model):
        model.model(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache())
    assert streamed_layers == []
    # inputs_embeds: the repeat pass has no token ids to read (one line naming input_ids).
    with pytest.raises(ValueError, match="input_ids"), torch.no_grad(), PRESSES["thorough"]()(model):
        model.model(inputs_embeds=model.model.embed_tokens(tokens(CONTEXT, 12)), past_key_values=DynamicCache())
