"""Numerical comparison for the parity tests (tests/README.md's tolerance policy)."""

from __future__ import annotations

from typing import Optional

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor, scale: Optional[torch.Tensor] = None,
            floor: float = 1e-12) -> float:
    """``max|a - b| / max(max|scale|, floor)`` with ``scale`` defaulting to ``b`` (the
    per-tensor relative error: an elementwise rtol means nothing for entries that are ~0); 0.0
    for empty tensors. Computed in fp32 (or wider) on detached copies."""
    if a.numel() == 0:
        return 0.0
    a, b = a.detach(), b.detach()
    dtype = torch.promote_types(torch.promote_types(a.dtype, b.dtype), torch.float32)
    ref = (b if scale is None else scale.detach()).to(dtype)
    return float((a.to(dtype) - b.to(dtype)).abs().max() / ref.abs().max().clamp_min(floor))
