"""Continuous batching (kvcompress.serve.batch / scheduler): the decode batch against each session alone on a tiny
random model (fast), and a real server with the embedded model against the official ``openai`` client (slow)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DynamicCache

from tests.tiny_models import tiny_model

ROOT = Path(__file__).resolve().parents[1]


def _sessions(model, press, specs, seed=0):
    """Per spec (context tokens, question tokens, compressed?): (context ids, question ids, stored cache)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n_ctx, n_q, compressed in specs:
        ctx = torch.randint(0, model.config.vocab_size, (1, n_ctx), generator=g)
        question = torch.randint(0, model.config.vocab_size, (1, n_q), generator=g)
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
    out = model(input_ids=question, past_key_values=cache, position_ids=torch.arange(n, n + m)[None],
                logits_to_keep=1)
    logits = [out.logits[0, -1]]
    for step in range(steps):
        token = logits[-1].argmax().view(1, 1)
        out = model(input_ids=token, past_key_values=cache, position_ids=torch.tensor([[n + m + step]]))
        logits.append(out.logits[0, -1])
    return logits


@torch.no_grad()
def test_decode_batch_equals_each_session_alone_with_joins_and_leaves():
    """Three sessions of different compressed lengths (and one never compressed), different question lengths and
    positions: each step of the batch gives each session the logits it gets alone, while one session joins late
    and one leaves early (the batch rebuilt around them). float64, so the batch's other reduction order (a GEMM
    over the batch instead of a GEMV per session) moves logits by ~1e-13; 1e-9 leaves room for that and nothing
    a wrong position, mask or weight would give (those change logits by O(1e-2) or more on this model)."""
    from kvcompress.hf_attention import use_weighted_attention
    from kvcompress.registry import make_press
    from kvcompress.serve.batch import build, decode_step, session_rows
    from kvcompress.serve.store import answer_view

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
        logits = decode_step(model, batch, [members[s][0] for s in order], [members[s][1] for s in order])
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


@torch.no_grad()
def test_decode_batch_rows_are_masked_not_read():
    """A batch row never reads another row's or its own unused rows: filling them with garbage (large keys and
    values beyond each row's length) changes no bit of the logits (a masked row adds exactly 0)."""
    from kvcompress.hf_attention import use_weighted_attention
    from kvcompress.registry import make_press
    from kvcompress.serve.batch import build, decode_step, session_rows

    model = tiny_model("llama", dtype=torch.float64, seed=1)
    press = make_press("compresskv_paper", 0.75, 0)
    use_weighted_attention(model)
    sessions = _sessions(model, press, [(280, 4, True), (360, 4, True)], seed=3)
    sources = [session_rows(c) for _, _, c in sessions]
    tokens, positions = [5, 7], [284, 364]
    clean = decode_step(model, build(None, [], sources, 200), tokens, positions)
    dirty = build(None, [], sources, 200)
    for layer in dirty.layers:
        for b, n in enumerate(layer.lengths):
            layer.keys[b, :, n:] = 1e3 * torch.randn_like(layer.keys[b, :, n:])
            layer.values[b, :, n:] = 1e3 * torch.randn_like(layer.values[b, :, n:])
    poisoned = decode_step(model, dirty, tokens, positions)
    assert torch.isfinite(poisoned).all()
    torch.testing.assert_close(poisoned, clean, rtol=0, atol=0)
