"""RNG for dropout under tensor parallelism (Megatron-LM's ``CudaRNGStatesTracker``).

Activations that are *replicated* across the TP group (after a row-parallel all-reduce: hidden
dropout) must get the same dropout mask on every TP rank, so they use the default generator,
seeded identically across the TP group. Activations that are *partitioned* (attention
probabilities of this rank's heads) must get independent masks per TP rank, so they draw from a
second, per-TP-rank generator state, entered with :meth:`RNGTracker.fork`.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

TP_SEED_OFFSET = 2718  # Megatron's offset of the model-parallel seed


class RNGTracker:
    """Holds the tensor-parallel RNG state; ``fork()`` swaps it in for a region."""

    def __init__(self, device: torch.device):
        self.device = device
        self.state: torch.Tensor | None = None

    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def seed(self, seed: int) -> None:
        outer = self._get()
        torch.manual_seed(seed)
        self.state = self._get()
        self._set(outer)

    @contextlib.contextmanager
    def fork(self):
        """Run the block on the per-TP-rank generator, then restore the default one."""
        if self.state is None:
            raise RuntimeError("RNGTracker.seed() was not called")
        outer = self._get()
        self._set(self.state)
        try:
            yield
        finally:
            self.state = self._get()
            self._set(outer)

    def state_dict(self) -> dict:
        return {"state": self.state}

    def load_state_dict(self, sd: dict) -> None:
        self.state = sd["state"]


class ForkedDropout(nn.Module):
    """Dropout drawn from the per-TP-rank generator (activations partitioned over TP, e.g. the
    ``[s/t, b, h]`` tokens of sequence parallelism)."""

    def __init__(self, p: float, tracker: RNGTracker):
        super().__init__()
        self.p, self.tracker = p, tracker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with self.tracker.fork():
            return F.dropout(x, self.p, True)


def seed_everything(seed: int, pp_rank: int, tp_rank: int, tracker: RNGTracker) -> None:
    """Megatron's ``model_parallel_cuda_manual_seed``: default seed ``seed + 100 pp_rank``
    (same on every TP and DP rank of a stage), TP seed ``default + 2718 + tp_rank``."""
    default = seed + 100 * pp_rank
    random.seed(default)
    np.random.seed(default % 2**32)
    torch.manual_seed(default)
    tracker.seed(default + TP_SEED_OFFSET + tp_rank)


def get_rng_state(tracker: RNGTracker) -> dict:
    """Every generator this rank uses, for checkpoints."""
    out = {"python": random.getstate(), "numpy": np.random.get_state(),
           "torch": torch.get_rng_state(), "tracker": tracker.state_dict()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict, tracker: RNGTracker) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tracker.load_state_dict(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
