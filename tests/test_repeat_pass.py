"""The repeat pass layer by layer against the whole-model pass it replaces: streamed through each layer right after its
prefill (``_repeat_streamed``), or after the prefill when its pieces are chosen from every layer's novelty
(``_repeat_layer_by_layer``, balanced()). The same cache on every family without sliding-window layers, one full
layer at a time (or the full cache released layer by layer after the prefill) instead of all of them to the end, and
the whole-model pass kept wherever streaming cannot run."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvcompress import CompressKVPress, reference
from kvcompress.offload import ParkedLayers
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
    "balanced": lambda: CompressKVPress.balanced(compression_ratio=0.6, seed=0, repeat_chunk=48),
}


def _count_streamed(monkeypatch) -> list[int]:
    """Layers the repeat pass streamed through, in order."""
    layers, original = [], reference.repeat_through_layer

    def spy(layer, decoder, hidden, cache, layer_idx, shift=None):
        layers.append(layer_idx)
        return original(layer, decoder, hidden, cache, layer_idx, shift)

    monkeypatch.setattr("kvcompress.repeat_hooks.repeat_through_layer", spy)
    return layers


def _whole_pass(monkeypatch) -> None:
    monkeypatch.setattr(WeightedSubsetPress, "_streamable", lambda self, state: False)


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


def _full_layers(model, press) -> tuple[DynamicCache, list[int], dict[int, set[int]]]:
    """The compressed cache; at each layer's prefill attention the number of layers holding all the context's rows;
    at each repeat chunk's attention, per layer, the numbers of layers holding at least them."""
    at_prefill, at_repeat = [], {}

    def count(module, args, kwargs, output):  # registered before the press's hook: sees the cache as it is
        layers = kwargs["past_key_values"].layers
        if kwargs["hidden_states"].shape[1] == CONTEXT:
            at_prefill.append(sum(layer.keys.shape[-2] == CONTEXT for layer in layers))
        else:
            at_repeat.setdefault(module.layer_idx, set()).add(sum(layer.keys.shape[-2] >= CONTEXT for layer in layers))

    hooks = [layer.self_attn.register_forward_hook(count, with_kwargs=True) for layer in model.model.layers]
    try:
        return compressed_cache(model, press, tokens(CONTEXT, 13).to(model.device)), at_prefill, at_repeat
    finally:
        for hook in hooks:
            hook.remove()


def _assert_same_cache(a: DynamicCache, b: DynamicCache) -> None:
    for i, (x, y) in enumerate(zip(a.layers, b.layers, strict=True)):
        for name in ("keys", "values", "row_weights"):
            u, v = getattr(x, name), getattr(y, name)
            assert torch.equal(u, v), f"layer {i} {name}: up to {(u - v).abs().max().item():.3g} apart"


@pytest.mark.parametrize("streamed", [True, False])
def test_one_full_layer_at_a_time_when_streamed(streamed, monkeypatch):
    """At each layer's prefill attention: the layers holding all n rows (the streamed pass: that layer alone; the
    whole pass: every layer so far)."""
    if not streamed:
        _whole_pass(monkeypatch)
    _, held, _ = _full_layers(tiny_model("qwen2", num_hidden_layers=4), PRESSES["thorough"]())
    assert held == ([1, 1, 1, 1] if streamed else [1, 2, 3, 4])


def test_after_the_prefill_full_layers_go_one_by_one(monkeypatch):
    """balanced(): its pieces need every layer's novelty, so every layer holds its full cache at the end of the
    prefill; the pass then compresses layer l before it reads layer l + 1 (at layer l's repeat attention, the layers
    still full are l..L-1), where the whole-model pass holds them all until it ends."""
    model = tiny_model("qwen2", num_hidden_layers=4)
    _, _, at_repeat = _full_layers(model, PRESSES["balanced"]())
    assert at_repeat == {0: {4}, 1: {3}, 2: {2}, 3: {1}}
    _whole_pass(monkeypatch)
    _, _, at_repeat = _full_layers(model, PRESSES["balanced"]())
    assert at_repeat == {0: {4}, 1: {4}, 2: {4}, 3: {4}}


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA"))],
)
def test_parked_layers_wait_in_host_memory_and_keep_the_cache(device, monkeypatch):
    """balanced() with each waiting layer parked right after its prefill (by default on CUDA, side-stream copies out
    and back; forced on the CPU): during the prefill only the layer being prefilled holds its rows (every layer so far
    when not parked), and the cache is the unparked one bit for bit, as a second unparked run's is (on CUDA the fit's
    row sums add in a fixed order: ``fit_equations._add_rows_``; with atomics the values differed run to run)."""
    assert ParkedLayers.wanted(torch.device("cuda")) and not ParkedLayers.wanted(torch.device("cpu"))
    model = tiny_model("qwen2", num_hidden_layers=4).to(device)
    monkeypatch.setattr(ParkedLayers, "wanted", staticmethod(lambda device: False))
    plain, held, _ = _full_layers(model, PRESSES["balanced"]())
    assert held == [1, 2, 3, 4]
    _assert_same_cache(_full_layers(model, PRESSES["balanced"]())[0], plain)  # a run is the same run every time
    monkeypatch.undo()
    if device == "cpu":
        monkeypatch.setattr(ParkedLayers, "wanted", staticmethod(lambda device: True))
    parked, held, _ = _full_layers(model, PRESSES["balanced"]())
    assert held == [1, 1, 1, 1]
    _assert_same_cache(parked, plain)
    # thorough() streams (compresses each layer right after its prefill): nothing to park.
    _, held, _ = _full_layers(model, PRESSES["thorough"]())
    assert held == [1, 1, 1, 1]


def test_parked_layers_round_trip():
    """park / prefetch / restore (and restore_all) give each layer back its own rows, in any order."""
    cache = DynamicCache()
    rows = [(torch.randn(1, 2, 9, 4), torch.randn(1, 2, 9, 3)) for _ in range(3)]
    for layer_idx, (keys, values) in enumerate(rows):
        cache.update(keys.clone(), values.clone(), layer_idx)
    parked = ParkedLayers(torch.device("cpu"))
    for layer_idx in range(3):
        parked.park(cache.layers[layer_idx], layer_idx)
        assert cache.layers[layer_idx].keys.shape == (1, 2, 0, 4)
    parked.prefetch(2)
    parked.restore(cache.layers[1], 1)
    parked.restore_all(cache)
    for layer, (keys, values) in zip(cache.layers, rows, strict=True):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    assert not parked.host and not parked.arriving


def test_the_whole_pass_stays_where_streaming_cannot(monkeypatch):
    streamed_layers = _count_streamed(monkeypatch)
    # Sliding-window layers (gemma3): the whole pass, after the prefill or not.
    compressed_cache(tiny_model("gemma3"), PRESSES["thorough"](), tokens(320, 9))
    compressed_cache(tiny_model("gemma3"), PRESSES["balanced"](), tokens(320, 9))
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
