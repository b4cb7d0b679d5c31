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
