"""Sliding-window layers after a press (kvcompress.window): at most their window after compression and while
decoding, whatever cache the user passed, with the outputs the model computes (tiny Gemma 3, CPU).

Tolerance: trimming removes only rows the sliding mask already hides (their softmax terms are exactly 0), so
the two runs differ only in sdpa's float32 summation blocking: rtol = atol = 1e-5 on O(1) logits.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache
from transformers.generation.configuration_utils import CompileConfig

import kvcompress.weighted_press
from kvcompress import CompressKVPress
from kvcompress.cache import WeightedLayer, cache_bytes
from kvcompress.static_cache import StaticWeightedCache, StaticWindowLayer
from kvcompress.window import WindowLayer, layer_windows
from tests.test_padding import answer, prefill, random_ids
from tests.test_pipeline import QUESTIONS, setup  # noqa: F401  (its fixture: a tiny model with a real tokenizer)
from tests.tiny_models import tiny_model

WINDOW, CONTEXT, TOL = 16, 200, dict(rtol=1e-5, atol=1e-5)


def gemma():
    return tiny_model("gemma3", sliding_window=WINDOW)  # layers: sliding, full, sliding


def press():
    return CompressKVPress(compression_ratio=0.75, seed=0)


def compress(model, ids, cache=None):
    cache = DynamicCache() if cache is None else cache
    with torch.no_grad(), press()(model):
        model.model(input_ids=ids, past_key_values=cache)
    return cache


def test_layer_windows_follow_transformers_rule():
    assert layer_windows(gemma()) == [WINDOW, None, WINDOW]
    assert layer_windows(tiny_model("llama")) == [None, None]


@pytest.mark.parametrize("with_config", [False, True])
def test_sliding_layers_hold_their_window_after_compression_and_while_decoding(with_config):
    model = gemma()
    ids = random_ids(CONTEXT, seed=1)
    cache = compress(model, ids, DynamicCache(config=model.config) if with_config else None)
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [WindowLayer, WeightedLayer, WindowLayer]
    assert all(cache.layers[i].keys.shape[-2] == WINDOW - 1 for i in (0, 2))
    assert "window: 2 layers, 30 rows" in repr(cache) and "compressed: 1 layers, 50 rows" in repr(cache)
    kv_bytes = 2 * 2 * 2 * (WINDOW - 1) * 16 * 4  # layers x (K, V) x heads x rows x head dim x float32
    assert cache_bytes(cache, by_kind=True)["window"] == kv_bytes
    token = random_ids(1, seed=2)
    with torch.no_grad():
        for _ in range(2 * WINDOW):  # decode well past the window, one step at a time
            token = model(input_ids=token, past_key_values=cache).logits[:, -1:].argmax(-1)
            assert all(cache.layers[i].keys.shape[-2] <= WINDOW for i in (0, 2))
    assert cache.get_seq_length() == CONTEXT + 2 * WINDOW


def test_trimmed_windows_give_what_the_model_computes(monkeypatch):
    """Same press with the sliding layers left whole (the old behaviour): same tokens, same logits."""
    model = gemma()
    ids, question = random_ids(CONTEXT, seed=3), random_ids(5, seed=4)
    trimmed = answer(model, prefill(model, press(), ids), ids, None, question)
    monkeypatch.setattr(kvcompress.weighted_press, "trim_to_windows", lambda *args: None)
    whole_cache = prefill(model, press(), ids)
    assert whole_cache.layers[0].keys.shape[-2] == CONTEXT
    whole = answer(model, whole_cache, ids, None, question)
    assert torch.equal(trimmed[0], whole[0])
    torch.testing.assert_close(trimmed[1], whole[1], **TOL)


def cut_back(cache, lengths):
    """What kvpress's pipeline does between questions: slice every layer to its length before the answer."""
    for layer, length in zip(cache.layers, lengths, strict=True):
        layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]


@pytest.mark.parametrize("static", [False, True])
def test_second_question_after_cut_back_equals_a_fresh_cache(static):
    model = gemma()
    ids = random_ids(CONTEXT, seed=5)
    questions = random_ids(5, seed=6), random_ids(7, seed=7)
    cache = prefill(model, press(), ids)
    if static:
        cache = StaticWeightedCache.from_compressed(cache, max_new_tokens=32)
    fresh = answer(model, copy.deepcopy(cache), ids, None, questions[1])
    lengths = [cache.get_seq_length(i) for i in range(len(cache.layers))]
    answer(model, cache, ids, None, questions[0])
    cut_back(cache, lengths)
    again = answer(model, cache, ids, None, questions[1])
    assert torch.equal(again[0], fresh[0])
    torch.testing.assert_close(again[1], fresh[1], **TOL)


def test_mistral_style_windows_on_every_layer(monkeypatch):
    """Every layer sliding (Mistral-style): nothing is compressed (the press says so), every layer is cut to its
    window, the outputs stay the model's, and a second question after the pipeline's cut-back equals a fresh
    cache's."""
    warned = []
    monkeypatch.setattr(kvcompress.weighted_press.logger, "warning_once", warned.append)
    model = tiny_model("mistral", sliding_window=WINDOW)
    ids, question = random_ids(CONTEXT, seed=16), random_ids(5, seed=17)
    cache = prefill(model, press(), ids)
    assert len(warned) == 1 and "every layer of this model uses a sliding window: nothing is compressed" in warned[0]
    assert all(isinstance(layer, WindowLayer) and layer.keys.shape[-2] == WINDOW - 1 for layer in cache.layers)
    fresh = answer(model, copy.deepcopy(cache), ids, None, question)
    whole = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=ids, past_key_values=whole)
    expected = answer(model, whole, ids, None, question)
    assert torch.equal(fresh[0], expected[0])
    torch.testing.assert_close(fresh[1], expected[1], **TOL)
    lengths = [cache.get_seq_length(i) for i in range(len(cache.layers))]
    answer(model, cache, ids, None, random_ids(3, seed=18))
    cut_back(cache, lengths)
    again = answer(model, cache, ids, None, question)
    assert torch.equal(again[0], fresh[0])
    torch.testing.assert_close(again[1], fresh[1], **TOL)


