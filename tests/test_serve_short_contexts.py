"""``--compress-min-tokens``: a context shorter than the threshold (a system prompt, a short chat history) is stored
whole, never compressed; longer ones are compressed as before, and 0 compresses every context (kvpress's
pipeline). A tiny random model and an engine in this process (fast); a real server with the embedded model (slow)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from tests.serve_helpers import running_server
from tests.tiny_models import tiny_model


@torch.no_grad()
def test_a_context_under_the_threshold_is_stored_whole_and_a_longer_one_compressed():
    """The default press at 25% kept, threshold 100: a 60-token context is stored as the plain prefill stores it
    (every row, equal keys and values; the scheduler's estimate reserves all 60 rows), a 300-token one compressed;
    with threshold 0 the 60-token one is compressed too. A threshold below 0 is refused naming the flag."""
    from kvcompress.cache import WeightedLayer
    from kvcompress.hf_attention import use_weighted_attention
    from kvcompress.registry import make_press
    from kvcompress.serve.jobs import Job
    from tests.test_serve_prefill_chunks import _engine

    model = tiny_model("llama", seed=2)
    use_weighted_attention(model)
    g = torch.Generator().manual_seed(6)
    short, long = (torch.randint(0, 256, (n,), generator=g).tolist() for n in (60, 300))
    plain = DynamicCache()
    model.model(input_ids=torch.tensor([short]), past_key_values=plain)

    def engine(threshold: int):
        return _engine(model, make_press("compresskv", 0.75, 0), compress_min_tokens=threshold)

    kept, every = engine(100), engine(0)
    try:
        whole = kept.context_cache(short)
        for layer, reference in zip(whole.layers, plain.layers, strict=True):
            assert not isinstance(layer, WeightedLayer) and layer.keys.shape[-2] == 60
            torch.testing.assert_close(layer.keys, reference.keys, rtol=0, atol=0)
            torch.testing.assert_close(layer.values, reference.values, rtol=0, atol=0)
        assert kept.scheduler._estimate(Job(short, [1], max_tokens=3), peek=True)[0] == (60 + 1 + 2,)
        assert kept.scheduler._estimate(Job(long, [1], max_tokens=3), peek=True)[0] == (75 + 1 + 2,)
        assert all(layer.keys.shape[-2] < 300 for layer in kept.context_cache(long).layers)
        assert all(layer.keys.shape[-2] < 60 for layer in every.context_cache(short).layers)
        assert (kept.metrics.short_contexts._value.get(), every.metrics.short_contexts._value.get()) == (1, 0)
    finally:
        kept.shutdown()
        every.shutdown()
    with pytest.raises(ValueError, match=r"^--compress-min-tokens: must be an integer >= 0, got -1"):
        engine(-1)


@pytest.mark.slow
def test_a_server_keeps_a_short_chat_whole_and_answers_as_the_uncompressed_model(embedded_dir, tmp_path):
    """The default server (the default press at 25% kept, ``--compress-min-tokens`` 256): a 3-turn chat whose context
    is about 50 tokens is stored whole (resident bytes = its uncompressed bytes; the log says why) and answered as
    the model answers the same tokens with no cache compressed (greedy, float32, one thread). Compressed at 25% kept,
    this chat's context lost the number it asks for (the forty-fifth session's probe)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvcompress.serve.protocol import Message, chat_split
    from tests.test_serve import client, metric

    chat = [{"role": "user", "content": "Remember the number 7342."},
            {"role": "assistant", "content": "Got it, 7342."},
            {"role": "user", "content": "Which number did I ask you to remember?"}]  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(embedded_dir)
    context_ids, question_ids = chat_split(tokenizer, [Message(**m) for m in chat])
    assert 20 < len(context_ids) < 256
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([context_ids + question_ids]), max_new_tokens=12, do_sample=False)
    expected = tokenizer.decode(out[0, len(context_ids) + len(question_ids):], skip_special_tokens=True)
    log_path = tmp_path / "server.log"
    with running_server(["--log-level", "info"], log_path) as base:
        reply = client(base).chat.completions.create(model="SmolLM2-135M-Instruct", messages=chat, temperature=0,
                                                     max_tokens=12)
        assert reply.choices[0].message.content == expected
        resident = metric(base, "kvcompress_cache_resident_bytes")
        assert resident > 0 and resident == metric(base, "kvcompress_cache_uncompressed_bytes")
    assert f"{len(context_ids)} context tokens -> {len(context_ids)} rows" in log_path.read_text()
    assert "kept whole: under --compress-min-tokens 256" in log_path.read_text()
