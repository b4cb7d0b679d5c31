"""Prefill a real context under one press, ``--repeats`` times: a whole process to time from outside.

``python -m eval.prefill_time --press compresskv --kept 0.25`` against ``--press exact`` gives the CPU
prefill-time ratio of a press (load the model, tokenize, prefill; compare medians and A/B ratios with an
external process timer). ``--press none`` stops after loading, to subtract the fixed cost. Presses are
``kvcompress.fidelity`` specs (``NAME`` or ``NAME[field=value,...]``); the context is the fidelity study's
first prose context of ``--tokens`` tokens.
"""

from __future__ import annotations

import argparse

import kvpress  # noqa: F401  (registers the kv-press-text-generation pipeline)
from transformers import pipeline

from kvcompress.fidelity.contexts import build_contexts
from kvcompress.fidelity.measure import prefill
from kvcompress.fidelity.specs import make_press, parse_spec
from kvcompress.models import load_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--press", default="exact", help="a press spec of kvcompress.fidelity, 'exact', or 'none'")
    parser.add_argument("--kept", type=float, default=0.25, help="kept fraction of the context (default 0.25)")
    parser.add_argument("--tokens", type=int, default=2000, help="context tokens, prose (default 2000)")
    parser.add_argument("--repeats", type=int, default=3, help="prefills in one process (default 3)")
    args = parser.parse_args(argv)
    spec = None if args.press == "none" else parse_spec(args.press)
    model, tokenizer = load_model()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    context = build_contexts(pipe, ["prose"], [args.tokens], seeds=1, continuation=1)[0]
    if spec is None:
        return
    seconds = [prefill(model, make_press(spec, args.kept, seed=i), context.ids)[1] for i in range(args.repeats)]
    print(f"{args.press} kept={args.kept} tokens={context.ids.shape[1]} prefill s: {[round(s, 3) for s in seconds]}")


if __name__ == "__main__":
    main()
