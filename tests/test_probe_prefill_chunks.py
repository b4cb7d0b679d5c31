"""``python -m eval.probe_prefill_chunks --smoke``: the script runs its load on a tiny model on CPU and reports the
schedule it saw (the timings are not a measurement there)."""

from __future__ import annotations

import json


def test_the_smoke_run_reports_each_chunk_sizes_schedule(tmp_path):
    from eval.probe_prefill_chunks import main

    out = tmp_path / "chunks.json"
    assert main(["--smoke", "--layers", "2", "--sessions", "2", "--context", "48", "--question", "80", "--chunks", "0",
                 "16", "--output", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["prefill_chunk"] for r in runs] == [0, 16]
    assert [r["chunks_fed"] for r in runs] == [1, 5]  # the whole question; ceil(80 / 16) chunks
    assert runs[0]["steps_until_first_token"] <= 1  # at most the step under way when it arrived
    assert runs[1]["steps_until_first_token"] >= 4  # a decode step between every two chunks
    for r in runs:
        assert 0 < r["median_step_ms_before"] and 0 < r["longest_gap_ms"] and 0 < r["ttft_ms"]


def test_the_smoke_run_reads_an_arriving_context_in_chunks(tmp_path):
    """``--arrives context``: the 300 tokens are a new context under the default press, read in ceil(300 / 64) chunks,
    its 2 layers compressed in one or two rounds after them, then its 16-token question (one feed more); without
    chunks, one call (compressed in it) and the question."""
    from eval.probe_prefill_chunks import main

    out = tmp_path / "chunks.json"
    assert main(["--smoke", "--layers", "2", "--sessions", "2", "--context", "48", "--question", "300", "--chunks",
                 "0", "64", "--arrives", "context", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["arrives"] == "context"
    rounds = [r["compression_rounds"] for r in result["runs"]]
    assert rounds[0] == 0 and rounds[1] in (1, 2)
    assert [r["chunks_fed"] for r in result["runs"]] == [1, 5 + rounds[1] + 1]  # context chunks, rounds, question
    assert result["runs"][1]["steps_until_first_token"] >= 5


def test_the_smoke_run_reads_an_arriving_context_under_balanced_in_chunks(tmp_path):
    """``--press balanced``: the context is read in ceil(300 / 64) chunks, its repeat pass and compression in the
    rounds after them (at least one), then the question; in one call without chunks."""
    from eval.probe_prefill_chunks import main

    out = tmp_path / "balanced.json"
    assert main(["--smoke", "--layers", "2", "--sessions", "2", "--context", "48", "--question", "300", "--chunks",
                 "0", "64", "--arrives", "context", "--press", "balanced", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["press"] == "balanced"
    one_call, chunked = result["runs"]
    assert one_call["compression_rounds"] == 0 and one_call["chunks_fed"] == 1
    assert chunked["compression_rounds"] in (1, 2) and chunked["chunks_fed"] == 5 + chunked["compression_rounds"] + 1
