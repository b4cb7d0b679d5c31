"""The fidelity study (kvcompress.fidelity and eval/fidelity.py): statistics, contexts, specs, bytes, the pipeline
replica, masking detection and the CLI end to end, on the embedded model at tiny sizes or tiny random models."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch

from kvcompress import CompressKVPress
from kvcompress.cache import WeightedLayer
from kvcompress.fidelity import contexts as ctxmod
from kvcompress.fidelity.measure import answer_questions, found, layer_errors, prefill
from kvcompress.fidelity.probes import PeakSampler, cache_bytes
from kvcompress.fidelity.specs import NAMES, check_specs, make_press, parse_spec
from kvcompress.fidelity.stats import bootstrap_mean, bootstrap_ratio, resample_indices
from tests.tiny_models import tiny_model


@pytest.fixture(scope="module")
def pipe(embedded_dir):
    import kvpress  # noqa: F401  (registers the pipeline)
    from transformers import pipeline

    from kvcompress.models import load_model

    model, tokenizer = load_model(str(embedded_dir))
    return pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)


def prefix_tokens(pipe) -> int:
    return pipe.preprocess("", [""], answer_prefix="", max_context_length=10**9)["context_ids"].shape[1]


# --- statistics ---------------------------------------------------------------------------------------------------


def test_bootstrap_interval_covers_the_mean_and_narrows_with_more_contexts():
    rng = np.random.default_rng(0)
    widths = []
    for n in (10, 100, 1000):
        mean, lo, hi = bootstrap_mean(rng.normal(3.0, 1.0, n), resamples=2000, seed=1)
        assert lo < 3.0 < hi and lo <= mean <= hi
        widths.append(hi - lo)
    assert widths[0] > 2 * widths[1] > 4 * widths[2]  # ~ 1 / sqrt(n)
    assert bootstrap_mean([2.0] * 5) == (2.0, 2.0, 2.0)


def test_bootstrap_resamples_contexts_with_all_their_trials():
    hits = np.array([[1, 1], [0, 0], [1, 0], [1, 1]])  # 4 contexts x 2 needle trials
    mean, lo, hi = bootstrap_mean(hits, resamples=500, seed=0)
    assert mean == pytest.approx(5 / 8)
    # every resampled mean is a mean of per-context means (multiples of 1/8 here), never of single trials
    assert (lo * 8) == pytest.approx(round(lo * 8)) and (hi * 8) == pytest.approx(round(hi * 8))
    assert resample_indices(4, 3, seed=7).tolist() == resample_indices(4, 3, seed=7).tolist()


def test_paired_ratio_interval_uses_the_same_contexts_for_both():
    base = np.random.default_rng(0).lognormal(0, 1, 12)
    ratio, lo, hi = bootstrap_ratio(0.5 * base, base, resamples=1000, seed=0)
    assert ratio == pytest.approx(0.5) and lo == pytest.approx(0.5) and hi == pytest.approx(0.5)
    _, lo_unpaired, hi_unpaired = bootstrap_ratio(0.5 * base[::-1], base, resamples=1000, seed=0)
    assert lo_unpaired < 0.5 < hi_unpaired


@pytest.mark.parametrize("bad", [dict(values=[]), dict(values=[[[1.0]]]), dict(values=[1.0], level=1.5)])
def test_bootstrap_rejects_bad_input(bad):
    with pytest.raises(ValueError, match="values|level"):
        bootstrap_mean(**bad)


def test_found_matches_whole_numbers_only():
    assert found(4821, "The passcode for the blue vault is 4821.")
    assert not found(4821, "14821 or 48210") and not found(4821, "")


# --- press specs --------------------------------------------------------------------------------------------------


def test_press_specs_parse_fields_and_build_presses():
    spec = parse_spec("compresskv[window_size=64, sink_size=16]")
    assert spec.label == "compresskv[window_size=64, sink_size=16]" and spec.fields == dict(
        window_size=64, sink_size=16
    )
    press = make_press(spec, kept=0.25, seed=3)
    assert isinstance(press, CompressKVPress)
    assert (press.compression_ratio, press.window_size, press.sink_size, press.seed) == (0.75, 64, 16, 3)
    assert make_press(parse_spec("uniform[weighted=true]"), 0.5).weighted is True
    assert make_press(parse_spec("snapkv[window_size=32]"), 0.5).window_size == 32
    assert make_press(parse_spec("exact"), 0.5) is None
    adakv = make_press(parse_spec("adakv"), 0.1)
    assert type(adakv.press).__name__ == "SnapKVPress" and adakv.compression_ratio == pytest.approx(0.9)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nope", "unknown press 'nope'; accepted names: exact, compresskv"),
        ("snapkv[foo=1]", "unknown field(s) foo of SnapKVPress; accepted fields: kernel_size, window_size"),
        ("compresskv[window_size=-1]", "window_size: must be an int >= 0"),
        ("compresskv[compression_ratio=0.5]", "unknown field(s) compression_ratio"),
        ("snapkv[window_size]", "bad field 'window_size'; write field=value"),
        ("exact[x=1]", "exact takes no fields"),
        ("snap kv", "write NAME or NAME[field=value,...]"),
    ],
)
def test_bad_press_specs_give_one_line_errors(spec, message):
    with pytest.raises(ValueError) as info:
        check_specs([spec], [0.5])
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"presses: spec {spec!r}") and message in text


def test_bad_kept_fraction_and_cli_spec_errors_stop_before_the_model(monkeypatch):
    from eval import fidelity

    with pytest.raises(ValueError, match=r"kept: fractions .* in \(0, 1\]"):
        check_specs(["snapkv"], [1.5])
    monkeypatch.setattr("kvcompress.models.load_model", lambda *a, **k: pytest.fail("model loaded before the check"))
    with pytest.raises(SystemExit) as info:
        fidelity.main(["--presses", "snapkv", "tvoa", "--output-dir", "/nonexistent"])
    assert "\n" not in str(info.value) and "unknown press 'tvoa'" in str(info.value)
    assert all(name in str(info.value) for name in NAMES)


# --- cache bytes and the peak sampler (tiny random model) ---------------------------------------------------------


def test_cache_bytes_is_the_sum_of_every_held_tensor():
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (1, 200))
    press = CompressKVPress(compression_ratio=0.5, seed=0)
    sampler = PeakSampler(None)
    cache, _ = prefill(model, press, ids, sampler)
    assert all(isinstance(layer, WeightedLayer) for layer in cache.layers)
    expected = sum(
        t.nbytes
        for layer in cache.layers
        for t in (layer.keys, layer.values, layer.row_weights, layer.value_min, layer.value_max)
    )
    assert cache_bytes(cache) == expected
    exact_sampler = PeakSampler(None)
    full, _ = prefill(model, None, ids, exact_sampler)
    full_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in full.layers)
    assert cache_bytes(full) == full_bytes and cache_bytes(cache) < 0.6 * full_bytes
    assert exact_sampler.peak == full_bytes and sampler.peak >= cache_bytes(cache)
    for layer in full.layers:  # a view keeps its whole buffer alive: the buffer is what the cache holds
        layer.keys, layer.values = layer.keys[:, :, :10], layer.values[:, :, :10]
    assert cache_bytes(full) == full_bytes


def test_layer_errors_treat_masked_rows_as_removed():
    from transformers import DynamicCache

    model = tiny_model("llama")
    full, _ = prefill(model, None, torch.randint(0, 256, (1, 40)))
    queries = {i: torch.randn(1, 4, 5, 16) for i in range(2)}
    drop = torch.arange(10, 30)
    kept = torch.cat([torch.arange(10), torch.arange(30, 40)])
    removed = DynamicCache()
    for i, layer in enumerate(full.layers):
        removed.update(layer.keys[:, :, kept], layer.values[:, :, kept], i)
    heads = torch.arange(2).repeat_interleave(len(drop))
    masked = {i: (torch.zeros_like(heads), heads, drop.repeat(2)) for i in range(2)}
    expected = layer_errors(model, full, removed, queries)
    assert layer_errors(model, full, full, queries, masked) == pytest.approx(expected, rel=1e-5)
    assert min(expected) > 0.01 and layer_errors(model, full, full, queries) == [0.0, 0.0]


# --- contexts (embedded tokenizer; no forward pass) ---------------------------------------------------------------


def test_contexts_are_deterministic_of_the_requested_length_with_needles_at_their_depths(pipe):
    kinds, lengths = ["prose", "code", "mix"], [600, 1000]
    contexts = ctxmod.build_contexts(pipe, kinds, lengths, seeds=2, continuation=16, seed=0)
    again = ctxmod.build_contexts(pipe, kinds, lengths, seeds=2, continuation=16, seed=0)
    other = ctxmod.build_contexts(pipe, kinds, lengths, seeds=2, continuation=16, seed=1)
    assert [c.describe() for c in contexts] == [c.describe() for c in again]
    assert all(torch.equal(a.ids, b.ids) for a, b in zip(contexts, again, strict=True))
    assert [c.start for c in contexts] != [c.start for c in other]
    assert [(c.kind, c.length, c.seed) for c in contexts] == [(k, n, s) for k in kinds for n in lengths for s in (0, 1)]
    prefix = prefix_tokens(pipe)
    tokenizer = pipe.tokenizer
    depths = ctxmod.DEPTHS
    for i, ctx in enumerate(contexts):
        assert abs(ctx.ids.shape[1] - prefix - ctx.length) <= 1  # the chat template's prefix + the text
        assert ctx.continuation.shape == (1, 16) and len(ctx.questions) == 2
        assert [n.depth for n in ctx.needles] == [depths[2 * i % 5], depths[(2 * i + 1) % 5]]
        assert len({n.key for n in ctx.needles}) == 2 and all(1000 <= n.code < 10000 for n in ctx.needles)
        text = tokenizer.decode(ctx.ids[0, prefix:])
        for needle in ctx.needles:
            at = text.index(needle.sentence)
            before = len(tokenizer(text[:at], add_special_tokens=False)["input_ids"])
            assert abs(before / ctx.length - needle.depth) < 0.05, (ctx.name, needle)
            assert needle.key in tokenizer.decode(ctx.questions[ctx.needles.index(needle)][0])
    for kind in kinds:  # slices of one kind never overlap
        spans = sorted((c.start, c.start + c.length + 16) for c in contexts if c.kind == kind)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    corpus = ctxmod.load_corpus(tokenizer, "prose")
    ctx = contexts[0]
    tail = ctx.continuation[0].tolist()
    window = corpus.ids[ctx.start : ctx.start + ctx.length + 64]
    assert any(window[i : i + 16] == tail for i in range(len(window)))  # the source's true next tokens


def test_each_seed_takes_slices_no_earlier_seed_took():
    """Seeds 0, 1, 2 of a study draw disjoint slices of a kind's text while it has free ones (independent draws
    gave seeds 0 and 1 one shared slice: two near-equal contexts); seed 0's are the plain draw's, and a later seed
    keeps every slice of its plain draw that no earlier seed took."""
    import random

    from kvcompress.fidelity.contexts import slot_order

    for kind in ("prose", "code", "mix"):
        orders = [slot_order(seed, kind, 26, 4) for seed in range(3)]
        assert orders[0] == random.Random(f"0:{kind}").sample(range(26), 4)
        assert len({slot for order in orders for slot in order}) == 12
        for seed in (1, 2):
            plain = random.Random(f"{seed}:{kind}").sample(range(26), 4)
            earlier = {slot for order in orders[:seed] for slot in order}
            assert [a for a, b in zip(orders[seed], plain, strict=True) if a != b] == [
                a for a, b in zip(orders[seed], plain, strict=True) if b in earlier
            ] and all((a == b) == (b not in earlier) for a, b in zip(orders[seed], plain, strict=True))
    assert slot_order(1, "prose", 26, 4)[1] != slot_order(0, "prose", 26, 4)[0]  # the shared slice (19) is replaced
    assert len(slot_order(1, "prose", 5, 4)) == 4  # too few free slices: an earlier seed's may be taken again


def test_context_settings_are_checked(pipe):
    with pytest.raises(ValueError, match="kinds: unknown kind 'poetry'"):
        ctxmod.build_contexts(pipe, ["poetry"], [300], 1, 16)
    with pytest.raises(ValueError, match="depths"):
        ctxmod.build_contexts(pipe, ["prose"], [300], 1, 16, depths=[0.0, 1.0])
    with pytest.raises(ValueError, match="lengths: the prose text .* holds"):
        ctxmod.build_contexts(pipe, ["prose"], [60_000], 2, 16)


# --- kvpress's pipeline protocol (embedded model) -----------------------------------------------------------------


@pytest.mark.slow
def test_pipeline_replica_gives_the_public_pipelines_answers(pipe):
    ctx = ctxmod.build_contexts(pipe, ["prose"], [300], seeds=1, continuation=4)[0]
    questions = [n.question for n in ctx.needles]
    for spec in ("snapkv", "compresskv"):
        press = make_press(parse_spec(spec), kept=0.5, seed=0)
        public = pipe(ctx.text, questions=questions, press=press, max_new_tokens=8)["answers"]
        cache, _ = prefill(pipe.model, make_press(parse_spec(spec), kept=0.5, seed=0), ctx.ids)
        assert answer_questions(pipe, cache, ctx, max_new_tokens=8) == public, spec


# --- the CLI end to end (embedded model) --------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_writes_every_output_flags_masking_and_resumes(tmp_path, embedded_dir, capsys):
    from eval import fidelity

    out = tmp_path / "run"
    argv = ["--model", str(embedded_dir), "--kinds", "prose", "--lengths", "300", "--seeds", "1",
            "--continuation-tokens", "16", "--max-new-tokens", "6", "--kept", "0.5", "--resamples", "200",
            "--presses", "snapkv", "compresskv", "adakv", "--output-dir", str(out)]  # fmt: skip (exact runs unasked)
    assert fidelity.main(argv) == 0
    for name in ("runs.jsonl", "summary.csv", "summary.json", "layer_errors.csv", "fidelity.md", "fidelity_kl.png"):
        assert (out / name).stat().st_size > 0, name
    runs = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [(r["press"], r["kept"]) for r in runs] == [
        ("exact", 1.0),
        ("snapkv", 0.5),
        ("compresskv", 0.5),
        ("adakv", 0.5),
    ]
    by = {r["press"]: r for r in runs}
    assert by["exact"]["kl"] == 0 and by["exact"]["layer_err"] == 0 and len(by["exact"]["answers"]) == 2
    assert by["adakv"]["kept_everything"] and not by["snapkv"]["kept_everything"]
    assert not by["compresskv"]["kept_everything"]
    for press in ("snapkv", "compresskv"):
        row = by[press]
        assert row["kl"] > 0 and 0 < row["layer_err"] < 1 and len(row["layer_errors"]) == 30
        assert row["cache_bytes"] < 0.6 * row["full_bytes"] and row["cache_mib"] <= row["peak_cache_mib"]
        assert row["prefill_ratio"] > 0
    assert by["snapkv"]["peak_cache_mib"] * 2**20 <= by["snapkv"]["full_bytes"]  # compressed layer by layer
    summary = json.loads((out / "summary.json").read_text())
    assert {"summary", "config", "contexts", "environment"} <= set(summary)
    assert [set(n) for n in summary["contexts"][0]["needles"]] == [{"key", "code", "depth"}] * 2
    assert summary["environment"]["kvpress"] == "0.5.5" and summary["config"]["presses"][0] == "snapkv"
    table = {(e["press"], e["kept"]): e for e in summary["summary"]}
    assert table[("adakv", 0.5)]["kept_everything"] and not table[("adakv", 0.5)]["best_kl"]
    assert table[("snapkv", 0.5)]["kl_vs_snapkv"] == pytest.approx(1.0)
    assert sum(e["best_kl"] for e in summary["summary"]) == 1
    with open(out / "layer_errors.csv", newline="") as handle:
        assert len(list(csv.DictReader(handle))) == 4 * 30
    markdown = (out / "fidelity.md").read_text()
    assert markdown.startswith("| press | kept | KL") and "yes †" in markdown and "masks only" in markdown
    capsys.readouterr()

    assert fidelity.main(argv) == 0  # resume: nothing recomputed
    assert "all 4 rows already" in capsys.readouterr().out
    assert len((out / "runs.jsonl").read_text().splitlines()) == 4
    settings = by["compresskv"]["press_settings"]  # what each row was measured with; the calibration's layers
    assert settings["active_retrieval_layers"] == [18] and settings["retrieval_prior_share"] == 1.0
    assert "active_retrieval_layers" not in by["snapkv"]["press_settings"] and by["exact"]["press_settings"] == {}
    saved = (out / "runs.jsonl").read_text()  # rows of another press under the label are not resumed into
    rows = [json.loads(line) for line in saved.splitlines()]
    for row in rows:
        if row["press"] == "compresskv":
            row["press_settings"]["retrieval_prior_share"] = 0.0
    (out / "runs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(SystemExit) as info:
        fidelity.main(argv)
    assert "\n" not in str(info.value)
    assert "compresskv rows measured with another press (retrieval_prior_share: 0.0 there, 1.0 now)" in str(info.value)
    for row in rows:  # rows from before the settings were recorded (and before calibrations: no layers)
        del row["press_settings"]
    (out / "runs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(SystemExit) as info:
        fidelity.main(argv)
    assert "compresskv rows measured with another press (retrieval layers [] there, [18] now)" in str(info.value)
    (out / "runs.jsonl").write_text(saved)
    with pytest.raises(SystemExit) as info:
        fidelity.main([*argv, "--continuation-tokens", "8"])
    assert "\n" not in str(info.value) and "other settings" in str(info.value)

    merged = tmp_path / "merged"  # parallel runs merged: concatenated rows, a repeated row counted once
    merged.mkdir()
    (merged / "settings.json").write_text((out / "settings.json").read_text())
    (merged / "runs.jsonl").write_text((out / "runs.jsonl").read_text() * 2)
    argv = [*argv[:-6], "--presses", "snapkv", "streamingllm", "--output-dir", str(merged), "--report-only"]
    assert fidelity.main(argv) == 0
    assert "already in" not in capsys.readouterr().out  # nothing prefilled, not even the exact pass
    summary = json.loads((merged / "summary.json").read_text())["summary"]
    assert [(e["press"], e["contexts"]) for e in summary] == [("exact", 1), ("snapkv", 1)]  # no streamingllm rows
    assert len((merged / "runs.jsonl").read_text().splitlines()) == 8
    with pytest.raises(SystemExit) as info:
        fidelity.main([*argv, "--contexts", "prose-300-s9"])
    assert "\n" not in str(info.value) and "contexts: unknown context names ['prose-300-s9']" in str(info.value)
