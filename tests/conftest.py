import os

import torch

# Without CUDA, Triton kernels run in its interpreter on CPU tensors; with CUDA they run compiled. This must be
# set before anything imports triton (transformers and kvpress do, at import), so it lives here rather than in
# the kernel test modules (importing torch does not import triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def embedded_dir():
    """The embedded SmolLM2-135M-Instruct, converted from its GGUF once per machine (~45 s)."""
    from kvcompress.models import embedded_model_dir

    return embedded_model_dir()
