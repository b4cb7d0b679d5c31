"""Peak resident memory and time of one context prefill under the default press: one call against
kvcompress.prefill_in_chunks, each in a fresh process (VmHWM of /proc/self/status: the process's peak RSS, so the
model's weights and the interpreter are in both; their difference is the prefill's). CPU, the embedded model.

    python results/context_chunks/peak_probe.py --tokens 4096 --chunk 0      # one call
    python results/context_chunks/peak_probe.py --tokens 4096 --chunk 512    # chunks of 512
    python results/context_chunks/peak_probe.py --tokens 4096 --chunk 512 --press thorough   # its repeat pass
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def peak_rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=0, help="0: one call")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--press", choices=("default", "thorough", "balanced"), default="default")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import DynamicCache

    from kvcompress import prefill_in_chunks
    from kvcompress.models import load_model
    from kvcompress.registry import make_press

    model, _ = load_model()
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    press = make_press("compresskv" if args.press == "default" else f"compresskv_{args.press}", 0.75)
    with torch.no_grad():
        prefill_in_chunks(model, press, ids[:, :256], 128)  # warm-up: kernels, calibration files, allocator
        before = peak_rss_mib()
        start = time.perf_counter()
        if args.chunk:
            cache = prefill_in_chunks(model, press, ids, args.chunk)
        else:
            cache = DynamicCache()
            with press(model):
                model.model(input_ids=ids, past_key_values=cache)
        seconds = time.perf_counter() - start
    rows = sum(layer.keys.shape[-2] for layer in cache.layers)
    print(json.dumps(dict(press=args.press, tokens=args.tokens, chunk=args.chunk, seconds=round(seconds, 3),
                          peak_rss_mib=round(peak_rss_mib(), 1), peak_before_mib=round(before, 1), rows=rows)))


if __name__ == "__main__":
    main()