@pytest.mark.parametrize("static", [False, True])
def test_pipeline_questions_together_equal_each_alone_on_gemma3(setup, static):  # noqa: F811
    """kvpress's pipeline on a Gemma 3 model: two questions on one compressed context give, call for call, the
    logits each gives alone (the window layers go back to the end of the context between questions). Logits,
    not strings: this tiny random Gemma 3 answers every question with newlines."""
    from transformers import pipeline

    tokenizer, context = setup[1], setup[3]
    model = tiny_model("gemma3", vocab_size=len(tokenizer), sliding_window=WINDOW, seed=3)
    model.generation_config.eos_token_id = -1  # never stop early: the same number of calls every run
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    logits: list[torch.Tensor] = []
    model.register_forward_hook(lambda module, args, output: logits.append(output.logits[0, -1].clone()))

    def run(questions: list[str]) -> list[torch.Tensor]:
        logits.clear()
        cache = {"cache": StaticWeightedCache(max_new_tokens=64)} if static else {}
        pipe(context, questions=questions, press=press(), max_new_tokens=6, **cache)
        return list(logits)

    together = run(QUESTIONS)
    alone = run(QUESTIONS[:1]) + run(QUESTIONS[1:])
    assert len(together) == len(alone) == 12
    torch.testing.assert_close(torch.stack(together), torch.stack(alone), **TOL)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_rewinding_a_window_layer_elsewhere_is_refused_and_changes_nothing(static):
    """A full (compressed) layer, then a sliding one: a crop the window layer refuses is refused before any layer
    is cut (the compressed layer keeps its rows), and the next token's logits are those of a cache that was never
    asked to crop."""
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                       layer_types=["full_attention", "sliding_attention"])  # fmt: skip
    ids = random_ids(CONTEXT, seed=8)
    caches = []
    for _ in range(2):
        cache = compress(model, ids)
        cache = StaticWeightedCache.from_compressed(cache, max_new_tokens=8) if static else cache
        with torch.no_grad():
            model(input_ids=random_ids(3, seed=9), past_key_values=cache)
        caches.append(cache)
    cache, untouched = caches

    def lengths(c):
        return [layer.get_seq_length() for layer in c.layers]

    before = lengths(cache)
    for bad in (CONTEXT + 1, -1):
        with pytest.raises(ValueError, match="max_length: a sliding-window layer after a press can go back only"):
            cache.crop(bad)
    assert lengths(cache) == before
    step = random_ids(1, seed=10)
    with torch.no_grad():
        got = model(input_ids=step, past_key_values=cache).logits
        want = model(input_ids=step, past_key_values=untouched).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("question_tokens", [5, 2 * WINDOW + 3])
def test_static_cache_keeps_windows_in_a_ring(question_tokens):
    """Generation over the static rings equals the dynamic cache's, for a question longer than the window too
    (each new token's realness is read from its own column: from the last row, a sliding mask hid the question's
    first tokens from themselves)."""
    model = gemma()
    ids, question = random_ids(CONTEXT, seed=10), random_ids(question_tokens, seed=11)
    cache = prefill(model, press(), ids)
    static = StaticWeightedCache.from_compressed(cache, max_new_tokens=question_tokens + 2 * WINDOW)
    assert [type(layer) for layer in static.layers][::2] == [StaticWindowLayer, StaticWindowLayer]
    assert static.layers[0].keys.shape[-2] == WINDOW and static.is_compileable
    full = torch.cat([ids, question], 1)
    kwargs = dict(max_new_tokens=2 * WINDOW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        expected = model.generate(full, past_key_values=copy.deepcopy(cache), pad_token_id=0, **kwargs)
        out = model.generate(full, past_key_values=static, pad_token_id=0, **kwargs)
    assert torch.equal(out.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(expected.logits), rtol=1e-4, atol=1e-4)


def test_static_window_layers_refuse_to_write_past_the_preallocated_rows():
    model = gemma()
    ids = random_ids(CONTEXT, seed=19)
    static = StaticWeightedCache.from_compressed(prefill(model, press(), ids), max_new_tokens=3)
    with torch.no_grad():
        model(input_ids=random_ids(3, seed=20), past_key_values=static)
        with pytest.raises(ValueError, match="StaticWeightedCache is full"):  # the window layer 0 runs first
            model(input_ids=random_ids(1, seed=21), past_key_values=static)


@pytest.mark.slow
def test_compiled_decode_over_windows_is_one_graph_and_equals_eager():
    """Gemma 3's sliding layers in the static cache need no host counter: one graph for 2 x window steps."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = gemma()
    ids, question = random_ids(CONTEXT, seed=12), random_ids(5, seed=13)
    cache = prefill(model, press(), ids)
    full = torch.cat([ids, question], 1)
    config = CompileConfig(fullgraph=True, dynamic=False, backend="inductor", mode="default")
    config._compile_all_devices = True
    kwargs = dict(max_new_tokens=2 * WINDOW, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        expected = model.generate(full, past_key_values=copy.deepcopy(cache), pad_token_id=0, **kwargs)
        static = StaticWeightedCache.from_compressed(cache, max_new_tokens=2 * WINDOW + 8)
        out = model.generate(full, past_key_values=static, pad_token_id=0, compile_config=config, **kwargs)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert torch.equal(out.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(expected.logits), rtol=1e-4, atol=1e-4)
