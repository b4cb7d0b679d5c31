"""Reference sources of CompressKVPress (kvcompress.reference) on tiny random models: the prefill's own queries
(non-causal "context", causal "accumulated"), a partial repeat pass, and the default's cache kept bit for bit
(rows) by the fused / chunked mass and the blocked fit."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvcompress import CompressKVPress, fit_equations, reference
from kvcompress.reference import novel_pieces, post_rope_queries, spread_pieces
from tests.references import float64_attention_mass, float64_fit_rows
from tests.test_press_options import compressed_cache, tokens
from tests.tiny_models import tiny_model

CONTEXT = 320


def float64_mass(queries, keys, scaling, query_positions=None, *, reduce="sum", key_mask=None, row_lse=None):
    """The definition of attention_mass in float64, returned as float32 like the library's (monkeypatched in); a
    handed-over ``row_lse`` is not used: the definition normalises each row itself."""
    return float64_attention_mass(queries, keys, scaling, query_positions, reduce=reduce, key_mask=key_mask).float()


def dense_sums(prob, kept_prob, owner, values, bins, k):
    """fit_equations.held_sums by its definition: every kept row's cross sums against every position, then own bin."""
    problems, m, n = prob.shape
    a = kept_prob.double()
    blocks = a.reshape(problems, m, bins, k).permute(0, 2, 3, 1)
    gram = blocks @ blocks.transpose(-1, -2)
    c_all = prob.double().transpose(1, 2) @ a  # [P, n, T * k]
    own = (owner.clamp_min(0) * k)[..., None] + torch.arange(k)
    c = c_all.gather(2, own) * (owner >= 0)[..., None]
    mass = torch.zeros(problems, bins, k, dtype=torch.float64).scatter_add_(
        1, owner.clamp_min(0)[..., None].expand(-1, -1, k), c
    )
    value_rhs = torch.einsum(
        "pnk,pnd,pnt->ptkd", c, values, torch.nn.functional.one_hot(owner.clamp_min(0), bins).double()
    )
    return gram, mass, value_rhs


def test_default_keeps_its_cache_under_the_reference_definitions(monkeypatch):
    """The default's math did not change: the same rows, weights and values within float32 rounding."""
    model = tiny_model("llama", num_hidden_layers=2)
    context = tokens(CONTEXT, 4)
    now = compressed_cache(model, CompressKVPress(compression_ratio=0.75, seed=1), context)
    monkeypatch.setattr(reference, "attention_mass", float64_mass)
    monkeypatch.setattr(fit_equations, "held_sums", dense_sums)
    before = compressed_cache(model, CompressKVPress(compression_ratio=0.75, seed=1), context)
    for layer, ref in zip(now.layers, before.layers, strict=True):
        assert torch.equal(layer.keys, ref.keys)  # the same rows: kept keys are the cache's own rows
        # The fit's cross sums are float32 products (relative ~1e-7 per term) fed to a ridge solve whose
        # condition (<~ 1 / ridge = 10 times the bins' spread) amplifies them: 1e-4 of each tensor's scale.
        for got, want in ((layer.row_weights, ref.row_weights), (layer.values, ref.values)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4 * want.abs().max().item())
        assert not torch.equal(layer.row_weights, torch.ones_like(layer.row_weights))  # the fit ran


@pytest.mark.parametrize("source", ["context", "accumulated"])
def test_prefill_sources_are_the_mass_of_all_prefill_queries(source, monkeypatch):
    model = tiny_model("qwen2", num_hidden_layers=2)
    context = tokens(CONTEXT, 2)
    seen = {}
    layer = model.model.layers[1].self_attn
    layer.register_forward_pre_hook(
        lambda m, a, kw: seen.update(kw) if "hidden_states" in kw else None, with_kwargs=True
    )
    record = reference.record_prefill

    def spy(module, kwargs, keys, *args, **options):
        result = record(module, kwargs, keys, *args, **options)
        if module is layer:
            seen["keys"], seen["reference"] = keys, result
        return result

    monkeypatch.setattr("kvcompress.presses.record_prefill", spy)
    press = CompressKVPress(compression_ratio=0.75, reference=(source,), score_pooling="sum", fit_queries=16)
    cache = compressed_cache(model, press, context)
    assert cache.layers[1].keys.shape[2] == int(CONTEXT * 0.25)
    queries = post_rope_queries(layer, seen["hidden_states"], seen["position_embeddings"])
    positions = torch.arange(CONTEXT) if source == "accumulated" else None
    expected = float64_mass(queries, seen["keys"], layer.scaling, positions)
    got = seen["reference"].mass[source]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.sum(-1), torch.full_like(got.sum(-1), CONTEXT * 2.0))  # group 2, 1 per query
    fit_queries, fit_positions = seen["reference"].fit_queries()
    assert fit_queries.shape[2] == 16 and len(fit_positions) == 16
    if source == "context":  # used non-causally: every fit query sees every key
        assert torch.all(fit_positions == CONTEXT - 1)
    else:
        assert torch.equal(fit_positions, reference.even_sample(CONTEXT, 16))


