"""How this test session runs Triton kernels: compiled on CUDA tensors where CUDA is present, in the Triton
interpreter on CPU tensors elsewhere (``TRITON_INTERPRET=1``, set by conftest before triton is imported).

A kernel test module adopts it by creating its inputs on ``DEVICE`` and skipping when the kernel module it
imports was defined in the other mode (``module.INTERPRET != INTERPRET``). Set ``TRITON_INTERPRET=1``
yourself to force the interpreter on a CUDA machine (inputs then stay on the CPU).
"""

from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "1" if not torch.cuda.is_available() else "0") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
