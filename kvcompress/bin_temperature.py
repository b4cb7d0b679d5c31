"""The temperature of eq. (12) of WildCat (arXiv 2602.10056) and the coefficient of the RPNys kernel it sets:
what :mod:`kvcompress.nystrom` compresses each bin with (the Triton kernel computes the same on the device)."""

from __future__ import annotations

import torch

from kvcompress._checks import as_finite_float64
from kvcompress.lambert import RHO0, lambert_w0


def temperature(
    scaling: float | torch.Tensor,
    query_radius: float | torch.Tensor,
    key_radius: float | torch.Tensor,
    n: int | torch.Tensor,
) -> torch.Tensor:
    """Temperature tau of eq. (12), elementwise over broadcastable float64 tensors.

    tau = sqrt(R_K / R_Q * b0 / (2 W0(b0 / (2 rho0)))),  b0 = log(n) / (beta R_Q R_K) + 2.
    Requires beta, R_Q, R_K > 0 and n >= 1.
    Raises ValueError naming the first argument out of range or non-finite, or shapes that do not broadcast.
    """
    tensors = {}
    for name, x in (("scaling", scaling), ("query_radius", query_radius), ("key_radius", key_radius)):
        tensors[name] = as_finite_float64(name, x)
        if bool((tensors[name] <= 0).any()):
            raise ValueError(f"{name}: must be > 0 everywhere")
    tensors["n"] = as_finite_float64("n", n)
    if bool((tensors["n"] < 1).any()):
        raise ValueError("n: must be >= 1 everywhere")
    try:
        torch.broadcast_shapes(*(t.shape for t in tensors.values()))
    except RuntimeError as err:
        shapes = ", ".join(f"{k} {tuple(t.shape)}" for k, t in tensors.items())
        raise ValueError(f"temperature: shapes do not broadcast ({shapes})") from err
    return _temperature(*tensors.values())


def _temperature(
    scaling: torch.Tensor, query_radius: torch.Tensor, key_radius: torch.Tensor, n: torch.Tensor
) -> torch.Tensor:
    """:func:`temperature` on values the caller guarantees (computed in float64; no host read here)."""
    beta, r_q, r_k, n_ = (torch.as_tensor(x, dtype=torch.float64) for x in (scaling, query_radius, key_radius, n))
    b0 = torch.log(n_) / (beta * r_q * r_k) + 2
    return torch.sqrt(r_k / r_q * b0 / (2 * lambert_w0(b0 / (2 * RHO0))))


def kernel_coefficient(
    scaling: torch.Tensor, query_radius: torch.Tensor, key_radius: torch.Tensor, n: torch.Tensor
) -> torch.Tensor:
    """a = beta / tau^2, the coefficient of the RPNys kernel exp(a <x, y>), float64.

    A bin whose recentred keys are all zero (R_K = 0; one key, or equal keys) gets a = 0: its kernel is constant
    either way (the radii stand in for 1 there, also a query radius taken from those keys, so no 0 / 0 is formed).
    """
    flat = key_radius <= 0
    one = torch.ones_like(key_radius)
    tau = _temperature(scaling, torch.where(flat, one, query_radius), torch.where(flat, one, key_radius), n)
    return torch.where(flat, torch.zeros_like(tau), scaling / tau**2)
