import os

from triton_mode import INTERPRET

# Without CUDA, Triton kernels run in its interpreter; with CUDA, compiled (tests/triton_mode.py). This must be
# set before anything imports triton (transformers and kvpress do, at import), so it lives here rather than in
# the kernel test modules (importing torch does not import triton).
os.environ.setdefault("TRITON_INTERPRET", "1" if INTERPRET else "0")

import pytest  # noqa: E402
import torch  # noqa: E402

# 2 threads (the CI machines' cores) unless OMP_NUM_THREADS says otherwise: `OMP_NUM_THREADS=1 pytest` runs every
# reduction single-threaded, which changes float rounding; tolerances must hold under both. Under pytest-xdist
# (scripts/test.sh runs two workers) each worker takes 1 thread, so the two never fight over the 2 cores.
_threads = os.environ.get("OMP_NUM_THREADS", "")
_default_threads = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2
torch.set_num_threads(int(_threads) if _threads.isdigit() and int(_threads) > 0 else _default_threads)


@pytest.fixture(scope="session")
def embedded_dir():
    """The embedded SmolLM2-135M-Instruct, converted from its GGUF once per machine (~45 s)."""
    from kvcompress.models import embedded_model_dir

    return embedded_model_dir()
