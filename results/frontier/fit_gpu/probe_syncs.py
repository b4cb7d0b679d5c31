"""GPU probe: the host-device synchronisations one prefill under each press makes (torch.cuda sync debug mode
"warn"), with the library frames that made them. Random-weight Qwen2.5-7B shape cut to 4 layers, 8,192 tokens.
Run from the repo root on a CUDA machine: python results/frontier/fit_gpu/probe_syncs.py OUT_DIR"""

import collections
import json
import sys
import traceback
import warnings
from pathlib import Path

import torch

from eval.speed.config import resolve_config
from eval.speed.e2e import build_model, prefill
from eval.speed.prefill import make_setting

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
cfg = resolve_config(["--model-layers", "4"])
device = torch.device("cuda")
model = build_model(cfg, device, torch.bfloat16)
ids = torch.randint(0, cfg.model["vocab_size"], (1, 8192), device=device)
seen: dict[str, collections.Counter] = {}


def record(message, category, filename, lineno, file=None, line=None):
    frames = [f for f in traceback.extract_stack()[:-1] if "kvcompress" in f.filename or "/eval/" in f.filename]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(frames[-4:]))
    seen[current][f"{str(message)[:60]} @ {where or f'{filename}:{lineno}'}"] += 1


warnings.showwarning = record
warnings.simplefilter("always")
for current in ("none", "snapkv", "default", "thorough", "balanced", "kvzip"):
    seen[current] = collections.Counter()
    press = make_setting(current, cfg)
    prefill(model, press, ids)  # warm-up (Triton compiles) outside the count
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    prefill(model, press, ids)
    torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    print(current, sum(seen[current].values()), "syncs", flush=True)
    for key, count in seen[current].most_common(12):
        print(f"  {count:4d}  {key}", flush=True)
(out / "syncs.json").write_text(json.dumps({k: dict(v) for k, v in seen.items()}, indent=1))
