"""The server reads a long new context in chunks between decode steps (``--prefill-chunk``, kvcompress.context_chunks):
the stored context, first-token logits and session rows of the one-call prefill; one chunk between two decode steps,
shorter requests passing it; a real server answering as without chunks."""

from __future__ import annotations

import re
import threading

import pytest
import torch

from tests.serve_helpers import running_server
from tests.test_serve_prefill_chunks import STORY, _engine, ask_greedy
from tests.tiny_models import tiny_model


def _engine_keeping_logits(model, chunk: int, method: str = "compresskv"):
    """An engine with ``method``'s press at 50% kept, every context compressed, ``chunk``-token chunks, and the list
    the logits of every token it samples are appended to."""
    from kvcompress.registry import make_press

    engine = _engine(model, make_press(method, 0.5, 0), prefill_chunk=chunk, compress_min_tokens=0)
    logits = []
    real_advance = engine.advance

    def advance(session, token, scores):
        logits.append(scores.clone())
        return real_advance(session, token, scores)

    engine.advance = advance
    return engine, logits


@pytest.mark.parametrize("family, method", [("llama", "compresskv"), ("gemma3", "compresskv"),
                                            ("llama", "compresskv_thorough"), ("gemma3", "compresskv_thorough")])
@torch.no_grad()
def test_a_context_read_in_chunks_gives_the_one_call_store_and_first_token(family, method):
    """A 300-token context and a 10-token question, on engines with 64-token chunks and with 512: the chunked one
    reads the context in 5 calls (64, ..., 300), compresses one full-attention layer a round after them (a round
    budget of 0 s: at least one layer), then reads the question; its stored context (every layer's rows, weights,
    clip range), first-token logits and session rows agree with the one-call engine's within float64 rounding
    (kvcompress.context_chunks: the same press on the same rows, sums in another order). gemma3: 16-token sliding
    layers. ``thorough()``: its repeat pass runs through one layer a round after the chunks (gemma3: through the
    whole model, in the first round)."""
    from kvcompress.hf_attention import use_weighted_attention
    from kvcompress.serve.jobs import Job

    overrides = {"sliding_window": 16} if family == "gemma3" else {}
    model = tiny_model(family, dtype=torch.float64, seed=3, **overrides)
    use_weighted_attention(model)
    g = torch.Generator().manual_seed(11)
    context = torch.randint(0, 256, (300,), generator=g).tolist()
    question = torch.randint(0, 256, (10,), generator=g).tolist()
    results = {}
    for chunk in (64, 512):
        engine, logits = _engine_keeping_logits(model, chunk, method)
        engine.compress_round_seconds = 0.0
        try:
            opening = engine.begin(Job(context, question, max_tokens=4, temperature=0))
            chunked = chunk == 64
            assert (opening.reading is not None) == chunked
            read = []
            while (session := engine.feed(opening, chunk)) is None:
                read.append(opening.reading.read if opening.reading is not None else ("question", opening.fed))
            stored = engine.stored(context).cache
            results[chunk] = (stored, logits[0], session)
            if chunked:
                full = sum(getattr(layer.self_attn, "sliding_window", None) is None for layer in model.model.layers)
                # the last context chunk, a round per layer's compression, then the question
                assert read == [64, 128, 192, 256] + [300] * full + [("question", 0)]
                assert opening.context_chunks == 5 and engine.metrics.context_chunks._value.get() == 5
                assert opening.compress_rounds == full
                assert opening.held_bytes == 0 and max(layer.keys.shape[-2] for layer in stored.layers) <= 150
        finally:
            engine.shutdown()
    (stored, logits, session), (stored_one, logits_one, session_one) = results[64], results[512]
    for mine, one in zip(stored.layers, stored_one.layers, strict=True):
        assert type(mine) is type(one)
        for name in ("keys", "values", "row_weights", "value_min", "value_max"):
            if hasattr(one, name):
                torch.testing.assert_close(getattr(mine, name), getattr(one, name), rtol=0, atol=1e-10)
    torch.testing.assert_close(logits, logits_one, rtol=0, atol=1e-10)
    assert session.position == session_one.position == 310 and session.need == session_one.need
    for mine, one in zip(session.rows, session_one.rows, strict=True):
        for name in ("keys", "values", "weights", "v_min", "v_max"):
            torch.testing.assert_close(getattr(mine, name), getattr(one, name), rtol=0, atol=1e-10)


