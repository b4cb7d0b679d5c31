"""SmolLM2-135M-Instruct (the embedded model) on 1k-token pydoc_data.topics contexts. Slow; CI runs them."""

from __future__ import annotations

import statistics

import pytest
import torch
from transformers import pipeline

from kvcompress import CompressKVPress, UniformPress
from kvcompress.fidelity.contexts import build_contexts
from kvcompress.fidelity.measure import continuation_kl, continuation_logprobs, layer_errors, prefill
from kvcompress.fidelity.probes import QueryRecorder
from kvcompress.models import load_model
from kvcompress.registry import make_press

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_and_contexts(embedded_dir):
    model, tokenizer = load_model(str(embedded_dir))
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    contexts = build_contexts(pipe, ["prose"], [1024], seeds=3, continuation=48, seed=7)
    return model, contexts


def test_continuation_kl_falls_as_kept_fraction_grows(model_and_contexts):
    model, contexts = model_and_contexts
    kl = {0.25: [], 0.5: [], 0.9: []}
    for index, ctx in enumerate(contexts[:2]):
        cache, _ = prefill(model, None, ctx.ids)
        exact = continuation_logprobs(model, cache, ctx.ids.shape[1], ctx.continuation)
        for kept in kl:
            press = CompressKVPress(compression_ratio=1 - kept, seed=index)
            cache, _ = prefill(model, press, ctx.ids)
            approx = continuation_logprobs(model, cache, ctx.ids.shape[1], ctx.continuation)
            kl[kept].append(continuation_kl(exact, approx))
    means = {kept: statistics.mean(values) for kept, values in kl.items()}
    assert means[0.25] > means[0.5] > means[0.9] > 0, means


def test_attention_error_lower_than_uniform_subset_of_same_size(model_and_contexts):
    model, contexts = model_and_contexts
    ours, uniform = [], []
    for index, ctx in enumerate(contexts):
        recorder = QueryRecorder(model, last=64)
        full, _ = prefill(model, None, ctx.ids)
        recorder.remove()
        for press, errors in (
            # the same rows in every layer as the uniform subset (no calibrated layers: layer by layer)
            (CompressKVPress(compression_ratio=0.75, sink_size=32, window_size=32, seed=index, retrieval_layers=(),
                             full_layers=()), ours),
            (UniformPress(compression_ratio=0.75, sink_size=32, window_size=32, seed=index), uniform),
        ):
            cache, _ = prefill(model, press, ctx.ids)
            assert all(layer.keys.shape[-2] <= int(ctx.ids.shape[1] * 0.25) for layer in cache.layers)
            errors += layer_errors(model, full, cache, recorder.queries)
    assert len(ours) == len(uniform) == 3 * model.config.num_hidden_layers
    assert statistics.mean(ours) < statistics.mean(uniform), (statistics.mean(ours), statistics.mean(uniform))


def test_one_line_chat_prompts_stay_close_to_the_full_cache(embedded_dir):
    """A one-line chat prompt (35-37 tokens with the template) at 25% kept: the default's teacher-forced KL over the
    full cache's 24-token answer stays well under StreamingLLM's (measured 0.15 against 0.48 on these four). Without
    its first token (a budget of 8 rows once split 0 sink + 4 window) it was 1.6 (0.48): answers empty or looping."""
    model, tokenizer = load_model(str(embedded_dir))
    ours, streaming = [], []
    for prompt in ("Tell a long story.", "Write a poem about the sea.", "Explain how a rainbow forms.",
                   "Count from one to fifty."):  # fmt: skip
        chat = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]  # transformers 5 returns a BatchEncoding
        with torch.no_grad():
            answer = model.generate(ids, max_new_tokens=24, do_sample=False)[:, ids.shape[1] :]
        cache, _ = prefill(model, None, ids)
        exact = continuation_logprobs(model, cache, ids.shape[1], answer)
        presses = ((CompressKVPress(compression_ratio=0.75), ours), (make_press("streamingllm", 0.75), streaming))
        for press, kl in presses:
            cache, _ = prefill(model, press, ids)
            approx = continuation_logprobs(model, cache, ids.shape[1], answer)
            kl.append(continuation_kl(exact, approx))
    assert statistics.mean(ours) < 0.5 * statistics.mean(streaming), (ours, streaming)