def test_spread_pieces_and_the_partial_repeat_pass(monkeypatch):
    assert spread_pieces(1000, 1.0, 128) is None
    pieces = spread_pieces(1000, 0.25, 128)  # 8 pieces of 128 (the last one 104 tokens): 2 kept, spread
    assert torch.equal(pieces, torch.cat([torch.arange(0, 128), torch.arange(896, 1000)]))
    assert len(spread_pieces(1000, 1e-6, 128)) == 104  # at least one piece: the last
    assert torch.equal(spread_pieces(1000, 0.99, 128), torch.arange(1000))

    model = tiny_model("llama", num_hidden_layers=2)
    context = tokens(CONTEXT, 3)
    calls = []
    record = reference.record_repeat

    def spy(module, kwargs, keys, ref, samples, total):
        calls.append((kwargs["hidden_states"].shape[1], total))
        return record(module, kwargs, keys, ref, samples, total)

    monkeypatch.setattr("kvcompress.repeat_hooks.record_repeat", spy)
    press = CompressKVPress(
        compression_ratio=0.75, reference=("window", "repeat"), repeat_fraction=0.5, repeat_span=40, repeat_chunk=64
    )
    cache = compressed_cache(model, press, context)
    assert all(layer.keys.shape[2] == int(CONTEXT * 0.25) for layer in cache.layers)
    # 8 pieces of 40 tokens, 4 re-read (160 tokens) in chunks of 64: per layer 64 + 64 + 32 queries, streamed
    # (every chunk through layer 0, which is then compressed, then through layer 1).
    assert calls == [(64, 160), (64, 160), (32, 160)] * 2
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match=r"repeat_fraction: must be a number in \(0, 1\]"):
            CompressKVPress(repeat_fraction=bad)
    with pytest.raises(ValueError, match="repeat_span"):
        CompressKVPress(repeat_span=0)


def test_novel_pieces_take_the_pieces_of_the_most_novel_keys():
    generator = torch.Generator().manual_seed(11)
    # Two layers of [1, 3 heads, 1000] novelty on different scales per head; one key far out in pieces 2 and 7
    # (the last, 104 tokens) of every head: after the per-head min-max they score 1 and about 0.5, every other
    # key < 0.1.
    novelty = [torch.rand(1, 3, 1000, generator=generator) * torch.tensor([1.0, 5.0, 0.2])[:, None] for _ in range(2)]
    for layer in novelty:
        layer[..., 990] = layer.amax(-1) * 5
        layer[..., 300] = layer[..., 990] * 2
    pieces = novel_pieces(novelty, 0.25, 128)  # 8 pieces: 2 re-read, in position order
    assert torch.equal(pieces, torch.cat([torch.arange(256, 384), torch.arange(896, 1000)]))
    assert novel_pieces(novelty, 1.0, 128) is None
    assert torch.equal(novel_pieces(novelty, 1e-6, 128), torch.arange(256, 384))  # at least one piece: the top one
    # Against the definition (float64, per-head min-max, mean over heads and layers, a piece's max), fresh scores:
    novelty = [torch.rand(1, 2, 333, generator=generator) for _ in range(3)]
    stacked = torch.stack(novelty).double()[:, 0]  # [layers, heads, n]
    low, high = stacked.amin(-1, keepdim=True), stacked.amax(-1, keepdim=True)
    score = ((stacked - low) / (high - low)).mean((0, 1))
    piece_score = torch.stack([score[i : i + 32].max() for i in range(0, 333, 32)])
    want = piece_score.topk(round(0.3 * len(piece_score))).indices.sort().values
    got = novel_pieces(novelty, 0.3, 32)
    assert torch.equal(got, torch.cat([torch.arange(i * 32, min(333, i * 32 + 32)) for i in want.tolist()]))