@torch.no_grad()
def test_context_chunks_run_between_decode_steps_and_the_stored_context_serves_the_next_request():
    """16-token chunks: A (no context) decodes 40 tokens; E (a 10-token question) and B (a new 100-token context, a
    5-token question) arrive together after its first step, and B's context waits for the next round (E fed 10 of
    its 16 tokens), then is read in 7 chunks and compressed in 2 rounds (a layer a round: a round budget of 0 s), one
    call between two decode steps; C (a short question, no context), sent
    after B's second chunk, opens while B's context is read; D (B's context again, after it) takes the stored
    context: no context call of its own. The uncompressed rows B holds while its context is read count against the
    memory budget (``held_bytes``) until its last layer is compressed."""
    from kvcompress.registry import make_press
    from kvcompress.serve.jobs import Job

    model = tiny_model("llama", seed=5)
    engine = _engine(model, make_press("compresskv", 0.5, 0), prefill_chunk=16, compress_min_tokens=0)
    engine.compress_round_seconds = 0.0
    g = torch.Generator().manual_seed(2)
    ids = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    document = ids(100)
    jobs = {name: Job(context, ids(n), max_tokens=tokens, temperature=0, rid=name)
            for name, context, n, tokens in (("A", [], 3, 40), ("E", [], 10, 2), ("B", document, 5, 3),
                                             ("C", [], 4, 5))}  # fmt: skip
    calls, closed, done, held = [], {}, threading.Event(), []
    feed, decode, close = engine.feed, engine.decode, engine.close

    def fed(opening, tokens=None):
        before = opening.reading.read if opening.reading is not None else None
        session = feed(opening, tokens)
        held.append((opening.job.rid, opening.held_bytes))
        calls.append(("context" if before is not None else "question", opening.job.rid))
        if calls.count(("context", "B")) == 2 and before is not None:  # C arrives while B's context is read
            engine.submit([jobs["C"]])
        return session

    def decoded(batch, tokens, positions):
        calls.append(("decode", len(tokens)))
        if calls.count(("decode", 1)) == 1 and len(calls) == 2:  # after A's first step: E, then B
            engine.submit([jobs["E"], jobs["B"]])
        return decode(batch, tokens, positions)

    def closed_one(session, batch=1):
        closed[session.job.rid] = len(session.ids)
        close(session, batch)
        if session.job.rid == "B":
            engine.submit([Job(document, ids(2), max_tokens=2, temperature=0, rid="D")])
        if len(closed) == 5:
            done.set()

    engine.feed, engine.decode, engine.close = fed, decoded, closed_one
    try:
        engine.submit([jobs["A"]])
        assert done.wait(120), calls
    finally:
        engine.shutdown()
    assert closed == {"A": 40, "B": 3, "C": 5, "D": 2, "E": 2}
    context_calls = [i for i, call in enumerate(calls) if call == ("context", "B")]
    assert len(model.model.layers) == 2 and len(context_calls) == 7 + 2  # chunks, then compression rounds
    assert engine.metrics.context_chunks._value.get() == 7
    for before, after in zip(context_calls, context_calls[1:], strict=False):
        assert any(call[0] == "decode" for call in calls[before:after]), calls
    assert ("context", "D") not in calls and ("question", "D") in calls
    rounds, current = [], []  # the feed calls between two decode steps
    for call in calls:
        if call[0] == "decode":
            rounds.append(current)
            current = []
        else:
            current.append(call)
    e_round = next(feeds for feeds in rounds if ("question", "E") in feeds)
    assert e_round == [("question", "E")]  # B's context waits for a round that fed nothing (E's 10 tokens took it)
    assert max(sum(call[0] == "context" for call in calls_) for calls_ in rounds) == 1
    first_c = calls.index(("question", "C"))
    assert context_calls[0] < first_c < context_calls[-1]  # C passed B's context
    b_held = [held_bytes for rid, held_bytes in held if rid == "B"]
    assert b_held[:8] == [100 * engine.full_row_bytes] * 8 and b_held[8:] == [0, 0]  # until the last layer
    assert engine.metrics.prefills._value.get() == 1


