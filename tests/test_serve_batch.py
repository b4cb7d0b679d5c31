"""Continuous batching (kvcompress.serve.batch / step / scheduler): the decode batch against each session alone on a
tiny random model (fast), and a real server with the embedded model against the official ``openai`` client (slow)."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import time
from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache

from tests.serve_helpers import API_KEY, running_server
from tests.tiny_models import tiny_model


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Dynamo counts recompiles per code object, and every model's forward runs through transformers' one wrapper:
    each test's compiled steps start from no entries, whatever earlier tests in the same worker compiled (past 8, a
    ``fullgraph`` compile fails)."""
    torch._dynamo.reset()


def _sessions(model, press, specs, seed=0):
    """Per spec (context tokens, question tokens, compressed?): (context ids, question ids, stored cache)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n_ctx, n_q, compressed in specs:
        ctx = torch.randint(0, model.config.vocab_size, (1, n_ctx), generator=g).to(model.device)
        question = torch.randint(0, model.config.vocab_size, (1, n_q), generator=g).to(model.device)
        cache = DynamicCache()
        if compressed:
            with press(model):
                model.model(input_ids=ctx, past_key_values=cache)
        else:
            model.model(input_ids=ctx, past_key_values=cache)
        out.append((ctx, question, cache))
    return out


def _alone(model, ctx, question, cache, steps):
    """Greedy decode of one session on its own cache (the one-request path): logits of every step."""
    from kvcompress.serve.store import answer_view

    cache = answer_view(cache)
    n, m = ctx.shape[1], question.shape[1]
    out = model(input_ids=question, past_key_values=cache,
                position_ids=torch.arange(n, n + m, device=question.device)[None], logits_to_keep=1)
    logits = [out.logits[0, -1]]
    for step in range(steps):
        token = logits[-1].argmax().view(1, 1)
        out = model(input_ids=token, past_key_values=cache,
                    position_ids=torch.tensor([[n + m + step]], device=question.device))
        logits.append(out.logits[0, -1])
    return logits


def _opened(model, sessions):
    """Each session's question prefilled on a view of its cache, as the server opens it: (per session its rows
    for the batch, its first token, the position of that token)."""
    from kvcompress.serve.batch import session_rows
    from kvcompress.serve.store import answer_view

    sources, tokens, positions = [], [], []
    for ctx, question, cache in sessions:
        view = answer_view(cache)
        n, m = ctx.shape[1], question.shape[1]
        out = model(input_ids=question, past_key_values=view,
                    position_ids=torch.arange(n, n + m, device=question.device)[None], logits_to_keep=1)
        sources.append(session_rows(view))
        tokens.append(int(out.logits[0, -1].argmax()))
        positions.append(n + m)
    return sources, tokens, positions


def _decodes_as_alone(model, batch, tokens, positions, alone, steps, rtol, atol, forward=None, rebuild_at=None):
    """``steps`` decode steps of ``batch`` (run by ``forward``, default the model): each session's logits those
    ``alone`` (:func:`_alone`) gives it. ``rebuild_at``: before that step the batch is rebuilt with every session
    (the same shapes in new buffers, as when a session joins and another leaves)."""
    from kvcompress.serve.batch import build
    from kvcompress.serve.step import decode_step

    for step in range(steps):
        if step == rebuild_at:
            batch = build(batch, list(range(len(tokens))), [], batch.capacities, static=batch.layers[0].is_compileable)
        logits = decode_step(model, batch, tokens, positions, forward)
        for b in range(len(tokens)):
            torch.testing.assert_close(logits[b], alone[b][step + 1], rtol=rtol, atol=atol)
        tokens = [int(alone[b][step + 1].argmax()) for b in range(len(tokens))]
        positions = [p + 1 for p in positions]


MODES = ["shared-mask", "per-row-offsets", "static", "compiled"]


@pytest.mark.parametrize("mode", MODES)
@torch.no_grad()
def test_decode_batch_equals_each_session_alone_with_joins_and_leaves(mode):
    """Three sessions of different compressed lengths (and one never compressed), different question lengths and
    positions: each step of the batch gives each session the logits it gets alone, while one session joins late
    and one leaves early (the batch rebuilt around them). float64, so the batch's other reduction order (a GEMM
    over the batch instead of a GEMV per session) moves logits by ~1e-13; 1e-9 leaves room for that and nothing
    a wrong position, mask or weight would give (those change logits by O(1e-2) or more on this model).
    ``per-row-offsets``: each row bounded by its own causal offset instead of the step's shared mask, as on CUDA
    (where the Triton kernel then reads no key past a row's own; here the PyTorch path takes the same arguments).
    ``static``: the batch attends its whole capacity with each row's new row as its causal offset (what compiled
    steps run); ``compiled``: those steps under ``torch.compile(fullgraph=True)`` (dynamo's capture, run without
    code generation), which must capture no step of a batch size it has seen (a rebuilt batch of the same shape
    reuses the graph: its new buffers are inputs, not constants)."""
    from torch._dynamo.testing import CompileCounter

    from kvcompress.hf_attention import use_weighted_attention
    from kvcompress.registry import make_press
    from kvcompress.serve.batch import build as build_batch
    from kvcompress.serve.batch import session_rows
    from kvcompress.serve.step import decode_step
    from kvcompress.serve.store import answer_view

    static, per_row = mode in ("static", "compiled"), mode == "per-row-offsets"
    counter = CompileCounter()
    forward = None
    seen: set[int] = set()

    def build(kept, keep, new, capacity):
        return build_batch(kept, keep, new, capacity, static=static, per_row_offsets=per_row)

    model = tiny_model("llama", dtype=torch.float64)
    press = make_press("compresskv_paper", 0.75, 0)
    use_weighted_attention(model)
    specs = [(300, 5, True), (420, 9, True), (50, 3, False)]
    sessions = _sessions(model, press, specs)
    assert [type(c.layers[0]).__name__ for _, _, c in sessions] == ["WeightedLayer", "WeightedLayer", "DynamicLayer"]
    rows = [c.layers[0].keys.shape[-2] for _, _, c in sessions]
    assert rows[0] != rows[1] and rows[0] < 300  # compressed, to different lengths
    steps = 6
    alone = [_alone(model, *s, steps) for s in sessions]

    def opened(i):
        ctx, question, cache = sessions[i]
        view = answer_view(cache)
        n, m = ctx.shape[1], question.shape[1]
        out = model(input_ids=question, past_key_values=view, position_ids=torch.arange(n, n + m)[None],
                    logits_to_keep=1)
        torch.testing.assert_close(out.logits[0, -1], alone[i][0], rtol=0, atol=1e-9)
        return session_rows(view), int(out.logits[0, -1].argmax()), n + m

    capacity = max(rows) + 9 + steps + 1
    rows0, tok0, pos0 = opened(0)
    rows1, tok1, pos1 = opened(1)
    if mode == "compiled":
        forward = torch.compile(model.forward, fullgraph=True, backend=counter)
    batch = build(None, [], [rows0, rows1], capacity)
    members = {0: [tok0, pos0, 0], 1: [tok1, pos1, 0]}  # session -> [pending token, position, step]
    order = [0, 1]
    rnd = 0
    while order:
        if rnd == 2:  # session 2 joins while the others decode
            rows2, tok2, pos2 = opened(2)
            batch = build(batch, list(range(len(order))), [rows2], capacity)
            order.append(2)
            members[2] = [tok2, pos2, 0]
        frames = counter.frame_count
        logits = decode_step(model, batch, [members[s][0] for s in order], [members[s][1] for s in order], forward)
        if len(order) in seen:
            assert counter.frame_count == frames, f"a step of batch size {len(order)} was captured again"
        seen.add(len(order))
        for b, s in enumerate(order):
            state = members[s]
            state[2] += 1
            torch.testing.assert_close(logits[b], alone[s][state[2]], rtol=0, atol=1e-9)
            state[0], state[1] = int(logits[b].argmax()), state[1] + 1
        # session 0 leaves early, the others when done: the batch is rebuilt around the rest
        keep = [b for b, s in enumerate(order) if members[s][2] < steps and not (s == 0 and rnd == 3)]
        if len(keep) < len(order):
            batch = build(batch, keep, [], capacity)
            order = [order[b] for b in keep]
        rnd += 1
    assert [members[s][2] for s in range(3)] == [4, steps, steps]
    assert seen == {1, 2, 3}
    if mode == "compiled":
        assert 1 <= counter.frame_count <= len(seen)


def test_auto_compiles_the_decode_step_on_one_cuda_device_only():
    """``--compile-decode auto`` (the default): inductor for a model on one CUDA device, eager on CPU and for a model
    split over devices; a named backend stays as named."""
    from types import SimpleNamespace

    from kvcompress.serve.step import compiled_forward, resolved_backend

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    one, split = {"embed": 0, "layers.0": 0}, {"embed": 0, "layers.9": 1}
    assert resolved_backend(SimpleNamespace(device=cuda), "auto") == "inductor"
    assert resolved_backend(SimpleNamespace(device=cuda, hf_device_map=one), "auto") == "inductor"
    assert resolved_backend(SimpleNamespace(device=cuda, hf_device_map=split), "auto") == "off"
    assert resolved_backend(SimpleNamespace(device=cpu), "auto") == "off"
    assert resolved_backend(SimpleNamespace(device=cpu), "inductor") == "inductor"
    assert compiled_forward(tiny_model("llama"), "auto") is None  # on the CPU: eager steps
    with pytest.raises(ValueError, match="compile_decode: choose from auto, off"):
        compiled_forward(tiny_model("llama"), "fast")


@torch.no_grad()
def test_a_failed_compiled_step_is_run_again_eager(caplog):
    """A compiled step that raises after writing the step's rows (what a failure inside the graph leaves): the engine
    runs the step again eager over the same static batch, with the logits an eager step gives from the start, and
    decodes eager from then on; the log says why."""
    from types import SimpleNamespace

    from kvcompress.hf_attention import use_weighted_attention
    from kvcompress.registry import make_press
    from kvcompress.serve.batch import build
    from kvcompress.serve.engine import Engine
    from kvcompress.serve.metrics import ServerMetrics
    from kvcompress.serve.step import decode_step
    from kvcompress.serve.store import ContextStore

    model = tiny_model("llama", dtype=torch.float32, seed=8)
    use_weighted_attention(model)
    sessions = _sessions(model, make_press("compresskv", 0.5, 0), [(300, 3, True), (160, 2, True)], seed=4)
    sources, tokens, positions = _opened(model, sessions)
    engine = Engine(model, SimpleNamespace(eos_token_id=None), model_name="m", press=make_press("compresskv", 0.5, 0),
                    press_label="c", store=ContextStore(10**9), metrics=ServerMetrics(), compile_decode="off")
    try:
        def failing(**inputs):  # the step's rows written, then an error
            model(**inputs)
            raise RuntimeError("a graph the warm-up did not foresee")

        assert engine.ready.wait(60)  # the worker thread's warm-up is over (nothing to compile): it runs no model now
        engine.decode_forward = failing  # what a compiled step that raises looks like to the engine
        expected_batch, batch = (build(None, [], sources, 512, static=True) for _ in range(2))
        for _ in range(3):
            expected = decode_step(model, expected_batch, tokens, positions)
            logits = engine.decode(batch, tokens, positions)
            torch.testing.assert_close(logits, expected, rtol=0, atol=0)
            assert engine.decode_forward is None
            positions = [p + 1 for p in positions]
            tokens = expected.argmax(-1).tolist()
        assert "compiled decode step failed; decoding eager from now on" in caplog.text
    finally:
        engine.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="auto compiles on CUDA only")
def test_the_default_engine_on_a_gpu_compiles_its_steps_in_its_worker_thread():
    """An engine built as ``kvcompress serve`` builds it by default (``--compile-decode auto``) on CUDA compiles its
    decode step with inductor in its scheduler's thread, and keeps it: a warm-up that failed would fall back to
    eager steps (``decode_forward`` None)."""
    from types import SimpleNamespace

    from kvcompress.registry import make_press
    from kvcompress.serve.engine import Engine
    from kvcompress.serve.metrics import ServerMetrics
    from kvcompress.serve.store import ContextStore

    model = tiny_model("llama", dtype=torch.bfloat16, seed=3).to("cuda")
    engine = Engine(model, SimpleNamespace(eos_token_id=None), model_name="m", press=make_press("compresskv", 0.5, 0),
                    press_label="c", store=ContextStore(10**9), metrics=ServerMetrics())  # fmt: skip
    try:
        assert engine.decode_forward is not None
        assert engine.ready.wait(600)
        assert engine.decode_forward is not None
    finally:
        engine.shutdown()


def test_a_worker_thread_gets_its_own_cudagraph_tree_state():
    """The server steps its compiled decode in a worker thread; torch before 2.13 set up CUDA-graph-tree state only in
    the thread that imported inductor, so that thread gets it from ``cudagraph_state_for_this_thread`` (run again, it
    keeps what is there), where inductor's own lookup then finds it."""
    from torch._inductor import cudagraph_trees

    from kvcompress.serve.step import cudagraph_state_for_this_thread

    seen = {}

    def worker() -> None:
        seen["before"] = torch._C._is_key_in_tls("tree_manager_containers")
        cudagraph_state_for_this_thread()
        containers = torch._C._get_obj_in_tls("tree_manager_containers")
        cudagraph_state_for_this_thread()
        seen["kept"] = torch._C._get_obj_in_tls("tree_manager_containers") is containers
        seen["found"] = cudagraph_trees.get_obj(cudagraph_trees.local, "tree_manager_containers") is containers
        # Held by inductor's thread-local object, as inductor holds its own: what keeps them alive whether or not the
        # stash holds a reference (torch 2.11's did not: a later graph read freed memory).
        seen["held"] = getattr(cudagraph_trees.local, "tree_manager_containers", None) is containers
        seen["locks"] = getattr(cudagraph_trees.local, "tree_manager_locks", None) is torch._C._get_obj_in_tls(
            "tree_manager_locks"
        )

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == {"before": False, "kept": True, "found": True, "held": True, "locks": True}


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: sliding-window layers beside full ones
@torch.no_grad()
def test_warm_up_compiles_the_graphs_every_later_batch_uses(family):
    """The server compiles before its first request (``step.warm_up``: static batches of one and of two synthetic
    one-row sessions): later batches of real sessions, of one to three sessions and three capacities, are steps of
    those two graphs, never captured again (a capture is seconds to minutes of a server's time)."""
    from torch._dynamo.testing import CompileCounter

    from kvcompress.hf_attention import use_weighted_attention
    from kvcompress.registry import make_press
    from kvcompress.serve.batch import build
    from kvcompress.serve.step import decode_step, warm_up

    model = tiny_model(family, dtype=torch.float32, sliding_window=8)
    use_weighted_attention(model)
    press = make_press("compresskv", 0.5, 0)  # the server makes its press (kvpress imported) before it compiles
    counter = CompileCounter()
    forward = torch.compile(model.forward, fullgraph=True, backend=counter)
    warm_up(model, forward)
    assert counter.frame_count == 2
    sessions = _sessions(model, press, [(200, 5, True), (120, 3, True), (60, 2, False)], seed=4)
    sources, tokens, positions = _opened(model, sessions)
    for size, capacity in ((1, 150), (3, 130), (2, 170)):
        batch = build(None, [], sources[:size], capacity, static=True)
        for step in range(2):
            decode_step(model, batch, tokens[:size], [p + step for p in positions[:size]], forward)
    assert counter.frame_count == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel with per-row offsets runs on CUDA")
