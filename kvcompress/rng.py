"""Counter-based random numbers for pivot sampling.

Every Gumbel draw of RPNys is a pure function of ``(seed, stream, step, position)``: a bin compressed
on its own gets the same draws as the same bin inside a batched call, and a GPU kernel can reproduce
them with 32-bit integer arithmetic. The mixer is Wellons' ``lowbias32`` integer hash; products are
split into 16-bit halves so that int64 tensors never overflow.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 tensors holding 32-bit values, without int64 overflow."""
    lo = (x & 0xFFFF) * c
    hi = ((x >> 16) * (c & 0xFFFF)) & 0xFFFF
    return (lo + (hi << 16)) & _MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 hash of 32-bit values stored in an int64 tensor."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_key(seed: int) -> int:
    """Fold any Python int into a 32-bit key."""
    seed %= 2**64
    lo = torch.tensor(seed & _MASK32, dtype=torch.int64)
    hi = torch.tensor(seed >> 32, dtype=torch.int64)
    return int(mix32(lo ^ mix32(hi + 0x9E3779B9)))


def stream_step_key(key: int, streams: torch.Tensor, step: int) -> torch.Tensor:
    """Key of one pivot step for each stream: ``[...]`` int64 -> ``[...]`` int64."""
    return mix32(mix32(streams ^ key) ^ step)


def gumbel(step_keys: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """Standard Gumbel draws ``[..., length]`` for positions ``0..length-1`` of each step key."""
    positions = torch.arange(length, device=step_keys.device, dtype=torch.int64)
    bits = mix32(step_keys.unsqueeze(-1) ^ mix32(positions + 0x632BE5AB))
    # 24 random bits -> uniform in (0, 1), never exactly 0 or 1.
    uniform = ((bits >> 8).to(torch.float64) + 0.5) / 2**24
    return (-torch.log(-torch.log(uniform))).to(dtype)
