"""Lower-precision storage of the optimizer's fp32 tensors: Megatron-LM's precision-aware
optimizer (``--use-precision-aware-optimizer``, ``--main-params-dtype``, ``--exp-avg-dtype``,
``--exp-avg-sq-dtype``: :mod:`loom.config.optimizer_precision`), whose storage rules are
Transformer Engine's ``FusedAdam`` (``transformer_engine/pytorch/optimizers/fused_adam.py``):
between steps a tensor is kept in its storage dtype, and the update computes in fp32.

* ``bf16``: a cast (round to nearest).
* ``fp16`` / ``fp8`` (E4M3): scaled per tensor, ``stored = x / scale`` with
  ``scale = max|x| / R`` for R = 65504 / 2 (fp16) or 448 (E4M3, its largest finite value);
  ``x ~= stored * scale``.
* the fp32 master of a bf16 parameter (``--main-params-dtype fp32``, Megatron's default under
  ``--bf16``; TE's ``store_param_remainders``): the parameter holds the upper 16 bits of the
  master's fp32 bit pattern, rounded to nearest (ties away from zero, so that every remainder fits
  an int16), and an int16 keeps the lower 16 bits relative to it: 2 bytes, lossless
  (:func:`split_remainder`, :func:`join_remainder`).

Torch-only; the optimizer that uses it: :class:`loom.training.distributed_optimizer.
DistributedOptimizer` (:class:`StatePrecision`, :class:`StoredStates`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

STORAGE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
           "fp8": torch.float8_e4m3fn}
"""Megatron's dtype names -> torch storage dtypes (fp8: E4M3, TE's ``kFloat8E4M3``)."""

SCALED_RANGE = {torch.float16: torch.finfo(torch.float16).max / 2.0, torch.float8_e4m3fn: 448.0}
"""R of the per-tensor scale ``max|x| / R`` (TE's ``dtype_to_range_map``)."""


@dataclass
class Packed:
    """A tensor in its storage dtype: ``data`` (same shape), ``scale`` (0-d fp32, or None when
    unscaled: fp32, bf16)."""

    data: torch.Tensor
    scale: Optional[torch.Tensor] = None

    def nbytes(self) -> int:
        """Bytes of the stored elements (the scale's 4 bytes per tensor aside)."""
        return self.data.numel() * self.data.element_size()


def pack(x: torch.Tensor, dtype: torch.dtype) -> Packed:
    """fp32 ``x`` -> its storage in ``dtype`` (see the module: cast, or scaled per tensor)."""
    if dtype == torch.float32:
        return Packed(x)
    if dtype not in SCALED_RANGE:
        return Packed(x.to(dtype))
    amax = x.abs().max() if x.numel() else torch.zeros((), device=x.device)
    scale = (amax.float() / SCALED_RANGE[dtype]).reshape(())
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    return Packed((x * inv).to(dtype), scale)


def unpack(p: Packed) -> torch.Tensor:
    """A new fp32 tensor from :func:`pack`'s storage (``p.data`` itself when it is fp32)."""
    if p.data.dtype == torch.float32:
        return p.data
    x = p.data.float()
    return x if p.scale is None else x.mul_(p.scale)


def split_remainder(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``master`` -> ``(bf16 values, int16 remainders)``: the bf16 value is the upper half of
    the fp32 bits rounded to nearest on the lower half (ties away from zero: lower half >=
    0x8000 rounds up); the remainder is the lower half as a signed int16, negative exactly
    when it rounded up. :func:`join_remainder` inverts it bit for bit."""
    bits = master.contiguous().view(torch.int32)
    low = bits & 0xFFFF
    up = (low >= 0x8000).to(torch.int32)
    high = ((bits >> 16) + up) & 0xFFFF
    as_int16 = lambda v: (v - ((v >= 0x8000).to(torch.int32) << 16)).to(torch.int16)  # noqa: E731
    return as_int16(high).view(torch.bfloat16), as_int16(low)


def join_remainder(value: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """bf16 ``value`` and int16 ``remainder`` (of :func:`split_remainder`) -> the fp32 master."""
    high = value.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    low = remainder.to(torch.int32)
    high = (high - (low < 0).to(torch.int32)) & 0xFFFF
    return ((high << 16) | (low & 0xFFFF)).view(torch.float32)


@dataclass(frozen=True)
class StatePrecision:
    """Storage dtypes of Adam's moments (``exp_avg``, ``exp_avg_sq``) and of the master copies
    of 16-bit parameters (``master``: fp32, or fp16 scaled); ``remainders``: a bf16 parameter's
    fp32 master is kept as its int16 remainder (TE's ``store_param_remainders``, on in
    Megatron's ``OptimizerConfig`` by default)."""

    exp_avg: torch.dtype = torch.float32
    exp_avg_sq: torch.dtype = torch.float32
    master: torch.dtype = torch.float32
    remainders: bool = True

    @classmethod
    def of(cls, t: Any) -> Optional["StatePrecision"]:
        """From a TrainingConfig; None without ``--use-precision-aware-optimizer``."""
        if not t.use_precision_aware_optimizer:
            return None
        return cls(STORAGE[t.exp_avg_dtype], STORAGE[t.exp_avg_sq_dtype],
                   STORAGE[t.main_params_dtype])

    def state_dtype(self, key: str) -> torch.dtype:
        """The storage dtype of Adam's state ``key``."""
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}[key]

    def master_mode(self, param_dtype: torch.dtype) -> str:
        """How the fp32 master of a ``param_dtype`` parameter is kept: ``"remainder"`` (bf16
        parameter, fp32 master), ``"scaled"`` (fp16 master) or ``"fp32"``."""
        if self.master != torch.float32:
            return "scaled"
        return "remainder" if self.remainders and param_dtype == torch.bfloat16 else "fp32"


class StoredStates:
    """The masters and AdamW moments of an optimizer's ranges as stored between steps.

    ``ranges``: objects with ``param``, ``lo``, ``hi`` (the flat range of the parameter),
    ``master`` (its 1-D fp32 master, the key of ``state``) and ``keep`` (how the master is
    kept, :meth:`StatePrecision.master_mode`); ``state``: the inner optimizer's state dict;
    ``keys``: the moments' state keys. ``precision`` None: nothing is packed (fp32 states).
    Between :meth:`pack` and :meth:`unpack` the fp32 tensors are gone: a remainder-kept
    master's parameter holds its bf16 value, the rest is in :attr:`packed`."""

    def __init__(self, precision: Optional[StatePrecision], ranges: Sequence, state: dict,
                 keys: Sequence[str]):
        self.precision, self.ranges, self.state, self.keys = precision, ranges, state, keys
        self.packed: dict[int, dict[str, Packed]] = {}  # id(range) -> its stored tensors
        self.is_packed = False

    def pack(self) -> None:
        """Store the masters and moments in :attr:`precision`'s dtypes (no-op without it, or
        when packed): a remainder-kept master writes its bf16 value into the parameter
        (:func:`split_remainder`) and keeps the int16 rest."""
        if self.precision is None or self.is_packed:
            return
        for rg in self.ranges:
            slot = {}
            st = self.state.get(rg.master)
            for k in self.keys if st and not getattr(rg, "offloaded", False) else ():
                if k in st:  # (host-offloaded states stay fp32, as Megatron's CPU Adam's)
                    slot[k] = pack(st.pop(k), self.precision.state_dtype(k))
            if rg.keep == "remainder":
                value, rest = split_remainder(rg.master.data)
                rg.param.detach().view(-1)[rg.lo:rg.hi].copy_(value)
                slot["master"] = Packed(rest)
            elif rg.keep == "scaled":
                slot["master"] = pack(rg.master.data, self.precision.master)
            if rg.keep != "fp32":
                rg.master.data = rg.master.data.new_empty(0)
            self.packed[id(rg)] = slot
        self.is_packed = True

    def unpack(self) -> None:
        """fp32 masters and moments back from :meth:`pack`'s storage (no-op when unpacked)."""
        if not self.is_packed:
            return
        for rg in self.ranges:
            slot = self.packed.pop(id(rg), {})
            kept = slot.pop("master", None)
            if rg.keep == "remainder":
                rg.master.data = join_remainder(rg.param.detach().view(-1)[rg.lo:rg.hi],
                                                kept.data)
            elif rg.keep == "scaled":
                rg.master.data = unpack(kept)
            if slot:
                self.state[rg.master].update({k: unpack(v) for k, v in slot.items()})
        self.is_packed = False

    @contextlib.contextmanager
    def unpacked(self):
        """The fp32 masters and moments inside the block, stored as before after it."""
        was = self.is_packed
        self.unpack()
        try:
            yield
        finally:
            if was:
                self.pack()
