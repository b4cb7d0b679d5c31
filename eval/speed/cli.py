"""The run: selected sections, the printed tables and the JSON (``python -m eval.speed``)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from eval.speed import kernels
from eval.speed.clock import Clock, Notes, has_backend_keyword, release
from eval.speed.config import DTYPES, Config, resolve_config, resolve_device
from eval.speed.decode import format_decode, run_decode
from eval.speed.e2e import run_e2e
from eval.speed.prefill import run_prefill_section
from eval.speed.report import check_goals, environment, report


def main(argv: list[str] | None = None) -> int:
    """Run the selected sections, print the tables and write the JSON."""
    try:
        cfg = resolve_config(argv)
        device = resolve_device(cfg)
    except (ValueError, RuntimeError, TypeError) as exc:  # a flag out of range, or no GPU for the full sizes
        raise SystemExit(f"speed: {exc}") from None
    dtype = DTYPES[cfg.dtype]
    output = Path(cfg.output or ("results/speed/speed_smoke.json" if cfg.smoke else "results/speed/speed.json"))
    print(f"config: {asdict(cfg)}")
    threads, cudnn = torch.get_num_threads(), torch.backends.cuda.cudnn_sdp_enabled()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    torch.backends.cuda.enable_cudnn_sdp(cudnn and cfg.cudnn_sdpa)
    try:
        return run(cfg, device, dtype, output)
    finally:
        torch.set_num_threads(threads)
        torch.backends.cuda.enable_cudnn_sdp(cudnn)


def run(cfg: Config, device: torch.device, dtype: torch.dtype, output: Path) -> int:
    """The body of :func:`main`."""
    torch.manual_seed(cfg.seed)
    clock = Clock(device)
    notes = Notes()
    env = environment(device)
    results: dict[str, Any] = {
        "device": env.get("gpu") or f"cpu ({env['cpu']}, {env['cpu_count']} cores)",
        "device_type": device.type,
        "smoke": cfg.smoke,
        "dtype": str(dtype).removeprefix("torch."),
        "environment": env,
        "backend_keyword": {
            "compress_kv": has_backend_keyword(kernels.compress_kv),
            "weighted_attention": has_backend_keyword(kernels.weighted_attention),
        },
        "config": asdict(cfg),
        "notes": notes,
    }
    if cfg.smoke:
        notes.add("smoke run: tiny sizes; the numbers are NOT performance claims")
    start = time.perf_counter()
    sections: dict[str, float] = {}
    with torch.no_grad():
        if "bandwidth" in cfg.only or "kernels" in cfg.only:
            if "bandwidth" not in cfg.only:
                notes.add("bandwidth measured anyway: it is the denominator of the kernel rooflines")
            tic = time.perf_counter()
            results["bandwidth"] = kernels.run_bandwidth(cfg, device, clock)
            sections["bandwidth"] = time.perf_counter() - tic
            print(f"bandwidth: {results['bandwidth']['gbps']:.4g} GB/s")
        flush = torch.empty(cfg.flush_mib * 2**20 // 4, device=device) if cfg.flush_mib else None
        if "kernels" in cfg.only:
            tic = time.perf_counter()
            bandwidth = results["bandwidth"]["gbps"]
            results["kernels"] = {
                "compress_kv": kernels.run_compress_kernels(cfg, device, dtype, clock, bandwidth, notes, flush),
                "weighted_attention": kernels.run_decode_kernels(cfg, device, dtype, clock, bandwidth, notes, flush),
            }
            sections["kernels"] = time.perf_counter() - tic
        if "e2e" in cfg.only:
            tic = time.perf_counter()
            results["e2e"] = run_e2e(cfg, device, dtype, clock, notes, flush)
            release(device)
            sections["e2e"] = time.perf_counter() - tic
        if "prefill" in cfg.only:
            tic = time.perf_counter()
            results["prefill_breakdown"] = run_prefill_section(cfg, device, dtype, clock, notes)
            sections["prefill"] = time.perf_counter() - tic
        if "decode" in cfg.only:
            tic = time.perf_counter()
            results["decode"] = run_decode(cfg, device, dtype, clock, notes)
            release(device)
            sections["decode"] = time.perf_counter() - tic
    results["section_s"] = sections
    results["goals"] = check_goals(results)
    if cfg.smoke:
        results["goals"]["note"] = "smoke run at tiny sizes: these values are NOT performance claims"
    results["total_s"] = time.perf_counter() - start
    results["notes"] = list(notes)
    print("\n" + report(results) + ("\n" + format_decode(results["decode"]) if "decode" in results else ""))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"\nwrote {output}; total {results['total_s']:.1f} s")
    return 0


