"""CompressKVPress(retrieval_layers=...): more middle rows in the named layers, the same total, the priors' shares
there; the caches it makes (one row count per layer) through generate, a static cache and the server's batch."""

from __future__ import annotations

import copy

import pytest
import torch

import kvcompress.presses as presses
from kvcompress import CompressKVPress
from kvcompress.static_cache import StaticWeightedCache
from tests.test_padding import answer, prefill, random_ids
from tests.test_press_options import compressed_cache, tokens
from tests.test_serve import pipe  # noqa: F401  (the embedded model, a fixture)
from tests.tiny_models import tiny_model

CONTEXT = 320


def press(**options) -> CompressKVPress:
    return CompressKVPress(compression_ratio=0.75, seed=3, window_size=16, **options)


@pytest.mark.parametrize(
    "share, expected", [(1.0, {"novelty": 60, "induction": 30}), (0.5, {"novelty": 45, "induction": 22}),
                        (0.0, {"novelty": 30, "induction": 15})],
)  # fmt: skip
def test_named_layers_get_more_middle_rows_the_others_give_them_up_and_the_priors_take_their_share(
    monkeypatch, share, expected
):
    """4 layers, a 320-token context at 25% kept: 80 rows a head, 4 sink + 16 window + a middle of 60. Layer 1 gets
    twice the middle (120); the 3 others give up 60 / 3 = 20 middle rows each (40): 140 + 3 x 60 = 4 x 80 rows.
    The priors' reserved counts in layer 1 are their shares (1/2, 1/4) of the uniform 60 rows plus ``share`` of the 60
    extra ones (share 0: the uniform press's counts, the extra rows all to the window's attention); in the others
    they are shares of the 40 rows left."""
    reserved: dict[str, list] = {"uniform": [], "retrieval": []}
    mixed_scores = presses.mixed_scores
    label = "uniform"

    def recording(*args, **kwargs):
        reserved[label].append(kwargs["reserved"])
        return mixed_scores(*args, **kwargs)

    monkeypatch.setattr(presses, "mixed_scores", recording)
    model = tiny_model("llama", num_hidden_layers=4)
    context = tokens(CONTEXT, 1)
    uniform = compressed_cache(model, press(), context)
    label = "retrieval"
    moved = compressed_cache(model, press(retrieval_layers=(1,), retrieval_prior_share=share), context)
    assert [layer.keys.shape[-2] for layer in uniform.layers] == [80] * 4
    assert [layer.keys.shape[-2] for layer in moved.layers] == [60, 140, 60, 60]
    for layer in moved.layers:  # a weight per row, and the sink and window kept exact (weight 1)
        assert layer.row_weights.shape[-1] == layer.keys.shape[-2]
        assert torch.equal(layer.row_weights[..., :4], torch.ones_like(layer.row_weights[..., :4]))
        assert torch.equal(layer.row_weights[..., -16:], torch.ones_like(layer.row_weights[..., -16:]))
    assert reserved["uniform"][1] == {"novelty": 30, "induction": 15}
    assert reserved["retrieval"][1] == expected
    assert reserved["retrieval"][0] == {"novelty": 20, "induction": 10}


def test_a_factor_of_one_keeps_the_uniform_cache_bit_for_bit():
    """retrieval_rows=1.0 moves no row: the press's math is the default's, so its cache is the same."""
    model = tiny_model("qwen2", num_hidden_layers=3)
    context = tokens(CONTEXT, 2)
    expected = compressed_cache(model, press(), context)
    got = compressed_cache(model, press(retrieval_layers=[2], retrieval_rows=1.0), context)
    for layer, twin in zip(got.layers, expected.layers, strict=True):
        assert torch.equal(layer.keys, twin.keys) and torch.equal(layer.values, twin.values)
        assert torch.equal(layer.row_weights, twin.row_weights)


@pytest.mark.parametrize(
    "family, layers, message",
    [
        ("llama", (2,), r"^retrieval_layers: 2 is not a full-attention layer of this 2-layer model; accepted: 0 to 1$"),
        ("gemma3", (0,), r"^retrieval_layers: 0 is not a full-attention layer of this 3-layer model; accepted: 1$"),
        ("llama", (0, 1), r"^retrieval_layers: \(0, 1\) names every full-attention layer"),
    ],
)
def test_layers_the_model_does_not_have_are_refused_before_the_prefill(family, layers, message):
    model = tiny_model(family)
    with pytest.raises(ValueError, match=message), press(retrieval_layers=layers)(model):
        pass
    assert not any(module._forward_hooks for module in model.modules())