def test_a_compression_round_lasts_about_one_chunk(monkeypatch):
    """After a context's last chunk its layers are compressed a round at a time: one layer, then another while the
    round's time plus the last layer's stays within its chunks' mean time (3 chunks in 3.0 s: 1.0 s), or
    ``compress_round_seconds``. Here each layer takes 0.4 s of a fake clock: 8 layers go 2 a round (0.8 s; a third
    would end at 1.2 s), 1 a round with a 0 s budget, all in one with 10 s."""
    import contextlib
    from types import SimpleNamespace

    from kvcompress.serve import contexts
    from kvcompress.serve.contexts import ContextSource
    from kvcompress.serve.jobs import Job, Opening
    from kvcompress.serve.metrics import ServerMetrics

    clock = [0.0]
    monkeypatch.setattr(contexts.time, "perf_counter", lambda: clock[0])

    class Layers:  # the reading's side: compress_next(1) takes 0.4 s a layer
        def __init__(self, count):
            self.waiting = count

        def compress_next(self, layers=1):
            count = self.waiting if layers is None else min(layers, self.waiting)
            clock[0] += 0.4 * count
            self.waiting -= count
            return self.waiting

    for budget, expected in ((None, [2, 2, 2, 2]), (0.0, [1] * 8), (10.0, [8])):
        engine = SimpleNamespace(model=SimpleNamespace(device=torch.device("cpu")), compress_round_seconds=budget,
                                 press=lambda model: contextlib.nullcontext(), metrics=ServerMetrics())  # fmt: skip
        reading = Layers(8)
        opening = Opening(Job([1] * 300, [1], max_tokens=1), None, None, 0.0, reading=reading, context_chunks=3,
                          context_seconds=3.0)  # fmt: skip
        rounds = []
        while reading.waiting:
            before = reading.waiting
            ContextSource._compress_round(engine, opening, every_layer=False)
            rounds.append(before - reading.waiting)
        assert rounds == expected, (budget, rounds)
        assert opening.compress_rounds == len(expected) == engine.metrics.compress_rounds._value.get()
        assert opening.compress_seconds == pytest.approx(3.2) and opening.context_seconds == pytest.approx(6.2)
    reading = Layers(8)
    ContextSource._compress_round(engine, Opening(Job([1], [1], max_tokens=1), None, None, 0.0, reading=reading),
                                  every_layer=True)  # fmt: skip
    assert reading.waiting == 0


