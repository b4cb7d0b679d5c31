"""The harness command lines end to end at tiny sizes: files, columns and sane numbers (fidelity: test_fidelity.py)."""

from __future__ import annotations

import csv

import pytest

from eval import approx_error


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
