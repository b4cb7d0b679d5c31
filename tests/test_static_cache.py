"""The static compressed cache (kvcompress.static_cache): same tokens and logits as the dynamic compressed cache
through generate (padded batches too) and the kvpress pipeline, one compiled graph for every decode step, and a
clear error past its preallocated rows (tiny models, CPU).

Tolerance: both caches run the same float32 reference math over the same visible rows; they differ only in the
summation order (the static buffers carry masked empty rows, so the matmuls block differently). Each attention
output then differs by a few float32 ulps times the number of summed rows (<= ~300 here: ~4e-5 relative at worst),
and logits of these tiny models are O(1), hence rtol = atol = 1e-4 on logits and exact greedy tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache
from transformers.generation.configuration_utils import CompileConfig

from kvcompress import CompressKVPress, UniformPress
from kvcompress.cache import cache_bytes
from kvcompress.padding import pad_rows
from kvcompress.static_cache import StaticWeightedCache, StaticWeightedLayer
from tests.test_padding import answer, prefill, random_ids
from tests.test_pipeline import QUESTIONS, setup  # noqa: F401  (its fixture: a tiny model with a real tokenizer)
from tests.tiny_models import tiny_model

PRESSES = {
    "default": lambda: CompressKVPress(compression_ratio=0.75, seed=0),
    "paper": lambda: CompressKVPress.paper(0.75, seed=0),
    "uniform": lambda: UniformPress(compression_ratio=0.75, seed=0),
}
TOL = dict(rtol=1e-4, atol=1e-4)


def compile_config() -> CompileConfig:
    """generate's compiled decode on CPU: inductor, full graph (a graph break raises)."""
    config = CompileConfig(fullgraph=True, dynamic=False, backend="inductor", mode="default")
    config._compile_all_devices = True  # generate compiles only on CUDA/XPU otherwise
    return config


@pytest.mark.parametrize("name", list(PRESSES))
@pytest.mark.parametrize("padded", [False, True])
def test_generate_on_static_cache_equals_dynamic(name, padded):
    model = tiny_model("llama")
    contexts = [random_ids(n, seed=n) for n in ((300, 40, 170) if padded else (260,))]
    ids, mask = pad_rows(contexts, "left") if padded else (contexts[0], None)
    question = random_ids(5, seed=99).expand(len(contexts), -1)
    cache = prefill(model, PRESSES[name](), ids, mask)
    tokens, logits = answer(model, copy.deepcopy(cache), ids, mask, question)
    static = StaticWeightedCache.from_compressed(cache, max_new_tokens=16)
    assert static.is_compileable and all(isinstance(layer, StaticWeightedLayer) for layer in static.layers)
    static_tokens, static_logits = answer(model, static, ids, mask, question)
    assert torch.equal(static_tokens, tokens)
    torch.testing.assert_close(static_logits, logits, **TOL)
    assert static.get_seq_length() == cache.get_seq_length() + question.shape[1] + tokens.shape[1] - 1


def test_press_freezes_an_empty_static_cache():
    """Passing StaticWeightedCache(max_new_tokens) to the prefill: the press compresses, then makes it static."""
    model = tiny_model("qwen2")
    ids = random_ids(240, seed=4)
    cache = StaticWeightedCache(max_new_tokens=16)
    with torch.no_grad(), PRESSES["default"]()(model):
        model.model(input_ids=ids, past_key_values=cache)
    assert cache.is_compileable
    reference = prefill(model, PRESSES["default"](), ids)
    question = random_ids(4, seed=5)
    tokens, logits = answer(model, cache, ids, None, question)
    expected = answer(model, reference, ids, None, question)
    assert torch.equal(tokens, expected[0])
    torch.testing.assert_close(logits, expected[1], **TOL)
    assert "compressed: 2 layers" in repr(cache) and cache_bytes(cache) > cache_bytes(reference)