@pytest.mark.parametrize("compile_decode", ["off", "inductor", "cudagraphs"])
@torch.no_grad()
def test_decode_batch_on_a_gpu_equals_each_session_alone(compile_decode):
    """On CUDA the batch's rows reach the compiled kernel as per-row causal offsets (no mask) and per-row folds:
    three sessions of 3-5x different lengths give each session the logits it gets alone for 8 steps. float32; the
    two runs' kernels split the keys differently (another float32 summation order, relative error about 1e-6 a
    layer), so 1e-4, far below what a row reading another's rows or missing its own does (O(1e-2)). Compiled
    (CUDA graphs): the batch is rebuilt in new buffers halfway, so a graph replayed on the old buffers' addresses
    (not re-recorded) would read the old rows."""
    from kvcompress.hf_attention import use_weighted_attention
    from kvcompress.registry import make_press
    from kvcompress.serve.batch import build
    from kvcompress.serve.step import compiled_forward

    model = tiny_model("llama", dtype=torch.float32, seed=6).to("cuda")
    use_weighted_attention(model)
    specs = [(900, 4, True), (250, 4, True), (400, 4, True)]
    sessions = _sessions(model, make_press("compresskv", 0.5, 0), specs, seed=9)
    steps = 8
    alone = [_alone(model, *session, steps) for session in sessions]
    sources, tokens, positions = _opened(model, sessions)
    forward = compiled_forward(model, compile_decode)
    batch = build(None, [], sources, max(s.keys.shape[-2] for rows in sources for s in rows) + steps + 1,
                  static=forward is not None)
    if forward is None:
        assert all(layer.row_offsets is not None and layer.key_mask(0) is None for layer in batch.layers)
    _decodes_as_alone(model, batch, tokens, positions, alone, steps, rtol=1e-4, atol=1e-4, forward=forward,
                      rebuild_at=steps // 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
@pytest.mark.parametrize("compile_decode", ["inductor", "cudagraphs"])
@torch.no_grad()
def test_compiled_steps_with_cuda_graphs_run_in_a_worker_thread(compile_decode):
    """As the server runs them: warmed up and stepped in a thread of its own (CUDA-graph state is per thread, and
    torch before 2.13 set it up only in the importing thread), each session's logits those it gets alone."""
    from kvcompress.hf_attention import use_weighted_attention
    from kvcompress.registry import make_press
    from kvcompress.serve.batch import build
    from kvcompress.serve.step import compiled_forward, warm_up

    model = tiny_model("llama", dtype=torch.float32, seed=6).to("cuda")
    use_weighted_attention(model)
    sessions = _sessions(model, make_press("compresskv", 0.5, 0), [(500, 4, True), (200, 3, True)], seed=2)
    steps = 6
    alone = [_alone(model, *session, steps) for session in sessions]
    sources, tokens, positions = _opened(model, sessions)
    failures = []

    def worker() -> None:
        try:
            with torch.inference_mode():
                forward = compiled_forward(model, compile_decode)
                warm_up(model, forward)
                batch = build(None, [], sources, 512, static=True)
                _decodes_as_alone(model, batch, tokens, positions, alone, steps, rtol=1e-4, atol=1e-4,
                                  forward=forward, rebuild_at=steps // 2)
        except BaseException as error:  # noqa: BLE001 - re-raised in the test's thread
            failures.append(error)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    if failures:
        raise failures[0]


@pytest.mark.slow  # an inductor compile of the tiny model's step (~20-40 s on the shared CPU); CI runs it
@pytest.mark.parametrize("layers", ["uniform", "per_layer"])
@torch.no_grad()
def test_inductor_compiled_decode_batch_equals_each_session_alone(layers):
    """The server's ``--compile-decode inductor`` path on CPU: generated code for the static batch's step gives each
    of three sessions the logits it gets alone, across a rebuild in new buffers. float64, but Llama's RMSNorm and
    RoPE angles run in float32 whatever the dtype, and generated code sums and fuses them in another order (ulps of
    6e-8 relative): logits move by ~5e-8, so 1e-6, still far below a wrong row, mask or range (O(1e-2)).
    ``per_layer``: a retrieval layer (more rows in layer 1) and a capacity of each layer's own in one graph."""
    from kvcompress.hf_attention import use_weighted_attention
    from kvcompress.registry import make_press
    from kvcompress.serve.batch import build
    from kvcompress.serve.step import compiled_forward

    model = tiny_model("llama", dtype=torch.float64, seed=6, num_hidden_layers=3)
    use_weighted_attention(model)
    options = {"retrieval_layers": (1,)} if layers == "per_layer" else {}
    sessions = _sessions(model, make_press("compresskv", 0.5, 0, **options),
                         [(300, 4, True), (120, 3, True), (60, 2, False)], seed=9)  # fmt: skip
    steps = 6
    alone = [_alone(model, *session, steps) for session in sessions]
    sources, tokens, positions = _opened(model, sessions)
    capacity = 200 if layers == "uniform" else [200, 260, 200]
    batch = build(None, [], sources, capacity, static=True)
    assert len(set(batch.capacities)) == (1 if layers == "uniform" else 2)
    _decodes_as_alone(model, batch, tokens, positions, alone, steps, rtol=0, atol=1e-6,
                      forward=compiled_forward(model, "inductor"), rebuild_at=steps // 2)


@pytest.mark.parametrize("mode", MODES[:3])
@pytest.mark.parametrize("family", ["gemma3", "mistral"])  # sliding, full, sliding; every layer sliding
@torch.no_grad()
def test_decode_batch_keeps_each_sessions_sliding_window(family, mode):
    """On sliding-window layers each session's new token sees only its own window, as alone: 12 steps past a
    window of 8, two sessions of different lengths in one batch (the batch attended over every row it held:
    logits off by 0.1-0.4 from the second step). float64; tolerance as in the test above. ``static``: the whole
    capacity attended, each row's window cut from it on the device."""
    from kvcompress.hf_attention import use_weighted_attention
    from kvcompress.registry import make_press
    from kvcompress.serve.batch import build
    from kvcompress.window import layer_windows

    model = tiny_model(family, dtype=torch.float64, sliding_window=8)
    use_weighted_attention(model)
    sessions = _sessions(model, make_press("compresskv", 0.5, 0), [(200, 5, True), (120, 3, True)], seed=4)
    steps = 12
    alone = [_alone(model, *s, steps) for s in sessions]
    sources, tokens, positions = _opened(model, sessions)
    assert [source.window for source in sources[0]] == layer_windows(model)  # gemma3 [8, None, 8]; mistral [8, 8]
    batch = build(None, [], sources, max(s.keys.shape[-2] for rows in sources for s in rows) + steps + 1,
                  static=mode == "static", per_row_offsets=mode == "per-row-offsets")
    _decodes_as_alone(model, batch, tokens, positions, alone, steps, rtol=0, atol=1e-9)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@torch.no_grad()
def test_decode_batch_rows_are_masked_not_read(static):
    """A batch row never reads another row's or its own unused rows: filling them with garbage (large keys and
    values beyond each row's length) changes no bit of the logits (a masked row adds exactly 0). A static batch
    attends its whole capacity, so there every unused row is in the step's attention."""
    from kvcompress.hf_attention import use_weighted_attention
    from kvcompress.registry import make_press
    from kvcompress.serve.batch import build, session_rows
    from kvcompress.serve.step import decode_step

    model = tiny_model("llama", dtype=torch.float64, seed=1)
    press = make_press("compresskv_paper", 0.75, 0)
    use_weighted_attention(model)
    sessions = _sessions(model, press, [(280, 4, True), (360, 4, True)], seed=3)
    sources = [session_rows(c) for _, _, c in sessions]
    tokens, positions = [5, 7], [284, 364]
    clean = decode_step(model, build(None, [], sources, 200, static=static), tokens, positions)
    dirty = build(None, [], sources, 200, static=static)
    for layer in dirty.layers:
        for b, n in enumerate(layer.lengths):
            layer.keys[b, :, n:] = 1e3 * torch.randn_like(layer.keys[b, :, n:])
            layer.values[b, :, n:] = 1e3 * torch.randn_like(layer.values[b, :, n:])
    poisoned = decode_step(model, dirty, tokens, positions)
    assert torch.isfinite(poisoned).all()
    torch.testing.assert_close(poisoned, clean, rtol=0, atol=0)


@torch.no_grad()
def test_a_static_batch_rebuilt_to_its_shape_keeps_its_buffers_and_each_sessions_answer():
    """A session leaves and another joins between two steps of a static batch: same batch size and capacity, so
    the batch is rebuilt in its own buffers (a CUDA graph replayed on them needs no re-recording; new buffers would
    make it re-record, and after torch's limit of such re-records run without graphs). The rows move in place and
    the new session's row is cleared past its rows: every session still gets the logits it gets alone (float64,
    1e-9 as above). A session longer than the capacity is refused before anything is written."""
    from kvcompress.hf_attention import use_weighted_attention
    from kvcompress.registry import make_press
    from kvcompress.serve.batch import batch_capacity, build
    from kvcompress.serve.step import decode_step

    model = tiny_model("llama", dtype=torch.float64, seed=3)
    use_weighted_attention(model)
    sessions = _sessions(model, make_press("compresskv", 0.5, 0), [(260, 4, True), (400, 6, True), (90, 3, False),
                                                                  (150, 5, True)], seed=7)  # fmt: skip
    steps = 5
    alone = [_alone(model, *session, steps) for session in sessions]
    sources, tokens, positions = _opened(model, sessions)
    capacity = batch_capacity(max(s.keys.shape[-2] for rows in sources for s in rows) + steps, static=True)
    assert capacity % 256 == 0
    batch = build(None, [], [sources[2], sources[0], sources[1]], capacity, static=True)
    buffers = [(layer.keys, layer.values, layer.weights, layer.value_min, layer.value_max) for layer in batch.layers]
    members, step_of = [2, 0, 1], [0, 0, 0, 0]

    def step() -> None:
        logits = decode_step(model, batch, [tokens[s] if step_of[s] == 0 else int(alone[s][step_of[s]].argmax())
                                            for s in members], [positions[s] + step_of[s] for s in members])
        for b, s in enumerate(members):
            step_of[s] += 1
            torch.testing.assert_close(logits[b], alone[s][step_of[s]], rtol=0, atol=1e-9)

    step()
    step()
    with pytest.raises(ValueError, match="capacity: .* cannot hold"):
        build(batch, [1, 2], [[*sources[3][:-1], replace(sources[3][-1], keys=torch.zeros(1, 1, capacity + 1, 1))]],
              capacity, static=True)
    # session 1 leaves and 3 takes its row (past 3's rows: 1's fitted weights, unless cleared); 0 and 2 swap rows
    batch = build(batch, [1, 0], [sources[3]], capacity, static=True)
    members = [0, 2, 3]
    for layer, held in zip(batch.layers, buffers, strict=True):
        assert all(a is b for a, b in zip((layer.keys, layer.values, layer.weights, layer.value_min,
                                           layer.value_max), held, strict=True))  # fmt: skip
    step()
    step()


@torch.no_grad()
def test_a_static_batch_folds_each_rows_new_value_into_its_clip_range():
    """A static batch widens each layer's clip range by each row's new value before the attention (the eager batch
    folds it inside the attention call): with every compressed layer's range first narrowed to a point, so that
    every new value lies outside it, one step gives both batches the same ranges and the same logits."""
    from kvcompress.hf_attention import use_weighted_attention
    from kvcompress.registry import make_press
    from kvcompress.serve.batch import build, session_rows
    from kvcompress.serve.step import decode_step

    model = tiny_model("llama", dtype=torch.float64, seed=1)
    press = make_press("compresskv_paper", 0.75, 0)
    use_weighted_attention(model)
    sessions = _sessions(model, press, [(280, 4, True), (360, 4, True)], seed=4)
    sources = [session_rows(c) for _, _, c in sessions]
    batches = [build(None, [], sources, 200, static=static) for static in (False, True)]
    narrowed = []
    for batch in batches:
        for layer in batch.layers:
            middle = (layer.value_min + layer.value_max) / 2
            layer.value_min.copy_(middle)
            layer.value_max.copy_(middle)
        narrowed.append([layer.value_min.clone() for layer in batch.layers])
    eager, static = (decode_step(model, batch, [5, 7], [284, 364]) for batch in batches)
    torch.testing.assert_close(static, eager, rtol=0, atol=1e-9)
    for before, layer, other in zip(narrowed[1], batches[1].layers, batches[0].layers, strict=True):
        assert (layer.value_min < before).any()  # the fold happened
        assert torch.equal(layer.value_min, other.value_min) and torch.equal(layer.value_max, other.value_max)


@torch.no_grad()
def test_a_step_copies_to_the_device_once_and_a_failed_step_leaves_the_batch_as_it_was(monkeypatch):
    """Every layer shares one RowCounts, so a step builds one tensor from host lists (tokens, positions and cache
    position together; a per-layer copy would wait for the layers queued before it on a GPU). A forward that fails
    in its second layer, after the first layer wrote its row, leaves the counts as they were: the step run again
    gives, bit for bit, the logits of a batch that never failed, and the next step too."""
    import sys

    from kvcompress.hf_attention import use_weighted_attention
    from kvcompress.registry import make_press
    from kvcompress.serve import batch as batch_module
    from kvcompress.serve import step as step_module
    from kvcompress.serve.batch import build, session_rows
    from kvcompress.serve.step import decode_step

    model = tiny_model("llama", dtype=torch.float64, seed=2)
    press = make_press("compresskv_paper", 0.75, 0)
    use_weighted_attention(model)
    sessions = _sessions(model, press, [(260, 4, True), (330, 4, True)], seed=5)
    sources = [session_rows(c) for _, _, c in sessions]
    reference, failing = build(None, [], sources, 200), build(None, [], sources, 200)
    assert len(failing.row_counts()) == 1 and len(failing.layers) > 1
    made_here, real_tensor = [], torch.tensor

    def counting_tensor(*args, **kwargs):
        if sys._getframe(1).f_code.co_filename in (batch_module.__file__, step_module.__file__):
            made_here.append(args[0])
        return real_tensor(*args, **kwargs)

    tokens, positions = [5, 7], [264, 334]
    monkeypatch.setattr(torch, "tensor", counting_tensor)
    expected = [decode_step(model, reference, tokens, positions)]
    assert len(made_here) == 1
    expected.append(decode_step(model, reference, [9, 11], [265, 335]))
    monkeypatch.setattr(torch, "tensor", real_tensor)

    second = model.model.layers[1]
    real_forward = second.forward

    def broken(*args, **kwargs):
        raise RuntimeError("layer 1 failed")

    monkeypatch.setattr(second, "forward", broken)
    before = list(failing.layers[0].lengths)
    with pytest.raises(RuntimeError, match="layer 1 failed"):
        decode_step(model, failing, tokens, positions)
    assert failing.layers[0].lengths == before and all(c.width == 0 for c in failing.row_counts())
    monkeypatch.setattr(second, "forward", real_forward)
    got = [decode_step(model, failing, tokens, positions), decode_step(model, failing, [9, 11], [265, 335])]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="decode_step"):
        failing.layers[0].update(torch.randn(2, 1, 1, 16, dtype=torch.float64), torch.randn(2, 1, 1, 16))


# -- a real server: continuous batching against each request alone ----------------------------------------------
ROW_BYTES = 30 * 3 * (2 * 64 * 4 + 4)  # one decode-batch row of SmolLM2-135M in float32: K, V, weight per KV head
BUDGET = 2150 * ROW_BYTES  # ~100 MB: 8 sessions of ~110 rows plus their 8 stored contexts fit; 3 of ~740 rows do not
DECODE_PER_PREFILL = 0.1  # --decode-per-prefill of the shared server


@pytest.fixture(scope="module")
def batch_server(embedded_dir, tmp_path_factory):
    """compresskv_paper (a fast prefill) at 25% kept, 8 sessions per step, 8 waiting at most, INFO logs to a file;
    a new context's prefill waits for a tenth of the previous prefill's time of decoding (a step or two here)."""
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    with running_server(["--method", "compresskv_paper", "--max-batch", "8", "--max-queue", "8", "--cache-memory",
                         str(BUDGET), "--log-level", "info", "--decode-per-prefill", str(DECODE_PER_PREFILL)],
                        log_path) as base:
        yield base, log_path


def _ask(base: str, doc: str, question: str, max_tokens: int, stop=None):
    from tests.test_serve import client, doc_question

    reply = client(base).chat.completions.create(model="SmolLM2-135M-Instruct", messages=doc_question(doc, question),
                                                 temperature=0, max_tokens=max_tokens, stop=stop)
    return reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage.completion_tokens


QUESTIONS = ["\n\nWhat does this text describe? Answer briefly.", "\n\nName one keyword from the text.",
             "\n\nWhat is the first word?", "\n\nSummarise it in one sentence.", "\n\nWhich example does it give?",
             "\n\nIs anything deprecated here?", "\n\nWho would read this?", "\n\nWhat is the title?"]


@pytest.mark.slow
def test_eight_concurrent_sessions_get_their_answers_alone(batch_server):
    """8 sessions with different contexts, questions, max_tokens and stop strings, all in flight at once (joining
    the batch as their contexts are prefilled, while the others decode), each get exactly (text, finish reason,
    token count) what the same request gets alone afterwards. float32: the batch moves logits by ~1e-5 against a
    gap between the two best tokens that is orders of magnitude larger on these answers (the tiny-model test
    above checks the logits themselves)."""
    from tests.test_serve import contexts, metric

    base, log_path = batch_server
    docs = contexts(8, tokens=300)
    max_tokens = [4, 6, 8, 10, 12, 14, 16, 9]
    stops = [None, ["."], [" the"], ["\n"], None, [","], [" is", "."], None]
    steps = metric(base, "kvcompress_batch_size_count")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_ask, base, docs[i], QUESTIONS[i], max_tokens[i], stops[i]) for i in range(8)]
        together = [f.result() for f in futures]
    batched = metric(base, "kvcompress_batch_size_sum") / max(1, metric(base, "kvcompress_batch_size_count"))
    alone_steps = metric(base, "kvcompress_batch_size_count")
    alone = [_ask(base, docs[i], QUESTIONS[i], max_tokens[i], stops[i]) for i in range(8)]
    assert together == alone
    assert len({text for text, _, _ in alone}) == 8 and any(f == "stop" for _, f, _ in alone)
    # The concurrent sessions really shared decode steps: alone, every step has batch size 1. How many share a step
    # depends on how prefills and decodes interleave on the machine (mean 2.0 with two other processes on 2 cores).
    assert alone_steps > steps and batched > 1.5
    assert metric(base, "kvcompress_batch_size_sum") / metric(base, "kvcompress_batch_size_count") < batched
    assert metric(base, "kvcompress_cache_sessions") == 8  # every context stored once, reused alone
    _assert_prefill_budget_held(log_path.read_text(), DECODE_PER_PREFILL)


