"""Load benchmark of ``kvcompress serve``: simulated users with long contexts and follow-up questions.

For each method (default: ``exact`` and ``compresskv``) the script starts ``python -m kvcompress.serve`` on
127.0.0.1 under the same ``--cache-memory``, runs the load, reads the server's ``/metrics`` and stops it. Load:
``--users`` users in parallel, each with its own context of ``--context-tokens`` tokens (passages of CPython's
documentation, offline); each sends the context with a first question, then ``--questions`` follow-up questions
on the same context, one after the other, streamed, greedy, ``--max-tokens`` each (``--sequential``: one request
at a time, the users in turn, so the time to first token holds no wait in the queue; ``--one-part``: context and
question in one text part, as most chat clients send them). Bounded: at most
``users x (1 + questions)`` requests per method, and no new request after ``--time-limit`` seconds.

Each method runs once per ``--max-batch`` value (the server's continuous batching: sessions decoded together
per step; ``--max-batch 1`` is the one-at-a-time server).

Reported per run: contexts resident at the end and at most during the run (polled every second), reuse
rate (store hits / requests), p50 and p95 time to first token (all requests, first questions, follow-ups),
p50 / p95 / largest inter-token latency (gaps between streamed content chunks at the client), aggregate generated tokens
per second over the run, tokens per second of the decode steps alone (server: tokens decoded in steps / seconds
of those steps; first tokens come from question prefills), mean and largest batch size per decode step
(server), prefills, resident bytes next to their uncompressed size, and where the server's worker spent its time
(seconds of context prefills, question prefills and decode steps, summed). ``--server-arg`` passes a flag to every
server (e.g. ``--server-arg=--decode-per-prefill=1``); ``--server-log DIR`` keeps each server's per-phase INFO log.

    python -m eval.serve_load --users 8 --questions 3 --context-tokens 512 --cache-memory 150MiB --max-batch 8 1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from kvcompress._checks import number_flag

ROOT = Path(__file__).resolve().parents[1]
FOLLOW_UPS = [
    "\n\nName one keyword this text mentions.",
    "\n\nWhat is the first sentence about?",
    "\n\nGive a one-line summary.",
    "\n\nWhich example does it give?",
    "\n\nIs anything deprecated here?",
]


def user_contexts(users: int, tokens: int) -> list[str]:
    import pydoc_data.topics

    from transformers import AutoTokenizer

    from kvcompress.models import embedded_model_dir

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir())
    text = "\n\n".join(pydoc_data.topics.topics.values())
    ids = tokenizer.encode(text)
    if len(ids) < users * tokens:
        raise SystemExit(f"--context-tokens: {users} users x {tokens} tokens exceed the {len(ids)}-token corpus")
    return [tokenizer.decode(ids[i * tokens: (i + 1) * tokens]) for i in range(users)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(method: str, max_batch: int, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvcompress.serve", "--port", str(port), "--method", method, "--ratio",
           str(args.ratio), "--cache-memory", args.cache_memory, "--log-level", "warning",
           "--max-queue", str(max(8, 2 * args.users)), "--max-batch", str(max_batch)]
    if args.server_log:  # the server's per-phase INFO lines, one file per run
        Path(args.server_log).mkdir(parents=True, exist_ok=True)
        cmd[cmd.index("--log-level") + 1] = "info"
    cmd += args.server_arg
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.model:
        cmd += ["--model", args.model]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    stderr = None
    if args.server_log:
        stderr = open(Path(args.server_log) / f"{method}_batch{max_batch}.log", "w")  # noqa: SIM115 - the server's lifetime
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=stderr, stderr=stderr)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the {method} server did not start")


def metrics(base: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics", timeout=60).text.splitlines():
        m = re.match(r"^(kvcompress_[a-z_]+(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def ask(base: str, context: str, question: str, max_tokens: int, one_part: bool = False) -> dict:
    """One streamed chat request: time to first content token, gaps between content chunks, total time, tokens.
    ``one_part``: the context and the question in one text (all question under the server's ``--chat-context
    parts``: prefilled whole, never compressed), else two text parts (the context compressed)."""
    content = context + question if one_part else [{"type": "text", "text": context},
                                                   {"type": "text", "text": question}]
    body = {"messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    try:
        return _stream(base, body, start)
    except httpx.TimeoutException:  # no answer within 900 s: a failed request, not a crashed user
        return {"status": "timeout"}


def _stream(base: str, body: dict, start: float) -> dict:
    first, tokens, last, gaps = None, 0, None, []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=900) as r:
        if r.status_code != 200:
            return {"status": r.status_code}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                if first is None:
                    first = now - start
                else:
                    gaps.append(now - last)
                last = now
    total = time.perf_counter() - start
    return {"status": 200, "ttft": first if first is not None else total, "seconds": total, "tokens": tokens,
            "gaps": gaps}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def run_method(method: str, max_batch: int, contexts: list[str], args: argparse.Namespace) -> dict:
    proc, base = start_server(method, max_batch, args)
    try:
        results: list[tuple[int, dict]] = []
        peak = {"sessions": 0.0}
        stop_at = time.time() + args.time_limit
        done = threading.Event()

        def poll() -> None:
            while not done.wait(1.0):
                peak["sessions"] = max(peak["sessions"], metrics(base).get("kvcompress_cache_sessions", 0))

        def user(i: int) -> None:
            for k in range(1 + args.questions):
                if time.time() > stop_at:
                    return
                question = "\n\nWhat is this text about? Answer briefly." if k == 0 else FOLLOW_UPS[(k - 1) % 5]
                results.append((k, ask(base, contexts[i], question, args.max_tokens, args.one_part)))

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        start = time.perf_counter()
        if args.sequential:  # round robin, one request at a time: no queueing in the time to first token
            for k in range(1 + args.questions):
                for i in range(args.users):
                    if time.time() > stop_at:
                        break
                    question = "\n\nWhat is this text about? Answer briefly." if k == 0 else FOLLOW_UPS[(k - 1) % 5]
                    results.append((k, ask(base, contexts[i], question, args.max_tokens, args.one_part)))
        else:
            threads = [threading.Thread(target=user, args=(i,)) for i in range(args.users)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        wall = time.perf_counter() - start
        done.set()
        m = metrics(base)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    ok = [r for _, r in results if r["status"] == 200]
    first = [r["ttft"] for k, r in results if k == 0 and r["status"] == 200]
    follow = [r["ttft"] for k, r in results if k > 0 and r["status"] == 200]
    hits = sum(v for key, v in m.items() if key.startswith("kvcompress_context_reuse_hits_total{"))
    misses = m.get("kvcompress_context_reuse_misses_total", 0)
    return {
        "method": method, "max_batch": max_batch, "requests": len(results), "ok": len(ok), "wall_s": wall,
        "sessions_resident_end": m.get("kvcompress_cache_sessions", 0),
        "sessions_resident_peak": max(peak["sessions"], m.get("kvcompress_cache_sessions", 0)),
        "resident_bytes": m.get("kvcompress_cache_resident_bytes", 0),
        "uncompressed_bytes": m.get("kvcompress_cache_uncompressed_bytes", 0),
        "prefills": m.get("kvcompress_prefills_total", 0), "reuse_rate": hits / max(1, hits + misses),
        "ttft_p50": percentile([r["ttft"] for r in ok], 0.5), "ttft_p95": percentile([r["ttft"] for r in ok], 0.95),
        "ttft_first_p50": percentile(first, 0.5), "ttft_follow_p50": percentile(follow, 0.5),
        "ttft_follow_p95": percentile(follow, 0.95),
        "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "tokens": sum(r["tokens"] for r in ok),
        "itl_p50": percentile([g for r in ok for g in r["gaps"]], 0.5),
        "itl_p95": percentile([g for r in ok for g in r["gaps"]], 0.95),
        "itl_max": max((g for r in ok for g in r["gaps"]), default=float("nan")),
        "step_tokens_per_s": m.get("kvcompress_batch_size_sum", 0) / max(1e-9, m.get(
            "kvcompress_decode_step_seconds_sum", 0)),
        "batch_mean": m.get("kvcompress_batch_size_sum", 0) / max(1, m.get("kvcompress_batch_size_count", 0)),
        "batch_max": min((float(k.split('le="')[1].split('"')[0]) for k, v in m.items()
                          if k.startswith("kvcompress_batch_size_bucket") and "+Inf" not in k
                          and v == m.get("kvcompress_batch_size_count", 0) and v > 0), default=float("nan")),
        "server_prefill_s_mean": m.get("kvcompress_prefill_seconds_sum", 0)
        / max(1, m.get("kvcompress_prefill_seconds_count", 0)),
        "server_question_prefill_s_mean": m.get("kvcompress_question_prefill_seconds_sum", 0)
        / max(1, m.get("kvcompress_question_prefill_seconds_count", 0)),
        # where the worker's time went (seconds summed over the run)
        "server_prefill_s": m.get("kvcompress_prefill_seconds_sum", 0),
        "server_question_prefill_s": m.get("kvcompress_question_prefill_seconds_sum", 0),
        "server_decode_s": m.get("kvcompress_decode_step_seconds_sum", 0),
        "decode_steps": m.get("kvcompress_decode_step_seconds_count", 0),
    }


def table(rows: list[dict]) -> str:
    head = ("| method | max batch | requests ok | contexts resident (end / peak) | resident MB (uncompressed MB) | "
            "prefills | reuse rate | TTFT p50 / p95 s | first-question TTFT p50 s | follow-up TTFT p50 / p95 s | "
            "inter-token p50 / p95 / max s | batch per step (mean / max bucket) | tokens | tokens/s | "
            "decode-step tokens/s | "
            "server: context prefill / question prefill s (mean) | worker s: context prefill / question / decode |")
    lines = [head, "|" + "---|" * 17]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['max_batch']} | {r['ok']}/{r['requests']} | {r['sessions_resident_end']:.0f} / "
            f"{r['sessions_resident_peak']:.0f} | {r['resident_bytes'] / 1e6:.1f} "
            f"({r['uncompressed_bytes'] / 1e6:.1f}) | "
            f"{r['prefills']:.0f} | {r['reuse_rate']:.2f} | {r['ttft_p50']:.2f} / {r['ttft_p95']:.2f} | "
            f"{r['ttft_first_p50']:.2f} | {r['ttft_follow_p50']:.2f} / {r['ttft_follow_p95']:.2f} | "
            f"{r['itl_p50']:.3f} / {r['itl_p95']:.3f} / {r['itl_max']:.3f} | "
            f"{r['batch_mean']:.2f} / {r['batch_max']:.0f} | "
            f"{r['tokens']} | {r['tokens_per_s']:.2f} | {r['step_tokens_per_s']:.2f} | "
            f"{r['server_prefill_s_mean']:.1f} / "
            f"{r['server_question_prefill_s_mean']:.2f} | {r['server_prefill_s']:.1f} / "
            f"{r['server_question_prefill_s']:.1f} / {r['server_decode_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", nargs="+", default=["exact", "compresskv"])
    p.add_argument("--ratio", type=float, default=0.25, help="kept fraction (default 0.25)")
    p.add_argument("--cache-memory", default="52MiB", help="the same store budget for every method")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--questions", type=int, default=3, help="follow-up questions per user")
    p.add_argument("--context-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--time-limit", type=number_flag(0, low_open=True), default=600,
                   help="no new request after this many seconds (> 0)")  # fmt: skip
    p.add_argument("--max-batch", type=int, nargs="+", default=[8],
                   help="the server's --max-batch; each method runs once per value (1 = one request at a time; "
                        "default 8)")
    p.add_argument("--sequential", action="store_true",
                   help="one request at a time, users in turn (time to first token without queueing)")
    p.add_argument("--one-part", action="store_true",
                   help="send each context and question as one text part, as most chat clients do (all question "
                        "under the server's --chat-context parts: prefilled in --prefill-chunk pieces, never "
                        "compressed); default: two parts, the context compressed")
    p.add_argument("--threads", type=int, help="torch threads of the server")
    p.add_argument("--model")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra argument for every server, repeatable (e.g. --server-arg=--decode-per-prefill=1)")
    p.add_argument("--server-log", help="write each server's INFO log (per-phase lines) into this folder")
    p.add_argument("--output", help="write the results as JSON here")
    args = p.parse_args(argv)
    for name in ("users", "context_tokens", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be an integer >= 1")
    if args.questions < 0:
        p.error("--questions: must be an integer >= 0")
    contexts = user_contexts(args.users, args.context_tokens)
    if min(args.max_batch) < 1:
        p.error("--max-batch: must be integers >= 1")
    rows = [run_method(method, max_batch, contexts, args) for method in args.methods for max_batch in args.max_batch]
    print(table(rows))
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