@pytest.mark.slow
def test_a_server_reads_a_long_context_in_chunks_beside_a_stream(embedded_dir, tmp_path):
    """A real server, ``--prefill-chunk 128``: a document of ~700 tokens as the context part of a message, sent while
    another answer streams, is read in ceil(n / 128) chunks and compressed in the rounds after them (the log and
    ``/metrics``), and both get the answers a
    server reading it in one call (``--prefill-chunk 100000``) gives them."""
    import concurrent.futures

    import httpx

    from tests.serve_helpers import API_KEY
    from tests.test_serve import contexts, doc_question

    document = " ".join(contexts(2, tokens=340))
    story, ask = STORY, ask_greedy

    answers = {}
    for chunk in (128, 100000):
        log_path = tmp_path / f"server_{chunk}.log"
        with running_server(["--prefill-chunk", str(chunk), "--log-level", "info"], log_path) as base:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                streaming = pool.submit(ask, base, story, 48)
                long = pool.submit(ask, base, doc_question(document, "What is this text about?"), 12)
                answers[chunk] = (streaming.result(), long.result())
            metrics = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
        found = re.findall(r"prefill\+compress: (\d+) context tokens -> \d+ rows in [\d.]+ s"
                           r"(?: \((\d+) chunks and (\d+) compression rounds)?", log_path.read_text())
        tokens, chunks, rounds = max((int(n), int(k or 1), int(r or 0)) for n, k, r in found)
        assert tokens > 600
        counted = float(re.search(r"^kvcompress_context_chunks_total (\S+)$", metrics, re.M).group(1))
        counted_rounds = float(re.search(r"^kvcompress_context_compress_rounds_total (\S+)$", metrics, re.M).group(1))
        if chunk == 128:
            assert chunks == -(-tokens // 128) and counted == chunks
            assert rounds >= 1 and counted_rounds == rounds  # the layers compressed after the last chunk
        else:
            assert chunks == 1 and counted == 0 and rounds == 0 and counted_rounds == 0
    assert answers[128] == answers[100000]



@torch.no_grad()
def test_new_turns_after_a_stored_turn_are_read_in_chunks_as_in_one_call():
    """A stored 300-token context, then a 500-token one that starts with it (a later turn, ``--turn-reuse prefix``):
    with 64-token chunks its 200 new tokens are prefilled exact in 4 calls (counted a prefix hit, no context
    prefill, nothing held beyond the estimate), then stored; the stored cache (the compressed 300 plus 200 exact
    rows) and the first-token logits agree with the one-call engine's within float64 rounding."""
    from kvcompress.hf_attention import use_weighted_attention
    from kvcompress.serve.contexts import TailRead
    from kvcompress.serve.jobs import Job

    model = tiny_model("llama", dtype=torch.float64, seed=4)
    use_weighted_attention(model)
    g = torch.Generator().manual_seed(12)
    first = torch.randint(0, 256, (300,), generator=g).tolist()
    later = first + torch.randint(0, 256, (200,), generator=g).tolist()
    question = torch.randint(0, 256, (6,), generator=g).tolist()
    results = {}
    for chunk in (64, 512):
        engine, logits = _engine_keeping_logits(model, chunk)
        engine.compress_round_seconds = 0.0
        try:
            opening = engine.begin(Job(first, question, max_tokens=2, temperature=0))
            while engine.feed(opening, chunk) is None:  # the first context, in chunks (64) or one call (512)
                pass
            assert engine.is_stored(first)
            opening = engine.begin(Job(later, question, max_tokens=2, temperature=0))
            assert isinstance(opening.reading, TailRead) == (chunk == 64) and opening.held_bytes == 0
            read = []
            while (session := engine.feed(opening, chunk)) is None:
                read.append(opening.reading.read if opening.reading is not None else "question")
            if chunk == 64:
                assert read == [364, 428, 492, "question"] and opening.context_chunks == 4
                assert engine.metrics.context_hits.labels(kind="prefix")._value.get() == 1
                assert engine.metrics.prefills._value.get() == 1  # the first context only
            results[chunk] = (engine.stored(later).cache, logits[-1], session)
        finally:
            engine.shutdown()
    (stored, logits, session), (stored_one, logits_one, session_one) = results[64], results[512]
    for mine, one in zip(stored.layers, stored_one.layers, strict=True):
        assert mine.keys.shape == one.keys.shape and mine.keys.shape[-2] == 150 + 200  # compressed 300, then exact
        for name in ("keys", "values", "row_weights", "value_min", "value_max"):
            torch.testing.assert_close(getattr(mine, name), getattr(one, name), rtol=0, atol=1e-10)
    torch.testing.assert_close(logits, logits_one, rtol=0, atol=1e-10)
    assert session.position == session_one.position == 506
