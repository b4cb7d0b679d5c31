"""The fidelity summary's per-context KL ratios to SnapKV: mean, min and max beside the ratio of means."""

from __future__ import annotations

import pytest

from kvcompress.fidelity.report import markdown, summarize


def _row(press: str, context: str, kl: float) -> dict:
    return dict(
        press=press,
        kept=0.25,
        context=context,
        kl=kl,
        top1=0.9,
        needle_hits=[1, 0],
        layer_err=0.1,
        cache_mib=1.0,
        peak_cache_mib=1.0,
        prefill_ratio=1.0,
        kept_everything=False,
    )


def test_per_context_ratios_show_the_rare_large_loss_the_ratio_of_means_hides():
    contexts = ["a", "b", "c", "d"]
    snap = [0.10, 0.20, 0.01, 0.40]
    ours = [0.05, 0.10, 0.03, 0.20]  # half of SnapKV's KL on three contexts, 3x on the one where both are small
    rows = [_row("snapkv", c, k) for c, k in zip(contexts, snap, strict=True)] + [
        _row("compresskv", c, k) for c, k in zip(contexts, ours, strict=True)
    ]
    plan = [("snapkv", 0.25), ("compresskv", 0.25)]
    table = {e["press"]: e for e in summarize(rows, plan, contexts, resamples=200)}
    ours_entry = table["compresskv"]
    assert ours_entry["kl_vs_snapkv"] == pytest.approx(sum(ours) / sum(snap))  # 0.53: looks like a clear win
    ratios = [o / s for o, s in zip(ours, snap, strict=True)]
    assert ours_entry["kl_ratio_mean"] == pytest.approx(sum(ratios) / 4)
    assert ours_entry["kl_ratio_max"] == pytest.approx(3.0) and ours_entry["kl_ratio_min"] == pytest.approx(0.5)
    assert table["snapkv"]["kl_ratio_max"] == pytest.approx(1.0)
    text = markdown(list(table.values()), 4)
    assert "per-context KL / SnapKV: mean (min-max)" in text.splitlines()[0]
    assert f"| {sum(ratios) / 4:.2f} (0.50-3.00) |" in text
    assert all(line.count("|") == text.splitlines()[0].count("|") for line in text.splitlines()[:4])


def test_contexts_where_snapkv_is_exact_are_left_out_of_the_per_context_ratios():
    rows = [_row("snapkv", "a", 0.0), _row("snapkv", "b", 0.2)]
    rows += [_row("compresskv", "a", 0.1), _row("compresskv", "b", 0.1)]
    table = {e["press"]: e for e in summarize(rows, [("snapkv", 0.25), ("compresskv", 0.25)], ["a", "b"], 100)}
    assert table["compresskv"]["kl_ratio_max"] == pytest.approx(0.5) == table["compresskv"]["kl_ratio_mean"]