def test_the_repeat_pass_rereads_the_novel_pieces(monkeypatch):
    model = tiny_model("qwen2", num_hidden_layers=2)
    context = tokens(CONTEXT, 3)
    seen = {"totals": []}
    record, choose = reference.record_repeat, reference.novel_pieces

    def spy_record(module, kwargs, keys, ref, samples, total):
        seen["totals"].append(total)
        return record(module, kwargs, keys, ref, samples, total)

    def spy_choose(novelty, fraction, span, device):
        seen["novelty"], seen["pieces"] = novelty, choose(novelty, fraction, span, device)
        return seen["pieces"]

    monkeypatch.setattr("kvcompress.repeat_hooks.record_repeat", spy_record)
    monkeypatch.setattr("kvcompress.presses.novel_pieces", spy_choose)
    press = CompressKVPress(
        compression_ratio=0.75,
        reference=("window", "novelty", "repeat"),
        repeat_fraction=0.25,
        repeat_span=20,
        repeat_pieces="novel",
    )
    cache = compressed_cache(model, press, context)
    assert all(layer.keys.shape[2] == int(CONTEXT * 0.25) for layer in cache.layers)
    assert len(seen["novelty"]) == 2 and seen["novelty"][0].shape == (1, 2, CONTEXT)  # every layer's, this row's
    assert len(seen["pieces"]) == 4 * 20  # 16 pieces of 20 tokens, 4 re-read
    assert set(seen["totals"]) == {80}
    for bad in ("random", None):
        with pytest.raises(ValueError, match="repeat_pieces: must be one of 'spread', 'novel'"):
            CompressKVPress(repeat_pieces=bad)
    with pytest.raises(ValueError, match="repeat_pieces: 'novel' needs 'novelty' and 'repeat' in reference"):
        CompressKVPress(reference=("window", "repeat"), repeat_pieces="novel")


def test_balanced_setting_and_registry_row():
    from kvcompress import registry

    press = CompressKVPress.balanced(0.75, seed=3, repeat_span=16)  # overrides replace single fields
    assert press.reference == ("window", "novelty", "induction", "repeat") and press.repeat_pieces == "novel"
    assert press.repeat_fraction == 0.25 and press.repeat_span == 16 and press.score_pooling == "max"
    assert press.compression_ratio == 0.75 and press.seed == 3 and press.fit == "values"
    assert press.fit_queries == 64  # 64 window + 64 repeat queries: the fit's share of a GPU prefill (BENCHMARKS)
    built = registry.make_press("compresskv_balanced", 0.75)
    assert built == CompressKVPress.balanced(0.75, seed=0) and built.repeat_span == 32
    assert registry.METHODS["compresskv_balanced"].label == "CompressKV (balanced)"


def test_press_specs_take_lists_of_sources():
    from kvcompress.fidelity.specs import make_press, parse_spec

    spec = parse_spec("compresskv[reference=[window,context],repeat_fraction=0.5]")
    assert spec.fields == {"reference": ["window", "context"], "repeat_fraction": 0.5}
    press = make_press(spec, 0.25)
    assert press.reference == ("window", "context") and press.repeat_fraction == 0.5


def test_key_novelty_against_its_float64_definition_and_the_outlier_it_keeps():
    from kvcompress.selection import key_novelty

    generator = torch.Generator().manual_seed(7)
    keys = torch.randn(2, 3, 50, 16, generator=generator) + 2.0  # a shared mean direction, as real keys have
    got = key_novelty(keys)
    k = keys.double()
    mean = k.mean(2, keepdim=True)
    want = 1 - (k * mean).sum(-1) / (k.norm(dim=-1) * mean.norm(dim=-1))
    # float32 normalisation and a 16-term dot: a few float32 ulps of values in [0, 2].
    torch.testing.assert_close(got, want.float(), rtol=0, atol=1e-5)
    outlier = keys.clone()
    outlier[:, :, 17] = -outlier[:, :, 17]  # opposite the mean direction: the largest novelty of its head
    assert (key_novelty(outlier).argmax(-1) == 17).all()