@pytest.mark.parametrize("padded", [False, True])
def test_generate_on_a_static_cache_equals_the_dynamic_one(padded):
    """Layers of different row counts (and, padded, batch rows of different lengths) through generate: the static
    copy answers as the dynamic cache does."""
    from kvcompress.padding import pad_rows

    model = tiny_model("llama", num_hidden_layers=3)
    contexts = [random_ids(n, seed=n) for n in ((300, 90, 170) if padded else (260,))]
    ids, mask = pad_rows(contexts, "left") if padded else (contexts[0], None)
    question = random_ids(5, seed=99).expand(len(contexts), -1)
    cache = prefill(model, press(retrieval_layers=(1,)), ids, mask)
    rows = [layer.keys.shape[-2] for layer in cache.layers]
    assert rows[1] > rows[0] == rows[2]
    expected = answer(model, copy.deepcopy(cache), ids, mask, question)
    got = answer(model, StaticWeightedCache.from_compressed(cache, max_new_tokens=16), ids, mask, question)
    assert torch.equal(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1], rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_the_servers_decode_batch_equals_each_session_alone_and_holds_each_layers_own_rows():
    """The server's batch gives each layer its own row counts (one RowCounts per distinct lengths) and its own
    capacity: two sessions compressed with a retrieval layer, float64, each step's logits those of the session
    alone (1e-9: see test_serve_batch's joins-and-leaves test); the batch holds each layer's widest session plus
    the answer's rows, the bytes the scheduler counts for it, not the widest layer's rows in every layer."""
    from kvcompress.hf_attention import use_weighted_attention
    from kvcompress.serve.batch import batch_bytes, build, row_bytes, session_rows
    from kvcompress.serve.step import decode_step
    from kvcompress.serve.store import answer_view
    from tests.test_serve_batch import _alone, _sessions

    model = tiny_model("llama", dtype=torch.float64, num_hidden_layers=3)
    use_weighted_attention(model)
    sessions = _sessions(model, press(retrieval_layers=(2,)), [(300, 5, True), (420, 7, True)])
    assert len({layer.keys.shape[-2] for layer in sessions[0][2].layers}) == 2
    steps = 4
    capacities = [max(cache.layers[i].keys.shape[-2] for _, _, cache in sessions) + 7 + steps for i in range(3)]
    assert capacities[2] > capacities[0] == capacities[1]
    alone = [_alone(model, *session, steps) for session in sessions]
    batch, positions, last = None, [], []
    for ctx, question, cache in sessions:
        view = answer_view(cache)
        n, m = ctx.shape[1], question.shape[1]
        out = model(input_ids=question, past_key_values=view, position_ids=torch.arange(n, n + m)[None],
                    logits_to_keep=1)  # fmt: skip
        batch = build(batch, list(range(len(positions))), [session_rows(view)], capacities)
        positions.append(n + m)
        last.append(out.logits[0, -1])
    assert batch.capacities == tuple(capacities) and batch.capacity == capacities[2]
    clip_ranges = 3 * 2 * 16 * 4 * 2  # layers x KV heads x head dim x float32, v_min and v_max
    assert batch.nbytes() == batch_bytes(2, capacities, row_bytes(sessions[0][2]), clip_ranges)
    for step in range(steps):
        tokens_now = [int(logits.argmax()) for logits in last]
        logits = decode_step(model, batch, tokens_now, [p + step for p in positions])
        for index, expected in enumerate(alone):
            torch.testing.assert_close(logits[index], expected[step + 1], rtol=0, atol=1e-9)
        last = list(logits)


@pytest.mark.slow
def test_a_server_batch_with_a_retrieval_layer_answers_each_request_as_alone(pipe):  # noqa: F811
    """The embedded model under the default press (its calibration: layer 18 widened, layer 7 kept whole), three
    requests decoded together by the scheduler: each answer is the one it gets alone (greedy; float32, so the batch
    moves logits by ~1e-5 against a lone row, as in test_serve_batch), and the batch gave layer 7 the most room,
    layer 18 more than the others."""
    import threading

    from kvcompress.serve.engine import Engine
    from kvcompress.serve.jobs import Job
    from kvcompress.serve.metrics import ServerMetrics
    from kvcompress.serve.protocol import Message, chat_split
    from kvcompress.serve.store import ContextStore
    from tests.test_serve import QUESTIONS, contexts

    built = []
    engine = Engine(pipe.model, pipe.tokenizer, model_name="m", press_label="r", store=ContextStore(10**9),
                    press=CompressKVPress(compression_ratio=0.75), metrics=ServerMetrics(),
                    max_batch=4, compress_min_tokens=0)  # fmt: skip  # the chat header alone is the context
    build_batch = engine.build_batch
    engine.build_batch = lambda *args: built.append(args[-1]) or build_batch(*args)
    try:
        prompts = [chat_split(pipe.tokenizer, [Message(role="user", content=text + QUESTIONS[i % 2])])
                   for i, text in enumerate(contexts(3))]  # fmt: skip

        def job(context_ids, question_ids, done=None):
            new = Job(context_ids, question_ids, max_tokens=10, temperature=0.0)
            new.text = []

            def emit(kind, *rest):
                if kind == "text":
                    new.text.append(rest[0])
                elif done is not None:
                    done.release()

            new.emit = emit
            return new

        alone = []
        for prompt in prompts:
            alone.append(job(*prompt))
            engine.run_alone(alone[-1])
        done = threading.Semaphore(0)
        together = [job(*prompt, done=done) for prompt in prompts]
        engine.submit(together)
        for _ in together:
            assert done.acquire(timeout=300)
        assert ["".join(j.text) for j in together] == ["".join(j.text) for j in alone]
        widths = max(built[len(prompts):], key=len)  # the scheduler's batches (after the three alone)
        whole = {layer for prompt in prompts for layer in engine.press.full_layers_at(len(prompt[0]))}
        assert whole == {7, 23}  # contexts under 1448 tokens: the calibration's choice near 1024
        others = [w for i, w in enumerate(widths) if i not in whole | {18}]
        assert min(widths[i] for i in whole) > widths[18] > max(others)
    finally:
        engine.shutdown()
