"""CompressKVPress / UniformPress inside transformers models (tiny random-weight configs, CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AttentionInterface, DynamicCache, GPT2Config, GPT2LMHeadModel

from kvcompress import CompressKVPress, UniformPress, weighted_attention
from kvcompress.cache import WeightedLayer
from kvcompress.hf_attention import ATTENTION_NAME, kvcompress_attention
from kvcompress.weighted_press import RowPlan
from tests.tiny_models import FAMILIES, tiny_model

CONTEXT, QUESTION = 300, 6


def tokens(n: int, seed: int, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def compress_context(model, press, context: torch.Tensor) -> DynamicCache:
    cache = DynamicCache()
    with press(model):
        model.model(input_ids=context, past_key_values=cache)
    return cache


def compressed_layers(model, cache) -> list[int]:
    return [i for i, layer in enumerate(cache.layers) if isinstance(layer, WeightedLayer)]


@pytest.mark.parametrize("family", FAMILIES)
def test_full_budget_is_identical_to_no_press(family):
    model = tiny_model(family)
    context, question = tokens(CONTEXT, 1), tokens(QUESTION, 2)
    with torch.no_grad():
        stock_cache = DynamicCache()  # no press, stock sdpa, same two steps
        model(context, past_key_values=stock_cache)
        reference = model(question, past_key_values=stock_cache).logits
        for press in (CompressKVPress(compression_ratio=0.0), UniformPress(compression_ratio=0.0)):
            cache = compress_context(model, press, context)
            assert type(cache) is DynamicCache and not compressed_layers(model, cache)
            logits = model(question, past_key_values=cache).logits
            assert torch.equal(logits, reference)
        # A context whose budget cannot hold the 68 protected tokens still keeps exactly its budget.
        short = tokens(80, 3)
        cache = compress_context(model, CompressKVPress(compression_ratio=0.5), short)
        assert compressed_layers(model, cache) and all(
            cache.get_seq_length(i) == 40 for i in compressed_layers(model, cache)
        )


def test_short_context_keeps_the_first_token():
    """A budget too small for the protected tokens splits half of it between sink and window in proportion, the
    sink rounded up: a one-line chat prompt keeps its first token (the attention sink) whenever the press has one."""
    press = CompressKVPress(compression_ratio=0.75)  # sink 4, window 64
    assert press.plan(35) == RowPlan(35, 1, 3, 4)  # budget 8: floor would give the sink 0 rows
    assert press.plan(200) == RowPlan(200, 2, 23, 25)
    assert press.plan(400) == RowPlan(400, 4, 64, 32)  # the budget holds them: unchanged
    assert CompressKVPress(compression_ratio=0.75, sink_size=0).plan(35) == RowPlan(35, 0, 4, 4)
    assert CompressKVPress(compression_ratio=0.75, window_size=0).plan(16) == RowPlan(16, 2, 0, 2)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("press_cls", [CompressKVPress, UniformPress])
def test_each_family_compresses_to_budget_and_answers(family, press_cls):
    model = tiny_model(family)
    ratio = 0.6
    press = press_cls(compression_ratio=ratio, seed=0)
    cache = compress_context(model, press, tokens(CONTEXT, 1))
    budget = int(CONTEXT * (1 - ratio))
    layers = compressed_layers(model, cache)
    sliding = [i for i, layer in enumerate(model.model.layers) if getattr(layer.self_attn, "is_sliding", False)]
    assert layers == [i for i in range(model.config.num_hidden_layers) if i not in sliding]
    for i, layer in enumerate(cache.layers):
        rows = layer.keys.shape[-2]
        assert rows == (CONTEXT if i in sliding else budget) or (i not in sliding and rows <= budget)
        assert layer.values.shape[-2] == rows
    assert cache.get_seq_length() == CONTEXT  # positions continue after the whole context
    with torch.no_grad():
        out = model.generate(
            torch.cat([tokens(CONTEXT, 1), tokens(QUESTION, 2)], 1),
            past_key_values=cache,
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=0,
        )
    assert out.shape[-1] == CONTEXT + QUESTION + 4
    assert all(cache.layers[i].keys.shape[-2] <= budget + QUESTION + 3 for i in layers)


def test_budget_counts_protected_tokens_and_cache_holds_only_those_rows():
    model = tiny_model("llama")
    for n, ratio in ((300, 0.75), (301, 0.5), (1000, 0.9)):
        cache = compress_context(model, CompressKVPress(compression_ratio=ratio, seed=1), tokens(n, n))
        for layer in cache.layers:
            assert isinstance(layer, WeightedLayer)
            assert layer.keys.shape[-2] <= int(n * (1 - ratio))
            assert layer.keys.shape[-2] >= int(n * (1 - ratio)) - 12  # bins use all but < bin_rank rows
            assert layer.row_weights.shape[-1] == layer.keys.shape[-2]
            assert layer.keys.is_contiguous() and layer.keys.untyped_storage().nbytes() == layer.keys.nbytes


def _capture_attention_calls():
    """Re-register the kvcompress attention with a recorder; returns (calls, restore)."""
    calls = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        out = kvcompress_attention(module, query, key, value, attention_mask, **kwargs)
        calls.append((module.layer_idx, query, key, value, kwargs.get("scaling"), out[0]))
        return out

    AttentionInterface.register(ATTENTION_NAME, recording)
    return calls, lambda: AttentionInterface.register(ATTENTION_NAME, kvcompress_attention)


def test_the_attention_works_under_kvpress_attention_patch():
    """kvpress wraps every registered attention function when it is imported, and its wrapper passes ``dropout`` by
    position, sixth: a kvcompress function registered before kvpress's import must take it there (it once took
    ``scaling`` sixth and failed with "got multiple values for argument 'scaling'")."""
    from kvpress.attention_patch import attention_patch

    model = tiny_model("llama")
    cache = DynamicCache()
    with torch.no_grad(), CompressKVPress(compression_ratio=0.5, seed=3)(model):
        model.model(input_ids=tokens(CONTEXT, 1), past_key_values=cache)
    question = tokens(QUESTION, 2)
    with torch.no_grad():
        expected = model(question, past_key_values=copy.deepcopy(cache)).logits
        AttentionInterface.register(ATTENTION_NAME, attention_patch(kvcompress_attention))
        try:
            got = model(question, past_key_values=cache).logits
        finally:
            AttentionInterface.register(ATTENTION_NAME, kvcompress_attention)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_model_attention_equals_weighted_attention_on_the_same_tensors():
    model = tiny_model("qwen2")
    context, question = tokens(CONTEXT, 1), tokens(QUESTION, 2)
    cache = DynamicCache()
    press = CompressKVPress(compression_ratio=0.5, seed=3)
    seen_values = {}

    def remember_context_values(module, args, kwargs, output):  # registered before the press: sees the full context
        values = kwargs["past_key_values"].layers[module.layer_idx].values
        seen_values.setdefault(module.layer_idx, values.clone())  # the prefill's call, not the repeat pass's

    hooks = [
        layer.self_attn.register_forward_hook(remember_context_values, with_kwargs=True) for layer in model.model.layers
    ]
    with torch.no_grad(), press(model):
        model.model(input_ids=context, past_key_values=cache)
    for hook in hooks:
        hook.remove()
    assert all(values.shape[-2] == CONTEXT for values in seen_values.values())
    calls, restore = _capture_attention_calls()
    try:
        with torch.no_grad():
            model(question, past_key_values=cache)
            model(tokens(1, 9), past_key_values=cache)  # one decode step
    finally:
        restore()
    assert len(calls) == 2 * model.config.num_hidden_layers
    for layer_idx, query, key, value, scaling, out in calls:
        layer = cache.layers[layer_idx]
        rows, new = key.shape[-2], key.shape[-2] - layer.row_weights.shape[-1]
        weights = torch.cat([layer.row_weights, torch.ones(1, 2, new)], dim=-1)
        context_values = seen_values[layer_idx]  # range over the ORIGINAL context plus every new row
        v_min = torch.minimum(context_values.amin(2), value[:, :, -new:].amin(2))
        v_max = torch.maximum(context_values.amax(2), value[:, :, -new:].amax(2))
        expected = weighted_attention(
            query, key, value, weights, scaling=scaling, v_min=v_min, v_max=v_max, causal_offset=rows - query.shape[2]
        )
        torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-6, atol=1e-6)


def _attention_outputs(model, cache, question):
    outputs = {}
    hooks = [
        layer.self_attn.register_forward_hook(lambda m, a, out: outputs.__setitem__(m.layer_idx, out[0]))
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            model(question, past_key_values=cache)
    finally:
        for hook in hooks:
            hook.remove()
    return outputs


def test_layer_outputs_approach_exact_as_kept_fraction_grows():
    model = tiny_model("llama", num_hidden_layers=3)
    context, question = tokens(600, 5), tokens(QUESTION, 6)
    exact = _attention_outputs(model, compress_context(model, CompressKVPress(0.0), context), question)
    errors = []
    for kept in (0.25, 0.5, 0.9):
        total = 0.0
        for seed in range(3):
            cache = compress_context(model, CompressKVPress(compression_ratio=1 - kept, seed=seed), context)
            approx = _attention_outputs(model, cache, question)
            total += sum(((approx[i] - exact[i]).norm() / exact[i].norm()).item() for i in exact)
        errors.append(total)
    assert errors[0] > errors[1] > errors[2] > 0, errors


def test_state_belongs_to_the_cache_two_interleaved_caches():
    model = tiny_model("llama")
    context_a, context_b, question = tokens(CONTEXT, 11), tokens(CONTEXT, 12), tokens(QUESTION, 13)
    press = CompressKVPress(compression_ratio=0.7, seed=0)
    cache_a, cache_b = compress_context(model, press, context_a), compress_context(model, press, context_b)
    plain = DynamicCache()
    with torch.no_grad():
        model(context_a, past_key_values=plain)  # never compressed, same model, now on kvcompress attention
        solo_a = model(question, past_key_values=copy.deepcopy(cache_a)).logits
        solo_b = model(question, past_key_values=copy.deepcopy(cache_b)).logits
        # Interleave: a, plain, b, a, b on the same model.
        a1 = model(question[:, :3], past_key_values=cache_a).logits
        p1 = model(question, past_key_values=plain).logits
        b1 = model(question[:, :3], past_key_values=cache_b).logits
        a2 = model(question[:, 3:], past_key_values=cache_a).logits
        b2 = model(question[:, 3:], past_key_values=cache_b).logits
        model.set_attn_implementation("sdpa")
        stock_cache = DynamicCache()
        model(context_a, past_key_values=stock_cache)
        stock = model(question, past_key_values=stock_cache).logits
    torch.testing.assert_close(torch.cat([a1, a2], 1), solo_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([b1, b2], 1), solo_b, rtol=1e-5, atol=1e-5)
    assert torch.equal(p1, stock)  # an untouched cache runs exactly stock sdpa
    assert not torch.allclose(solo_a, solo_b)


def test_generate_outside_press_matches_manual_greedy_and_logical_positions():
    model = tiny_model("llama")
    context, question = tokens(CONTEXT, 21), tokens(QUESTION, 22)
    press = CompressKVPress(compression_ratio=0.5, seed=4)
    cache = compress_context(model, press, context)
    manual_cache = copy.deepcopy(cache)
    with torch.no_grad():
        generated = model.generate(
            torch.cat([context, question], 1), past_key_values=cache, max_new_tokens=6, do_sample=False, pad_token_id=0
        )[:, CONTEXT + QUESTION :]
        # By hand, with explicit true positions (what kvpress's pipeline does).
        positions = torch.arange(CONTEXT, CONTEXT + QUESTION)[None]
        logits = model(question, past_key_values=manual_cache, position_ids=positions).logits[:, -1]
        manual = []
        for step in range(6):
            manual.append(logits.argmax(-1, keepdim=True))
            position = torch.tensor([[CONTEXT + QUESTION + step]])
            logits = model(manual[-1], past_key_values=manual_cache, position_ids=position).logits[:, -1]
    assert torch.equal(generated, torch.cat(manual, 1))


def test_generate_inside_press_compresses_prompt_once_then_decodes_weighted():
    model = tiny_model("mistral")
    prompt = tokens(CONTEXT, 31)
    press = CompressKVPress(compression_ratio=0.5, seed=5)
    with torch.no_grad():
        with press(model):
            out = model.generate(
                prompt, max_new_tokens=5, do_sample=False, pad_token_id=0, return_dict_in_generate=True
            )
        cache = out.past_key_values
        assert all(isinstance(layer, WeightedLayer) for layer in cache.layers)
        budget = int(CONTEXT * 0.5)
        assert budget - 12 < cache.layers[0].keys.shape[-2] - 4 <= budget  # 4 decoded tokens were fed back
        # By hand: compress the prompt, then greedy decode over the compressed cache.
        manual_cache = DynamicCache()
        with press(model):
            logits = model(prompt, past_key_values=manual_cache).logits[:, -1]
        manual = []
        for _ in range(5):
            manual.append(logits.argmax(-1, keepdim=True))
            logits = model(manual[-1], past_key_values=manual_cache).logits[:, -1]
    assert torch.equal(out.sequences[:, CONTEXT:], torch.cat(manual, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_models_stay_finite(dtype):
    model = tiny_model("qwen3", dtype=dtype)
    for layer in model.model.layers:  # large key norms, as real models have
        layer.self_attn.k_proj.weight.data *= 20
    cache = compress_context(model, CompressKVPress(compression_ratio=0.75, seed=0), tokens(CONTEXT, 41))
    with torch.no_grad():
        logits = model(tokens(QUESTION, 42), past_key_values=cache).logits
    assert logits.dtype == dtype and torch.isfinite(logits).all()
    assert all(torch.isfinite(layer.values).all() and torch.isfinite(layer.row_weights).all() for layer in cache.layers)


def test_uniform_weighted_scales_values_and_weights():
    model = tiny_model("llama")
    context = tokens(CONTEXT, 51)
    plain = compress_context(model, UniformPress(compression_ratio=0.5, seed=7), context)
    weighted = compress_context(model, UniformPress(compression_ratio=0.5, seed=7, weighted=True), context)
    middle = CONTEXT - 64
    kept = int(CONTEXT * 0.5) - 64
    for a, b in zip(plain.layers, weighted.layers, strict=True):
        assert torch.equal(a.keys, b.keys)  # same subset, position order
        assert torch.all(a.row_weights == 1)
        torch.testing.assert_close(
            b.row_weights[..., 32:-32], torch.full_like(b.row_weights[..., 32:-32], middle / kept)
        )
        torch.testing.assert_close(b.values[:, :, 32:-32], a.values[:, :, 32:-32] * (middle / kept))
        torch.testing.assert_close(b.values[:, :, :32], a.values[:, :, :32])


def test_unsupported_model_and_bad_press_arguments():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).eval()
    with pytest.raises(ValueError, match="model: GPT2LMHeadModel is not supported"):
        with CompressKVPress(compression_ratio=0.5)(model):
            pass
    for kwargs, name in (
        (dict(compression_ratio=1.0), "compression_ratio"),
        (dict(compression_ratio=-0.1), "compression_ratio"),
        (dict(compression_ratio=0.5, bin_rank=0), "bin_rank"),
        (dict(compression_ratio=0.5, query_radius="values"), "query_radius"),
        (dict(compression_ratio=0.5, sink_size=-1), "sink_size"),
        (dict(compression_ratio=0.5, seed="x"), "seed"),
    ):
        with pytest.raises(ValueError, match=f"^{name}:"):
            CompressKVPress(**kwargs)


def test_crop_counts_tokens_and_refuses_to_cut_the_compressed_context():
    model = tiny_model("llama")
    cache = compress_context(model, CompressKVPress(compression_ratio=0.5, seed=0), tokens(CONTEXT, 61))
    rows = cache.get_seq_length(0)
    snapshot = copy.deepcopy(cache)
    with torch.no_grad():
        model(tokens(QUESTION, 62), past_key_values=cache)
    assert cache.get_seq_length() == CONTEXT + QUESTION and cache.get_seq_length(0) == rows + QUESTION
    cache.crop(CONTEXT)  # back to the compressed context, as after answering a question
    assert cache.get_seq_length() == CONTEXT
    for layer, kept in zip(cache.layers, snapshot.layers, strict=True):
        assert torch.equal(layer.keys, kept.keys) and torch.equal(layer.values, kept.values)
    with pytest.raises(ValueError, match="max_length: a compressed cache can be cropped back to its 300-token"):
        cache.crop(CONTEXT - 1)
    with torch.no_grad():
        model(tokens(QUESTION, 62), past_key_values=cache)
    with pytest.raises(ValueError, match="max_length: a compressed cache can be cropped back to its 300-token"):
        cache.crop(-QUESTION - 1)  # the same crop counted from the end (blamed eviction presses, a RuntimeError)
    cache.crop(-QUESTION)
    assert cache.get_seq_length() == CONTEXT and cache.get_seq_length(0) == rows
    # Cutting the rows directly (bypassing crop) is refused at once, and the layer is left as it was.
    before = cache.layers[0].keys
    with pytest.raises(RuntimeError, match="removed rows of a compressed cache layer"):
        cache.layers[0].keys = cache.layers[0].keys[:, :, :100]
    assert cache.layers[0].keys is before


@pytest.mark.parametrize("make, tokens_in, scale", [
    (lambda: CompressKVPress.paper(0.75, seed=0), 150, 300.0),
    (lambda: UniformPress(compression_ratio=0.99, weighted=True, seed=0), 1500, 1000.0),
], ids=["paper", "uniform-weighted"])  # fmt: skip
def test_weighted_values_that_outgrow_float16_are_refused_and_the_cache_is_put_back(make, tokens_in, scale):
    """Values of a few hundred fit float16, but Nystrom weights (paper()) or the uniform press's length / rows
    scale them by 100-250x: the compressed rows held Inf (paper: NaN logits; the weighted uniform press: clipped,
    wrong logits 0.49 off). Refused after the prefill with the prefill's own flags (one sync), cache put back."""
    model = tiny_model("llama", dtype=torch.float16)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(scale)
    cache = DynamicCache()
    with pytest.raises(ValueError, match=r"^layer \d compressed values: NaN or Inf after compression: .*float16"):
        with torch.no_grad(), make()(model):
            model.model(input_ids=torch.randint(0, 256, (1, tokens_in), generator=torch.Generator().manual_seed(1)),
                        past_key_values=cache)  # fmt: skip
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize(
    "press", [CompressKVPress(compression_ratio=0.5), CompressKVPress.thorough(0.5), CompressKVPress.paper(0.5)]
)
@pytest.mark.parametrize("prebuilt", [False, True], ids=["lazy-layers", "layers-from-config"])
def test_a_layer_with_nan_keys_is_named_after_the_prefill(press, prebuilt):
    """The finiteness of every compressed layer is read once, after the prefill: the error names the first bad layer,
    and the cache passed in is put back as it was (no layer compressed from NaN keys), so it can be used again."""
    press.seed = 0  # paper()'s random selection: the same rows from the same context
    model = tiny_model("llama", num_hidden_layers=3)
    weight = model.model.layers[1].self_attn.k_proj.weight
    kept = weight.data[0, 0].item()
    with torch.no_grad():
        weight[0, 0] = float("nan")
    ids = torch.randint(0, model.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache(config=model.config) if prebuilt else DynamicCache()
    layers = list(cache.layers)
    with pytest.raises(ValueError, match=r"^layer 1 keys: contains NaN or Inf \(the model's own prefill"), press(model):
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    assert type(cache) is DynamicCache and cache.get_seq_length() == 0 and cache.layers == layers
    assert all(not layer.is_initialized for layer in cache.layers)
    with torch.no_grad():
        weight[0, 0] = kept
    with torch.no_grad(), press(model):  # the same cache takes the next prefill as a new one would
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        fresh = DynamicCache()
        model(input_ids=ids, past_key_values=fresh, use_cache=True)
    for layer, expected in zip(cache.layers, fresh.layers, strict=True):
        assert isinstance(layer, WeightedLayer) and layer.keys.shape == expected.keys.shape
        torch.testing.assert_close(layer.keys, expected.keys, rtol=0, atol=0)
        torch.testing.assert_close(layer.row_weights, expected.row_weights, rtol=0, atol=0)


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("caught_inside", [False, True])
def test_a_prefill_that_fails_in_a_layers_compression_puts_the_cache_back(layer, caught_inside):
    """NaN queries (a NaN in layer ``layer``'s q_proj) make paper()'s query radius NaN: its compression raises in
    the middle of the prefill, naming the NaN, where it named a negative input and left some layers compressed,
    some exact and some empty. The cache comes back as it was, whether the error leaves the press's block or is
    caught inside it, and takes the next prefill as a new cache would."""
    model = tiny_model("llama")
    weight = model.model.layers[layer].self_attn.q_proj.weight
    kept = weight.data[0, 0].item()
    with torch.no_grad():
        weight[0, 0] = float("nan")
    ids = torch.randint(3, 256, (1, 120), generator=torch.Generator().manual_seed(0))
    press = CompressKVPress.paper(0.5, seed=0, query_radius="queries")
    cache = DynamicCache()
    with pytest.raises(ValueError, match="holds NaN"):
        with torch.no_grad(), press(model):
            if caught_inside:
                with pytest.raises(ValueError, match="holds NaN"):
                    model.model(ids, past_key_values=cache)
                raise ValueError("holds NaN: caught inside, raised again for the outer check")
            model.model(ids, past_key_values=cache)
    assert type(cache) is DynamicCache and cache.get_seq_length() == 0 and not cache.layers
    with torch.no_grad():
        weight[0, 0] = kept
    with torch.no_grad(), press(model):
        model.model(ids, past_key_values=cache)
        fresh = DynamicCache()
        model.model(ids, past_key_values=fresh)
    for got, expected in zip(cache.layers, fresh.layers, strict=True):
        torch.testing.assert_close(got.keys, expected.keys, rtol=0, atol=0)


def test_prefill_state_is_read_once_per_decoder_call(monkeypatch):
    """kvpress's is_prefilling reads a device tensor (a host sync on a GPU): once per decoder call, not per layer."""
    from kvcompress import weighted_press

    calls = []
    real = weighted_press.is_prefilling
    monkeypatch.setattr(weighted_press, "is_prefilling", lambda position, n: calls.append(n) or real(position, n))
    model = tiny_model("llama", num_hidden_layers=3)
    ids = torch.randint(0, model.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache()
    with CompressKVPress(compression_ratio=0.5)(model):
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True)
    assert calls == [96, 1]


@pytest.mark.parametrize("inference", [False, True])
def test_a_position_buffer_written_in_place_is_read_again_in_the_next_call(inference):
    """A static-shape pipeline may reuse one cache_position buffer: a new prefill in it, in the next decoder call, is
    still seen as one (inference tensors included: they keep no version counter)."""
    press = CompressKVPress(compression_ratio=0.5)
    with torch.inference_mode(inference):
        buffer = torch.arange(8, 16)  # a second chunk: not a prefill
        press._before_forward(None, (), {})
        assert not press._prefilling(buffer, 8)
        buffer.copy_(torch.arange(8))  # the same buffer, now a fresh prefill of 8 tokens
        press._before_forward(None, (), {})
        assert press._prefilling(buffer, 8)
        assert not press._prefilling(buffer, 1)  # another length: read again
