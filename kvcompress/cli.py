"""The ``kvcompress`` command: ``kvcompress <command> [flags]``; ``kvcompress <command> --help`` for its flags."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

PROG = "kvcompress"

# command -> ("module:function" taking argv without the program name and returning an exit status, summary).
# Adding a command is one line here; its module is imported only when it runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "eval": ("kvcompress.longbench.cli:main", "LongBench-E evaluation of the presses (default: embedded offline run)"),
    "calibrate": ("kvcompress.calibration_scan:main",
                  "find the layers of a model that read facts back and those it needs whole, for the press"),
    "serve": ("kvcompress.serve.cli:main", "OpenAI-compatible server keeping contexts compressed (default: embedded)"),
}


def usage() -> str:
    """The command list, one line each."""
    width = max(len(name) for name in COMMANDS)
    lines = [f"usage: {PROG} <command> [flags]   ({PROG} <command> --help: its flags)", "", "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to the command named by ``argv[0]`` (``sys.argv[1:]`` when None); returns its exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}; choose from {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module, _, function = COMMANDS[name][0].partition(":")
    command = getattr(importlib.import_module(module), function)
    saved, sys.argv = sys.argv, [f"{PROG} {name}", *rest]  # the command's --help and run records name it so
    try:
        return int(command(rest) or 0)
    finally:
        sys.argv = saved
