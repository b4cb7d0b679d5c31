"""Padded batches: every row of a left- or right-padded batch gives what it gives alone (tiny models, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvcompress import CompressKVPress, UniformPress
from kvcompress.cache import WeightedLayer, cache_bytes
from kvcompress.padding import pad_rows
from tests.tiny_models import tiny_model

LENGTHS = (300, 40, 170)  # 40 < the 68 protected tokens of the default press
QUESTION, NEW_TOKENS, PAD = 5, 6, 0

PRESSES = {
    "default": lambda: CompressKVPress(compression_ratio=0.75, seed=0),
    "window-fit": lambda: CompressKVPress(compression_ratio=0.75, reference=("window",), seed=0),
    "prefill-weights": lambda: CompressKVPress(compression_ratio=0.75, reference=("prefill",), fit="weights"),
    "hybrid": lambda: CompressKVPress(compression_ratio=0.75, selection="hybrid", fit="none", seed=0),
    "novel-repeat": lambda: CompressKVPress(
        compression_ratio=0.75,
        reference=("window", "novelty", "repeat"),
        repeat_fraction=0.25,
        repeat_span=16,
        repeat_pieces="novel",
    ),
    "induction": lambda: CompressKVPress(compression_ratio=0.75, reference=("window", "novelty", "induction")),
    "paper": lambda: CompressKVPress.paper(0.75, seed=0),
    "uniform": lambda: UniformPress(compression_ratio=0.75, seed=0),
    "uniform-weighted": lambda: UniformPress(compression_ratio=0.75, weighted=True, seed=0),
}


def random_ids(n: int, seed: int, vocab: int = 256) -> torch.Tensor:
    return torch.randint(1, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def prefill(model, press, ids: torch.Tensor, mask: torch.Tensor | None = None) -> DynamicCache:
    """The context prefill under ``press`` as generate does it: positions count only real tokens."""
    cache = DynamicCache()
    positions = None if mask is None else (mask.cumsum(-1) - 1).clamp(min=0)
    with press(model):
        model.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
    return cache


@torch.no_grad()
def answer(model, cache, ids: torch.Tensor, mask: torch.Tensor | None, question: torch.Tensor) -> tuple:
    full = torch.cat([ids, question], 1)
    full_mask = None if mask is None else torch.cat([mask, torch.ones_like(question)], 1)
    out = model.generate(
        full,
        attention_mask=full_mask,
        past_key_values=cache,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=PAD,
    )
    return out.sequences[:, full.shape[1] :], torch.stack(out.logits, 1)


def alone_and_batched(model, make_press, side: str, lengths=LENGTHS, question_tokens: int = QUESTION):
    contexts = [random_ids(n, seed=n) for n in lengths]
    question = random_ids(question_tokens, seed=99)
    alone = []
    for context in contexts:
        cache = prefill(model, make_press(), context)
        alone.append((answer(model, cache, context, None, question), cache))
    ids, mask = pad_rows(contexts, side)
    cache = prefill(model, make_press(), ids, mask)
    batched = answer(model, cache, ids, mask, question.expand(len(contexts), -1))
    return alone, batched, cache


CASES = [("llama", name) for name in PRESSES] + [("qwen2", "default"), ("qwen2", "paper"), ("qwen2", "uniform")]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("family, name", CASES)
def test_each_padded_row_matches_the_row_alone(family, name, side):
    model = tiny_model(family)
    alone, (tokens, logits), cache = alone_and_batched(model, PRESSES[name], side)
    for b, ((row_tokens, row_logits), row_cache) in enumerate(alone):
        assert torch.equal(tokens[b : b + 1], row_tokens), (b, tokens[b], row_tokens[0])
        if name != "paper":  # RPNys pivots are discontinuous in the keys: the prefill's fp noise can move one
            torch.testing.assert_close(logits[b : b + 1], row_logits, rtol=1e-4, atol=1e-4)
        budget = int(LENGTHS[b] * 0.25)
        for layer, row_layer in zip(cache.layers, row_cache.layers, strict=True):
            assert isinstance(layer, WeightedLayer)
            kept = int(layer.row_valid[b].sum())
            assert kept == row_layer.context_rows == budget  # short rows too: exactly the budget


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_long_question_on_the_fused_cpu_path_matches_the_reference_row_by_row(side, monkeypatch):
    """A question of SDPA_MIN_QUERIES tokens or more (a chat turn after a compressed context) runs Alg. 3 through
    sdpa's fused kernel on CPU: each padded row's tokens and logits equal the row's alone through the reference."""
    from kvcompress import attention

    model = tiny_model("llama")
    question_tokens = 2 * attention.SDPA_MIN_QUERIES
    with monkeypatch.context() as patch:
        patch.setattr(attention, "SDPA_MIN_QUERIES", 10**9)  # the reference for every call
        alone, _, _ = alone_and_batched(model, PRESSES["default"], side, question_tokens=question_tokens)
    calls = []
    sdpa = attention._weighted_attention_sdpa
    monkeypatch.setattr(attention, "_weighted_attention_sdpa", lambda *a: calls.append(a[0].shape[2]) or sdpa(*a))
    _, (tokens, logits), _ = alone_and_batched(model, PRESSES["default"], side, question_tokens=question_tokens)
    assert calls == [question_tokens] * 4 * len(model.model.layers)  # each question (3 alone, 1 batch), every layer
    for b, ((row_tokens, row_logits), _) in enumerate(alone):
        steps = row_tokens.shape[1]  # a row alone stops at its end-of-sequence token, the batch pads after it
        assert torch.equal(tokens[b : b + 1, :steps], row_tokens), (b, tokens[b], row_tokens[0])
        torch.testing.assert_close(logits[b : b + 1, :steps], row_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["thorough", "novel-repeat"])
