import os

from triton_mode import INTERPRET

# Without CUDA, Triton kernels run in its interpreter; with CUDA, compiled (tests/triton_mode.py). This must be
# set before anything imports triton (transformers and kvpress do, at import), so it lives here rather than in
# the kernel test modules (importing torch does not import triton).
os.environ.setdefault("TRITON_INTERPRET", "1" if INTERPRET else "0")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def embedded_dir():
    """The embedded SmolLM2-135M-Instruct, converted from its GGUF once per machine (~45 s)."""
    from kvcompress.models import embedded_model_dir

    return embedded_model_dir()