def test_capacity_beyond_int32_or_memory_is_refused_and_the_cache_put_back():
    """``max_new_tokens`` past what a static layer indexes is refused when built (2**63 once passed, then failed
    inside torch); within it but past memory, the press's prefill is refused naming ``max_new_tokens`` (it was the
    CPU allocator's error) and the cache is put back empty, as it was. A static cache no press froze (nothing to
    compress) says so when asked what remains, instead of reporting rows it does not limit."""
    for rows in (2**31, 2**63):
        with pytest.raises(ValueError, match=r"^max_new_tokens: must be an int in \[1, 2147483647\]"):
            StaticWeightedCache(rows)
    model = tiny_model("qwen2")
    cache = StaticWeightedCache(max_new_tokens=2**30)  # 2 KV heads x 16 x fp32 x (K, V): 256 GiB a layer
    with pytest.raises(ValueError, match=r"^max_new_tokens: 1073741824 preallocated rows per layer do not fit"):
        with torch.no_grad(), PRESSES["default"]()(model):
            model.model(input_ids=random_ids(240, seed=4), past_key_values=cache)
    assert type(cache) is StaticWeightedCache and cache.get_seq_length() == 0 and not cache.layers
    assert cache.remaining() == 2**30
    with torch.no_grad(), CompressKVPress(compression_ratio=0.0)(model):
        model.model(input_ids=random_ids(40, seed=4), past_key_values=cache)
    with pytest.raises(ValueError, match="^cache: this StaticWeightedCache was never made static"):
        cache.remaining()


def test_compiled_decode_is_one_full_graph_and_equals_eager():
    """generate with a static compressed cache compiles its decode step (inductor, fullgraph=True: a graph break
    would raise) and gives the eager dynamic cache's tokens and logits."""
    torch._dynamo.reset()
    model = tiny_model("llama", num_hidden_layers=1)
    ids, question = random_ids(200, seed=1), random_ids(3, seed=2)
    cache = prefill(model, PRESSES["default"](), ids)
    expected = answer(model, copy.deepcopy(cache), ids, None, question)
    static = StaticWeightedCache.from_compressed(cache, max_new_tokens=16)
    full = torch.cat([ids, question], 1)
    with torch.no_grad():
        out = model.generate(
            full, past_key_values=static, max_new_tokens=6, do_sample=False, output_logits=True,
            return_dict_in_generate=True, pad_token_id=0, compile_config=compile_config(),
        )  # fmt: skip
    assert hasattr(model, "_compiled_call")  # generate took the compiled path
    assert torch.equal(out.sequences[:, full.shape[1] :], expected[0])
    torch.testing.assert_close(torch.stack(out.logits, 1), expected[1], **TOL)


def test_decode_step_has_no_graph_break():
    """torch._dynamo.explain of one decode step over the static cache: one graph, no break."""
    torch._dynamo.reset()
    model = tiny_model("llama", num_hidden_layers=1)
    ids = random_ids(120, seed=3)
    static = StaticWeightedCache.from_compressed(prefill(model, PRESSES["uniform"](), ids), max_new_tokens=4)
    position = torch.tensor([ids.shape[1]])
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(
            input_ids=random_ids(1, seed=4), past_key_values=static, cache_position=position,
            position_ids=position[None], use_cache=True,
        )  # fmt: skip
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons


def test_writing_past_the_preallocated_rows_raises():
    model = tiny_model("llama")
    ids = random_ids(150, seed=6)
    static = StaticWeightedCache.from_compressed(prefill(model, PRESSES["default"](), ids), max_new_tokens=4)
    assert static.remaining() == 4
    with torch.no_grad():
        model(input_ids=random_ids(4, seed=7), past_key_values=static)  # exactly fills it
        assert static.remaining() == 0
        with pytest.raises(ValueError, match="StaticWeightedCache is full.*max_new_tokens"):
            model(input_ids=random_ids(1, seed=8), past_key_values=static)
    static.crop(ids.shape[1])  # back to the context: the rows are free again
    assert static.remaining() == 4 and static.get_seq_length() == ids.shape[1]
    with pytest.raises(ValueError, match="max_new_tokens: must be an int"):
        StaticWeightedCache(max_new_tokens=0)
    with pytest.raises(ValueError, match="cache: from_compressed takes a cache a kvcompress press has compressed"):
        StaticWeightedCache.from_compressed(DynamicCache(), max_new_tokens=4)
    with pytest.raises(ValueError, match="cache: from_compressed copies a dynamic compressed cache; this one is"):
        StaticWeightedCache.from_compressed(static, max_new_tokens=8)  # would share its buffers and keep 4 rows


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3's first layer is a static window layer
def test_beam_search_and_several_sequences_are_refused_by_name(family):
    """``generate`` expands the prompt (not the cache) for beams and several sequences per prompt: the cache's
    first layer refuses the wider batch with the option's name, and the cache is left as it was."""
    model = tiny_model(family)
    ids = random_ids(150, seed=6)
    static = StaticWeightedCache.from_compressed(prefill(model, PRESSES["default"](), ids), max_new_tokens=8)
    prompt = torch.cat([ids, random_ids(3, seed=7)], 1)
    for options in (dict(num_beams=2), dict(do_sample=True, num_return_sequences=2)):
        with torch.no_grad(), pytest.raises(ValueError, match="^num_beams: a static compressed cache holds 1 batch"):
            model.generate(prompt, attention_mask=torch.ones_like(prompt), past_key_values=static, max_new_tokens=2,
                           **options)  # fmt: skip
        assert static.remaining() == 8 and static.get_seq_length() == ids.shape[1]


