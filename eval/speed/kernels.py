"""Copy bandwidth and kernel rooflines: ``compress_kv`` and decode ``weighted_attention`` (+ stock sdpa)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from eval.speed.clock import Clock, Notes, backend_kwargs, release, stats
from eval.speed.config import Config
from kvcompress import compress_kv, weighted_attention


def run_bandwidth(cfg: Config, device: torch.device, clock: Clock) -> dict[str, Any]:
    """Device-to-device copy of a ``bandwidth_mib`` buffer: (read + write bytes) / time."""
    numel = cfg.bandwidth_mib * 2**20 // 4
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    samples = clock.times(lambda: dst.copy_(src), cfg.warmup, cfg.repeats)
    moved = 2 * src.nbytes
    result = {"buffer_bytes": src.nbytes, "bytes_moved": moved, **stats(samples)}
    result["gbps"] = moved / result["median_s"] / 1e9
    result["best_gbps"] = moved / result["min_s"] / 1e9
    return result


def coreset_size(n: int, kept: float, bin_rank: int) -> tuple[int, int]:
    """``(rank, bins)``: ``int(n * kept)`` rows rounded down to whole bins of ``bin_rank`` pivots."""
    bins = max(1, int(n * kept) // bin_rank)
    return bins * bin_rank, bins


def run_compress_kernels(
    cfg: Config, device: torch.device, dtype: torch.dtype, clock: Clock, bandwidth: float, notes: Notes, flush
) -> list[dict[str, Any]]:
    """``compress_kv`` on ``[batch, heads, n, d]`` keys/values, per backend."""
    rows = []
    for heads in cfg.compress_heads:
        rows += _compress_case(cfg, heads, device, dtype, clock, bandwidth, notes, flush)
        release(device)
    return rows


def _compress_case(
    cfg: Config, heads: int, device: torch.device, dtype: torch.dtype, clock: Clock, bandwidth: float, notes, flush
) -> list[dict[str, Any]]:
    n, d, batch = cfg.compress_n, cfg.compress_d, cfg.compress_batch
    rank, bins = coreset_size(n, cfg.kept, cfg.bin_rank)
    elt = torch.empty((), dtype=dtype).element_size()
    keys = torch.randn(batch, heads, n, d, device=device, dtype=dtype)
    values = torch.randn(batch, heads, n, d, device=device, dtype=dtype)
    moved = 2 * batch * heads * n * d * elt + batch * heads * rank * (2 * d * elt + 4)
    rows = []
    for backend in cfg.backends:
        kwargs, note = backend_kwargs(compress_kv, backend, device)
        notes.add(note)
        if kwargs is None:
            continue
        row = {"heads": heads, "batch": batch, "n": n, "d": d, "rank": rank, "bins": bins, "backend": backend}
        row["backend_keyword"] = "backend" in kwargs
        row["bytes"] = moved

        def call(kwargs: dict = kwargs) -> Any:
            return compress_kv(keys, values, rank, bins=bins, scaling=d**-0.5, seed=cfg.seed, **kwargs)

        rows.append(timed_row(row, call, cfg, clock, flush, notes, f"compress_kv heads={heads} backend={backend}"))
        if "median_s" in row:
            row["gbps"] = moved / row["median_s"] / 1e9
            row["roofline"] = row["gbps"] / bandwidth
    return rows


def timed_row(
    row: dict[str, Any], call: Callable[[], Any], cfg: Config, clock: Clock, flush, notes: Notes, what: str
) -> dict[str, Any]:
    """``row`` with the kernel timing of ``call`` (or the error, noted: one failure must not end the run)."""
    try:
        row.update(stats(clock.times(call, cfg.warmup, cfg.repeats, flush)))
    except Exception as err:
        row["error"] = f"{type(err).__name__}: {err}"
        notes.add(f"{what} failed: {row['error']}")
    return row


def run_decode_kernels(
    cfg: Config, device: torch.device, dtype: torch.dtype, clock: Clock, bandwidth: float, notes: Notes, flush
) -> list[dict[str, Any]]:
    """``weighted_attention`` with one query per head over n compressed rows, per backend (+ sdpa)."""
    rows = []
    for heads_kv, group in cfg.decode_heads:
        for batch in cfg.decode_batches:
            for n in cfg.decode_lengths:
                rows += _decode_case(cfg, heads_kv, group, batch, n, device, dtype, clock, bandwidth, notes, flush)
        release(device)
    return rows


def _decode_case(
    cfg: Config,
    heads_kv: int,
    group: int,
    batch: int,
    n: int,
    device: torch.device,
    dtype: torch.dtype,
    clock: Clock,
    bandwidth: float,
    notes: Notes,
    flush,
) -> list[dict[str, Any]]:
    d, heads_q = cfg.decode_d, heads_kv * group
    q = torch.randn(batch, heads_q, 1, d, device=device, dtype=dtype)
    k = torch.randn(batch, heads_kv, n, d, device=device, dtype=dtype)
    v = torch.randn(batch, heads_kv, n, d, device=device, dtype=dtype)
    w = torch.rand(batch, heads_kv, n, device=device, dtype=torch.float32) + 0.5
    v_min, v_max = v.amin(2).float(), v.amax(2).float()  # float32, as a compressed cache layer stores them
    kv_bytes = k.nbytes + v.nbytes
    q_out_bytes = 2 * q.nbytes
    calls: list[tuple[str, Callable[[], Any], int]] = []
    for backend in cfg.backends:
        kwargs, note = backend_kwargs(weighted_attention, backend, device)
        notes.add(note)
        if kwargs is None:
            continue

        def call(kwargs: dict = kwargs) -> Any:  # check_finite=False: its checks sync the device on every call
            return weighted_attention(q, k, v, w, scaling=d**-0.5, v_min=v_min, v_max=v_max, check_finite=False,
                                      **kwargs)  # fmt: skip

        calls.append((backend, call, kv_bytes + w.nbytes + q_out_bytes + v_min.nbytes + v_max.nbytes))
    if cfg.sdpa_reference:

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, scale=d**-0.5, enable_gqa=True)

        calls.append(("sdpa", sdpa, kv_bytes + q_out_bytes))
    rows = []
    for label, call, moved in calls:
        row = {"kv_heads": heads_kv, "group": group, "batch": batch, "n": n, "d": d, "backend": label, "bytes": moved}
        what = f"decode kernel {heads_kv}x{group} batch={batch} n={n} backend={label}"
        rows.append(timed_row(row, call, cfg, clock, flush, notes, what))
        if "median_s" in row:
            row["gbps"] = moved / row["median_s"] / 1e9
            row["roofline"] = row["gbps"] / bandwidth
    return rows

