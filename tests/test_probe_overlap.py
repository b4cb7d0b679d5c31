"""eval.probe_overlap: its interval arithmetic against a brute-force count on fresh random intervals and its reading
of a Chrome trace (its flags and workload: tests/test_probe_workload.py)."""

from __future__ import annotations

import random

import pytest

from eval import probe_overlap


def random_intervals(rng: random.Random, count: int) -> list[tuple[float, float]]:
    """Integer endpoints in [0, 200), so a unit grid counts covered time exactly."""
    spans = []
    for _ in range(count):
        start = rng.randrange(0, 190)
        spans.append((float(start), float(start + rng.randrange(1, 10))))
    return spans


def covered(intervals, t: int) -> bool:
    return any(start <= t < end for start, end in intervals)


@pytest.mark.parametrize("seed", range(5))
def test_union_and_intersection_equal_a_unit_grid_count(seed):
    rng = random.Random(seed)
    a, b = random_intervals(rng, rng.randrange(1, 30)), random_intervals(rng, rng.randrange(1, 30))
    ua, ub = probe_overlap.union(a), probe_overlap.union(b)
    assert all(x[1] < y[0] for x, y in zip(ua, ua[1:], strict=False))  # disjoint, sorted, gaps between
    assert probe_overlap.length(ua) == sum(covered(a, t) for t in range(200))
    assert probe_overlap.intersection(ua, ub) == sum(covered(a, t) and covered(b, t) for t in range(200))


def test_a_trace_is_read_per_stream():
    def event(stream: int, ts: float, dur: float, cat: str = "kernel") -> dict:
        return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "args": {"stream": stream}}

    trace = {
        "traceEvents": [
            event(7, 0, 1000), event(7, 1000, 1000), event(7, 5000, 2000),  # main: 4 ms busy
            event(13, 1500, 1000, "gpu_memcpy"), event(13, 3000, 1000),  # side: 2 ms, 0.5 ms beside main
            {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 99000, "args": {}},  # host work: not a stream's
        ]
    }  # fmt: skip
    summary = probe_overlap.stream_overlap(trace)
    assert summary["span_ms"] == pytest.approx(7.0)
    main, side = summary["streams"]
    assert (main["stream"], main["main"], main["busy_ms"]) == (7, True, pytest.approx(4.0))
    assert (side["stream"], side["busy_ms"], side["overlapped_ms"]) == (13, pytest.approx(2.0), pytest.approx(0.5))
    assert probe_overlap.stream_overlap({"traceEvents": []}) == {"span_ms": 0.0, "streams": []}
