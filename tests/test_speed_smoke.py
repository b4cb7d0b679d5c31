"""eval/speed/ (python -m eval.speed) in smoke mode on CPU: every section runs and reports positive numbers."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from eval import speed

TINY = [
    "--device", "cpu", "--smoke", "--dtype", "float32",
    "--compress-n", "384", "--decode-lengths", "256", "--decode-batches", "1", "2", "--decode-heads", "2x2",
    "--prefill-lengths", "384", "--decode-context", "384", "--decode-tokens", "2", "--repeats", "2",
    "--backends", "torch",  # deterministic whatever TRITON_INTERPRET other test modules set
    "--decode-contexts", "256", "--decode-batch-sizes", "1", "2", "--only", "bandwidth,kernels,e2e,prefill,decode",
]  # fmt: skip


def positive(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def test_smoke_run_writes_every_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "speed.json"
    assert speed.main([*TINY, "--output", str(output)]) == 0
    printed = capsys.readouterr().out
    for title in ("[bandwidth]", "[kernels] compress_kv", "[kernels] weighted_attention", "[e2e] prefill",
                  "[e2e] decode", "[e2e] attention part", "[goals]", "[decode] greedy decode step"):  # fmt: skip
        assert title in printed
    data = json.loads(output.read_text())
    assert data["smoke"] is True and data["device_type"] == "cpu" and data["device"].startswith("cpu")
    assert data["dtype"] == "float32"
    assert set(data["section_s"]) == {"bandwidth", "kernels", "e2e", "prefill", "decode"}
    assert "[prefill] breakdown per setting" in printed

    bandwidth = data["bandwidth"]
    assert all(positive(bandwidth[k]) for k in ("gbps", "best_gbps", "median_s", "bytes_moved"))

    compress = data["kernels"]["compress_kv"]
    decode = data["kernels"]["weighted_attention"]
    assert [r["backend"] for r in compress] == ["torch"]
    assert {r["backend"] for r in decode} == {"torch", "sdpa"} and len(decode) == 4
    for row in compress + decode:
        assert "error" not in row, row
        assert all(positive(row[k]) for k in ("median_s", "gbps", "roofline", "bytes")), row
    assert compress[0]["rank"] == 96 and compress[0]["bins"] == 8  # 25% of 384 rows, 12 pivots per bin

    e2e = data["e2e"]
    assert positive(e2e["model"]["parameters"]) and e2e["model"]["config"]["num_hidden_layers"] == 2
    assert [r["press"] for r in e2e["prefill"]] == ["none", "snapkv", "compresskv"]
    assert [r["variant"] for r in e2e["decode"]] == ["full/sdpa", "snapkv/sdpa", "compresskv/kvcompress"]
    calls = {(r["variant"], r["call"]) for r in e2e["attention"]}
    assert ("full/sdpa", "model:sdpa") in calls and ("compresskv/kvcompress", "model:kvcompress") in calls
    assert ("compresskv/kvcompress", "raw:weighted_attention[torch]") in calls
    for row in e2e["prefill"] + e2e["decode"] + e2e["attention"]:
        assert "error" not in row, row
        assert positive(row["median_s"]), row
    for row in e2e["decode"]:
        assert positive(row["tokens_per_s"]) and positive(row["cache_gib"]), row
        assert row["peak_decode_gib"] is None or row["peak_decode_gib"] > 0  # CPU: resident peak where readable
    full, _, compressed = e2e["decode"]
    assert compressed["cache_rows"] <= 384 // 4 < full["cache_rows"] == 384

    steps = data["decode"]["steps"]  # every cache variant at both batch sizes, compiled ones included
    assert [(r["variant"], r["batch"]) for r in steps] == [(v, b) for v in speed.decode.VARIANTS for b in (1, 2)]
    for row in steps:
        assert "error" not in row, row
        assert positive(row["step_ms"]) and positive(row["tokens_per_s"]) and positive(row["cache_gib"]), row
    rows = {(r["variant"], r["batch"]): r["cache_rows"] for r in steps}
    assert rows[("full/eager", 2)] == 256 and rows[("kept/static+compile", 1)] == 64 + 4  # kept + new-token rows
    assert rows[("ours/eager", 1)] == 64 and rows[("ours/compiled", 1)] == 64 + 4
    calls = data["decode"]["attention"]
    assert {r["variant"] for r in calls} == set(speed.decode.ATTENTION_VARIANTS)
    assert all(positive(r["python_s"]) and positive(r["host_s"]) and r["cuda_graph_s"] is None for r in calls)
    assert all(positive(r["host_step_s"]) and positive(r["host_grow_s"]) for r in calls if r["variant"] == "ours/eager")
    for goal in data["decode"]["goals"]:
        assert goal["compiled_vs_floor"] and goal["speedup_vs_full"] and goal["ours_attention_host_us"], goal

    goals = data["goals"]
    assert {"prefill_overhead", "decode_roofline", "attention_speedup", "note"} <= set(goals)
    assert positive(goals["attention_speedup"]["model_path"])
    assert isinstance(data["notes"], list)


def test_backend_keyword_is_passed_when_present(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a ``backend`` keyword (the planned interface) each row calls the backend it names."""
    seen: list[str] = []

    def with_backend(fn):
        def wrapper(*args, backend: str = "auto", **kwargs):
            seen.append(f"{fn.__name__}:{backend}")
            return fn(*args, **kwargs)

        wrapper.__name__ = fn.__name__
        wrapper.__signature__ = inspect.signature(wrapper)
        return wrapper

    monkeypatch.setattr(speed.kernels, "compress_kv", with_backend(speed.kernels.compress_kv))
    monkeypatch.setattr(speed.kernels, "weighted_attention", with_backend(speed.kernels.weighted_attention))
    output = tmp_path / "kernels.json"
    argv = [*TINY, "--only", "kernels", "--backends", "auto", "torch", "--output", str(output)]
    assert speed.main(argv) == 0
    data = json.loads(output.read_text())
    assert data["backend_keyword"] == {"compress_kv": True, "weighted_attention": True}
    assert "e2e" not in data and "bandwidth" in data  # the roofline denominator is always measured
    assert {"compress_kv:auto", "compress_kv:torch", "weighted_attention:auto", "weighted_attention:torch"} == set(seen)
    assert [r["backend"] for r in data["kernels"]["compress_kv"]] == ["auto", "torch"]