def test_a_repeat_pass_continues_the_positions_the_prefill_used(name):
    """A left-padded batch called without position ids puts each row's context at positions shifted by its
    padding; RoPE sees only distances, so each row compresses as alone, provided the repeat pass places its tokens
    after the row's context as the prefill placed it (it restarted at the row's length: rows kept other tokens).
    Values carry no rotation: each row's compressed values and weights equal the row's alone, up to float32 rounding
    of the rotated dot products (1e-4)."""
    model = tiny_model("llama", hidden_size=128, num_attention_heads=4)
    make = (lambda: CompressKVPress.thorough(0.6, seed=0)) if name == "thorough" else PRESSES[name]
    rows = [random_ids(n, seed=n) for n in (200, 137, 90)]
    ids, mask = pad_rows(rows, side="left", pad_id=PAD)
    batched = DynamicCache()
    with torch.no_grad(), make()(model):
        model.model(input_ids=ids, attention_mask=mask, past_key_values=batched)  # positions 0..n-1 for every row
    for b, row in enumerate(rows):
        alone = prefill(model, make(), row)
        for got, want in zip(batched.layers, alone.layers, strict=True):
            kept = want.values.shape[-2]
            torch.testing.assert_close(got.values[b : b + 1, :, :kept], want.values, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got.row_weights[b : b + 1, :, :kept], want.row_weights, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("preset", ["thorough", "balanced"])  # streamed during the prefill; layer by layer after it
def test_a_streamed_repeat_pass_continues_offset_positions(preset):
    """An unpadded context given positions 37.. (a prefix cached elsewhere, say): the repeat pass continues from
    there, so the compressed values and weights equal those of positions 0.. (RoPE sees only distances; 1e-4 for
    float32 rounding of the rotated dot products)."""
    model = tiny_model("llama", hidden_size=128, num_attention_heads=4)
    make = getattr(CompressKVPress, preset)
    row = random_ids(160, seed=5)
    caches = []
    for offset in (0, 37):
        cache = DynamicCache()
        with torch.no_grad(), make(0.6, seed=0)(model):
            model.model(input_ids=row, position_ids=torch.arange(160)[None] + offset, past_key_values=cache)
        caches.append(cache)
    for got, want in zip(caches[0].layers, caches[1].layers, strict=True):
        torch.testing.assert_close(got.values, want.values, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.row_weights, want.row_weights, rtol=1e-4, atol=1e-4)


def test_filler_rows_are_masked_zero_weight_and_counted():
    model = tiny_model("llama")
    contexts = [random_ids(n, seed=n) for n in LENGTHS]
    ids, mask = pad_rows(contexts, "left")
    cache = prefill(model, CompressKVPress(compression_ratio=0.75, reference=("window",), seed=0), ids, mask)
    budgets = [int(n * 0.25) for n in LENGTHS]
    for layer in cache.layers:
        assert layer.keys.shape[-2] == max(budgets)  # rectangular: the longest row's budget
        for b, budget in enumerate(budgets):
            assert layer.row_valid[b].tolist() == [True] * budget + [False] * (max(budgets) - budget)
            assert torch.all(layer.row_weights[b, :, budget:] == 0)
            assert torch.all(layer.keys[b, :, budget:] == 0) and torch.all(layer.values[b, :, budget:] == 0)
    # get_seq_length() counts the padded tokens: positions and masks continue after the padded width.
    assert cache.get_seq_length() == ids.shape[1]
    held = sum(
        t.nbytes
        for layer in cache.layers
        for t in (layer.keys, layer.values, layer.row_weights, layer.row_valid, layer.value_min, layer.value_max)
    )
    assert cache_bytes(cache) == held  # filler rows are held, so they are counted


def test_unpadded_mask_takes_the_batched_path_unchanged():
    model = tiny_model("llama")
    ids = torch.cat([random_ids(200, seed=s) for s in (1, 2)])
    press = CompressKVPress(compression_ratio=0.75, reference=("window",), seed=0)
    plain, masked = prefill(model, press, ids), prefill(model, press, ids, torch.ones_like(ids))
    for a, b in zip(plain.layers, masked.layers, strict=True):
        assert a.row_valid is None and b.row_valid is None
        assert torch.equal(a.keys, b.keys) and torch.equal(a.row_weights, b.row_weights)


@pytest.mark.parametrize(
    "mask, message",
    [
        (torch.ones(2, 50, 50), r"attention_mask: kvcompress presses read padding from a 2D mask"),
        (torch.ones(3, 50, dtype=torch.long), r"attention_mask: shape \(3, 50\) must be \[2, >= 50\]"),
        (torch.cat([torch.ones(1, 50), torch.zeros(1, 50)]).long(), r"attention_mask: batch rows \[1\] have no real"),
    ],
)
@pytest.mark.parametrize("preset", ["default", "thorough"])
def test_bad_padding_masks_are_refused_before_the_prefill(mask, message, preset):
    """Refused before any layer writes the cache (was: after layer 0 had written its rows, so a retry on the same
    cache found twice the rows): the same cache then takes the prefill with a good mask."""
    model = tiny_model("llama")
    ids = torch.cat([random_ids(50, seed=s) for s in (1, 2)])
    press = CompressKVPress(compression_ratio=0.5) if preset == "default" else CompressKVPress.thorough(0.5)
    cache = DynamicCache()
    with pytest.raises(ValueError, match=message), torch.no_grad(), press(model):
        model.model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    assert cache.get_seq_length() == 0
    with torch.no_grad(), press(model):
        model.model(input_ids=ids, past_key_values=cache)
    assert [layer.keys.shape[-2] for layer in cache.layers] == [25, 25]


def test_a_padded_repeat_pass_over_sliding_window_layers_is_refused_before_the_prefill():
    """A cache built from the model's config holds sliding-window layers, which a padded repeat pass cannot read
    row by row: refused before the prefill (was: after it), naming the way out; a DynamicCache() takes it."""
    model = tiny_model("gemma3", sliding_window=32)
    ids = torch.cat([random_ids(80, seed=s) for s in (1, 2)])
    mask = torch.ones_like(ids)
    mask[1, :20] = 0
    cache = DynamicCache(config=model.config)
    with pytest.raises(ValueError, match=r"^attention_mask: a padded batch with reference 'repeat' is not supported"):
        with torch.no_grad(), CompressKVPress.thorough(0.5)(model):
            model.model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    assert cache.get_seq_length() == 0
    with torch.no_grad(), CompressKVPress.thorough(0.5)(model):
        model.model(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache())


@pytest.mark.parametrize("side", ["left", "right"])
def test_triton_decode_kernel_on_a_padded_batch_equals_the_reference(side, monkeypatch):
    """The question and every decode step of a padded batch through the Triton kernel (CPU interpreter)."""
    pytest.importorskip("triton")
    from kvcompress import hf_attention
    from kvcompress.attention import weighted_attention
    from kvcompress.kernels import weighted_decode

    if not weighted_decode.INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py sets it)")
    model = tiny_model("llama")
    contexts = [random_ids(n, seed=n) for n in LENGTHS]
    ids, mask = pad_rows(contexts, side)
    question = random_ids(QUESTION, seed=99).expand(len(contexts), -1)
    make = PRESSES["window-fit"]
    reference = answer(model, prefill(model, make(), ids, mask), ids, mask, question)
    calls = []

    def triton_attention(*args, **kwargs):
        calls.append(kwargs["key_mask"] is not None)
        return weighted_attention(*args, **kwargs, backend="triton")

    monkeypatch.setattr(hf_attention, "weighted_attention_unchecked", triton_attention)
    tokens, logits = answer(model, prefill(model, make(), ids, mask), ids, mask, question)
    assert calls and all(calls)  # every call ran the kernel with a padding mask
    assert torch.equal(tokens, reference[0])
    torch.testing.assert_close(logits, reference[1], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_embedded_model_left_padded_generate_matches_each_row_alone(embedded_dir):
    """SmolLM2-135M-Instruct, default press: contexts of 400, 45 and 160 tokens left-padded, as generate pads."""
    import pydoc_data.topics

    from kvcompress.models import load_model

    model, tokenizer = load_model(str(embedded_dir))
    text = " ".join(list(pydoc_data.topics.topics.values())[:8])
    full = tokenizer(text, return_tensors="pt").input_ids
    contexts = [full[:, :400], full[:, 1000:1045], full[:, 2000:2160]]
    question = tokenizer(" In short, the text above is about", return_tensors="pt").input_ids
    alone = []
    for context in contexts:
        cache = prefill(model, PRESSES["default"](), context)
        alone.append(answer(model, cache, context, None, question)[0])
    ids, mask = pad_rows(contexts, "left")
    cache = prefill(model, PRESSES["default"](), ids, mask)
    tokens, _ = answer(model, cache, ids, mask, question.expand(3, -1))
    for b, row_tokens in enumerate(alone):
        assert torch.equal(tokens[b : b + 1], row_tokens), [tokenizer.decode(t) for t in (tokens[b], row_tokens[0])]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_value_range_folds_in_real_appended_rows_only(dtype):
    """The clip range kept across steps: the context's range, widened by each appended row as it arrives unless the
    call's key mask hides it (a padded later token), float32 whatever the values' dtype, and started again from the
    context when the rows are cut back; against its float64 definition (min and max are exact)."""
    gen = torch.Generator().manual_seed(3)
    context, d = 6, 5
    values = torch.randn(2, 3, context, d, generator=gen).to(dtype)
    low, high = values.amin(2).float(), values.amax(2).float()
    keys = torch.randn(2, 3, context, d, generator=gen).to(dtype)
    layer = WeightedLayer(keys, values, torch.rand(2, 3, context, generator=gen), low, high, tokens=4 * context)
    grown = torch.cat([values, 3 * torch.randn(2, 3, 4, d, generator=gen).to(dtype)], 2)
    mask = torch.ones(2, context + 2, dtype=torch.bool)
    mask[1, context + 1] = False  # row 1's second appended token is padding

    def widened(rows: slice, hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        tail = grown[:, :, rows].double()
        hidden = torch.zeros_like(tail, dtype=torch.bool) if hidden is None else hidden.expand_as(tail)
        return tail.masked_fill(hidden, float("inf")).amin(2), tail.masked_fill(hidden, float("-inf")).amax(2)

    def assert_range(got, parts) -> None:
        want_low = torch.stack([low.double(), *[part[0] for part in parts]]).amin(0).float()
        want_high = torch.stack([high.double(), *[part[1] for part in parts]]).amax(0).float()
        assert got[0].dtype == got[1].dtype == torch.float32
        torch.testing.assert_close(got[0], want_low, rtol=0, atol=0)
        torch.testing.assert_close(got[1], want_high, rtol=0, atol=0)

    first = widened(slice(context, context + 2), ~mask[:, None, context:, None])
    assert_range(layer.value_range(grown[:, :, : context + 2], mask), [first])  # two rows, one of them padding
    assert_range(layer.value_range(grown, None), [first, widened(slice(context + 2, None))])  # two more, no mask
    assert_range(layer.value_range(grown[:, :, : context + 1], None), [widened(slice(context, context + 1))])  # cut


def test_the_running_clip_range_survives_a_failed_call_and_never_touches_the_contexts(monkeypatch):
    """The attention function folds a step's new rows into the layer's running range inside the attention call
    (``fold_from``) and reports them folded only after it returns: a call that raised leaves them to the next one,
    which then clips with every row. The fold is in place on the layer's own copies: the context's range, which a
    cut restarts from, stays as compressed."""
    from kvcompress import hf_attention

    gen = torch.Generator().manual_seed(5)
    context, d = 8, 16
    values = torch.randn(1, 2, context, d, generator=gen)
    low, high = values.amin(2), values.amax(2)
    weights = torch.rand(1, 2, context, generator=gen)
    layer = WeightedLayer(torch.randn(1, 2, context, d, generator=gen), values, weights, low.clone(), high.clone(),
                          tokens=3 * context)  # fmt: skip
    query = torch.randn(1, 4, 1, d, generator=gen)
    keys, grown = layer.update(torch.randn(1, 2, 1, d, generator=gen), 5 + torch.rand(1, 2, 1, d, generator=gen))

    def failing(*args, **kwargs):
        raise RuntimeError("out of memory")

    with monkeypatch.context() as patch:
        patch.setattr(hf_attention, "weighted_attention_unchecked", failing)
        with pytest.raises(RuntimeError, match="out of memory"):
            hf_attention.kvcompress_attention(None, query, keys, grown, None, scaling=0.25)
    assert layer.clip_range(context + 1)[2] == context  # the new row is still to fold
    out, _ = hf_attention.kvcompress_attention(None, query, keys, grown, None, scaling=0.25)
    v_min, v_max, fold_from = layer.clip_range(context + 1)
    assert fold_from == context + 1
    assert torch.equal(v_max, torch.maximum(high, grown[:, :, -1])) and torch.equal(v_min, low)
    assert torch.equal(layer.value_min, low) and torch.equal(layer.value_max, high)
    assert (out.amax() > high.amax()).item()  # the answer leans on the new row, past the context's range


def test_decode_steps_over_a_compressed_cache_keep_their_gradients():
    """The running clip range is folded in place, outside autograd, and the PyTorch path clips with a copy of it
    while gradients are recorded: decode steps run with autograd on (a prefill compressed under no_grad) and their
    backward pass sees no tensor changed by a later step's fold."""
    model = tiny_model("llama", num_hidden_layers=2)
    ids = torch.randint(0, model.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(0))
    cache = DynamicCache()
    with CompressKVPress(compression_ratio=0.5)(model):
        with torch.no_grad():
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        first = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache, use_cache=True).logits
        second = model(input_ids=first[:, -1:].argmax(-1), past_key_values=cache, use_cache=True).logits
    (first.sum() + second.sum()).backward()
    weight = model.model.layers[0].self_attn.v_proj.weight
    assert weight.grad is not None and bool(weight.grad.abs().sum() > 0)
    assert not cache.layers[0].clip_range(cache.layers[0].keys.shape[-2])[0].requires_grad


def gemma3_with_vision_and_its_text_model():
    """A tiny Gemma3ForConditionalGeneration (sliding and full layers, a vision tower) and a Gemma3ForCausalLM with
    the same text weights."""
    from transformers import Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, head_dim=16,
                num_key_value_heads=2, vocab_size=300, sliding_window=64,
                layer_types=["sliding_attention", "full_attention"] * 2)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)  # fmt: skip
    torch.manual_seed(0)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=299,
                          boi_token_index=297, eoi_token_index=298)  # fmt: skip
    wrapped = Gemma3ForConditionalGeneration(config).eval()
    plain = Gemma3ForCausalLM(wrapped.config.text_config).eval()
    plain.model.load_state_dict(wrapped.model.language_model.state_dict())
    return wrapped, plain