def _assert_prefill_budget_held(log: str, ratio: float) -> None:
    """Every context prefill that ran while sessions decoded came after at least one decode step and after the
    batch had decoded ``ratio`` times the previous prefill's seconds (the server's own clock, from its log)."""
    lines = re.findall(r"context prefill of ([\d.]+) s after (\d+) decode steps \(([\d.]+) s\) since the previous "
                       r"one, (\d+) sessions decoding; the next one after ([\d.]+) s", log)
    assert lines
    owed, checked = None, 0
    for seconds, steps, decoded, sessions, next_after in lines:
        assert abs(float(next_after) - ratio * float(seconds)) <= 0.002
        if int(sessions) and owed is not None:
            assert int(steps) >= 1 and float(decoded) >= owed - 0.002, (steps, decoded, owed)
            checked += 1
        owed = float(next_after)
    assert checked >= 1  # some prefills did wait for the batch


@pytest.mark.slow
def test_compiled_decode_server_gives_the_eager_servers_answers(batch_server, tmp_path):
    """``--compile-decode eager``: the server's steps run dynamo's capture of a static batch (each step attends the
    whole capacity, visibility and clip ranges on the device), warmed up before the first request. Four concurrent
    requests with different max_tokens and stops get exactly the answers the eager batch server gives them, and at
    least one step decoded two sessions or more (the graph whose batch size is symbolic). ``/health`` says ok only
    once the step is compiled."""
    from tests.test_serve import contexts, metric

    eager_base, _ = batch_server
    docs = contexts(4, tokens=300)
    max_tokens, stops = [16, 20, 24, 12], [None, ["."], None, [","]]
    log_path = tmp_path / "server.log"
    with running_server(["--method", "compresskv_paper", "--max-batch", "4", "--compile-decode", "eager",
                         "--log-level", "info"], log_path) as base:
        assert "compiled decode warmed up" in log_path.read_text()  # /health answered 503 until then
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(_ask, base, docs[i], QUESTIONS[i], max_tokens[i], stops[i]) for i in range(4)]
            compiled = [f.result() for f in futures]
        single = metric(base, "kvcompress_batch_size_bucket", '{le="1.0"}')
        assert metric(base, "kvcompress_batch_size_count") > single
    assert compiled == [_ask(eager_base, docs[i], QUESTIONS[i], max_tokens[i], stops[i]) for i in range(4)]


