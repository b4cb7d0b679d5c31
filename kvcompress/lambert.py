"""Lambert W0 (App. L) and the constant rho_0 of eq. (12): a leaf module (torch only), shared by the
PyTorch reference (:mod:`kvcompress.nystrom`) and the Triton kernel (:mod:`kvcompress.kernels.rpnys`)."""

from __future__ import annotations

import math

import torch


def lambert_w0(z: torch.Tensor, iterations: int = 8) -> torch.Tensor:
    """Principal branch W0 for z >= 0, elementwise (Loczi's iteration, App. L, Thm. L.1).

    The error after n steps is below max(0.32^(2^n), 0.633^(2^n) / 3); 8 steps reach float64 precision.
    Returns the dtype of ``z`` (computed in float64 for float32 and lower).
    """
    if not isinstance(z, torch.Tensor):
        raise TypeError(f"lambert_w0: z must be a torch.Tensor, got {type(z).__name__}")
    if not torch.is_floating_point(z):
        z = z.to(torch.get_default_dtype())
    if bool(torch.isnan(z).any()):
        raise ValueError("lambert_w0: z holds NaN (a non-finite input upstream: queries, keys or scores); it must be "
                         "a number >= 0")
    if bool((z < 0).any()):
        raise ValueError("lambert_w0: z must be >= 0 (this implementation covers the range [0, inf))")
    work = z.to(torch.float64)
    tiny = work < 1e-300
    safe = torch.where(tiny, torch.ones_like(work), work)
    log_z = torch.log(safe)
    w = torch.where(safe > math.e, log_z - torch.log(log_z.clamp_min(1e-300)), safe / math.e)
    for _ in range(iterations):
        w = w / (1 + w) * (1 + log_z - torch.log(w))
    w = torch.where(torch.isinf(work), work, w)
    return torch.where(tiny, work, w).to(z.dtype)


# rho_0 of eq. (12): sqrt(1 + exp(W0(2 / e^2) + 2)) ~= 3.19.
RHO0 = math.sqrt(1 + math.exp(float(lambert_w0(torch.tensor(2 / math.e**2, dtype=torch.float64))) + 2))
