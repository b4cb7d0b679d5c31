"""eval.fidelity_paired: two presses' continuation KL paired per context, pooled over runs whose names repeat."""

import json

import numpy as np
import pytest

from eval import fidelity_paired


def _run(tmp_path, name: str, rows: list[tuple[str, str, float, float]]):
    run = tmp_path / name
    run.mkdir()
    lines = [json.dumps({"context": c, "press": p, "kept": k, "kl": kl}) for c, p, k, kl in rows]
    (run / "runs.jsonl").write_text("\n".join(lines) + "\n")
    return str(run)


def test_runs_pool_with_contexts_paired_within_each_run(tmp_path, capsys):
    rng = np.random.default_rng()
    a0, b0, a1, b1 = (rng.uniform(0.01, 1.0, 3) for _ in range(4))
    names = ["prose-2048-s0", "code-2048-s0", "mix-2048-s0"]  # the same names in both runs (another --seed)
    first = _run(tmp_path, "seed0", [(c, p, 0.25, v) for p, vals in (("x", a0), ("snapkv", b0)) for c, v in
                                     zip(names, vals, strict=True)] + [("prose-2048-s0", "x", 0.5, 9.0)])  # fmt: skip
    second = _run(tmp_path, "seed1", [(c, p, 0.25, v) for p, vals in (("x[y=1]", a1), ("snapkv", b1)) for c, v in
                                      zip(names, vals, strict=True)])  # fmt: skip
    kl_a, kl_b, paired = fidelity_paired.paired_kl([(first, "x", "snapkv"), (second, "x[y=1]", "snapkv")], 0.25)
    order = np.argsort(names)  # contexts sorted by name within a run
    np.testing.assert_array_equal(kl_a, np.concatenate([a0[order], a1[order]]))
    np.testing.assert_array_equal(kl_b, np.concatenate([b0[order], b1[order]]))
    assert paired[0] == f"{first}:code-2048-s0" and len(paired) == 6
    assert fidelity_paired.main(["--pair", first, "x", "snapkv", "--pair", second, "x[y=1]", "snapkv"]) == 0
    ratio = np.concatenate([a0, a1]).mean() / np.concatenate([b0, b1]).mean()
    out = capsys.readouterr().out
    assert out.startswith(f"KL A / B on 6 contexts: {ratio:.3f} [95% paired interval ")
    per_context = np.concatenate([a0 / b0, a1 / b1])
    assert f"{int((per_context > 1.5).sum())} above 1.5, {int((per_context < 1).sum())} below 1" in out


def test_a_press_the_run_lacks_is_one_error_naming_the_labels(tmp_path):
    run = _run(tmp_path, "run", [("prose-2048-s0", "snapkv", 0.25, 0.1), ("prose-2048-s0", "x", 0.25, 0.2)])
    with pytest.raises(SystemExit, match=r"no rows of 'nope' at kept 0.25; it has \['snapkv', 'x'\]"):
        fidelity_paired.main(["--pair", run, "nope", "snapkv"])
    with pytest.raises(SystemExit, match="no rows of 'x' at kept 0.5"):
        fidelity_paired.main(["--pair", run, "x", "snapkv", "--kept", "0.5"])


def test_a_failed_press_row_and_a_cut_line_are_skipped_and_the_file_is_left_as_it_is(tmp_path):
    """A row the study wrote for a press that failed on a context (no 'kl') leaves that context out of the pairing
    (it raised KeyError); a line cut by a study still appending is skipped, and this reader does not rewrite the
    file under it."""
    run = _run(tmp_path, "run", [(c, p, 0.25, 0.1 + i) for i, c in enumerate(("prose-2048-s0", "code-2048-s0"))
                                 for p in ("x", "snapkv")])  # fmt: skip
    path = tmp_path / "run" / "runs.jsonl"
    failed = json.dumps({"context": "mix-2048-s0", "press": "x", "kept": 0.25, "error": "ValueError: ..."})
    text = path.read_text() + failed + "\n" + json.dumps({"context": "mix-2048-s0", "press": "snapkv"})[:30]
    path.write_text(text)
    kl_a, kl_b, names = fidelity_paired.paired_kl([(run, "x", "snapkv")], 0.25)
    assert names == [f"{run}:code-2048-s0", f"{run}:prose-2048-s0"] and kl_a.tolist() == [1.1, 0.1]
    assert path.read_text() == text


def test_a_context_the_baseline_reproduces_exactly_has_no_per_context_ratio(tmp_path, capsys):
    """A zero baseline KL made the worst context infinite (the study's own report left such contexts out): every
    per-context reading now leaves it out, the ratio of means keeps it."""
    from kvcompress.fidelity.stats import context_ratios

    rng = np.random.default_rng()
    a, b = rng.uniform(0.01, 1.0, 4), rng.uniform(0.01, 1.0, 4)
    b[2] = 0.0
    ratios, covered = context_ratios(a, b)
    np.testing.assert_array_equal(covered, [True, True, False, True])
    np.testing.assert_allclose(ratios, np.delete(a, 2) / np.delete(b, 2), rtol=0, atol=0)
    names = ["c0", "c1", "c2", "c3"]
    run = _run(tmp_path, "r", [(c, p, 0.25, v) for p, vals in (("x", a), ("snapkv", b))
                               for c, v in zip(names, vals, strict=True)])  # fmt: skip
    assert fidelity_paired.main(["--pair", run, "x", "snapkv"]) == 0
    out = capsys.readouterr().out
    assert "worst inf" not in out and f"on 4 contexts: {a.mean() / b.mean():.3f}" in out
    worst = int(np.argmax(ratios))
    assert f"worst {ratios[worst]:.2f} ({run}:{np.delete(names, 2)[worst]})" in out