@pytest.mark.slow
def test_a_session_joining_and_one_cancelled_leave_the_others_unchanged(batch_server):
    import httpx

    from tests.test_serve import contexts, doc_question, metric

    base, _ = batch_server
    docs = contexts(11, tokens=300)[8:]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    cancelled = metric(base, "kvcompress_cancelled_total")
    started, results = threading.Event(), {}

    def stream_a() -> None:
        body = {"messages": doc_question(docs[0], QUESTIONS[0]), "max_tokens": 24, "temperature": 0, "stream": True}
        pieces = []
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers, timeout=300) as r:
            for line in r.iter_lines():
                if '"content": "' in line and '"content": ""' not in line:
                    pieces.append(line)
                    if len(pieces) == 2:
                        started.set()  # A is decoding: B joins, C starts and hangs up
        results["a"] = pieces

    def cancel_c() -> None:
        body = {"messages": doc_question(docs[2], QUESTIONS[2]), "max_tokens": 60, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers, timeout=300) as r:
            seen = 0
            for line in r.iter_lines():
                if '"content": "' in line and '"content": ""' not in line:
                    seen += 1
                    if seen == 2:
                        break

    a = threading.Thread(target=stream_a)
    a.start()
    assert started.wait(300)
    c = threading.Thread(target=cancel_c)
    c.start()
    b = _ask(base, docs[1], QUESTIONS[1], 12)
    a.join()
    c.join()
    deadline = time.time() + 60
    while metric(base, "kvcompress_cancelled_total") == cancelled and time.time() < deadline:
        time.sleep(0.5)
    assert metric(base, "kvcompress_cancelled_total") == cancelled + 1
    a_text = "".join(json.loads(line[6:])["choices"][0]["delta"]["content"] for line in results["a"])
    assert (a_text, b) == (_ask(base, docs[0], QUESTIONS[0], 24)[0], _ask(base, docs[1], QUESTIONS[1], 12))