@pytest.mark.parametrize("chunk_elements", [None, 300])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (7, 1)])
def test_induction_score_against_its_float64_definition(heads, kv_heads, chunk_elements, monkeypatch):
    """One float64 loop over keys: p_j = softmax over keys 0..j of the query at j - 1, at key j; score
    sigmoid(log(j p_j)) max-pooled over the group; key 0 scores 0. float32 logits of 24-term dots and a
    log-sum-exp over up to 70 terms: a few float32 ulps of O(10) logits inside a sigmoid (slope <= 1/4).
    ``chunk_elements``: chunks of a few positions (and queries) at a time, the same result."""
    from kvcompress import selection
    from kvcompress.selection import causal_row_lse, induction_score

    if chunk_elements is not None:
        monkeypatch.setattr(selection, "_CHUNK_ELEMENTS", chunk_elements)

    generator = torch.Generator().manual_seed(heads)
    queries = torch.randn(2, heads, 70, 24, generator=generator) * 1.5
    keys = torch.randn(2, kv_heads, 70, 24, generator=generator)
    got = induction_score(queries, keys, 0.3)
    q, k = queries.double(), keys.double().repeat_interleave(heads // kv_heads, 1)
    want = torch.zeros(2, heads, 70, dtype=torch.float64)
    for j in range(1, 70):
        logits = 0.3 * (q[:, :, j - 1, None] * k[:, :, : j + 1]).sum(-1)  # [b, h, j + 1]: keys 0..j
        p = logits.softmax(-1)[..., j]
        want[:, :, j] = torch.sigmoid(torch.log(j * p))
    want = want.reshape(2, kv_heads, heads // kv_heads, 70).amax(2)
    assert got.dtype == torch.float32 and tuple(got.shape) == (2, kv_heads, 70)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5)
    lse = causal_row_lse(queries, keys, 0.3)
    mask = torch.ones(70, 70, dtype=torch.bool).tril()
    want_lse = (0.3 * q @ k.transpose(-1, -2)).masked_fill(~mask, float("-inf")).logsumexp(-1)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=2e-5)
    # A key that one query of its group, the one before it, recalls far more sharply than any other (p_40 near 1)
    # scores near the top of the scale, 40 / 41 (a prior ranks keys; the scale saturates for sharp recalls).
    sharp = keys.clone()
    leader = queries[:, :: heads // kv_heads, 39]
    sharp[:, :, 40] = 6.0 * leader / leader.norm(dim=-1, keepdim=True)
    assert (induction_score(queries, sharp, 0.3)[..., 40] > 0.97).all() and (got[..., 40] < 0.97).any()


def test_novelty_source_mixes_beside_a_query_source_and_needs_one_to_fit():
    model = tiny_model("llama", num_hidden_layers=2)
    context = tokens(CONTEXT, 5)
    press = CompressKVPress(compression_ratio=0.75, reference=("window", "novelty"), score_pooling="max")
    cache = compressed_cache(model, press, context)
    assert all(layer.keys.shape[2] == int(CONTEXT * 0.25) for layer in cache.layers)
    novelty = CompressKVPress(compression_ratio=0.75, reference=("novelty",), fit="none")
    alone = compressed_cache(model, novelty, context)
    window = compressed_cache(model, CompressKVPress(compression_ratio=0.75, reference=("window",)), context)
    # The mix differs from either source alone (else one of them changed nothing).
    assert not torch.equal(cache.layers[1].keys, window.layers[1].keys)
    assert not torch.equal(cache.layers[1].keys, alone.layers[1].keys)
    with pytest.raises(ValueError, match="fit: 'values' needs a query source in reference"):
        CompressKVPress(reference=("novelty",))


def test_induction_prior_takes_its_share_beside_novelty_and_the_window():
    model = tiny_model("llama", num_hidden_layers=2)
    context = tokens(CONTEXT, 6)
    both = CompressKVPress(compression_ratio=0.75)  # the default: window, novelty and induction
    assert both.reference == ("window", "novelty", "induction")
    cache = compressed_cache(model, both, context)
    assert all(layer.keys.shape[2] == int(CONTEXT * 0.25) for layer in cache.layers)
    novelty = compressed_cache(model, CompressKVPress(compression_ratio=0.75, reference=("window", "novelty")), context)
    assert not torch.equal(cache.layers[1].keys, novelty.layers[1].keys)  # the prior changed which rows stay
    unused = CompressKVPress(compression_ratio=0.75, induction_share=0)
    same = compressed_cache(model, unused, context)  # a share of 0: window + novelty's rows, weights and values
    for mine, theirs in zip(same.layers, novelty.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_induction_prior_reads_the_prefill_attentions_own_rows(family, monkeypatch):
    """An unpadded prefill under the press hands each layer's queries and causal log-sum-exp over from its own
    attention call (no second pass): the scores equal those computed from scratch (float32 log-sum-exps of two
    kernels: a few ulps inside a sigmoid), and the prefill's outputs equal those of a press without the prior."""
    from kvcompress import selection

    model = tiny_model(family, num_hidden_layers=2)
    context = tokens(CONTEXT, 8)
    calls = []
    original = selection.induction_score

    def spy(queries, keys, scaling, row_lse=None):
        got = original(queries, keys, scaling, row_lse)
        calls.append((row_lse is not None, (got - original(queries, keys, scaling)).abs().max().item()))
        return got

    monkeypatch.setattr(reference, "induction_score", spy)
    press = CompressKVPress(compression_ratio=0.75)
    without = CompressKVPress(compression_ratio=0.75, reference=("window", "novelty"))
    outputs = {}
    for name, chosen in (("induction", press), ("default", without)):
        with torch.no_grad(), chosen(model):
            outputs[name] = model(input_ids=context, past_key_values=DynamicCache()).logits
    assert [handed for handed, _ in calls] == [True, True]  # both layers, from the attention call
    assert max(difference for _, difference in calls) <= 1e-5
    torch.testing.assert_close(outputs["induction"], outputs["default"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_default_fit_takes_the_window_rows_from_the_prefill_call(family, monkeypatch):
    """The default (its induction prior has the prefill's attention hand its rows over) gives the fit the window
    queries' log-sum-exp and exact outputs from the prefill's own attention call, no pass of their own: they equal
    the float64 definition over the layer's keys (float32 attention of another kernel: 1e-5 of the largest); a
    press without the prior, or without a fit, asks for no outputs."""
    from kvcompress import methods

    calls = []
    original = methods.fit_kept_rows

    def spy(keys, values, kept, protected, queries, scaling, *, query_positions, known_rows, **options):
        calls.append((keys, values, queries, scaling, query_positions, known_rows))
        return original(keys, values, kept, protected, queries, scaling, query_positions=query_positions,
                        known_rows=known_rows, **options)  # fmt: skip

    monkeypatch.setattr(methods, "fit_kept_rows", spy)
    model = tiny_model(family, num_hidden_layers=2)
    press = CompressKVPress(compression_ratio=0.75)
    compressed_cache(model, press, tokens(CONTEXT, 5))
    assert press.prefill_output_rows() == press.observation_window and len(calls) == 2
    for keys, values, queries, scaling, positions, known in calls:
        (batch, heads_q, m, dim), heads_kv = queries.shape, keys.shape[1]
        assert m == press.observation_window and torch.equal(positions, torch.arange(CONTEXT - m, CONTEXT))
        group = heads_q // heads_kv
        grouped = queries.reshape(batch * heads_kv, group * m, dim)
        flat_keys, flat_values = keys.reshape(batch * heads_kv, CONTEXT, dim), values.flatten(0, 1)
        _, lse, exact = float64_fit_rows(grouped, flat_keys, flat_values, scaling, positions.repeat(group))
        torch.testing.assert_close(known[0].double(), lse.reshape(batch, heads_q, m), rtol=0, atol=1e-5)
        scale = exact.abs().max().item()
        torch.testing.assert_close(known[1].double(), exact.reshape(batch, heads_q, m, -1), rtol=0, atol=1e-5 * scale)
        assert known[1].untyped_storage().nbytes() == known[1].numel() * known[1].element_size()  # not the whole output
    calls.clear()
    without_prior = CompressKVPress(compression_ratio=0.75, reference=("window", "novelty"))
    compressed_cache(model, without_prior, tokens(CONTEXT, 5))
    assert [known for *_, known in calls] == [None, None]
    assert CompressKVPress(compression_ratio=0.75, fit="none").prefill_output_rows() == 0


def test_balanced_reads_the_induction_prior_from_the_prefill_before_its_repeat_pass(monkeypatch):
    """balanced(): every layer's prior comes from its own prefill call (the repeat pass after the prefill hands
    nothing over and computes no prior), and the cache shrinks to the kept rows."""
    calls = []
    original = reference.induction_score

    def spy(queries, keys, scaling, row_lse=None):
        calls.append(row_lse is not None)
        return original(queries, keys, scaling, row_lse)

    monkeypatch.setattr(reference, "induction_score", spy)
    model = tiny_model("llama", num_hidden_layers=2)
    cache = compressed_cache(model, CompressKVPress.balanced(0.75, repeat_chunk=32), tokens(CONTEXT, 9))
    assert calls == [True, True]
    assert all(layer.keys.shape[2] == int(CONTEXT * 0.25) for layer in cache.layers)


def test_value_weighted_novelty_against_its_float64_definition_and_the_outlier_it_drops():
    from kvcompress.selection import key_novelty

    generator = torch.Generator().manual_seed(8)
    keys = torch.randn(2, 3, 50, 16, generator=generator) + 2.0
    values = torch.randn(2, 3, 50, 12, generator=generator)
    got = key_novelty(keys, values)
    k, v = keys.double(), values.double()
    mean = k.mean(2, keepdim=True)
    cosine = (k * mean).sum(-1) / (k.norm(dim=-1) * mean.norm(dim=-1))
    norms = v.norm(dim=-1)
    want = (1 - cosine) * norms / norms.mean(-1, keepdim=True)
    # float32 normalisation, 16- and 12-term sums, a 50-term mean: a few float32 ulps of values below ~10.
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
    outlier = keys.clone()
    outlier[:, :, 17] = -outlier[:, :, 17]  # the most novel key of every head ...
    assert (key_novelty(outlier, values).argmax(-1) == 17).all()
    faint = values.clone()
    faint[:, :, 17] *= 1e-3  # ... whose value is too small to change the output: no longer first anywhere
    assert (key_novelty(outlier, faint).argmax(-1) != 17).all()


@pytest.mark.parametrize("value_norm", [True, False])
def test_the_press_weights_novelty_by_the_layers_values_unless_told_not_to(value_norm, monkeypatch):
    """Each layer's novelty prior reads that layer's own prefill keys and values (values only with
    ``novelty_value_norm``); a padded batch's rows read their own real tokens' values."""
    from kvcompress.selection import key_novelty

    seen = []

    def spy(keys, values=None):
        seen.append((keys.shape, None if values is None else values.shape))
        return key_novelty(keys, values)

    monkeypatch.setattr(reference, "key_novelty", spy)
    model = tiny_model("llama", num_hidden_layers=2)
    press = CompressKVPress(compression_ratio=0.75, novelty_value_norm=value_norm)
    compressed_cache(model, press, tokens(CONTEXT, 9))
    heads, dim = model.config.num_key_value_heads, model.config.hidden_size // model.config.num_attention_heads
    expected = (1, heads, CONTEXT, dim)
    assert seen == [(expected, expected if value_norm else None)] * 2
    with pytest.raises(ValueError, match="novelty_value_norm: must be True or False"):
        CompressKVPress(novelty_value_norm="yes")


def test_novelty_reserves_its_share_of_the_rows_and_the_query_mass_chooses_the_rest():
    from kvcompress.methods import mixed_scores
    from kvcompress.reference import LayerReference
    from kvcompress.selection import top_rows

    generator = torch.Generator().manual_seed(11)
    n, rows, reserved = 40, 12, 5
    window = torch.rand(1, 2, n, generator=generator)
    novelty = torch.rand(1, 2, n, generator=generator) * 1e-3  # far smaller scale: a sum would ignore it
    ref = LayerReference(mass={"window": window, "novelty": novelty})
    kept = top_rows(mixed_scores(ref, 0, n, {}, {}, reserved={"novelty": reserved}), rows)
    for head in range(2):
        first = novelty[0, head].topk(reserved).indices.tolist()
        rest = window[0, head].clone()
        rest[first] = -1
        want = set(first) | set(rest.topk(rows - reserved).indices.tolist())
        assert set(kept[0, head].tolist()) == want
    assert torch.equal(top_rows(mixed_scores(ref, 0, n, {}, {}, reserved={}), rows), top_rows(window, rows))
    with pytest.raises(ValueError, match="novelty_share"):
        CompressKVPress(novelty_share=1.5)


def test_priors_reserve_their_rows_in_turn_then_the_query_mass_chooses_the_rest():
    """Novelty's top rows first, then induction's top among the rows left, then the window's: each prior's count
    exactly, even where the two priors agree on their best rows."""
    from kvcompress.methods import mixed_scores
    from kvcompress.reference import LayerReference
    from kvcompress.selection import top_rows

    generator = torch.Generator().manual_seed(12)
    n, rows, by_novelty, by_induction = 50, 20, 6, 5
    window = torch.rand(1, 3, n, generator=generator)
    novelty = torch.rand(1, 3, n, generator=generator) * 1e-3
    induction = novelty * 0.5 + torch.rand(1, 3, n, generator=generator) * 1e-4  # mostly novelty's own order
    ref = LayerReference(mass={"window": window, "novelty": novelty, "induction": induction})
    reserved = {"novelty": by_novelty, "induction": by_induction}
    kept = top_rows(mixed_scores(ref, 0, n, {}, {}, reserved=reserved), rows)
    for head in range(3):
        first = novelty[0, head].topk(by_novelty).indices.tolist()
        second = induction[0, head].clone()
        second[first] = -1
        second = second.topk(by_induction).indices.tolist()
        rest = window[0, head].clone()
        rest[first + second] = -1
        want = set(first) | set(second) | set(rest.topk(rows - by_novelty - by_induction).indices.tolist())
        assert len(want) == rows and set(kept[0, head].tolist()) == want
    # Induction takes its share of what novelty leaves; without novelty in reference, its share of all the rows.
    crowded = CompressKVPress(novelty_share=0.8, induction_share=0.3)
    assert crowded._reserved_rows(100) == {"novelty": 80, "induction": 20}
    assert CompressKVPress(novelty_share=1.0)._reserved_rows(40) == {"novelty": 40, "induction": 0}
    alone = CompressKVPress(reference=("window", "induction"), induction_share=0.3)
    assert alone._reserved_rows(100) == {"novelty": 0, "induction": 30}
    with pytest.raises(ValueError, match="induction_share"):
        CompressKVPress(induction_share=-0.1)


@pytest.mark.parametrize("family, overrides", [("llama", {}), ("phi3", {"partial_rotary_factor": 0.5})])
def test_post_rope_queries_are_the_queries_the_models_attention_gets(family, overrides):
    """The press recomputes a layer's post-RoPE queries from its input; they must be the ones the model's attention
    function receives, also where RoPE rotates only part of each head (Phi-4-mini's ``partial_rotary_factor``:
    the window, repeat and RPNys sources raised a shape error there, mid-prefill)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = tiny_model(family, num_hidden_layers=1, **overrides)
    seen = {}

    def recording(module, query, *args, **kwargs):
        seen["query"] = query
        return sdpa_attention_forward(module, query, *args, **kwargs)

    AttentionInterface.register("recording_test", recording)
    model.set_attn_implementation("recording_test")
    attention = model.model.layers[0].self_attn
    hook = attention.register_forward_pre_hook(lambda m, a, kw: seen.update(inputs=kw), with_kwargs=True)
    with torch.no_grad():
        model(tokens(40, 1))
    hook.remove()
    got = post_rope_queries(attention, seen["inputs"]["hidden_states"], seen["inputs"]["position_embeddings"])
    if overrides:
        assert seen["inputs"]["position_embeddings"][0].shape[-1] < got.shape[-1]  # partial: the case under test
    torch.testing.assert_close(got, seen["query"], rtol=0, atol=0)  # the same float32 operations
    for press in (CompressKVPress.thorough(0.75), CompressKVPress(compression_ratio=0.75, reference=("window",))):
        assert {layer.keys.shape[2] for layer in compressed_cache(model, press, tokens(CONTEXT, 2)).layers} == {80}
