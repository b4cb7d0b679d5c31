"""``overlap_compression``: each layer compressed on a side stream keeps the cache (CPU: the bookkeeping; CUDA: the
streams, with the side stream held back so that a missing wait reads unwritten rows)."""

from __future__ import annotations

import contextlib
import weakref

import pytest
import torch
from transformers import DynamicCache

from kvcompress import CompressKVPress, UniformPress
from kvcompress.cache import WeightedLayer
from kvcompress.compression_stream import CompressionStream
from kvcompress.static_cache import StaticWeightedCache
from tests.tiny_models import tiny_model

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]
PRESSES = {
    "default": lambda **kw: CompressKVPress(compression_ratio=0.75, **kw),
    "paper": lambda **kw: CompressKVPress.paper(0.75, seed=0, **kw),
    "uniform": lambda **kw: UniformPress(compression_ratio=0.75, seed=0, **kw),
    # the repeat pass streamed through each layer after its prefill, and layer by layer after the prefill
    "thorough": lambda **kw: CompressKVPress.thorough(0.75, seed=0, repeat_chunk=128, **kw),
    "balanced": lambda **kw: CompressKVPress.balanced(0.75, seed=0, **kw),
}


def random_ids(n: int, seed: int, device: str) -> torch.Tensor:
    return torch.randint(1, 256, (1, n), generator=torch.Generator().manual_seed(seed)).to(device)


def _hold_back_the_side_stream(monkeypatch) -> None:
    """Each layer's side-stream work starts about 10 ms late (2e7 GPU cycles), so that a read of a compressed layer
    before the main stream waited for it finds unwritten rows."""
    run = CompressionStream.run

    def delayed(self, where, hold):
        with run(self, where, hold):
            torch.cuda._sleep(20_000_000)  # queued on the side stream, before the layer's compression
            yield

    monkeypatch.setattr(CompressionStream, "run", contextlib.contextmanager(delayed))


def _same(device: str):
    """CPU: one code path, bit for bit. CUDA: the same kernels, but the fit's ``index_add_`` sums in any order
    (float32 rounding, grown by the ridge-bounded solves to well under 1e-3); unwritten rows are off by far more."""
    if device == "cpu":
        return torch.equal
    return lambda x, y: torch.allclose(x.float(), y.float(), rtol=1e-3, atol=1e-3)


@torch.no_grad()
def prefill_and_answer(model, press, ids, mask, question):
    """The compressed cache's layers and the logits of a question and 3 greedy steps after it."""
    cache = DynamicCache()
    positions = None if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)
    with press(model):
        model.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
    layers = [
        (layer.keys.clone(), layer.values.clone(), layer.row_weights.clone())
        for layer in cache.layers
        if isinstance(layer, WeightedLayer)
    ]
    full = torch.cat([ids, question], 1)
    full_mask = None if mask is None else torch.cat([mask, torch.ones_like(question)], 1)
    out = model.generate(
        full, attention_mask=full_mask, past_key_values=cache, max_new_tokens=3, do_sample=False,
        output_logits=True, return_dict_in_generate=True, pad_token_id=0,
    )  # fmt: skip
    return layers, torch.stack(out.logits, 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", PRESSES)
@pytest.mark.parametrize("padded", [False, True])
def test_overlapped_compression_keeps_the_cache(device, name, padded, monkeypatch):
    """The same rows, weights and answers with and without the side stream (on CUDA held back a little)."""
    if device == "cuda":
        _hold_back_the_side_stream(monkeypatch)
    model = tiny_model("llama", num_hidden_layers=3).to(device)
    question = random_ids(5, 99, device)
    if padded:
        short, long = random_ids(180, 1, device), random_ids(300, 2, device)
        ids = torch.cat([torch.cat([torch.zeros_like(short[:, :120]), short], 1), long])
        mask = torch.ones_like(ids)
        mask[0, :120] = 0
        question = question.expand(2, -1)
    else:
        ids, mask = random_ids(300, 3, device), None
    plain_layers, plain_logits = prefill_and_answer(model, PRESSES[name](), ids, mask, question)
    layers, logits = prefill_and_answer(model, PRESSES[name](overlap_compression=True), ids, mask, question)
    assert len(layers) == len(plain_layers) == 3
    same = _same(device)
    for got, want in zip(layers, plain_layers, strict=True):
        for x, y in zip(got, want, strict=True):
            assert same(x, y)
    assert same(logits, plain_logits)


@pytest.mark.parametrize("device", DEVICES)
def test_a_static_cache_is_frozen_after_the_side_stream(device, monkeypatch):
    """A StaticWeightedCache handed to the prefill is made static (its rows copied into preallocated buffers) only
    after the main stream waited for the side stream: the same tokens and logits as without the option."""
    if device == "cuda":
        _hold_back_the_side_stream(monkeypatch)
    model = tiny_model("qwen2", num_hidden_layers=3).to(device)
    ids, question = random_ids(240, 4, device), random_ids(4, 5, device)
    answers = []
    for overlap in (False, True):
        cache = StaticWeightedCache(max_new_tokens=16)
        with torch.no_grad(), CompressKVPress(compression_ratio=0.75, overlap_compression=overlap)(model):
            model.model(input_ids=ids, past_key_values=cache)
        assert cache.is_compileable
        with torch.no_grad():
            out = model.generate(
                torch.cat([ids, question], 1), past_key_values=cache, max_new_tokens=3, do_sample=False,
                output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
        answers.append((out.sequences, torch.stack(out.logits, 1)))
    assert torch.equal(answers[0][0], answers[1][0])
    assert _same(device)(answers[0][1], answers[1][1])


@pytest.mark.parametrize("name", ["default", "thorough", "balanced"])
def test_at_most_one_layer_waits_and_none_after_the_prefill(name, monkeypatch):
    """While layer l is compressed only its own full cache is held for the side stream: layer l - 1's full keys are
    freed by then (its work joined), layer l's are alive while the next layer runs (its prefill, or its repeat pass
    after the prefill), and nothing is held once the prefill returns."""
    model = tiny_model("qwen2", num_hidden_layers=4)
    press = PRESSES[name](overlap_compression=True)
    compress = type(press)._compress_layer
    seen, full_keys = [], []  # (layer, layers held, previous layer's full keys alive); weak refs to them

    def watched(self, cache, state):
        idx = state["module"].layer_idx
        seen.append((idx, self._side.held, bool(full_keys) and full_keys[-1]() is not None))
        full_keys.append(weakref.ref(cache.layers[idx].keys))
        return compress(self, cache, state)

    monkeypatch.setattr(type(press), "_compress_layer", watched)
    held_on = []  # at each layer's attention: whether the layer before's full keys are still alive (held)
    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(
            lambda *_: held_on.append(bool(full_keys) and full_keys[-1]() is not None)
        )
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=random_ids(300, 5, "cpu"), past_key_values=cache)
        assert press._side.held == 0  # joined when the decoder returned
    assert seen == [(0, 1, False), (1, 1, False), (2, 1, False), (3, 1, False)]
    # Each of layers 1-3 runs its attention at least once (prefill or repeat chunks) while the layer before is held.
    assert held_on == [False, True, True, True] if name == "default" else sum(held_on) >= 3
    assert all(ref() is None for ref in full_keys)
    assert all(isinstance(layer, WeightedLayer) for layer in cache.layers)


def test_overlap_compression_is_a_bool():
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match=rf"overlap_compression: must be True or False, got {bad!r}"):
            CompressKVPress(compression_ratio=0.5, overlap_compression=bad)
