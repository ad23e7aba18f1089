"""Numerical comparison for the parity tests (tests/README.md's tolerance policy)."""

from __future__ import annotations

from typing import Optional

import torch

PARITY_RTOL = 1e-5
"""fp32 parity (a parallel layout against the single-process run from the same seed: loss,
every gradient, grad norm, several steps): the bound on :func:`rel_err` per tensor. Parallel
runs sum in other orders, so fp32 rounding (~6e-8 per operation, grown by the depth of the
sums) differs; 1e-5 is ~100x that and ~1000x below what a wrong shard, a missing reduction or
a wrong scale gives (tests/README.md, "Tolerances")."""

PARAM_RTOL = 1e-4
"""Parameters after several AdamW steps, per tensor: Adam divides each entry by its own
sqrt(v), amplifying rounding on entries whose gradient is ~0; a real error is O(1)
(tests/README.md, "Tolerances")."""

UNIT_ATOL = 1e-5
"""An absolute bound, only for tensors whose scale is known and O(1) (logits, normalized
activations, the SSD scan's output): the same 1e-5 as :data:`PARITY_RTOL` at scale 1
(tests/README.md: ``atol = 1e-5 x max(1, max|ref|)``)."""


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


def held_optimizer_bytes(trainer) -> int:
    """Bytes ``trainer``'s optimizer holds beyond the model's own parameters (its states and, in
    a 16-bit run, the master copies; each storage counted once): what the planner's optimizer
    term prices (tests/planner/test_planner_optimizer_bytes.py, test_planner_muon.py)."""
    model = {p.untyped_storage().data_ptr()
             for m in trainer.parts.model.chunks for p in m.parameters()}
    tensors = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    tensors += [t for s in trainer.optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor) and t.dim() > 0]
    seen, held = set(), 0
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in model and ptr not in seen:
            seen.add(ptr)
            held += t.untyped_storage().nbytes()
    return held
