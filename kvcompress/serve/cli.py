"""``kvcompress serve`` / ``python -m kvcompress.serve``: parse flags, load the model and press, run uvicorn."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

EPILOG = """example:
  kvcompress serve --method compresskv --ratio 0.25 --cache-memory 2GiB --port 8000
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{"messages": [{"role": "system", "content": "<document>"}, {"role": "user", "content": "<question>"}]}'
"""


def build_parser() -> argparse.ArgumentParser:
    from kvcompress.serve.protocol import CHAT_CONTEXT_MODES
    from kvcompress.serve.step import COMPILE_BACKENDS
    from kvcompress.serve.store import COMPRESS_MIN_TOKENS, TURN_REUSE

    p = argparse.ArgumentParser(
        prog="kvcompress serve", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="OpenAI-compatible server that keeps each long context compressed and reuses it.",
    )
    p.add_argument("--model", help="local model directory or Hub name (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument(
        "--served-model-name", help="the name clients send as 'model' (default: --model's directory or Hub name)"
    )
    p.add_argument("--method", default="compresskv",
                   help="a press of the method registry, or exact (default compresskv: about 1.2x a plain prefill "
                        "on CPU, 1.10x on an H200 at 32k tokens, no extra pass over the model, more rows in the "
                        "layers that read facts back and whole the layers the answers need at the context's length, "
                        "where the model has a calibration (kvcompress calibrate; shipped for the embedded model; "
                        "at 25%% kept above KVzip's scoring on its point estimates); for contexts "
                        "stored and asked many questions, "
                        "compresskv_balanced re-reads the most novel quarter of each (about 2x the prefill on CPU, "
                        "1.88x on an H200 at 32k tokens) "
                        "and answers more than the default (at 25%% kept about as many as the full cache on the "
                        "embedded model, above KVzip's scoring; "
                        "--press-option repeat_fraction=0.125 --press-option repeat_span=8 halves that second "
                        "reading, 1.7x on CPU); "
                        "compresskv_thorough re-reads all of it (4.3x on CPU, 4.2x on an H200) and keeps the most "
                        "of the continuation: choose it when the text written right after the context matters "
                        "more than the prefill; both read a long context in --prefill-chunk pieces as the default "
                        "does, their second reading one layer a round after the pieces (whole in one round on a "
                        "model with sliding-window layers), so the other answers stall about a chunk, not a whole "
                        "prefill)")
    p.add_argument("--ratio", type=float, default=0.25, help="KEPT fraction of each context's cache (default 0.25)")
    p.add_argument("--press-option", action="append", default=[], metavar="[METHOD.]FIELD=VALUE",
                   help="one press field other than its default, e.g. window_size=128 (repeatable; default: none)")
    p.add_argument("--seed", type=int, default=0, help="seed of randomised presses (default 0)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default 8000)")
    p.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"), help="default auto: cuda if torch sees a GPU"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="model weights and cache (default auto: bfloat16 on cuda, float32 on cpu)",
    )
    p.add_argument(
        "--device-map", choices=("auto",), help="spread the model over the GPUs with accelerate (default: one device)"
    )
    p.add_argument("--cache-memory", default="2GiB",
                   help="memory budget of everything resident: the stored compressed contexts and the decode "
                        "batch of the active sessions (default 2GiB)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for the model (a request's n choices take n places, and n is at most "
                        "this); more get 429 (default 64)")
    p.add_argument("--max-batch", type=int, default=8,
                   help="most sessions decoded together in one step (continuous batching); 1 serves one request "
                        "at a time (default 8)")
    p.add_argument("--max-batch-tokens", type=int, default=131072,
                   help="most cache rows one decode step holds: sessions x the longest session's reserved rows "
                        "(context, question, max_tokens), padding included; bounds a step's attention work "
                        "(default 131072)")
    p.add_argument("--decode-per-prefill", type=float, default=0.0, metavar="R",
                   help="prefill budget: while sessions decode, a new context's prefill waits until the batch has "
                        "decoded for R times the previous context prefill's seconds (and one step), so prefills "
                        "take at most 1/(1+R) of the worker's time then; requests on a stored context are not "
                        "held back. 0: new contexts join as soon as possible (fullest batches, best aggregate "
                        "tokens/s measured); larger: smoother running streams and earlier follow-ups, later "
                        "first tokens for new contexts (a number in [0, 1e6]; default 0.0)")
    p.add_argument("--prefill-chunk", type=int, default=512, metavar="C",
                   help="a question longer than C tokens is prefilled C tokens at a time, one chunk between two "
                        "decode steps, and new questions take at most C tokens a step beside it, so the answers "
                        "streaming meanwhile are held up about two chunks a step, not for whole questions (a "
                        "one-part chat message, a pasted document, is all question under --chat-context parts); "
                        "a new context longer than C is read the same way and compressed after its last chunk, "
                        "as one call would compress it, a few layers a round (each round about one chunk's "
                        "time), under a press that reads its sources chunk by chunk (the default press; a repeat "
                        "pass, compresskv_thorough's or _balanced's, runs in those rounds too; a kvpress press "
                        "reads it in one call); smaller: smoother "
                        "streams, larger: long prompts' first tokens sooner and fuller batches (an integer >= 1; "
                        "default 512)")
    p.add_argument("--compress-min-tokens", type=int, default=COMPRESS_MIN_TOKENS, metavar="N",
                   help="a context shorter than N tokens is stored whole, never compressed: a system prompt or a "
                        "short chat history saves little memory compressed and can lose what it says (an "
                        "instruction, a number to remember); 0 compresses every context, as kvpress's pipeline "
                        f"does (an integer >= 0; default {COMPRESS_MIN_TOKENS})")
    p.add_argument("--compile-decode", default="auto", choices=COMPILE_BACKENDS,
                   help="compile the decode step (torch.compile, one graph for every step): inductor (on CUDA with "
                        "CUDA graphs: a step is a few launches instead of a few hundred, for the host-bound steps "
                        "of small batches), cudagraphs (CUDA only: CUDA graphs without inductor, compiles in "
                        "seconds), eager (the capture alone, a check), off (eager steps). Compiled at start, "
                        "seconds to minutes, while /health answers 503; if compiling fails the steps run eager. "
                        "auto: inductor for a model on one CUDA device, off elsewhere (default auto)")
    p.add_argument("--chat-context", default="parts", choices=CHAT_CONTEXT_MODES,
                   help="which part of a chat's last user message is compressed context: parts (kvpress's pipeline: "
                        "all text parts but the last; a one-part message is all question, never compressed) or "
                        "blank-line (also a one-part message: its text through its last blank line, as "
                        "/v1/completions splits a prompt; for clients that send the document and the question in "
                        "one string) (default parts)")
    p.add_argument("--turn-reuse", default="prefix", choices=tuple(TURN_REUSE),
                   help="what a stored context serves: prefix (also a later turn of its chat: the stored cache plus "
                        "the new turns prefilled exact, no new compression) or exact (only the same context: every "
                        "other context is compressed whole, so an answer never depends on what the store holds, at "
                        "the cost of a prefill per turn) (default prefix)")
    p.add_argument("--api-key", default=os.environ.get("KVCOMPRESS_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default $KVCOMPRESS_API_KEY; none: open)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="server and uvicorn log level (default info)",
    )
    return p


def press_from_args(args: argparse.Namespace):
    """(press or None, a label naming the press settings exactly) from --method, --ratio, --press-option."""
    from kvcompress.registry import METHODS, make_press, parse_press_option

    if args.method not in METHODS:
        raise ValueError(f"--method: unknown method {args.method!r}; choose from {', '.join(METHODS)}")
    if not 0 < args.ratio <= 1:
        raise ValueError(f"--ratio: the kept fraction must be in (0, 1], got {args.ratio}")
    options = {}
    for item in args.press_option:
        method, name, value = parse_press_option(item, args.method)
        if method != args.method:
            raise ValueError(f"--press-option: {item!r} names {method!r}, but --method is {args.method!r}")
        options[name] = value
    try:  # a seed option wins over --seed
        press = make_press(args.method, 1.0 - args.ratio, options.get("seed", args.seed),
                           **{name: value for name, value in options.items() if name != "seed"})
    except (TypeError, ValueError) as err:
        if not options:
            raise
        raise ValueError(f"--press-option: {err}") from None
    label = "exact" if press is None else f"{args.method}:{press!r}"
    return press, label


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import uvicorn

        from kvcompress.serve.app import create_app
    except ImportError as err:
        print(f"kvcompress serve: error: {err.name} is missing; install the serve extra: pip install "
              "'kvcompress[serve]'", file=sys.stderr)
        return 2
    try:
        from kvcompress.serve.store import parse_bytes

        capacity = parse_bytes(args.cache_memory)
        if capacity < 1:  # nothing could ever be admitted: every request would wait or be refused
            raise ValueError(f"--cache-memory: must be more than 0 bytes, got {args.cache_memory!r}")
        if args.max_queue < 1:
            raise ValueError(f"--max-queue: must be an integer >= 1, got {args.max_queue}")
        if args.threads is not None and args.threads < 1:
            raise ValueError(f"--threads: must be an integer >= 1, got {args.threads}")
        for flag in ("max_batch", "max_batch_tokens"):
            if getattr(args, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')}: must be an integer >= 1, got {getattr(args, flag)}")
        from kvcompress.serve.scheduler import check_decode_per_prefill, check_prefill_chunk
        from kvcompress.serve.store import check_compress_min_tokens

        check_decode_per_prefill(args.decode_per_prefill)
        check_prefill_chunk(args.prefill_chunk)
        check_compress_min_tokens(args.compress_min_tokens)
        if not 0 < args.port < 65536:
            raise ValueError(f"--port: must be in [1, 65535], got {args.port}")
        if args.served_model_name is not None and not args.served_model_name.strip():  # clients could not name it
            raise ValueError(f"--served-model-name: must be a non-empty name, got {args.served_model_name!r}")
        from kvcompress._checks import model_path_problem

        problem = model_path_problem(args.model)  # before the Hub reads a missing path as a malformed repo id
        if problem:
            raise ValueError(f"--model: {problem}")
        press, press_label = press_from_args(args)
    except ValueError as err:
        print(f"kvcompress serve: error: {err}", file=sys.stderr)
        return 2
    import torch

    from kvcompress.models import EMBEDDED_MODEL, load_model, resolve_device_dtype
    from kvcompress.serve.engine import Engine
    from kvcompress.serve.metrics import ServerMetrics
    from kvcompress.serve.step import resolved_backend
    from kvcompress.serve.store import TURN_REUSE, ContextStore

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        device, dtype = resolve_device_dtype(args.device, args.dtype)
    except ValueError as err:
        print(f"kvcompress serve: error: {err}", file=sys.stderr)
        return 2
    if args.compile_decode == "cudagraphs" and device != "cuda":
        print(f"kvcompress serve: error: --compile-decode: cudagraphs needs a CUDA device, got --device {device} "
              "(use inductor or eager)", file=sys.stderr)
        return 2
    try:
        model, tokenizer = load_model(args.model, dtype=getattr(torch, dtype), device=device,
                                      device_map=args.device_map)
    except (OSError, ValueError, ImportError) as err:  # ImportError: a package the model needs (gguf, ...)
        message = str(err).splitlines()[0].removeprefix("model: ")
        print(f"kvcompress serve: error: --model: {message}", file=sys.stderr)
        return 2
    if press is not None and hasattr(press, "check_model"):  # settings that depend on the model's layers
        from kvcompress.window import layer_windows

        try:
            press.check_model(model, layer_windows(model))
        except ValueError as err:  # the model's calibration at fault (a bad file, its layers): --model, not a flag
            where = "--model" if getattr(err, "from_calibration", False) else "--press-option"
            print(f"kvcompress serve: error: {where}: {err}", file=sys.stderr)
            return 2
        from kvcompress.calibration import describe_full

        if getattr(press, "retrieval_layers", None) == "auto":
            logging.getLogger("kvcompress.serve").info(
                "retrieval_layers from the model's calibration: %s", list(press.active_retrieval_layers) or "none")
        if getattr(press, "full_layers", None) == "auto":
            logging.getLogger("kvcompress.serve").info(
                "full_layers from the model's calibration: %s", describe_full(press.active_full_layers))
    served = args.served_model_name or (EMBEDDED_MODEL if args.model is None else Path(args.model.rstrip("/")).name
                                        if Path(args.model).exists() else args.model)
    metrics = ServerMetrics()
    engine = Engine(model, tokenizer, model_name=served, press=press, press_label=press_label,
                    store=ContextStore(capacity), metrics=metrics, max_queue=args.max_queue,
                    max_batch=args.max_batch, max_batch_tokens=args.max_batch_tokens,
                    decode_per_prefill=args.decode_per_prefill, compile_decode=args.compile_decode,
                    prefill_chunk=args.prefill_chunk, compress_min_tokens=args.compress_min_tokens,
                    prefix_min_fraction=TURN_REUSE[args.turn_reuse])
    app = create_app(engine, served, api_key=args.api_key, chat_context=args.chat_context)
    logging.getLogger("kvcompress.serve").info(
        "serving %s with %s (kept %.3g) on http://%s:%d, cache memory %s, max batch %d, decode per prefill %g, "
        "prefill chunk %d, compiled decode %s, chat context %s", served, args.method, args.ratio, args.host, args.port,
        args.cache_memory, args.max_batch, args.decode_per_prefill, args.prefill_chunk,
        resolved_backend(model, args.compile_decode), args.chat_context)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.shutdown()
    return 0