@pytest.mark.slow
def test_memory_budget_queues_then_429_and_never_evicts_an_active_session(batch_server):
    """Each request reserves ~740 rows (its answer's room): two fit the budget at once, 8 wait, the rest get
    429 with Retry-After; every admitted one gets the answer a lone request gets, and the resident bytes never
    pass the budget (stored contexts are evicted to make room, active sessions never)."""
    import httpx

    from tests.test_serve import metric

    base, _ = batch_server
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"messages": [{"role": "user", "content": "Count from one to fifty."}], "max_tokens": 700,
            "temperature": 0, "stop": [","]}
    peak, done = [0.0], threading.Event()
    small = metric(base, "kvcompress_batch_size_bucket", '{le="2.0"}')
    steps = metric(base, "kvcompress_batch_size_count")

    def poll() -> None:
        while not done.wait(0.2):
            resident = sum(metric(base, "kvcompress_resident_bytes", f'{{kind="{k}"}}') for k in ("stored", "active"))
            peak[0] = max(peak[0], resident)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            replies = list(pool.map(lambda _: httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers,
                                                         timeout=300), range(16)))
    finally:
        done.set()
        poller.join()
    codes = sorted(r.status_code for r in replies)
    assert set(codes) == {200, 429} and codes.count(200) >= 9, codes  # one admitted at once + 8 waiting
    assert metric(base, "kvcompress_batch_size_count") - steps == metric(
        base, "kvcompress_batch_size_bucket", '{le="2.0"}') - small  # the budget held every step to 2 sessions
    busy = next(r for r in replies if r.status_code == 429)
    assert int(busy.headers["Retry-After"]) >= 1 and busy.json()["error"]["param"] == "queue"
    alone = httpx.post(f"{base}/v1/chat/completions", json=body, headers=headers, timeout=300).json()
    answers = {r.json()["choices"][0]["message"]["content"] for r in replies if r.status_code == 200}
    assert answers == {alone["choices"][0]["message"]["content"]}
    assert 0 < peak[0] <= BUDGET

    too_big = httpx.post(f"{base}/v1/chat/completions", headers=headers, timeout=60,
                         json={**body, "max_tokens": 3000})  # within the model's 8k, not within the budget
    assert too_big.status_code == 413 and too_big.json()["error"]["param"] == "max_tokens"
    unbounded = httpx.post(f"{base}/v1/chat/completions", headers=headers, timeout=300,
                           json={"messages": [{"role": "user", "content": "Say hi."}], "temperature": 0})
    assert unbounded.status_code == 200  # no max_tokens: the server lowers its default to what the budget holds


