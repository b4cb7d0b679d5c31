"""GPU probe of the fit (kvcompress.fitting.fit_kept_rows) before and after the TF32 / one-gather change: median
wall ms per call, the profiler's CPU and CUDA totals of one call, and the outputs' agreement. Run from the repo
root on a CUDA machine, with the fit before the change beside it (not committed: a copy of library code):
git show 1a51845:kvcompress/fitting.py > results/frontier/fit_gpu/fitting_before.py
python results/frontier/fit_gpu/probe_fit.py OUT_DIR"""

import contextlib
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from eval.bench_fit import make_case
from kvcompress import fitting

spec = importlib.util.spec_from_file_location("fitting_before", Path(__file__).with_name("fitting_before.py"))
before = importlib.util.module_from_spec(spec)
spec.loader.exec_module(before)
out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
device = torch.device("cuda")


def call(module, case):
    return module.fit_kept_rows(
        case["keys"],
        case["values"],
        case["kept"],
        case["protected"],
        case["queries"],
        case["scaling"],
        query_positions=case["query_positions"],
    )


def timed(fn, warmup=2, repeats=10):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def totals(fn):
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    cuda = sum(e.self_device_time_total for e in events) / 1e3
    cpu = sum(e.self_cpu_time_total for e in events) / 1e3
    return cpu, cuda, prof


no_tf32 = contextlib.nullcontext
rows = []
for context, queries in ((32768, 64), (32768, 320), (8192, 64)):
    case = make_case(context, 0.25, queries, 28, 4, 128, torch.bfloat16, device)
    variants = {"before": lambda c=case: call(before, c), "after": lambda c=case: call(fitting, c)}
    for name, fn in variants.items():
        ms = timed(fn)
        cpu, cuda, prof = totals(fn)
        rows.append(dict(context=context, queries=queries, variant=name, wall_ms=ms, cpu_ms=cpu, cuda_ms=cuda))
        print(rows[-1], flush=True)
        if context == 32768 and queries == 64:
            table = prof.key_averages(group_by_input_shape=True).table(
                sort_by="self_cuda_time_total", row_limit=25, max_shapes_column_width=70
            )
            (out / f"profile_{name}_32k_64.txt").write_text(table)
    saved = fitting._tensor_core_products
    fitting._tensor_core_products = lambda device, dtype: contextlib.nullcontext()
    ms = timed(variants["after"])
    fitting._tensor_core_products = saved
    rows.append(dict(context=context, queries=queries, variant="after_without_tf32", wall_ms=ms))
    print(rows[-1], flush=True)
    old, new = call(before, case), call(fitting, case)
    agree = dict(
        context=context,
        queries=queries,
        variant="agreement",
        accepted_same=bool(torch.equal(old.accepted, new.accepted)),
        accepted=new.accepted.float().mean().item(),
        weight_rel=((old.weights - new.weights).abs().max() / old.weights.abs().max()).item(),
        value_rel=((old.values.float() - new.values.float()).abs().max() / old.values.float().abs().max()).item(),
    )
    rows.append(agree)
    print(agree, flush=True)
    del case
    torch.cuda.empty_cache()
summary = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows)
(out / "probe_fit.json").write_text(json.dumps(summary, indent=1))