@pytest.mark.slow  # an inductor compile (~15-35 s on the shared CPU); CI runs it
def test_compiled_step_past_the_preallocated_rows_raises():
    """Inside an inductor-compiled step the capacity check is a device-side assertion with the same message."""
    torch._dynamo.reset()
    model = tiny_model("llama", num_hidden_layers=1)
    ids = random_ids(150, seed=12)
    static = StaticWeightedCache.from_compressed(prefill(model, PRESSES["default"](), ids), max_new_tokens=2)
    step = torch.compile(model.forward, fullgraph=True, dynamic=False)
    position = torch.tensor([ids.shape[1]])
    with torch.no_grad():
        for i in range(2):
            step(input_ids=random_ids(1, seed=i), past_key_values=static, cache_position=position + i,
                 position_ids=(position + i)[None], use_cache=True)  # fmt: skip
        with pytest.raises(RuntimeError, match="StaticWeightedCache is full.*max_new_tokens"):
            step(input_ids=random_ids(1, seed=2), past_key_values=static, cache_position=position + 2,
                 position_ids=(position + 2)[None], use_cache=True)  # fmt: skip


def test_crop_back_restarts_the_clip_range_and_reuses_rows():
    """Answering twice after cutting back to the context gives the same as answering once (pipeline pattern)."""
    model = tiny_model("llama")
    ids = random_ids(200, seed=9)
    static = StaticWeightedCache.from_compressed(prefill(model, PRESSES["default"](), ids), max_new_tokens=12)
    first = answer(model, static, ids, None, random_ids(4, seed=10))
    lengths = [static.get_seq_length(i) for i in range(len(static.layers))]
    static.crop(ids.shape[1])
    answer(model, static, ids, None, random_ids(4, seed=11))
    for i, layer in enumerate(static.layers):  # kvpress's pipeline cuts back by slicing the keys
        layer.keys, layer.values = layer.keys[:, :, : lengths[i] - 9], layer.values[:, :, : lengths[i] - 9]
    again = answer(model, static, ids, None, random_ids(4, seed=10))
    assert torch.equal(first[0], again[0])
    torch.testing.assert_close(first[1], again[1], **TOL)


def test_pipeline_with_a_static_cache_answers_as_with_the_dynamic_one(setup):  # noqa: F811
    """kvpress's pipeline, two questions on one context: the press makes the passed cache static after the prefill,
    the pipeline cuts it back between questions, and the answers are the dynamic cache's."""
    _, _, pipe, context = setup
    press = CompressKVPress(compression_ratio=0.6, seed=0)
    dynamic = pipe(context, questions=QUESTIONS, press=press, max_new_tokens=10)["answers"]
    cache = StaticWeightedCache(max_new_tokens=64)
    static = pipe(context, questions=QUESTIONS, press=press, max_new_tokens=10, cache=cache)["answers"]
    assert static == dynamic and cache.is_compileable


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and the compiled Triton kernel need CUDA")
def test_cuda_graph_decode_runs_the_kernel_and_equals_eager():
    """On CUDA: generate's decode compiled with mode="reduce-overhead" (CUDA graphs) over the static cache runs
    the Triton kernel with its causal offset read on the device, and gives the eager dynamic cache's tokens."""
    torch._dynamo.reset()
    model = tiny_model("llama").cuda()
    ids, question = random_ids(300, seed=14).cuda(), random_ids(4, seed=15).cuda()
    cache = prefill(model, PRESSES["default"](), ids)
    expected = answer(model, copy.deepcopy(cache), ids, None, question)
    static = StaticWeightedCache.from_compressed(cache, max_new_tokens=16)
    config = CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead")
    full = torch.cat([ids, question], 1)
    with torch.no_grad():
        out = model.generate(
            full, past_key_values=static, max_new_tokens=6, do_sample=False, output_logits=True,
            return_dict_in_generate=True, pad_token_id=0, compile_config=config,
        )  # fmt: skip
    assert torch.equal(out.sequences[:, full.shape[1] :], expected[0])
    torch.testing.assert_close(torch.stack(out.logits, 1), expected[1], **TOL)
