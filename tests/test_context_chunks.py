"""A context read in chunks under a press (kvcompress.context_chunks) gives the cache one call under it gives."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import DynamicCache

from kvcompress import CompressKVPress, UniformPress, hf_attention
from kvcompress.context_chunks import prefill_in_chunks
from tests.tiny_models import tiny_model

# float64: the chunked and the one-call forward differ only in the order of their sums, so every kept row, weight
# and clip bound agrees to a few units of float64 rounding of values of order 1-10
ATOL = 1e-10
# The paper's Nystrom weights divide by the pivots' residual kernel diagonals, which RPNys takes down to 1e-12 in
# float64 (kvcompress.nystrom._EXHAUSTED): the inputs' rounding (~1e-16) may grow up to 1e-4 in its weighted values
# and weights (2.4e-10 seen); the rows it picks (the keys) still agree within ATOL
NYSTROM_ATOL = 1e-4


def _model(family: str):
    overrides = {"sliding_window": 16} if family == "gemma3" else {}
    return tiny_model(family, dtype=torch.float64, seed=3, **overrides)


def _context(tokens: int, seed: int = 1, batch: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def _one_call(model, press, ids) -> DynamicCache:
    cache = DynamicCache()
    with press(model):
        model.model(input_ids=ids, past_key_values=cache)
    return cache


def _assert_same_cache(expected: DynamicCache, got: DynamicCache, weighted_atol: float = ATOL) -> None:
    assert len(expected.layers) == len(got.layers)
    for index, (a, b) in enumerate(zip(expected.layers, got.layers, strict=True)):
        assert type(a) is type(b), (index, type(a), type(b))
        assert a.keys.shape == b.keys.shape, (index, a.keys.shape, b.keys.shape)
        torch.testing.assert_close(b.keys, a.keys, rtol=0, atol=ATOL)
        torch.testing.assert_close(b.values, a.values, rtol=0, atol=weighted_atol)
        if hasattr(a, "row_weights"):
            torch.testing.assert_close(b.row_weights, a.row_weights, rtol=0, atol=weighted_atol)
            torch.testing.assert_close(b.value_min, a.value_min, rtol=0, atol=ATOL)
            torch.testing.assert_close(b.value_max, a.value_max, rtol=0, atol=ATOL)


PRESSES = {
    "default": lambda: CompressKVPress(compression_ratio=0.5, seed=0),
    "window": lambda: CompressKVPress(compression_ratio=0.75, reference=("window",), seed=0),
    "hybrid": lambda: CompressKVPress(compression_ratio=0.75, selection="hybrid", fit="none", seed=0),
    "paper": lambda: CompressKVPress.paper(compression_ratio=0.5, seed=0),
    "uniform": lambda: UniformPress(compression_ratio=0.5, seed=0),
}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("press_name", list(PRESSES))
def test_a_context_read_in_chunks_keeps_the_one_call_cache(family, press_name, monkeypatch):
    """Chunks of 1, 7, 64 and 299 tokens of a 300-token context (the window's 64 queries spread over several calls,
    a last call of one token) against one call: every layer's rows, weights and clip range within float64
    rounding; the chunk calls after the first hand their queries' normalisers over from their own attention
    (no query projection or attention pass of the press's own). gemma3: 16-token sliding layers, which every chunk
    crosses."""
    model, ids = _model(family), _context(300)
    press = PRESSES[press_name]()
    expected = _one_call(model, press, ids)
    handed = []
    real = hf_attention.split_at_context

    def spy(*args, **kwargs):
        handed.append(args[0].shape[-2])
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_attention, "split_at_context", spy)
    for chunk in (1, 7, 64, 299):
        handed.clear()
        _assert_same_cache(expected, prefill_in_chunks(model, press, ids, chunk),
                           NYSTROM_ATOL if press_name == "paper" else ATOL)  # fmt: skip
        if press.chunk_tail_rows() > 1 or "induction" in press.reference_sources():
            full_layers = sum(getattr(layer.self_attn, "sliding_window", None) is None for layer in model.model.layers)
            later_calls = [size for size in [chunk] * (300 // chunk) + [300 % chunk] if size >= 2][1:]
            assert sorted(handed) == sorted(later_calls * full_layers)


def test_without_handed_rows_the_press_reads_the_chunks_queries_itself(monkeypatch):
    """Where a call's attention hands nothing over (another attention path), each chunk's queries are projected
    and their causal normalisers computed over the cache: the same cache as one call."""
    model, ids = _model("llama"), _context(200, seed=4)
    press = CompressKVPress(compression_ratio=0.5, seed=0)
    expected = _one_call(model, press, ids)
    monkeypatch.setattr(hf_attention, "_causal_prefill_with_lse", lambda *args: None)
    _assert_same_cache(expected, prefill_in_chunks(model, press, ids, 48))


def test_generate_with_prefill_chunks_answers_as_one_call():
    """``model.generate(..., prefill_chunk_size=C)`` inside ``press.context_in_chunks(n)``: the same greedy tokens
    and the same compressed context as generate's one-call prefill under the press (the default, and ``thorough()``,
    whose repeat pass runs at the end of the last chunk's call). Without it the press would see a
    first chunk as the whole context (kvpress's own presses do) and keep the rest uncompressed."""
    model, ids = _model("llama"), _context(240, seed=6)
    press = CompressKVPress(compression_ratio=0.5, seed=0)
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    plain = [model.generate(ids, past_key_values=DynamicCache(), **options, **chunking).past_key_values.layers[0].keys
             for chunking in ({}, {"prefill_chunk_size": 50})]  # fmt: skip
    if (plain[0] - plain[1]).abs().max() > ATOL:  # runs where transformers' own chunked prefill is right (4.57)
        pytest.skip(f"transformers {transformers.__version__}: generate(prefill_chunk_size=...) gives every chunk the "
                    "last chunk's positions without any press (huggingface/transformers#43082)")  # fmt: skip
    with press(model):
        whole = model.generate(ids, past_key_values=DynamicCache(), **options)
    reading = press.context_in_chunks(ids.shape[1])
    with press(model), reading:
        chunked = model.generate(ids, past_key_values=DynamicCache(), prefill_chunk_size=50, **options)
    assert reading.done
    assert torch.equal(chunked.sequences, whole.sequences)
    with press(model):  # without the reading: the first chunk is compressed as if it were the context
        first_only = model.generate(ids, past_key_values=DynamicCache(), prefill_chunk_size=50, **options)
    assert first_only.past_key_values.layers[0].keys.shape[-2] == 25 + 190 + 5  # rows: 50 -> 25, then whole
    for a, b in zip(whole.past_key_values.layers, chunked.past_key_values.layers, strict=True):
        assert a.keys.shape == b.keys.shape and a.keys.shape[-2] < 240  # compressed, then 5 decoded rows
        torch.testing.assert_close(b.keys, a.keys, rtol=0, atol=ATOL)
        torch.testing.assert_close(b.row_weights, a.row_weights, rtol=0, atol=ATOL)
    thorough = CompressKVPress.thorough(compression_ratio=0.5, seed=0, repeat_chunk=64)  # its pass after the last chunk
    with thorough(model):
        whole = model.generate(ids, past_key_values=DynamicCache(), **options)
    with thorough(model), thorough.context_in_chunks(ids.shape[1]):
        chunked = model.generate(ids, past_key_values=DynamicCache(), prefill_chunk_size=50, **options)
    assert torch.equal(chunked.sequences, whole.sequences)
    for a, b in zip(whole.past_key_values.layers, chunked.past_key_values.layers, strict=True):
        torch.testing.assert_close(b.keys, a.keys, rtol=0, atol=ATOL)


def test_a_question_after_the_chunks_is_read_as_after_one_call():
    """The calls after the context (a question, then decoding) run under the weighted attention as after a one-call
    prefill: the question's logits agree."""
    model, ids = _model("llama"), _context(260, seed=8)
    question = _context(9, seed=9)
    press = CompressKVPress(compression_ratio=0.5, seed=0)
    logits = []
    for cache in (_one_call(model, press, ids), prefill_in_chunks(model, press, ids, 100)):
        positions = torch.arange(260, 269).unsqueeze(0)
        logits.append(model(input_ids=question, past_key_values=cache, position_ids=positions).logits)
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=ATOL)


def test_refusals_name_the_reason_and_leave_the_cache_empty():
    model = _model("llama")
    press = CompressKVPress(compression_ratio=0.5, seed=0)
    with pytest.raises(ValueError, match="context_in_chunks: CompressKVPress reads reference=\\['context'\\]"):
        CompressKVPress(compression_ratio=0.5, reference=("window", "context")).context_in_chunks(100)
    with pytest.raises(ValueError, match="query_radius='queries'"):
        CompressKVPress.paper(compression_ratio=0.5, query_radius="queries").context_in_chunks(100)
    with pytest.raises(ValueError, match="tokens: must be an int >= 1, got 0"):
        press.context_in_chunks(0)
    with pytest.raises(ValueError, match="chunk_size: must be an int >= 1, got 0"):
        prefill_in_chunks(model, press, _context(10), 0)
    ids = _context(120)
    cache = DynamicCache()
    reading = press.context_in_chunks(100)
    with press(model), reading, pytest.raises(ValueError, match="a 120-token call after 0 of the context's 100"):
        model.model(input_ids=ids, past_key_values=cache)
    assert cache.get_seq_length() == 0
    reading = press.context_in_chunks(120)
    mask = torch.ones(1, 60, dtype=torch.long)
    mask[0, 0] = 0
    with press(model), reading, pytest.raises(ValueError, match="attention_mask: a context read in chunks has no"):
        model.model(input_ids=ids[:, :60], attention_mask=mask, past_key_values=cache)
    with press(model), press.context_in_chunks(120):
        model.model(input_ids=ids[:, :60], past_key_values=cache)
    with press(model), press.context_in_chunks(60):
        with pytest.raises(ValueError, match="the cache holds 60 tokens where 0"):
            model.model(input_ids=ids[:, 60:], past_key_values=cache)
    assert cache.get_seq_length() == 60
    with pytest.raises(ValueError, match="past_key_values: a context read in chunks needs one DynamicCache"):
        with press(model), press.context_in_chunks(120):
            model.model(input_ids=ids[:, :60], use_cache=False)


def test_a_failed_call_puts_the_cache_back_empty(monkeypatch):
    """A call that raises inside a layer (here the last call's compression) leaves the cache empty, not half
    compressed, and the reading refuses another call: the context must be read again."""
    model, ids = _model("llama"), _context(200, seed=2)
    press = CompressKVPress(compression_ratio=0.5, seed=0)
    cache = DynamicCache()
    reading = press.context_in_chunks(200)
    with press(model), reading:
        model.model(input_ids=ids[:, :150], past_key_values=cache)
    assert cache.get_seq_length() == 150
    monkeypatch.setattr(type(press), "compress_middle", lambda *args: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"), press(model), reading:
        model.model(input_ids=ids[:, 150:], past_key_values=cache)
    assert cache.get_seq_length() == 0 and reading.failed
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="a call of this context failed"), press(model), reading:
        pass
    _assert_same_cache(_one_call(model, press, ids), prefill_in_chunks(model, press, ids, 64))


def test_without_a_press_the_chunks_are_the_plain_calls():
    """``press`` None: the context in calls of 64 tokens, nothing compressed: the plain one-call cache."""
    model, ids = _model("llama"), _context(200, seed=3)
    whole = DynamicCache()
    model.model(input_ids=ids, past_key_values=whole)
    chunked = prefill_in_chunks(model, None, ids, 64)
    for a, b in zip(whole.layers, chunked.layers, strict=True):
        assert type(b) is type(a) and b.keys.shape == a.keys.shape == (1, 2, 200, 16)
        torch.testing.assert_close(b.keys, a.keys, rtol=0, atol=ATOL)
        torch.testing.assert_close(b.values, a.values, rtol=0, atol=ATOL)


def _read_deferred(model, press, ids, chunk: int) -> tuple[DynamicCache, object]:
    """The context of ``ids`` read in calls of ``chunk`` tokens with its compression deferred: (cache, reading)."""
    cache, n = DynamicCache(), ids.shape[1]
    reading = press.context_in_chunks(n, defer_compression=True)
    for start in range(0, n, chunk):
        with press(model), reading:
            positions = torch.arange(start, min(n, start + chunk)).unsqueeze(0)
            model.model(input_ids=ids[:, start : start + chunk], past_key_values=cache, position_ids=positions)
    return cache, reading


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("press_name", ["default", "paper", "uniform"])
def test_deferred_compression_keeps_the_one_call_cache(family, press_name):
    """``defer_compression=True``: the last call compresses no layer (each full-attention layer still holds the
    context's 300 rows, the sliding ones are cut to their window); ``compress_next`` then compresses them in layer
    order, one or two at a time, into the one-call cache; a call after the context is refused until the last one is
    compressed, and leaves the cache as it was."""
    model, ids = _model(family), _context(300, seed=5)
    press = PRESSES[press_name]()
    expected = _one_call(model, press, ids)
    cache, reading = _read_deferred(model, press, ids, 64)
    full = [i for i, layer in enumerate(model.model.layers) if getattr(layer.self_attn, "sliding_window", None) is None]
    assert reading.compressing and not reading.done and len(reading.waiting) == len(full)
    assert all(cache.layers[i].keys.shape[-2] == 300 and not hasattr(cache.layers[i], "row_weights") for i in full)
    question = _context(5, seed=6)
    with pytest.raises(ValueError, match=f"{len(full)} layers of the context are left to compress"):
        with press(model), reading:
            model.model(input_ids=question, past_key_values=cache, position_ids=torch.arange(300, 305)[None])
    assert all(layer.keys.shape[-2] <= 300 for layer in cache.layers)
    assert reading.compress_next() == len(full) - 1
    assert hasattr(cache.layers[full[0]], "row_weights")
    assert not any(hasattr(cache.layers[i], "row_weights") for i in full[1:])
    left = [reading.compress_next(2)]
    while left[-1]:
        left.append(reading.compress_next(2))
    assert left == [max(0, len(full) - 1 - 2 * k) for k in range(1, len(left) + 1)]
    assert reading.done and not reading.compressing and reading.compress_next() == 0
    _assert_same_cache(expected, cache, NYSTROM_ATOL if press_name == "paper" else ATOL)
    with press(model), reading:  # a call after the context: read as after one call
        model.model(input_ids=question, past_key_values=cache, position_ids=torch.arange(300, 305)[None])


def test_deferred_compression_that_fails_puts_the_cache_back_empty(monkeypatch):
    """A layer's compression that raises, a cache that grew before its layers were all compressed, or compressed
    values that are not finite: ``compress_next`` raises, the cache is put back empty and the reading refuses more."""
    model, ids = _model("llama"), _context(200, seed=7)
    press = CompressKVPress(compression_ratio=0.5, seed=0)
    cache, reading = _read_deferred(model, press, ids, 80)
    with pytest.raises(ValueError, match="layers: must be an int >= 1, got 0"):
        reading.compress_next(0)
    with monkeypatch.context() as patch:
        patch.setattr(type(press), "compress_middle", lambda *args: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            reading.compress_next()
    assert cache.get_seq_length() == 0 and reading.failed and not reading.compressing
    with pytest.raises(RuntimeError, match="a call of this context failed"):
        reading.compress_next()

    cache, reading = _read_deferred(model, press, ids, 80)
    assert reading.compress_next() == 1
    with press(model):  # a question outside the reading: the second layer grows to 203 rows
        model.model(input_ids=ids[:, :3], past_key_values=cache, position_ids=torch.arange(200, 203)[None])
    with pytest.raises(ValueError, match="layer 1 holds 203 rows where the context has 200"):
        reading.compress_next()
    assert cache.get_seq_length() == 0 and reading.failed

    cache, reading = _read_deferred(model, press, ids, 80)
    real = type(press).compress_middle

    def overflowing(*args):
        keys, values, weights = real(*args)
        return keys, values, weights.index_fill(-1, torch.tensor([0]), float("inf"))

    monkeypatch.setattr(type(press), "compress_middle", overflowing)
    assert reading.compress_next() == 1  # the flags are read after the last layer (one sync)
    with pytest.raises(ValueError, match="layer 0 compressed values: NaN or Inf after compression"):
        reading.compress_next()
    assert cache.get_seq_length() == 0 and reading.failed


REPEAT_PRESSES = {
    "thorough": lambda: CompressKVPress.thorough(compression_ratio=0.5, seed=0, repeat_chunk=48),
    "balanced": lambda: CompressKVPress.balanced(compression_ratio=0.5, seed=0, repeat_fraction=0.25, repeat_span=16),
    "kvzip": lambda: CompressKVPress.kvzip(compression_ratio=0.5, seed=0),
}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("press_name", list(REPEAT_PRESSES))
def test_a_repeat_pass_after_the_chunks_keeps_the_one_call_cache(family, press_name):
    """A press with a repeat pass (the whole context re-read, max-pooled: ``thorough()``, ``kvzip()``; the most novel
    quarter in pieces chosen from every layer's novelty: ``balanced()``): the context read in chunks of 7, 64 and 299
    tokens, the pass run after the last call (at its end, or deferred: one layer per ``compress_next`` inside the
    press's block) gives the one-call cache within float64 rounding. Llama: the pass layer by layer; gemma3 (16-token
    sliding layers): through the whole model before the first layer is compressed, as after one call."""
    model, ids = _model(family), _context(300, seed=12)
    press = REPEAT_PRESSES[press_name]()
    expected = _one_call(model, press, ids)
    for chunk in (7, 64, 299):
        _assert_same_cache(expected, prefill_in_chunks(model, press, ids, chunk))
    cache, reading = _read_deferred(model, press, ids, 64)
    full = [i for i, layer in enumerate(model.model.layers) if getattr(layer.self_attn, "sliding_window", None) is None]
    assert [state["module"].layer_idx for _, state in reading.waiting] == full
    assert all(not hasattr(cache.layers[i], "row_weights") and cache.layers[i].keys.shape[-2] == 300 for i in full)
    with pytest.raises(RuntimeError, match="reads reference 'repeat', a pass through the model's layers"):
        reading.compress_next()  # outside the press's block: refused, nothing changed
    assert not reading.failed and len(reading.waiting) == len(full)
    with press(model):
        while reading.compress_next():
            pass
    _assert_same_cache(expected, cache)


def test_a_repeat_pass_after_the_chunks_refuses_embeddings():
    """A repeat pass re-reads the context's token ids: a chunk given as embeddings is refused before any layer runs,
    the cache left empty."""
    press = CompressKVPress.thorough(compression_ratio=0.5, seed=0)
    model, ids, cache = _model("llama"), _context(100, seed=13), DynamicCache()
    embeds = model.model.embed_tokens(ids[:, :50])
    with pytest.raises(ValueError, match="input_ids: CompressKVPress with reference 'repeat' reads the context's"):
        with press(model), press.context_in_chunks(100):
            model.model(inputs_embeds=embeds, past_key_values=cache)
    assert cache.get_seq_length() == 0