def test_cpu_without_smoke_and_bad_sizes_are_refused_in_one_line() -> None:
    for argv, message in ((["--device", "cpu", "--only", "bandwidth"], "--smoke"),
                          (["--smoke", "--repeats", "0"], "^speed: repeats: must be >= 1, got 0$"),
                          (["--smoke", "--threads", "-1"], "^speed: threads: must be >= 1, got -1$")):  # fmt: skip
        with pytest.raises(SystemExit, match=message):
            speed.main(argv)


@pytest.mark.parametrize("flags, during", [([], True), (["--no-cudnn-sdpa"], False)])
def test_no_cudnn_sdpa_holds_for_the_run_only(flags, during, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--no-cudnn-sdpa`` keeps sdpa off its cuDNN kernel while the sections run (what the stock decode rows cost
    without a cuDNN plan per key length) and gives torch its own setting back after; without it torch's stays."""
    import torch

    from eval.speed import cli

    seen = []
    monkeypatch.setattr(cli, "run", lambda cfg, *args: seen.append(torch.backends.cuda.cudnn_sdp_enabled()) or 0)
    before = torch.backends.cuda.cudnn_sdp_enabled()
    assert speed.main([*TINY, *flags]) == 0
    assert seen == [during and before] and torch.backends.cuda.cudnn_sdp_enabled() == before
    assert speed.resolve_config([*TINY, *flags]).cudnn_sdpa is during


def test_skipped_weighted_kernels_launch_nothing_and_come_back() -> None:
    """``host_python_s``'s context (eval.speed.decode): inside, the decode launcher runs its Python and returns an
    output of the right shape without launching (interpreted here: launching would write it); after, even after
    an error, the real kernels are back."""
    import torch

    from eval.speed.decode import _weighted_kernels_skipped
    from kvcompress.kernels import weighted_decode

    kernels = (weighted_decode._weighted_split_kernel, weighted_decode._weighted_decode_reduce_kernel)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled there, interpreted here
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 1, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g),
               torch.randn(1, 2, 40, 16, generator=g))  # fmt: skip
    w = torch.rand(1, 2, 40, generator=g) + 0.5
    q, k, v, w = (x.to(device) for x in (q, k, v, w))
    with pytest.raises(RuntimeError, match="inside"), _weighted_kernels_skipped():
        skipped = weighted_decode.weighted_decode_attention(q, k, v, w, scaling=0.25, num_splits=2)
        assert skipped.shape == (1, 4, 1, 16)
        now = (weighted_decode._weighted_split_kernel, weighted_decode._weighted_decode_reduce_kernel)
        assert all(a is not b for a, b in zip(now, kernels, strict=True))
        raise RuntimeError("inside")
    assert (weighted_decode._weighted_split_kernel, weighted_decode._weighted_decode_reduce_kernel) == kernels
    real = weighted_decode.weighted_decode_attention(q, k, v, w, scaling=0.25, num_splits=2)
    assert torch.isfinite(real).all()