@pytest.mark.parametrize("preset", ["default", "thorough"])
def test_a_multimodal_wrapper_gives_its_text_models_cache(preset):
    """Gemma3ForConditionalGeneration hands its language model a mapping of 4D masks and embeddings, not the padding
    mask and token ids the press reads (every press raised on the mapping): they come from the wrapper's own call,
    and the cache is the one the same text weights give without the wrapper (a left-padded batch for the default;
    one row for thorough(), whose repeat pass re-reads the token ids and refuses padding over sliding layers)."""
    wrapped, plain = gemma3_with_vision_and_its_text_model()
    make = CompressKVPress.thorough if preset == "thorough" else lambda ratio: CompressKVPress(compression_ratio=ratio)
    contexts = [random_ids(n, seed=n) for n in ((300, 170) if preset == "default" else (300,))]
    ids, mask = pad_rows(contexts, "left")
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    caches = []
    for model in (wrapped, plain):
        cache = DynamicCache(config=plain.config)
        with torch.no_grad(), make(0.75)(model):
            model.model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
        caches.append(cache)
    for got, expected in zip(*(cache.layers for cache in caches), strict=True):
        assert got.keys.shape == expected.keys.shape and got.keys.shape[-2] < ids.shape[1]
        torch.testing.assert_close(got.keys, expected.keys, rtol=0, atol=0)  # the same operations
        torch.testing.assert_close(got.values, expected.values, rtol=0, atol=0)
        if isinstance(got, WeightedLayer):
            torch.testing.assert_close(got.row_weights, expected.row_weights, rtol=0, atol=0)


def test_a_repeat_pass_over_an_image_is_refused_before_the_prefill():
    """thorough()'s second reading re-reads token ids, which do not carry an image's features: refused, naming
    pixel_values, with the cache untouched; the default press compresses the same call."""
    wrapped, _ = gemma3_with_vision_and_its_text_model()
    ids = torch.cat([random_ids(100, 1), torch.tensor([[297, 299, 299, 299, 299, 298]]), random_ids(100, 2)], 1)
    pixels = torch.randn(1, 3, 28, 28, generator=torch.Generator().manual_seed(3))
    cache = DynamicCache(config=wrapped.config.text_config)
    with pytest.raises(ValueError, match=r"^pixel_values: CompressKVPress with reference 'repeat' .* images"):
        with torch.no_grad(), CompressKVPress.thorough(0.75)(wrapped):
            wrapped(input_ids=ids, pixel_values=pixels, past_key_values=cache)
    assert cache.get_seq_length() == 0
    with torch.no_grad(), CompressKVPress(compression_ratio=0.75)(wrapped):
        wrapped(input_ids=ids, pixel_values=pixels, past_key_values=cache)
    assert cache.get_seq_length() == ids.shape[1] and cache.layers[1].keys.shape[-2] == int(ids.shape[1] * 0.25)