@pytest.mark.slow
def test_bad_inputs_keep_their_errors_and_phases_are_logged(batch_server):
    import httpx

    from tests.test_serve import BAD_INPUTS

    base, log_path = batch_server
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for _ in range(2):  # a prefill, then a reuse hit
        ok = httpx.post(f"{base}/v1/chat/completions", headers=headers, timeout=300, json={
            "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 3, "temperature": 0})
        assert ok.status_code == 200
    for body, status, param in BAD_INPUTS:  # json.dumps: a lone surrogate escaped (see test_serve)
        r = httpx.post(f"{base}/v1/chat/completions", content=json.dumps(body),
                       headers={**headers, "Content-Type": "application/json"}, timeout=60)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), (body, r.text)
    log = log_path.read_text()
    for phase in (r"queued: context \d+ tokens", r"prefill\+compress: \d+ context tokens -> \d+ rows in [\d.]+ s",
                  r"reuse hit: \d+ context tokens",
                  r"question prefill: \d+ tokens in [\d.]+ s \(\d+ chunks?\); first token",
                  r"decode: \d+ tokens in [\d.]+ s \([\d.]+ tokens/s\)"):
        assert re.search(r"INFO kvcompress\.serve: request \S+ " + phase, log), phase


@pytest.mark.slow
def test_prefill_budget_defers_new_contexts_while_sessions_decode_and_lets_follow_ups_pass(embedded_dir,
                                                                                            tmp_path_factory):
    """``--decode-per-prefill 1e6``: a new context's prefill waits until the batch has decoded a million times the
    previous prefill's seconds, i.e. here until the batch is empty. A streams a long answer; B and C (new contexts)
    and then D (A's context again: a store hit) arrive while A decodes. Read from the server's log and metrics:
    D passes B and C and joins A's batch; B's prefill runs only after every one of A's decode steps; C's only after
    B's whole answer; no context prefill ran while a session decoded."""
    import httpx

    from tests.test_serve import contexts, doc_question, metric

    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    args = ["--method", "compresskv_paper", "--max-batch", "8", "--cache-memory", str(BUDGET), "--log-level", "info",
            "--decode-per-prefill", "1e6"]
    docs = contexts(3, tokens=300)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with running_server(args, log_path) as base:
        _ask(base, docs[0], QUESTIONS[1], 1)  # stores A's context: D will be a hit
        decoding, pieces = threading.Event(), []

        def stream_a() -> None:
            body = {"messages": doc_question(docs[0], QUESTIONS[0]), "max_tokens": 48, "temperature": 0,
                    "stream": True}
            with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, headers=headers, timeout=300) as r:
                for line in r.iter_lines():
                    if '"content": "' in line and '"content": ""' not in line:
                        pieces.append(line)
                        if len(pieces) == 2:
                            decoding.set()

        def arrived(count: int) -> None:
            """Wait until the server has logged ``count`` arrivals (so B, C and D arrive in that order)."""
            deadline = time.time() + 120
            while log_path.read_text().count(" queued: context ") < count:
                assert time.time() < deadline, "the server never logged the request's arrival"
                time.sleep(0.05)

        a = threading.Thread(target=stream_a)
        a.start()
        assert decoding.wait(300)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            b = pool.submit(_ask, base, docs[1], QUESTIONS[1], 12)
            arrived(3)  # the store request, A, B
            c = pool.submit(_ask, base, docs[2], QUESTIONS[2], 12)
            arrived(4)
            d = pool.submit(_ask, base, docs[0], QUESTIONS[3], 6)
            answers = [f.result() for f in (b, c, d)]
        a.join()
        prefills_while_decoding = metric(base, "kvcompress_decode_steps_between_prefills_count")
    log = log_path.read_text()
    rid = {}  # request id per (context, question): the order of the "queued" lines is the order of arrival
    for m in re.finditer(r"request (\S+) queued: context (\d+) tokens, question (\d+) tokens, max_tokens (\d+)", log):
        rid.setdefault(int(m.group(4)), []).append(m.group(1))
    a_id, b_id, c_id, d_id = rid[48][0], rid[12][0], rid[12][1], rid[6][0]

    def at(pattern: str) -> int:
        match = re.search(pattern, log)
        assert match, pattern
        return match.start()

    a_tokens = len(pieces)
    assert a_tokens >= 20 and all(n >= 1 for _, _, n in answers)
    assert at(f"request {d_id} reuse hit") < at(f"request {b_id} prefill\\+compress")  # D passed B (and C)
    assert at(f"request {a_id} decode: ") < at(f"request {b_id} prefill\\+compress")
    assert at(f"request {b_id} decode: ") < at(f"request {c_id} prefill\\+compress")
    assert prefills_while_decoding == 0