def test_folding_one_row_makes_every_call_fold_a_row_into_the_clip_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """``host_step_s``'s calls (eval.speed.decode): each call folds the layer's last row into its clip range (one
    ``aminmax``, as a decode step's first attention call does), and the range stays the true one over every row."""
    import torch

    from eval.speed.decode import _folding_one_row
    from kvcompress.cache import WeightedLayer

    g = torch.Generator().manual_seed(5)
    keys, values = torch.randn(1, 2, 12, 16, generator=g), torch.randn(1, 2, 12, 16, generator=g)
    low, high = values.amin(-2) - torch.rand(1, 2, 16, generator=g), values.amax(-2)  # the context's wider range
    layer = WeightedLayer(keys, values, torch.rand(1, 2, 12, generator=g) + 0.5, low, high, tokens=40)
    keys, values = layer.update(torch.randn(1, 2, 3, 16, generator=g), torch.randn(1, 2, 3, 16, generator=g) * 3)
    layer.value_range(values)
    folds = []
    real_aminmax = torch.aminmax
    monkeypatch.setattr(torch, "aminmax", lambda *a, **k: folds.append(a[0].shape[-2]) or real_aminmax(*a, **k))
    step = _folding_one_row(layer, lambda: layer.value_range(values))
    for _ in range(3):
        got_low, got_high = step()
    assert folds == [1, 1, 1]
    torch.testing.assert_close(got_low, torch.minimum(low, values[:, :, 12:].amin(-2)), rtol=0, atol=0)
    torch.testing.assert_close(got_high, torch.maximum(high, values[:, :, 12:].amax(-2)), rtol=0, atol=0)


def test_one_row_longer_each_call_calls_over_a_new_length_and_the_layer_is_restored() -> None:
    """``host_grow_s``'s calls (eval.speed.decode): each call is over the layer's rows plus one more than the last
    call's (cycling), tagged as the layer's, with only that row left to fold; cropping restores the layer."""
    import torch

    from eval.speed.decode import _one_row_longer_each_call
    from kvcompress.cache import WeightedLayer, layer_of

    g = torch.Generator().manual_seed(6)
    keys, values = torch.randn(1, 2, 12, 16, generator=g), torch.randn(1, 2, 12, 16, generator=g)
    layer = WeightedLayer(keys, values, torch.rand(1, 2, 12, generator=g) + 0.5, values.amin(-2), values.amax(-2),
                          tokens=40)  # fmt: skip
    keys, values = layer.update(torch.randn(1, 2, 3, 16, generator=g), torch.randn(1, 2, 3, 16, generator=g))
    seen = []

    def call_over(k, v):
        assert layer_of(k) is layer and v.shape[-2] == k.shape[-2]
        assert layer.clip_range(k.shape[-2])[2] == k.shape[-2] - 1  # one row to fold
        seen.append(k.shape[-2])

    step = _one_row_longer_each_call(layer, call_over, 4)
    for _ in range(6):
        step()
    assert seen == [16, 17, 18, 19, 16, 17]
    layer.crop(15)
    assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
