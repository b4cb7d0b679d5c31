"""Settings of the speed harness: defaults, the --smoke preset, the goals, flags < YAML < defaults, the device."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvcompress._checks import BACKENDS
from kvcompress.config import load_yaml

DESCRIPTION = (
    "Speed of CompressKV: copy bandwidth, kernel rooflines, and end-to-end prefill/decode on a random-weight model."
)
DEFAULT_CONFIG = Path("configs/speed.yaml")
SECTIONS = ("bandwidth", "kernels", "e2e", "prefill", "decode")
DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}

# Qwen2.5-7B-Instruct's shape (random weights; nothing is downloaded).
QWEN25_7B = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
SMOKE_MODEL = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
# --smoke: tiny sizes for every code path (applied over the YAML, under explicit flags).
SMOKE = {
    "threads": 1,  # a shared 2-core machine: one thread avoids OpenMP spin contention (10-100x slower steps)
    "warmup": 1,
    "repeats": 3,
    "flush_mib": 4,
    "bandwidth_mib": 16,
    "compress_n": 512,
    "compress_heads": [2],
    "decode_lengths": [256, 512],
    "decode_batches": [1, 2],
    "decode_heads": [[2, 2], [1, 3]],
    "model": SMOKE_MODEL,
    "prefill_lengths": [384, 512],
    "breakdown_lengths": [384],
    "e2e_warmup": 1,
    "e2e_repeats": 2,
    "decode_context": 512,
    "decode_tokens": 4,
    "decode_warmup": 1,
    "decode_contexts": [256],
    "decode_batch_sizes": [1, 2],
    "decode_steps": 2,
    "decode_step_warmup": 2,
    "compile_backend": "eager",  # dynamo's full-graph capture without inductor's code generation (seconds on CPU)
}
GOALS = {
    "prefill_overhead_max": 0.02,  # CompressKV prefill / no-press prefill - 1, longest prefill length
    "decode_roofline_min": 0.70,  # weighted decode bytes/s over copy bandwidth, compressed lengths >= 4k
    "decode_roofline_from": 4096,
    "attention_speedup_min": 3.0,  # full-cache attention time / compressed-cache attention time
}


@dataclass
class Config:
    only: list[str] = field(default_factory=lambda: list(SECTIONS))
    device: str | None = None  # None: cuda when available, else cpu
    dtype: str = "bfloat16"
    output: str | None = None  # None: results/speed/speed.json (speed_smoke.json with --smoke)
    smoke: bool = False
    seed: int = 0
    threads: int | None = None  # torch CPU threads for this run (None: leave as is); --smoke uses 1
    warmup: int = 3
    repeats: int = 20
    flush_mib: int = 256  # zeroed before each kernel sample (> L2 of H100/H200); 0 = no flush
    bandwidth_mib: int = 2048
    backends: list[str] = field(default_factory=lambda: ["triton", "torch"])
    kept: float = 0.25  # kept fraction of the cache (kvpress compression_ratio = 1 - kept)
    bin_rank: int = 12  # pivots per bin
    compress_n: int = 32768
    compress_d: int = 128
    compress_heads: list[int] = field(default_factory=lambda: [4, 8])
    compress_batch: int = 1
    decode_d: int = 128
    decode_lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384, 32768])
    decode_batches: list[int] = field(default_factory=lambda: [1, 4, 16])
    decode_heads: list[list[int]] = field(default_factory=lambda: [[8, 4], [4, 7]])  # [kv_heads, group]
    sdpa_reference: bool = True
    model: dict[str, Any] = field(default_factory=lambda: dict(QWEN25_7B))
    prefill_lengths: list[int] = field(default_factory=lambda: [8192, 32768])
    breakdown_lengths: list[int] = field(default_factory=lambda: [8192, 32768, 65536])  # eval/speed/prefill.py
    breakdown_settings: list[str] | None = None  # None: every setting of eval/speed/prefill.py's SETTINGS
    e2e_warmup: int = 1
    e2e_repeats: int = 3
    decode_context: int = 32768
    decode_batch: int = 1
    decode_tokens: int = 64
    decode_warmup: int = 8
    attention_layer: int = 0
    attn_implementations: list[str] = field(default_factory=lambda: ["sdpa", "flash_attention_2"])
    snapkv_window: int = 64
    snapkv_kernel: int = 5
    # decode section (eval/speed/decode.py): cache variants at each context and batch size
    decode_contexts: list[int] = field(default_factory=lambda: [8192, 32768])
    decode_batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    decode_steps: int = 32
    decode_step_warmup: int = 4
    compile_mode: str = "reduce-overhead"  # CUDA graphs; "default" / "max-autotune-no-cudagraphs" also valid
    compile_backend: str = "inductor"
    # False: sdpa never picks cuDNN (torch >= 2.11 prefers it on Hopper; it builds a plan per new key length, which a
    # decode step over a growing cache may pay every step): what the stock eager rows cost without it
    cudnn_sdpa: bool = True



def build_parser() -> argparse.ArgumentParser:
    """CLI flags; all default to None so that the YAML config (then the built-in defaults) fill the gaps."""
    p = argparse.ArgumentParser(
        prog="python -m eval.speed", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--config", type=Path, default=None, help=f"YAML with the same keys (default {DEFAULT_CONFIG})")
    p.add_argument("--only", help="comma-separated sections: bandwidth,kernels,e2e,prefill,decode (default: "
                                  "configs/speed.yaml's list, which leaves decode out)")
    p.add_argument("--device", help="cuda, cuda:N or cpu (default cuda when available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="tensor and model dtype (default bfloat16)")
    p.add_argument("--output", help="JSON path (default results/speed/speed.json; speed_smoke.json with --smoke)")
    p.add_argument("--smoke", action="store_true", default=None, help="tiny sizes for every code path (CPU test)")
    p.add_argument("--seed", type=int)
    p.add_argument("--threads", type=int, help="torch CPU threads (default: unchanged; 1 with --smoke)")
    p.add_argument("--warmup", type=int, help="warm-up calls per kernel timing (default 3)")
    p.add_argument("--repeats", type=int, help="timed calls per kernel timing (default 20)")
    p.add_argument("--flush-mib", type=int, help="buffer zeroed before each kernel sample (default 256; 0 = none)")
    p.add_argument("--bandwidth-mib", type=int, help="copy buffer size (default 2048)")
    p.add_argument("--backends", nargs="+", choices=BACKENDS, help="kvcompress backends to time (default triton torch)")
    p.add_argument("--kept", type=float, help="kept fraction of the cache (default 0.25)")
    p.add_argument("--bin-rank", type=int, help="pivots per bin (default 12)")
    p.add_argument("--compress-n", type=int, help="compress_kv context length (default 32768)")
    p.add_argument("--compress-heads", type=int, nargs="+", help="compress_kv KV heads (default 4 8)")
    p.add_argument("--decode-lengths", type=int, nargs="+", help="compressed lengths for the decode kernel")
    p.add_argument("--decode-batches", type=int, nargs="+", help="batch sizes for the decode kernel (default 1 4 16)")
    p.add_argument("--decode-heads", nargs="+", help="KVxGROUP pairs for the decode kernel (default 8x4 4x7)")
    p.add_argument("--prefill-lengths", type=int, nargs="+", help="e2e prefill lengths (default 8192 32768)")
    p.add_argument("--breakdown-lengths", type=int, nargs="+", help="prefill breakdown lengths (default 8k 32k 64k)")
    p.add_argument("--breakdown-settings", nargs="+", help="prefill breakdown settings (default all; see prefill.py)")
    p.add_argument("--e2e-repeats", type=int, help="timed prefills per e2e / breakdown row (default 3)")
    p.add_argument("--decode-context", type=int, help="e2e context before decoding (default 32768)")
    p.add_argument("--decode-batch", type=int, help="e2e decode batch size (default 1)")
    p.add_argument("--decode-tokens", type=int, help="e2e timed decode steps (default 64)")
    p.add_argument("--model-layers", type=int, help="override the model's num_hidden_layers (shorter e2e runs)")
    p.add_argument("--attn-implementations", nargs="+", help="full-cache attention (default sdpa flash_attention_2)")
    p.add_argument("--decode-contexts", type=int, nargs="+", help="decode section: contexts (default 8192 32768)")
    p.add_argument("--decode-batch-sizes", type=int, nargs="+", help="decode section: batch sizes (default 1 8)")
    p.add_argument("--decode-steps", type=int, help="decode section: timed steps per variant (default 32)")
    p.add_argument("--compile-mode", help="decode section: torch.compile mode (default reduce-overhead)")
    p.add_argument("--compile-backend", help="decode section: torch.compile backend (default inductor)")
    p.add_argument("--no-cudnn-sdpa", dest="cudnn_sdpa", action="store_false", default=None,
                   help="sdpa never picks its cuDNN kernel in this run (default: torch's own choice)")
    return p


ATTN_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2")


def resolve_config(argv: list[str] | None = None) -> Config:
    """Built-in defaults < YAML config < smoke preset < command-line flags, validated."""
    args = vars(build_parser().parse_args(argv))
    merged = load_yaml(args.pop("config"), DEFAULT_CONFIG, Config)
    model_layers = args.pop("model_layers")
    flags = {k: v for k, v in args.items() if v is not None}
    if "only" in flags:
        flags["only"] = [s.strip() for s in flags["only"].split(",") if s.strip()]
    if "decode_heads" in flags:
        try:
            flags["decode_heads"] = [[int(x) for x in pair.lower().split("x")] for pair in flags["decode_heads"]]
        except ValueError as err:
            raise ValueError("--decode-heads: use KVxGROUP pairs such as 8x4 4x7") from err
    if flags.get("smoke", merged.get("smoke", False)):
        merged.update(SMOKE)
    merged.update(flags)
    cfg = Config(**merged)
    cfg.model = {**cfg.model}
    if model_layers is not None:
        if model_layers < 1:
            raise ValueError(f"--model-layers: must be an integer >= 1, got {model_layers}")
        cfg.model["num_hidden_layers"] = model_layers
    for name in ("kept", "repeats", "warmup", "seed"):  # a YAML string here failed deep inside with a TypeError
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name}: must be a number, got {value!r}")
    unknown = [name for name in cfg.attn_implementations if name not in ATTN_IMPLEMENTATIONS]
    if unknown or not cfg.attn_implementations:
        raise ValueError(f"attn_implementations: choose from {', '.join(ATTN_IMPLEMENTATIONS)}, got "
                         f"{cfg.attn_implementations}")  # fmt: skip
    import torch._dynamo

    if cfg.compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ValueError(f"compile_backend: one of torch.compile's backends (such as "
                         f"{', '.join(torch._dynamo.list_backends())}), got {cfg.compile_backend!r}")
    if cfg.output is not None and Path(cfg.output).is_dir():
        raise ValueError(f"output: {cfg.output} is a folder; name the JSON file to write")
    bad = set(cfg.only) - set(SECTIONS)
    if bad or not cfg.only:
        raise ValueError(f"only: choose from {','.join(SECTIONS)}, got {cfg.only}")
    if set(cfg.backends) - set(BACKENDS):
        raise ValueError(f"backends: choose from {BACKENDS}, got {cfg.backends}")
    if cfg.breakdown_settings is not None:
        from eval.speed.prefill import SETTINGS  # prefill.py imports this module

        unknown = [name for name in cfg.breakdown_settings if name not in SETTINGS]
        if unknown or not cfg.breakdown_settings:
            raise ValueError(f"breakdown_settings: choose from {', '.join(SETTINGS)}, got {cfg.breakdown_settings}")
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype: choose from {sorted(DTYPES)}, got {cfg.dtype!r}")
    if not 0 < cfg.kept < 1:
        raise ValueError(f"kept: must be in (0, 1), got {cfg.kept}")
    if any(len(pair) != 2 or min(pair) < 1 for pair in cfg.decode_heads):
        raise ValueError(f"decode_heads: need [kv_heads, group] pairs >= 1, got {cfg.decode_heads}")
    at_least_one = ("repeats", "bandwidth_mib", "compress_n", "compress_d", "decode_d", "bin_rank", "e2e_repeats",
                    "decode_context", "decode_batch", "decode_tokens", "compress_heads", "decode_lengths",
                    "decode_batches", "prefill_lengths", "breakdown_lengths", "decode_steps", "decode_contexts",
                    "decode_batch_sizes", "threads")  # fmt: skip
    for low, names in ((1, at_least_one), (0, ("warmup", "e2e_warmup", "decode_warmup", "flush_mib"))):
        for name in names:
            value = getattr(cfg, name)
            for each in value if isinstance(value, list) else [value]:
                if each is not None and each < low:  # --repeats for repeats, ...: one line naming the key
                    raise ValueError(f"{name}: must be >= {low}, got {value}")
    return cfg


def resolve_device(cfg: Config) -> torch.device:
    name = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device: use cuda, cuda:N or cpu, got {name!r}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: CUDA is not available here; use --device cpu --smoke")
        if device.index is not None:
            torch.cuda.set_device(device)
        return device
    if device.type != "cpu":
        raise ValueError(f"--device: use cuda, cuda:N or cpu, got {name!r}")
    if not cfg.smoke:
        raise RuntimeError("--device cpu: the full sizes need a GPU; add --smoke (tiny sizes, a smoke test)")
    return device


def random_qwen(layers: int, smoke: bool = False) -> torch.nn.Module:
    """A random-weight Qwen2.5-7B-Instruct-shaped model cut to ``layers`` decoder layers (seed 0, eval mode): bf16 on
    CUDA; ``smoke`` (or no GPU): :data:`SMOKE_MODEL`'s tiny shape in float32 on CPU."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cuda = torch.cuda.is_available() and not smoke
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    with torch.device(device):
        shape = dict(SMOKE_MODEL if smoke else QWEN25_7B, num_hidden_layers=layers)
        return AutoModelForCausalLM.from_config(Qwen2Config(**shape), dtype=dtype).eval()
