"""How much of a prefill's side-stream work runs while the main stream is busy too (CUDA): what
``overlap_compression`` hides, and what it cannot.

Each setting (names of ``eval.speed``'s prefill breakdown) prefills once to warm up, then once under
``torch.profiler`` (CUDA activity); the exported trace's GPU events (kernels, copies, fills) are grouped by stream.
The main stream is the one with the most busy time (the forward's); every other stream's busy time is split into
the part that ran while the main stream was busy as well (overlapped) and the rest (the main stream idle or waiting
for it). Busy time is the union of a stream's event intervals. Default workload: random-weight Qwen2.5-7B-Instruct
shape cut to 4 layers, 32,768 tokens, bf16, 25% kept.

Run from the repository root: ``python -m eval.probe_overlap [--settings default default_overlap] [--output x.json]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from eval.probe_workload import probe_args, warmed_prefills

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def parse(argv: list[str] | None) -> argparse.Namespace:
    return probe_args(
        "python -m eval.probe_overlap", __doc__.split("\n\n")[0], argv,
        settings=["default", "default_overlap", "balanced", "balanced_overlap"], tokens=32768,
        output="JSON file: setting -> streams' busy and overlapped ms", needs_cuda="a CPU has no streams to overlap",
    )  # fmt: skip


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time as ``intervals`` ``(start, end)``."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Time two disjoint sorted interval lists (:func:`union`'s output) share."""
    shared, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        shared += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return shared


def stream_overlap(trace: dict[str, Any]) -> dict[str, Any]:
    """From a Chrome trace (``torch.profiler``'s export): the span of its GPU events and, per stream, busy ms and
    for every stream but the main one the ms that overlapped the main stream's busy time (times in ms)."""
    by_stream: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "X" and event.get("cat") in GPU_CATEGORIES and "stream" in event.get("args", {}):
            start = float(event["ts"]) / 1e3  # the trace's microseconds
            by_stream[int(event["args"]["stream"])].append((start, start + float(event["dur"]) / 1e3))
    if not by_stream:
        return {"span_ms": 0.0, "streams": []}
    busy = {stream: union(spans) for stream, spans in by_stream.items()}
    main = max(busy, key=lambda stream: length(busy[stream]))
    every = [t for spans in busy.values() for span in spans for t in span]
    streams = []
    for stream, spans in sorted(busy.items(), key=lambda item: -length(item[1])):
        row: dict[str, Any] = {"stream": stream, "main": stream == main, "busy_ms": length(spans)}
        if stream != main:
            row["overlapped_ms"] = intersection(spans, busy[main])
        streams.append(row)
    return {"span_ms": max(every) - min(every), "streams": streams}


def profile_prefill(fn) -> dict[str, Any]:
    """:func:`stream_overlap` of one call of ``fn`` under the profiler."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return stream_overlap(json.loads(path.read_text()))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    found = {}
    for name, run in warmed_prefills(args):
        found[name] = summary = profile_prefill(run)
        print(f"{name}: GPU span {summary['span_ms']:.2f} ms", flush=True)
        for row in summary["streams"]:
            extra = "" if row["main"] else f", {row['overlapped_ms']:.2f} ms of it beside the main stream"
            print(f"  stream {row['stream']}{' (main)' if row['main'] else ''}: busy {row['busy_ms']:.2f} ms{extra}")
    if args.output:
        Path(args.output).write_text(json.dumps(found, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
