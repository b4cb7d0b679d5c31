"""The harness command lines end to end at tiny sizes: files, columns and sane numbers."""

from __future__ import annotations

import csv

import pytest

from eval import approx_error, fidelity


def read_csv(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_approx_error_cli_writes_csv_and_plot(tmp_path):
    argv = ["--n", "256", "--m", "32", "--ranks", "8", "32", "--trials", "2", "--output-dir", str(tmp_path)]
    assert approx_error.main(argv) in (0, None)
    rows = read_csv(tmp_path / "approx_error.csv")
    assert len(rows) == 2 * 5 * 2  # families x methods x ranks
    assert set(rows[0]) == set(approx_error.CSV_COLUMNS)
    assert all(float(r["max_err"]) >= 0 and float(r["rel_fro"]) >= 0 for r in rows)
    assert (tmp_path / "approx_error.png").stat().st_size > 10_000


def test_approx_error_rejects_unknown_method(tmp_path):
    with pytest.raises(SystemExit):
        approx_error.main(["--methods", "nope", "--output-dir", str(tmp_path)])


@pytest.mark.slow
def test_fidelity_cli_on_the_embedded_model(tmp_path, embedded_dir):
    argv = [
        "--model",
        str(embedded_dir),
        "--contexts",
        "1",
        "--context-tokens",
        "300",
        "--continuation-tokens",
        "8",
        "--max-new-tokens",
        "4",
        "--kept",
        "0.5",
        "--presses",
        "compresskv_keys",
        "snapkv",
        "--output-dir",
        str(tmp_path),
    ]
    fidelity.main(argv)
    table = {(r["press"], r["kept"]): r for r in read_csv(tmp_path / "fidelity.csv")}
    assert set(table) == {("exact", "1.0"), ("compresskv_keys", "0.5"), ("snapkv", "0.5")}
    assert float(table[("exact", "1.0")]["kl"]) == 0 and float(table[("compresskv_keys", "0.5")]["kl"]) > 0
    full, ours = float(table[("exact", "1.0")]["cache_mib"]), float(table[("compresskv_keys", "0.5")]["cache_mib"])
    assert ours < 0.55 * full
    layers = read_csv(tmp_path / "layer_errors.csv")
    assert len(layers) == 3 * 30 and all(float(r["rel_err"]) >= 0 for r in layers)
    assert (tmp_path / "fidelity.md").read_text().startswith("| press |")


def test_fidelity_rejects_unknown_press():
    with pytest.raises(ValueError, match="presses: unknown press"):
        fidelity.main(["--presses", "nope"])