@pytest.mark.parametrize("step", [1, 256], ids=["eager", "compiled"])
def test_admission_names_what_to_change_when_a_request_cannot_fit(step):
    """The budget check before queueing (no model: an engine's byte counts only). A context whose compressed cache
    alone passes the budget is refused naming the prompt, whatever max_tokens; a max_tokens the budget cannot
    hold, naming max_tokens; without max_tokens the answer is cut to what fits, one token at the least (it
    needs no batch rows). Before, a prompt that left no room said 'room for -N tokens'. A compiled server's batch
    capacity comes in steps of 256 rows: what fits is counted in whole steps."""
    from types import SimpleNamespace

    from kvcompress.serve.jobs import Job, TooLarge
    from kvcompress.serve.metrics import ServerMetrics
    from kvcompress.serve.scheduler import Scheduler

    engine = SimpleNamespace(metrics=ServerMetrics(), kept_fraction=0.25, compress_min_tokens=0, context_row_bytes=100,
                             batch_row_bytes=100, batch_session_bytes=10, warm_up=lambda: None,
                             batch_capacity=lambda rows: -(-rows // step) * step, capacity_step=step)  # fmt: skip
    scheduler = Scheduler(engine, max_batch=4, max_batch_tokens=10_000, memory=100_000, max_queue=0)
    try:
        huge = Job(list(range(4004)), [1, 2], max_tokens=1)  # 1001 rows once compressed: 100,100 bytes
        for job in (huge, Job(huge.context_ids, [1, 2], max_tokens=500, flexible_max=True)):
            with pytest.raises(TooLarge, match="^the prompt's context needs about") as error:
                scheduler.submit([job])
            assert error.value.param == "prompt"
        with pytest.raises(TooLarge, match=r"^max_tokens: .* room for 2000 tokens") as error:
            scheduler.submit([Job(list(range(400)), [1, 2], max_tokens=2000)])
        assert error.value.param == "max_tokens"
        # room: (100,000 - 10) // 100 = 999 batch rows (768 in steps of 256), for the context's rows, the question's 2
        # and max_tokens - 1
        room = 999 - 999 % step
        for context, expected in ((400, room - 100 - 2 + 1), (3992, 1)):  # 100 and 998 context rows
            job = Job(list(range(context)), [1, 2], max_tokens=5000, flexible_max=True)
            with pytest.raises(Exception, match="queue"):  # fits: it reaches the (empty) queue
                scheduler.submit([job])
            assert job.max_tokens == expected
    finally:
        scheduler.stop()


def test_a_requests_choices_are_queued_all_or_none():
    """``n`` choices need ``n`` places in the queue: with fewer left, the request is refused whole (nothing waits
    for choices that would never all run)."""
    from types import SimpleNamespace

    from kvcompress.serve.jobs import Job, QueueFull
    from kvcompress.serve.metrics import ServerMetrics
    from kvcompress.serve.scheduler import Scheduler

    engine = SimpleNamespace(metrics=ServerMetrics(), kept_fraction=0.25, compress_min_tokens=0, context_row_bytes=100,
                             batch_row_bytes=100, batch_session_bytes=10, warm_up=lambda: None,
                             batch_capacity=lambda rows: rows, capacity_step=1)  # fmt: skip
    scheduler = Scheduler(engine, max_batch=4, max_batch_tokens=10_000, memory=100_000, max_queue=2)
    try:
        jobs = [Job(list(range(400)), [1, 2], max_tokens=5, index=i) for i in range(3)]
        with pytest.raises(QueueFull, match="queue"):
            scheduler.submit(jobs)
        assert not scheduler._waiting
    finally:
        scheduler.stop()


def test_requests_whose_clients_left_hold_no_place_in_the_queue():
    """``--max-queue`` counts live requests: waiting requests whose clients disconnected, anywhere in the queue (not
    only at its head), no longer turn new clients away with 429; the worker drops them, and the queue depth with
    them."""
    import threading
    from types import SimpleNamespace

    from kvcompress.serve.jobs import Job, QueueFull
    from kvcompress.serve.metrics import ServerMetrics
    from kvcompress.serve.scheduler import Scheduler

    started = threading.Event()
    engine = SimpleNamespace(metrics=ServerMetrics(), kept_fraction=0.25, compress_min_tokens=0, context_row_bytes=100,
                             batch_row_bytes=100, batch_session_bytes=10, warm_up=started.wait,
                             batch_capacity=lambda rows: rows, capacity_step=1)  # fmt: skip
    scheduler = Scheduler(engine, max_batch=4, max_batch_tokens=10_000, memory=100_000, max_queue=3)
    try:  # the worker waits in warm_up: the queue holds what is submitted
        first, *left = [Job(list(range(40)), [1, 2], max_tokens=5) for _ in range(3)]
        scheduler.submit([first, *left])
        with pytest.raises(QueueFull):
            scheduler.submit([Job(list(range(40)), [1, 2], max_tokens=5)])
        for job in left:  # behind a live request: not at the queue's head
            job.cancelled.set()
        late = [Job(list(range(40)), [1, 2], max_tokens=5) for _ in range(2)]
        scheduler.submit(late)
        with pytest.raises(QueueFull):
            scheduler.submit([Job(list(range(40)), [1, 2], max_tokens=5)])
        assert list(scheduler._waiting) == [first, *late]  # dropped from anywhere in the queue, not only its head
    finally:
        scheduler.stop()
        started.set()


def test_the_batch_capacity_is_each_layers_widest_session_an_estimate_standing_for_every_layer():
    """Sessions reserve rows per layer (a press may give some layers more); a request not yet prefilled is one
    estimate for every layer. The batch's bytes are each layer's capacity times a row's share of every layer."""
    from types import SimpleNamespace

    from kvcompress.serve.batch import batch_bytes
    from kvcompress.serve.metrics import ServerMetrics
    from kvcompress.serve.scheduler import Scheduler

    engine = SimpleNamespace(metrics=ServerMetrics(), kept_fraction=0.25, compress_min_tokens=0, context_row_bytes=300,
                             batch_row_bytes=300, batch_session_bytes=10, warm_up=lambda: None,
                             batch_capacity=lambda rows: rows, capacity_step=1)  # fmt: skip
    scheduler = Scheduler(engine, max_batch=4, max_batch_tokens=10_000, memory=100_000, max_queue=0)
    try:
        sessions = [SimpleNamespace(need=(50, 140, 50)), SimpleNamespace(need=(90, 100, 90)), SimpleNamespace(need=())]
        assert scheduler._capacity(sessions) == (90, 140, 90)
        assert scheduler._capacity(sessions, (120,)) == (120, 140, 120)
        assert scheduler._capacity([], (120,)) == (120,) and scheduler._capacity([]) == ()
        assert scheduler._batch_bytes(2, (90, 140, 90)) == 2 * ((90 + 140 + 90) * 100 + 10)
        assert batch_bytes(2, (120,), 300, 10) == 2 * (120 * 300 + 10) and batch_bytes(3, (), 300, 10) == 0
    finally:
        scheduler.stop()


def test_a_stored_context_reserves_its_own_rows_in_each_layer():
    """A stored context kept wider in some layers (a retrieval layer, a layer kept whole) reserves each layer's own
    rows plus the question and the answer's tokens, not its widest layer's rows in every layer (which made a context
    with a whole layer look several times its size and evicted it from the store); a context not yet prefilled is
    one estimate for every layer, and one read in chunks holds all its rows uncompressed until its last chunk."""
    from types import SimpleNamespace

    from kvcompress.serve.jobs import Job
    from kvcompress.serve.metrics import ServerMetrics
    from kvcompress.serve.scheduler import Scheduler

    layers = [SimpleNamespace(keys=torch.empty(1, 2, rows, 4)) for rows in (30, 400, 30)]
    entry = SimpleNamespace(cache=SimpleNamespace(layers=layers), key="stored")
    engine = SimpleNamespace(metrics=ServerMetrics(), kept_fraction=0.25, compress_min_tokens=0,
                             context_row_bytes=300, batch_row_bytes=300, batch_session_bytes=10,
                             warm_up=lambda: None, batch_capacity=lambda rows: rows,
                             capacity_step=1, stored=lambda ids: entry if len(ids) == 400 else None,
                             bytes_held_while_read=lambda ids: 0)  # fmt: skip
    scheduler = Scheduler(engine, max_batch=4, max_batch_tokens=10_000, memory=100_000, max_queue=0)
    try:
        need, new_bytes, key = scheduler._estimate(Job(list(range(400)), [1, 2, 3], max_tokens=5))
        assert need == (30 + 3 + 4, 400 + 3 + 4, 30 + 3 + 4) and new_bytes == 0 and key == "stored"
        engine.store = SimpleNamespace(longest_prefix=lambda *args: None)
        engine.prefix_min_fraction, engine.model_name, engine.press_label = 0.5, "m", "p"
        need, new_bytes, key = scheduler._estimate(Job(list(range(200)), [1, 2, 3], max_tokens=5))
        assert need == (50 + 3 + 4,) and new_bytes == 50 * 300 and key is None
        engine.bytes_held_while_read = lambda ids: 1000 * len(ids)  # read in chunks: all 200 rows uncompressed
        need, new_bytes, key = scheduler._estimate(Job(list(range(200)), [1, 2, 3], max_tokens=5))
        assert need == (50 + 3 + 4,) and new_bytes == 200 * 1000 and key is None
    finally:
        scheduler.stop()
