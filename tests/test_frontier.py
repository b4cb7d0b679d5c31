"""eval/frontier.py: the retention / cost table and plot read the numbers the other harnesses wrote."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import yaml

from eval import frontier


def write_ruler(run_dir: Path, averages: dict[str, float]) -> None:
    run_dir.mkdir(parents=True)
    results = {method: {"average": value, "tasks": {}} for method, value in averages.items()}
    (run_dir / "scores.json").write_text(json.dumps({"benchmark": "ruler", "results": results}))


def test_table_and_plot_take_each_number_from_its_file(tmp_path: Path) -> None:
    rng = random.Random(7)
    ruler = {kept: {"compresskv": rng.uniform(0, 100), "snapkv": rng.uniform(0, 100)} for kept in ("0.25", "0.5")}
    for kept, averages in ruler.items():
        write_ruler(tmp_path / f"ruler_{kept}", averages)
    entry = dict(press="compresskv", kept=0.25, contexts=12, kl_vs_snapkv=1.3, kl_vs_snapkv_lo=1.1)
    entry.update(kl_vs_snapkv_hi=1.6, kl_ratio_max=2.4)
    other = {**entry, "kept": 0.5, "kl_vs_snapkv": 9.0}  # another fraction: never read at kl_kept 0.25
    (tmp_path / "summary.json").write_text(json.dumps({"summary": [other, entry]}))
    cpu = {"exact": [8.0, 6.0, 7.0], "compresskv": [9.0, 9.5, 8.5]}
    lines = ["loading...", "snapkv kept=0.25 tokens=2024 round 0: prefill 1.0 s wall, 99.0 s CPU"]
    for label, seconds in cpu.items():
        for i, s in enumerate(seconds):
            peak = 0.1 * (i + 1) if label == "compresskv" else 0.05
            lines.append(
                f"{label} kept=0.25 tokens=2024 round {i}: prefill 3.5 s wall, {s} s CPU, "
                f"peak resident 1.000 GiB (+{peak:.3f} GiB)"
            )
    (tmp_path / "prefill.txt").write_text("\n".join(lines) + "\n")
    # A point timed in another run is divided by that run's own baseline (ratios within one run).
    (tmp_path / "later.txt").write_text(
        "exact kept=0.25 tokens=2024 round 0: prefill 1.0 s wall, 5.0 s CPU\n"
        "novel kept=0.25 tokens=2024 round 0: prefill 1.0 s wall, 8.0 s CPU\n"
    )
    points = dict(
        baseline_prefill=[str(tmp_path / "prefill.txt"), "exact"],
        points=[
            dict(
                name="default",
                ruler={kept: [str(tmp_path / f"ruler_{kept}"), "compresskv"] for kept in ruler},
                kl=[str(tmp_path / "summary.json"), "compresskv"],
                prefill=[str(tmp_path / "prefill.txt"), "compresskv"],
            ),
            dict(name="ruler only", ruler={"0.25": [str(tmp_path / "ruler_0.25"), "snapkv"]}),
            dict(name="later", prefill=[str(tmp_path / "later.txt"), "novel"]),
        ],
    )
    points_file = tmp_path / "points.yaml"
    points_file.write_text(yaml.safe_dump(points))
    out = tmp_path / "out"
    assert frontier.main(["--points", str(points_file), "--output-dir", str(out)]) == 0
    result = json.loads((out / "frontier.json").read_text())
    default, only, later = result["points"]
    assert later["prefill_ratio"] == pytest.approx(8.0 / 5.0) and later["peak_gib"] is None
    assert default["ruler"] == {kept: ruler[kept]["compresskv"] for kept in ruler}
    assert default["prefill_ratio"] == pytest.approx(9.0 / 7.0)  # medians of the CPU seconds
    assert default["peak_gib"] == pytest.approx(0.2)
    assert default["kl"] == dict(ratio=1.3, low=1.1, high=1.6, worst=2.4, contexts=12)
    assert only["ruler"] == {"0.25": ruler["0.25"]["snapkv"]} and only["kl"] is None and only["prefill_ratio"] is None
    table = (out / "frontier.md").read_text()
    low, high = ruler["0.25"]["compresskv"], ruler["0.5"]["compresskv"]
    assert f"| default | {low:.1f} | {high:.1f} | 1.30 [1.10, 1.60] | 2.40 | 1.29 | 0.200 |" in table
    assert "| ruler only |" in table
    pytest.importorskip("matplotlib")
    assert (out / "frontier.png").stat().st_size > 0


def test_a_missing_method_names_the_file(tmp_path: Path) -> None:
    write_ruler(tmp_path / "run", {"snapkv": 10.0})
    (tmp_path / "prefill.txt").write_text("exact kept=0.25 tokens=10 round 0: prefill 1.0 s wall, 2.0 s CPU\n")
    points = dict(
        baseline_prefill=[str(tmp_path / "prefill.txt"), "exact"],
        points=[dict(name="x", ruler={"0.25": [str(tmp_path / "run"), "compresskv"]})],
    )
    (tmp_path / "points.yaml").write_text(yaml.safe_dump(points))
    with pytest.raises(SystemExit, match="no method 'compresskv'"):
        frontier.main(["--points", str(tmp_path / "points.yaml"), "--output-dir", str(tmp_path / "out")])


def test_gpu_columns_read_the_speed_breakdown_at_the_chosen_length(tmp_path: Path) -> None:
    (tmp_path / "prefill.txt").write_text("exact kept=0.25 tokens=10 round 0: prefill 1.0 s wall, 2.0 s CPU\n")
    rows = [
        dict(n=8192, setting="default", vs_none=9.0, peak_vs_snapkv=9.0),  # another length: never read
        dict(n=32768, setting="default", vs_none=1.17, peak_vs_snapkv=1.023),
        dict(n=32768, setting="balanced", error="OutOfMemoryError"),  # a failed row has no ratio
    ]
    (tmp_path / "speed.json").write_text(json.dumps({"prefill_breakdown": {"rows": rows}}))
    points = dict(
        baseline_prefill=[str(tmp_path / "prefill.txt"), "exact"],
        gpu_tokens=32768,
        gpu_machine="H200",
        points=[dict(name="default", gpu=[str(tmp_path / "speed.json"), "default"]), dict(name="cpu only")],
    )
    (tmp_path / "points.yaml").write_text(yaml.safe_dump(points))
    out = tmp_path / "out"
    assert frontier.main(["--points", str(tmp_path / "points.yaml"), "--output-dir", str(out)]) == 0
    table = (out / "frontier.md").read_text()
    assert "GPU prefill / no press (H200, 32k) | GPU peak / SnapKV's |" in table
    assert "| default | - | - | - | - | 1.17 | 1.023 |" in table and "| cpu only | - | - | - | - | - | - |" in table
    points["points"] = [dict(name="failed", gpu=[str(tmp_path / "speed.json"), "balanced"])]
    (tmp_path / "points.yaml").write_text(yaml.safe_dump(points))
    with pytest.raises(SystemExit, match="gpu: no setting 'balanced' at 32768 tokens"):
        frontier.main(["--points", str(tmp_path / "points.yaml"), "--output-dir", str(out)])


def test_pooled_runs_give_the_pooled_average_its_interval_and_the_kl_bound_count(tmp_path: Path, monkeypatch) -> None:
    from eval import ruler_paired
    from tests.test_ruler_paired import Example, write_run

    def contexts(seed: int) -> dict[str, list[Example]]:  # each seed its own contexts, as the generator makes them
        tasks = ("niah_single", "qa")
        return {task: [Example(f"{task}-{seed}-{i}", [[f"{task}{seed}{i}"]]) for i in range(4)] for task in tasks}

    built = []  # (task, seed) of each context set the generator builds

    def load_task(task, cfg):
        built.append((task, cfg.seed))
        return contexts(cfg.seed)[task]

    monkeypatch.setattr(ruler_paired, "load_task", load_task)
    monkeypatch.setattr(ruler_paired, "select", lambda examples, cfg: examples[: cfg.limit])
    runs = [write_run(tmp_path / f"r{seed}", "compresskv", seed, 4, contexts(seed), right=right)
            for seed, right in ((0, 3), (1, 1))]  # fmt: skip
    short = [write_run(tmp_path / "short", "snapkv", 0, 2, contexts(0), right=2)]
    rng = np.random.default_rng()
    kl = {seed: {p: rng.uniform(0.01, 1.0, 3) for p in ("x", "snapkv")} for seed in (0, 1)}
    fid = []
    for seed, by_press in kl.items():
        (tmp_path / f"f{seed}").mkdir()
        rows = [dict(context=f"c{i}", press=p, kept=0.25, kl=float(v)) for p, vals in by_press.items()
                for i, v in enumerate(vals)]  # fmt: skip
        (tmp_path / f"f{seed}" / "runs.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        fid.append([str(tmp_path / f"f{seed}"), "x"])
    (tmp_path / "prefill.txt").write_text("exact kept=0.25 tokens=10 round 0: prefill 1.0 s wall, 2.0 s CPU\n")
    points = dict(
        baseline_prefill=[str(tmp_path / "prefill.txt"), "exact"],
        kl_bound=1.2,
        points=[
            dict(name="pooled", ruler={"0.25": [runs, "compresskv"]}, kl=fid),
            dict(name="fewer", ruler={"0.25": [short, "snapkv"]}),
            dict(name="same", ruler={"0.25": [runs, "compresskv"]}),
        ],
    )
    (tmp_path / "points.yaml").write_text(yaml.safe_dump(points))
    out = tmp_path / "out"
    assert frontier.main(["--points", str(tmp_path / "points.yaml"), "--output-dir", str(out)]) == 0
    pooled, fewer, same = json.loads((out / "frontier.json").read_text())["points"]
    # three context settings (seed 0 limit 4, seed 1 limit 4, seed 0 limit 2) x two tasks, each built once
    assert sorted(built) == sorted([(t, s) for t in ("niah_single", "qa") for s in (0, 1, 0)])
    assert same["ruler"] == pooled["ruler"] and same["ruler_interval"] == pooled["ruler_interval"]
    assert pooled["ruler"]["0.25"] == pytest.approx(100 * 4 / 8)  # 3 + 1 of 8 contexts right in each task
    interval = pooled["ruler_interval"]["0.25"]
    assert interval["contexts"] == 8 and interval["low"] < 50 < interval["high"]
    assert fewer["ruler"]["0.25"] == 100 and fewer["ruler_interval"]["0.25"]["low"] == 100
    x = np.concatenate([kl[0]["x"], kl[1]["x"]])
    base = np.concatenate([kl[0]["snapkv"], kl[1]["snapkv"]])
    assert pooled["kl"]["ratio"] == pytest.approx(x.mean() / base.mean()) and pooled["kl"]["contexts"] == 6
    assert pooled["kl"]["worst"] == pytest.approx((x / base).max())
    assert pooled["kl"]["above"] == int((x / base > 1.2).sum())
    table = (out / "frontier.md").read_text()
    assert "| contexts above 1.2x |" in table
    assert f"| pooled | 50.0 [{interval['low']:.1f}, {interval['high']:.1f}] | {pooled['kl']['ratio']:.2f} [" in table
    assert "| fewer | 100.0 [100.0, 100.0] (2 per task) | - | - | - |" in table


def test_readme_results_table_is_the_one_eval_frontier_wrote() -> None:
    """README's results table is results/frontier/headline/frontier.md as written, not typed in by hand."""
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text().split("\n")
    start = readme.index("## Results")
    first = next(i for i in range(start, len(readme)) if readme[i].startswith("|"))
    last = next(i for i in range(first, len(readme)) if not readme[i].startswith("|"))
    written = (root / "results/frontier/headline/frontier.md").read_text().strip().split("\n")
    assert readme[first:last] == written
    points = yaml.safe_load((root / "results/frontier/headline.yaml").read_text())["points"]
    assert [line.split(" | ")[0].removeprefix("| ") for line in written[2:]] == [p["name"] for p in points]
