"""The server's question prefill in chunks (``--prefill-chunk``): a chunked question gives the one-shot prefill's
first-token logits and cache rows, and the scheduler runs one chunk between two decode steps (and at most a chunk's
worth of new questions), one request opening in chunks at a time, shorter questions passing it, a cancelled one
dropped between chunks. Tiny random models and
an engine in this process (fast); the real server with the embedded model (slow)."""

from __future__ import annotations

import re
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from tests.serve_helpers import running_server
from tests.tiny_models import tiny_model


def _engine(model, press, prefill_chunk=512, **options):
    from kvcompress.serve.engine import Engine
    from kvcompress.serve.metrics import ServerMetrics
    from kvcompress.serve.store import ContextStore

    tokenizer = SimpleNamespace(eos_token_id=None, decode=lambda ids, skip_special_tokens=True: " x" * len(ids))
    engine = Engine(model, tokenizer, model_name="m", press=press, press_label="p", store=ContextStore(10**9),
                    metrics=ServerMetrics(), compile_decode="off", prefill_chunk=prefill_chunk, **options)
    engine.eos_ids = set()  # random weights: every answer runs to its max_tokens
    assert engine.ready.wait(60)  # the worker's warm-up is over (nothing to compile)
    return engine


STORY = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]  # a long answer to stream


