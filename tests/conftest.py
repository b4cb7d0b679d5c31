import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def embedded_dir():
    """The embedded SmolLM2-135M-Instruct, converted from its GGUF once per machine (~45 s)."""
    from eval.models import embedded_model_dir

    return embedded_model_dir()
