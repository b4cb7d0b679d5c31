"""What a prefill leaves behind: a compressed cache is freed as soon as its last reference goes (no reference cycle
waiting for Python's collector, which may run much later, while the cache's device memory stays taken), and a
prefill run with gradients on keeps no graph of the compression (each one used to stay alive for good)."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import weakref

import pytest
import torch
from transformers import DynamicCache

from kvcompress import CompressKVPress, UniformPress, compress_kv
from tests.tiny_models import tiny_model

PRESSES = {
    "default": lambda: CompressKVPress(compression_ratio=0.75, seed=0),
    "paper": lambda: CompressKVPress.paper(0.75, seed=0),
    "balanced": lambda: CompressKVPress.balanced(0.75, seed=0),
    "thorough": lambda: CompressKVPress.thorough(0.75, seed=0),
    "uniform": lambda: UniformPress(compression_ratio=0.75, seed=0),
}


def _prefill(model, press, ids: torch.Tensor):
    cache = DynamicCache()
    with press(model):
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache, out


def _live_tensors() -> int:
    gc.collect()
    return sum(isinstance(obj, torch.Tensor) for obj in gc.get_objects())


@pytest.fixture(scope="module")
def model_and_ids():
    model = tiny_model("qwen2", dtype=torch.bfloat16, num_hidden_layers=2)
    return model, torch.randint(0, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(3))


def test_a_dropped_compressed_cache_is_freed_at_once(model_and_ids):
    """With the collector off, the last reference to a compressed cache frees its layers and their rows (each
    layer's keys name their layer by a weak reference: a strong one was a cycle only the collector could break)."""
    model, ids = model_and_ids
    with torch.no_grad():
        cache = _prefill(model, PRESSES["default"](), ids)[0]  # the output, which names the cache too, goes
    layer, keys = weakref.ref(cache.layers[0]), weakref.ref(cache.layers[0].keys)
    assert type(cache.layers[0]).__name__ == "WeightedLayer"
    enabled = gc.isenabled()
    gc.disable()
    try:
        del cache
        assert layer() is None and keys() is None
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("name", sorted(PRESSES))
def test_a_prefill_with_gradients_on_keeps_no_graph_of_the_compression(model_and_ids, name):
    """Prefills with autograd on, each result dropped before the next: the live tensors do not grow from one to the
    next (each prefill's graph used to stay alive: the selection's in-place updates made a cycle through autograd
    that outlived the cache), the compressed rows carry no graph, and the model's output still does."""
    model, ids = model_and_ids
    counts = []
    with torch.enable_grad():
        for _ in range(3):
            cache, out = _prefill(model, PRESSES[name](), ids)
            assert out.logits.grad_fn is not None  # the forward's own graph is the caller's
            layer = cache.layers[0]
            assert type(layer).__name__ == "WeightedLayer"
            assert not (layer.keys.requires_grad or layer.values.requires_grad or layer.row_weights.requires_grad)
            del cache, out, layer
            counts.append(_live_tensors())
    assert counts[2] == counts[1], counts


def test_compress_kv_runs_outside_autograd():
    """compress_kv on inputs that require gradients: results without a graph, and nothing left alive per call."""
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(2, 60, 16, generator=gen, requires_grad=True)
    counts = []
    for _ in range(3):
        keys, values, weights = compress_kv(base * 1.0, base * 2.0, 12, bins=2, seed=0)
        assert not (keys.requires_grad or values.requires_grad or weights.requires_grad)
        del keys, values, weights
        counts.append(_live_tensors())
    assert counts[2] == counts[1], counts


def _round_trip(cache, how: str):
    if how == "deepcopy":
        return copy.deepcopy(cache)
    if how == "pickle":
        return pickle.loads(pickle.dumps(cache))
    buffer = io.BytesIO()
    torch.save(cache, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("static", [False, True])
def test_a_copied_or_saved_cache_answers_on_its_own_layers(model_and_ids, how, static):
    """Keys name their layer weakly, and a weak reference is neither copied nor pickled: a deep copy, a pickle or a
    ``torch.save`` round trip of a compressed cache (dynamic, and static, whose keys are tagged once, when it is
    built) has keys that name its own layers, and it answers as the original did once the original is gone (a tag
    that named the original would read its rows, or none)."""
    from kvcompress.cache import layer_of
    from kvcompress.static_cache import StaticWeightedCache

    model, ids = model_and_ids
    question = torch.randint(0, model.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(4))
    position = torch.arange(ids.shape[1], ids.shape[1] + 4)[None]
    with torch.no_grad():
        cache = _prefill(model, PRESSES["default"](), ids)[0]
        if static:
            cache = StaticWeightedCache.from_compressed(cache, max_new_tokens=8)
        copied = _round_trip(cache, how)
        for layer, twin in zip(cache.layers, copied.layers, strict=True):
            assert layer_of(twin.keys) is twin and layer_of(layer.keys) is layer
        expected = model(input_ids=question, past_key_values=cache, position_ids=position).logits
        del cache
        gc.collect()
        logits = model(input_ids=question, past_key_values=copied, position_ids=position).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=0)


def test_a_shallow_copy_of_a_layer_names_the_copy(model_and_ids):
    """``copy.copy`` of a compressed layer (the server's store hands out such views): the copy's keys share the
    original's rows and name the copy; the original's keys still name the original."""
    from kvcompress.cache import layer_of

    model, ids = model_and_ids
    with torch.no_grad():
        cache = _prefill(model, PRESSES["default"](), ids)[0]
    layer = cache.layers[0]
    view = copy.copy(layer)
    assert layer_of(view.keys) is view and layer_of(layer.keys) is layer
    assert view.keys.data_ptr() == layer.keys.data_ptr() and torch.equal(view.keys, layer.keys)
