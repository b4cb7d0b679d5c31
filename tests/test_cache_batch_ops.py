"""transformers' generation features that reshape or cut a compressed cache: the batch operations (beam search's
reorder, ``batch_repeat_interleave`` for ``num_return_sequences``, ``batch_select_indices``) move every row's
weights, filler mask and value range with its keys, so a reshaped cache answers as the original cache's rows do;
speculative decoding crops rejected drafts (tiny float64 models, CPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from kvcompress import CompressKVPress
from kvcompress.cache import WeightedLayer
from kvcompress.padding import pad_rows
from kvcompress.window import WindowLayer
from tests.test_padding import prefill, random_ids
from tests.tiny_models import tiny_model

LENGTHS = (150, 40, 90)  # 40 tokens: fewer than the default's 68 protected ones, so the batch has filler rows
WINDOW = 24


@torch.no_grad()
def step(model, cache, mask: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of ``tokens [b, q]`` after the cache (positions continue each row's real tokens); the logits
    and the mask grown by the new tokens."""
    mask = torch.cat([mask, torch.ones_like(tokens)], 1)
    positions = (mask.cumsum(-1) - 1)[:, -tokens.shape[1] :]
    logits = model(input_ids=tokens, attention_mask=mask, position_ids=positions, past_key_values=cache).logits
    return logits, mask


OPERATIONS = {  # name -> (batch rows the operation keeps, how it is called)
    "reorder (beam search)": ([2, 0, 0], lambda cache: cache.reorder_cache(torch.tensor([2, 0, 0]))),
    "repeat_interleave (num_return_sequences)": ([0, 0, 1, 1, 2, 2], lambda cache: cache.batch_repeat_interleave(2)),
    "select indices": ([1, 2], lambda cache: cache.batch_select_indices(torch.tensor([1, 2]))),
    "select by mask": ([0, 2], lambda cache: cache.batch_select_indices(torch.tensor([True, False, True]))),
}


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("operation", OPERATIONS)
def test_a_reshaped_batch_answers_as_the_rows_it_took(family, operation):
    """After a question step (so the value range covers rows appended after the context), the operation, then two
    more steps: every row's logits equal the untouched cache's row it was taken from (float64: to 1e-9)."""
    overrides = dict(sliding_window=WINDOW) if family == "gemma3" else {}
    model = tiny_model(family, dtype=torch.float64, **overrides)
    ids, mask = pad_rows([random_ids(length, seed=row) for row, length in enumerate(LENGTHS)], "left")
    cache = prefill(model, CompressKVPress(compression_ratio=0.75, seed=0), ids, mask)
    kinds = {type(layer) for layer in cache.layers}
    assert WeightedLayer in kinds and (WindowLayer in kinds) == (family == "gemma3")
    question = torch.randint(1, 256, (len(LENGTHS), 5), generator=torch.Generator().manual_seed(7))
    _, mask = step(model, cache, mask, question)
    untouched = copy.deepcopy(cache)

    rows, operate = OPERATIONS[operation]
    operate(cache)
    expected_mask, mask = mask, mask[rows]
    for seed in (11, 12):
        tokens = torch.randint(1, 256, (len(LENGTHS), 3), generator=torch.Generator().manual_seed(seed))
        expected, expected_mask = step(model, untouched, expected_mask, tokens)
        got, mask = step(model, cache, mask, tokens[rows])
        torch.testing.assert_close(got, expected[rows], rtol=0, atol=1e-9)


@torch.no_grad()
def test_num_return_sequences_over_a_compressed_cache():
    """The transformers recipe for sampled sequences over a prefilled cache, ``cache.batch_repeat_interleave(n)``
    then ``generate(num_return_sequences=n)``, runs over a compressed cache; each sequence's logits equal those of
    the same tokens fed to an unrepeated copy of the cache."""
    model = tiny_model("llama", dtype=torch.float64)
    context = random_ids(150, seed=0)
    cache = prefill(model, CompressKVPress(compression_ratio=0.75, seed=0), context)
    single = copy.deepcopy(cache)
    question = random_ids(5, seed=1)
    ids = torch.cat([context, question], 1)
    cache.batch_repeat_interleave(2)
    torch.manual_seed(0)
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=4, do_sample=True,
        num_return_sequences=2, output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    logits = torch.stack(out.logits, 1).double()  # [2, new, vocab]; generate hands logits back in float32
    for row in range(2):
        again = copy.deepcopy(single)
        fed = torch.cat([question, out.sequences[row : row + 1, ids.shape[1] : -1]], 1)
        positions = torch.arange(context.shape[1], context.shape[1] + fed.shape[1])[None]
        expected = model(input_ids=fed, position_ids=positions, past_key_values=again).logits[0, -4:]
        torch.testing.assert_close(logits[row], expected, rtol=2**-23, atol=1e-9)  # one float32 rounding


@torch.no_grad()
def test_beam_search_over_a_padded_batch_gives_each_rows_own_beams():
    """Beam search under the press (the prefill compressed inside generate, every step reordering the cache): a
    left-padded batch of two contexts returns the beams each context gets alone."""
    model = tiny_model("llama", dtype=torch.float64)
    contexts = [random_ids(150, seed=0), random_ids(90, seed=1)]
    ids, mask = pad_rows(contexts, "left")
    options = dict(max_new_tokens=6, num_beams=3, num_return_sequences=2, do_sample=False, pad_token_id=0)
    with CompressKVPress(compression_ratio=0.75, seed=0)(model):
        batched = model.generate(ids, attention_mask=mask, **options)[:, 150:]
    for row, context in enumerate(contexts):
        with CompressKVPress(compression_ratio=0.75, seed=0)(model):
            alone = model.generate(context, attention_mask=torch.ones_like(context), **options)[:, context.shape[1]:]
        assert torch.equal(batched[2 * row : 2 * row + 2], alone), row


@torch.no_grad()
def test_assisted_decoding_over_a_compressed_cache_gives_the_greedy_answer(monkeypatch):
    """Speculative decoding (an assistant model's draft verified several tokens at a time, rejected rows cropped
    from the compressed cache) returns the tokens plain greedy decoding returns over the same cache."""
    from kvcompress.cache import WeightedDynamicCache

    crops = []
    crop = WeightedDynamicCache.crop
    monkeypatch.setattr(WeightedDynamicCache, "crop", lambda self, n: crops.append(n) or crop(self, n))
    model = tiny_model("llama", dtype=torch.float64)
    assistant = tiny_model("llama", dtype=torch.float64, seed=1)  # drafts that are often rejected
    context, question = random_ids(150, seed=0), random_ids(5, seed=1)
    cache = prefill(model, CompressKVPress(compression_ratio=0.75, seed=0), context)
    ids = torch.cat([context, question], 1)
    options = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0)
    plain = model.generate(ids, past_key_values=copy.deepcopy(cache), **options)
    drafted = model.generate(ids, past_key_values=copy.deepcopy(cache), assistant_model=assistant, **options)
    assert torch.equal(drafted, plain) and plain.shape[1] == ids.shape[1] + 12
    assert crops  # drafts were rejected and their rows cropped away
