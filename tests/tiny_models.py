"""Tiny random-weight models of every supported family (CPU, seconds to build)."""

from __future__ import annotations

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3")

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=4096,
)


def tiny_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides) -> torch.nn.Module:
    torch.manual_seed(seed)
    kwargs = {**_COMMON, **overrides}
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kwargs))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**{"sliding_window": None, **kwargs}))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kwargs))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **kwargs))
    elif family == "phi3":
        model = Phi3ForCausalLM(Phi3Config(pad_token_id=0, **kwargs))
    elif family == "gemma3":
        kwargs.update(num_hidden_layers=overrides.get("num_hidden_layers", 3), head_dim=16)
        kwargs.setdefault("sliding_window", 4096)
        config = Gemma3TextConfig(
            layer_types=["sliding_attention", "full_attention", "sliding_attention"][: kwargs["num_hidden_layers"]],
            **kwargs,
        )
        model = Gemma3ForCausalLM(config)
    else:
        raise ValueError(family)
    return model.to(dtype).eval()