def ask_greedy(base: str, chat: list[dict], max_tokens: int) -> str:
    """The greedy answer of the real server at ``base`` to ``chat``."""
    from tests.test_serve import client

    reply = client(base).chat.completions.create(model="SmolLM2-135M-Instruct", messages=chat, temperature=0,
                                                 max_tokens=max_tokens)
    return reply.choices[0].message.content


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@torch.no_grad()
def test_a_question_fed_in_chunks_gives_the_one_shot_logits_and_rows(family):
    """A 10-token question after a compressed 300-token context, fed 3, 4 or 7 tokens at a time, against all at
    once: the first token's logits and every layer's session rows (keys, values, weights, clip range) agree to float64
    rounding (the same attention, split at other query rows; float64 so the sums' order is all that differs). gemma3:
    sliding-window layers of 16 tokens, which a chunk crosses."""
    from kvcompress.hf_attention import use_weighted_attention
    from kvcompress.registry import make_press
    from kvcompress.serve.jobs import Job

    overrides = {"sliding_window": 16} if family == "gemma3" else {}
    model = tiny_model(family, dtype=torch.float64, seed=3, **overrides)
    use_weighted_attention(model)
    engine = _engine(model, make_press("compresskv", 0.5, 0))
    g = torch.Generator().manual_seed(11)
    context = torch.randint(0, 256, (300,), generator=g).tolist()
    question = torch.randint(0, 256, (10,), generator=g).tolist()
    logits = []
    real_advance = engine.advance
    engine.advance = lambda session, token, scores: (logits.append(scores.clone()), real_advance(session, token,
                                                                                               scores))[1]
    try:
        whole = engine.feed(engine.begin(Job(context, question, max_tokens=4, temperature=0)))
        stored = engine.stored(context).cache
        rows = [layer.keys.clone() for layer in stored.layers]
        assert max(r.shape[-2] for r in rows) <= 150  # compressed
        for chunk in (3, 4, 7):
            opening = engine.begin(Job(context, question, max_tokens=4, temperature=0))  # the stored context
            pieces = []
            while (session := engine.feed(opening, chunk)) is None:
                pieces.append(opening.fed)
            assert pieces == list(range(chunk, 10, chunk)) and opening.chunks == -(-10 // chunk)
            torch.testing.assert_close(logits[-1], logits[0], rtol=1e-10, atol=1e-10)
            assert session.position == whole.position == 310 and session.need == whole.need
            for mine, one_shot in zip(session.rows, whole.rows, strict=True):
                for name in ("keys", "values", "weights", "v_min", "v_max"):
                    torch.testing.assert_close(getattr(mine, name), getattr(one_shot, name), rtol=1e-10, atol=1e-10)
                assert mine.window == one_shot.window
        for layer, before in zip(stored.layers, rows, strict=True):  # no question row written into the stored cache
            assert torch.equal(layer.keys, before)
    finally:
        engine.shutdown()


@torch.no_grad()
def test_one_chunk_runs_between_two_decode_steps_and_shorter_questions_pass():
    """Submitted together, on a worker with 8-token chunks: A (a context, a 2-token question, 40 tokens to answer)
    decodes while B (a 40-token question), C (5 tokens), D (20), E (40, its client gone after 2 chunks) and F (3)
    open. From the engine's calls, in order: between two decode steps at most one chunk of a long question and 8
    tokens of new questions are prefilled; every later chunk of a long question comes after a decode step; one long
    question opens at a time, in arrival order; F (short) opens while B is in its chunks; E stops after its second
    chunk and is counted cancelled; every other answer runs to its end."""
    from kvcompress.serve.jobs import Job

    model = tiny_model("llama", seed=5)
    engine = _engine(model, None, prefill_chunk=8)
    g = torch.Generator().manual_seed(2)
    ids = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    jobs = {name: Job(context, ids(n), max_tokens=tokens, temperature=0, rid=name)
            for name, context, n, tokens in (("A", ids(64), 2, 40), ("B", [], 40, 3), ("C", [], 5, 10),
                                             ("D", [], 20, 2), ("E", [], 40, 5), ("F", [], 3, 3))}  # fmt: skip
    calls, closed, done = [], {}, threading.Event()
    feed, decode, close = engine.feed, engine.decode, engine.close

    def fed(opening, tokens=None):
        start = opening.fed
        if opening.job.rid == "E" and start == 8:
            opening.job.cancelled.set()  # its client leaves during its second chunk
        session = feed(opening, tokens)
        calls.append(("feed", opening.job.rid, start, opening.fed))
        return session

    def decoded(batch, tokens, positions):
        calls.append(("decode", len(tokens)))
        return decode(batch, tokens, positions)

    def closed_one(session, batch=1):
        closed[session.job.rid] = len(session.ids)
        close(session, batch)
        if len(closed) == 5:
            done.set()

    engine.feed, engine.decode, engine.close = fed, decoded, closed_one
    try:
        engine.submit(list(jobs.values()))
        assert done.wait(120), calls
    finally:
        engine.shutdown()
    assert closed == {"A": 40, "B": 3, "C": 10, "D": 2, "F": 3}
    assert engine.metrics.cancelled._value.get() == 1
    feeds = {name: [i for i, call in enumerate(calls) if call[:2] == ("feed", name)] for name in jobs}
    assert [len(feeds[name]) for name in "ABCDEF"] == [1, 5, 1, 3, 2, 1]
    assert engine.metrics.question_chunks._value.get() == 13  # /metrics counts every chunk fed
    assert [calls[i][2:] for i in feeds["B"]] == [(0, 8), (8, 16), (16, 24), (24, 32), (32, 40)]
    rounds, fed_tokens = [], 0  # question tokens fed between two decode steps
    for call in calls:
        if call[0] == "decode":
            rounds.append(fed_tokens)
            fed_tokens = 0
        else:
            fed_tokens += call[3] - call[2]
    assert max(rounds) <= 16 and rounds[0] == 7  # the first round: A's 2 and C's 5; B waits for a whole round
    for name in "BDE":
        for before, after in zip(feeds[name], feeds[name][1:], strict=False):
            assert any(call[0] == "decode" for call in calls[before:after]), (name, calls)
    assert feeds["B"][0] < feeds["F"][0] < feeds["B"][-1]  # F passed B
    assert feeds["D"][0] > feeds["B"][-1] and feeds["E"][0] > feeds["D"][-1]  # one long question at a time, in order
    assert max(call[1] for call in calls if call[0] == "decode") >= 3  # C and F decoded beside A


@pytest.mark.parametrize("chunk", [8, 512])
@torch.no_grad()
def test_a_requests_choices_share_one_question_prefill(chunk):
    """A request's 3 choices (``n`` = 3: one events queue, seeds 5, 6, 7, temperature 1), a 64-token context and a
    20-token question: only choice 0's question is prefilled (in 3 chunks of 8, or whole); choices 1 and 2 take its
    rows and logits when its last chunk ran, and each samples its own first token. Whole (the logits a lone request
    gets, bit for bit), each choice's first token is the one the same request alone with its seed gets."""
    from kvcompress.serve.jobs import Job

    model = tiny_model("llama", seed=7)
    engine = _engine(model, None, prefill_chunk=chunk)
    g = torch.Generator().manual_seed(4)
    context, question = torch.randint(0, 256, (64,), generator=g).tolist(), torch.randint(0, 256, (20,),
                                                                                             generator=g).tolist()
    request = object()  # what the choices of one request share: their events queue
    choices = [Job(context, question, max_tokens=4, temperature=1.0, seed=5 + i, index=i, events=request, rid="r")
               for i in range(3)]
    fed, closed, done = [], {}, threading.Event()
    feed, close = engine.feed, engine.close

    def feeding(opening, tokens=None):
        fed.append(opening.job.index)
        return feed(opening, tokens)

    def closing(session, batch=1):
        closed.setdefault(session.job.index, []).append(list(session.ids))
        close(session, batch)
        if len(closed) == 3:
            done.set()

    engine.feed, engine.close = feeding, closing
    try:
        engine.submit(choices)
        assert done.wait(120)
        assert fed == [0] * -(-20 // chunk)  # choice 0's chunks only
        assert engine.metrics.prompt_tokens._value.get() == 3 * 84
        assert engine.metrics.shared_prefills._value.get() == 2
        if chunk == 512:
            for i in range(3):
                engine.run_alone(Job(context, question, max_tokens=4, temperature=1.0, seed=5 + i, index=i))
            assert all(closed[i][0][0] == closed[i][1][0] for i in range(3)), closed
        assert len({tuple(closed[i][0]) for i in range(3)}) > 1  # each choice samples with its own seed
    finally:
        engine.shutdown()


class _Sink:
    """A request's event queue and loop in one (what ``Job.emit`` calls): records ``(index, kind, ...)``."""

    def __init__(self):
        self.events, self._lock = [], threading.Lock()

    def call_soon_threadsafe(self, fn, *args):
        fn(*args)

    def put_nowait(self, event):
        with self._lock:
            self.events.append(event)

    def ends(self, index: int) -> list[tuple]:
        with self._lock:
            return [e for e in self.events if e[0] == index and e[1] in ("done", "error")]


@pytest.mark.parametrize("seed", [0, 1, 2])
@torch.no_grad()
def test_random_requests_choices_and_cancellations_all_end_within_the_memory_budget(seed):
    """A random load on a worker with 8-token chunks, 3 sessions a step and a budget of about 3 sessions: 14
    requests in three waves, questions of 1-40 tokens over no context or one of 3 shared ones, 1-3 choices, greedy
    or sampled, 1-12 tokens, 3 of them cancelled at random moments. Every choice not cancelled ends once, with
    ``done`` and at most its ``max_tokens``; a cancelled one ends at most once; the worker ends idle (nothing
    waiting, opening or decoding); at every decode step the batch and the stored contexts fit the budget."""
    import random

    from kvcompress.serve.jobs import Job

    rng = random.Random(seed)
    model = tiny_model("llama", seed=seed)
    row = 2 * 2 * (2 * 16 * 4 + 4)  # a batch row's bytes: 2 layers, 2 KV heads, K and V of 16 float32, a weight
    engine = _engine(model, None, prefill_chunk=8, max_batch=3, memory=330 * row)
    scheduler = engine.scheduler
    contexts = [[rng.randrange(256) for _ in range(rng.randint(20, 60))] for _ in range(3)]
    requests = []
    for r in range(14):
        context = rng.choice([[], *contexts])
        question = [rng.randrange(256) for _ in range(rng.randint(1, 40))]
        sink, temperature, max_tokens = _Sink(), rng.choice([0.0, 1.0]), rng.randint(1, 12)
        requests.append((sink, [Job(context, question, max_tokens=max_tokens, temperature=temperature, seed=r,
                                    index=i, loop=sink, events=sink, rid=f"r{r}")
                                for i in range(rng.randint(1, 3))]))  # fmt: skip
    cancelled = {id(jobs[0]) for _, jobs in rng.sample(requests, 3)}
    over_budget = []
    decode = engine.decode

    def decoded(batch, tokens, positions):
        used = batch.nbytes() + engine.store.stats()["bytes"]
        if used > scheduler.memory:
            over_budget.append(used)
        return decode(batch, tokens, positions)

    engine.decode = decoded
    try:
        for wave in (requests[:5], requests[5:10], requests[10:]):
            for _, jobs in wave:
                engine.submit(jobs)
            for _, jobs in wave:
                if id(jobs[0]) in cancelled:
                    threading.Timer(rng.uniform(0, 0.3), lambda jobs=jobs: [j.cancelled.set() for j in jobs]).start()
            time.sleep(rng.uniform(0, 0.2))
        deadline = time.time() + 120
        while any(not sink.ends(job.index) for sink, jobs in requests for job in jobs if id(jobs[0]) not in cancelled):
            assert time.time() < deadline, [(j.rid, j.index) for s, js in requests for j in js if not s.ends(j.index)]
            time.sleep(0.05)
        while scheduler._waiting or scheduler._opening is not None or scheduler.active or scheduler._ready:
            assert time.time() < deadline, "the worker never went idle"
            time.sleep(0.05)
    finally:
        engine.shutdown()
    for sink, jobs in requests:
        for job in jobs:
            ends = sink.ends(job.index)
            if id(jobs[0]) in cancelled:
                assert len(ends) <= 1
            else:
                assert len(ends) == 1 and ends[0][1] == "done" and 1 <= ends[0][4] <= job.max_tokens, ends
    assert not over_budget, over_budget


def test_the_prefill_chunk_is_checked():
    from kvcompress.serve.scheduler import check_prefill_chunk

    assert check_prefill_chunk(1) == 1
    for bad in (0, -5, 2.5, True, "8"):
        with pytest.raises(ValueError, match=r"^--prefill-chunk: must be an integer >= 1"):
            check_prefill_chunk(bad)


@pytest.mark.slow
def test_a_server_prefills_a_long_one_part_message_in_chunks_beside_a_stream(embedded_dir, tmp_path):
    """A real server, ``--prefill-chunk 64``: a one-part chat message of ~300 tokens (all question under
    ``--chat-context parts``) sent while another answer streams is prefilled in 5 chunks (the server's log), and
    both get the answers a server without chunks (``--prefill-chunk 100000``) gives them alone. Two one-part messages
    of over 1024 tokens: the log says once that such a message is not compressed, and how to have it compressed."""
    import concurrent.futures

    from tests.test_serve import contexts

    doc = contexts(1, tokens=300)[0]
    messages = [{"role": "user", "content": doc + "\n\nWhat is this text about? Answer briefly."}]
    story, ask = STORY, ask_greedy

    answers = {}
    for chunk in (64, 100000):
        log_path = tmp_path / f"server_{chunk}.log"
        with running_server(["--method", "compresskv_paper", "--prefill-chunk", str(chunk), "--log-level", "info"],
                            log_path) as base:
            if chunk == 64:
                with concurrent.futures.ThreadPoolExecutor(2) as pool:
                    streaming = pool.submit(ask, base, story, 48)
                    long = pool.submit(ask, base, messages, 12)
                    answers[chunk] = (streaming.result(), long.result())
            else:
                answers[chunk] = (ask(base, story, 48), ask(base, messages, 12))
            if chunk == 64:  # a one-part message of 1024+ tokens: the server says once how to get it compressed
                long_doc = " ".join(contexts(4, tokens=300))
                for _ in range(2):
                    ask(base, [{"role": "user", "content": long_doc + "\n\nWhat is this about?"}], 1)
                assert log_path.read_text().count("is all question under --chat-context parts") == 1
        prefills = [(int(n), int(k)) for n, k in re.findall(r"question prefill: (\d+) tokens in [\d.]+ s \((\d+) "
                                                              r"chunks?\)", log_path.read_text())]
        long_tokens, chunks = max(prefills)
        assert long_tokens > 256 and chunks == -(-long_tokens // chunk)
        assert all(k == 1 for n, k in prefills if n <= chunk)
    assert answers[64] == answers[100000]
