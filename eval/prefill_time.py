"""Prefill a real context under one press, ``--repeats`` times: a whole process to time from outside.

``python -m eval.prefill_time --press compresskv_keys --kept 0.25`` against ``--press exact`` gives the
CPU prefill-time ratio of a press (load the model, tokenize, prefill; compare medians and A/B ratios with
an external process timer). ``--press none`` stops after loading, to subtract the fixed cost.
"""

from __future__ import annotations

import argparse

from transformers import pipeline

from eval.fidelity import Config, make_contexts, make_press, prefill
from eval.models import load_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--press", default="exact", help="a press name of eval.fidelity, 'exact', or 'none'")
    parser.add_argument("--kept", type=float, default=0.25)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    model, tokenizer = load_model()
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer)
    context = make_contexts(pipe, Config(contexts=1, context_tokens=args.tokens))[0]
    if args.press == "none":
        return
    seconds = [prefill(model, make_press(args.press, args.kept, seed=i), context.ids)[1] for i in range(args.repeats)]
    print(f"{args.press} kept={args.kept} tokens={context.ids.shape[1]} prefill s: {[round(s, 3) for s in seconds]}")


if __name__ == "__main__":
    main()
