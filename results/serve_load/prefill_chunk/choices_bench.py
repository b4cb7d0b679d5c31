"""One request with n choices over a long one-part chat message, against a server of the checkout this file is run
from: its wall time and how many question prefills the server logged. A record of the forty-fifth session's
measurement (docs/BENCHMARKS.md, "Question prefill in chunks"), run from a clone at each commit:

    PYTHONPATH=. python results/serve_load/prefill_chunk/choices_bench.py --n 4 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from eval.serve_load import free_port, user_contexts


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--context-tokens", type=int, default=1024)
    args = p.parse_args()
    port = free_port()
    log = Path(tempfile.mkdtemp()) / "server.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "kvcompress.serve", "--port", str(port), "--threads", "1",
                                 "--cache-memory", "1GiB", "--log-level", "info"], stdout=err, stderr=err)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        docs = user_contexts(args.repeats + 1, args.context_tokens)
        seconds = []
        for i, doc in enumerate(docs):
            body = {"messages": [{"role": "user", "content": doc + "\n\nWhat is this text about?"}], "n": args.n,
                    "max_tokens": 16, "temperature": 1.0, "seed": i}
            start = time.perf_counter()
            reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=900).json()
            if i:  # the first request warms the server up
                seconds.append(time.perf_counter() - start)
            assert len(reply["choices"]) == args.n, reply
        prefills = log.read_text().count("question prefill:")
        print(f"n={args.n}: request seconds median {statistics.median(seconds):.2f} (all: "
              f"{', '.join(f'{s:.2f}' for s in seconds)}); question prefills logged {prefills} for "
              f"{len(docs)} requests")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
