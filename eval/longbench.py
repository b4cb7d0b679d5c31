"""LongBench-E harness, the main job: ``python eval/longbench.py [flags]`` = ``kvcompress eval [flags]``.

A thin shim over ``kvcompress.longbench`` (protocol, decisions, flags: its docstring and ``--help``); it
runs the checkout's library, also as ``python -m eval.longbench`` or under ``accelerate launch`` / ``torchrun``.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__" and not __package__:  # run as a script: import the checkout's kvcompress
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcompress.longbench.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
