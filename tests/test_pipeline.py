"""The kvpress pipeline and model.generate agree on a compressed cache (tiny model, real tokenizer)."""

from __future__ import annotations

import pydoc_data.topics

import pytest
import torch
from transformers import AutoTokenizer, DynamicCache, pipeline

from kvcompress import CompressKVPress, UniformPress
from kvcompress.cache import WeightedLayer
from tests.tiny_models import tiny_model

QUESTIONS = ["What does the assert statement do?", "How are augmented assignments written?"]


@pytest.fixture(scope="module")
def setup(embedded_dir):
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    model = tiny_model("llama", vocab_size=len(tokenizer), seed=3, initializer_range=0.3)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    context = pydoc_data.topics.topics["assert"] + pydoc_data.topics.topics["assignment"][:1500]
    return model, tokenizer, pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer), context


@pytest.mark.parametrize(
    "press", [CompressKVPress(compression_ratio=0.6, seed=0), UniformPress(compression_ratio=0.6, seed=0)]
)
def test_multiple_questions_equal_single_questions(setup, press):
    _, _, pipe, context = setup
    together = pipe(context, questions=QUESTIONS, press=press, max_new_tokens=10)["answers"]
    alone = [pipe(context, question=q, press=press, max_new_tokens=10)["answer"] for q in QUESTIONS]
    assert together == alone
    assert all(answer.strip() for answer in together) and together[0] != together[1]
    exact = pipe(context, questions=QUESTIONS, max_new_tokens=10)["answers"]
    assert exact != together  # the press changed something


def test_generate_on_compressed_cache_equals_pipeline_answer(setup):
    model, tokenizer, pipe, context = setup
    press = CompressKVPress(compression_ratio=0.6, seed=1)
    answer = pipe(context, question=QUESTIONS[0], press=press, max_new_tokens=10)["answer"]
    inputs = pipe.preprocess(context, [QUESTIONS[0]], answer_prefix="", max_context_length=10**6)
    context_ids, question_ids = inputs["context_ids"], inputs["questions_ids"][0]
    cache = DynamicCache()
    with torch.no_grad():
        with press(model):
            model.model(input_ids=context_ids, past_key_values=cache)
        assert all(isinstance(layer, WeightedLayer) for layer in cache.layers)
        prompt = torch.cat([context_ids, question_ids], dim=1)
        out = model.generate(prompt, past_key_values=cache, max_new_tokens=10, do_sample=False)
    assert tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True) == answer
    assert answer.strip()


def test_pipeline_over_several_contexts_equals_each_alone(setup):
    _, _, pipe, context = setup
    contexts = [context, pydoc_data.topics.topics["if"] + pydoc_data.topics.topics["while"]]
    press = CompressKVPress(compression_ratio=0.6, seed=0)
    together = pipe(contexts, question=QUESTIONS[0], press=press, max_new_tokens=8)
    alone = [pipe(c, question=QUESTIONS[0], press=press, max_new_tokens=8) for c in contexts]
    assert [r["answer"] for r in together] == [r["answer"] for r in alone]


@pytest.mark.parametrize("wrapper", ["composed", "prefill-decoding"])
def test_wrapper_presses_are_refused_before_anything_runs(setup, wrapper):
    from kvpress import ComposedPress, DecodingPress, KnormPress, PrefillDecodingPress

    model, _, pipe, context = setup
    ours = CompressKVPress(compression_ratio=0.5, seed=0)
    if wrapper == "composed":
        press, name = ComposedPress([ours, KnormPress(compression_ratio=0.5)]), "ComposedPress"
    else:
        decoding = DecodingPress(base_press=KnormPress(), compression_interval=2, target_size=130)
        press, name = PrefillDecodingPress(prefilling_press=ours, decoding_press=decoding), "PrefillDecodingPress"
    calls = []
    hook = model.model.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError, match=f"^press: CompressKVPress cannot run inside {name}"):
            pipe(context, question=QUESTIONS[0], press=press, max_new_tokens=4)
        cache = DynamicCache()
        with pytest.raises(ValueError, match=f"cannot run inside {name}"), press(model):
            model.model(input_ids=torch.ones(1, 8, dtype=torch.long), past_key_values=cache)
    finally:
        hook.remove()
    assert not calls and not cache.layers  # refused before any forward ran


def test_eviction_after_compression_is_refused_without_touching_the_cache(setup):
    from kvpress import DecodingPress, KnormPress

    model, tokenizer, pipe, context = setup
    ids = tokenizer(context, return_tensors="pt").input_ids[:, :400]
    cache = DynamicCache()
    with torch.no_grad(), CompressKVPress(compression_ratio=0.5, reference=("window",))(model):
        model.model(input_ids=ids, past_key_values=cache)
    rows = [layer.keys.shape[-2] for layer in cache.layers]
    decoding = DecodingPress(base_press=KnormPress(), compression_interval=1, target_size=rows[0] + 1)
    with pytest.raises(RuntimeError, match="removed rows of a compressed cache layer"), torch.no_grad():
        with decoding(model):
            model.generate(torch.cat([ids, ids[:, :3]], 1), past_key_values=cache, max_new_tokens=4)
    assert all(isinstance(layer, WeightedLayer) for layer in cache.layers)
    assert all(layer.keys.shape[-2] >= layer.context_rows for layer in cache.layers)
