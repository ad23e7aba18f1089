"""Muon (``--optimizer muon``; Jordan et al. 2024, "Muon: an optimizer for hidden layers"), as
Megatron-LM d98e8a6 runs it: Megatron-Core's ``TensorParallelMuon``
(``megatron/core/optimizer/emerging_optimizers.py``) over ``emerging_optimizers`` 0.3.0's
``OrthogonalizedOptimizer`` and ``newton_schulz`` (the version Megatron pins), with AdamW for
every parameter Muon does not manage (:func:`loom.training.param_groups.muon_managed`).

One step of a Muon-managed weight W with gradient G (after clipping), learning rate lr, weight
decay wd, momentum mu:

1. decoupled weight decay ``W -= lr wd W``;
2. momentum ``M = mu M + (1 - mu) G`` (an EMA: ``M.lerp_(G, 1 - mu)``), and the update
   ``U = M``, or ``U = (1 - mu) G + mu M`` with ``--muon-nesterov``;
3. ``O = NS(U) x scale(rows, cols) x --muon-extra-scale-factor``: Newton-Schulz
   orthogonalization (:func:`newton_schulz`, ``--muon-num-ns-steps`` iterations of
   ``X <- a X + (b A + c A^2) X``, ``A = X X^T``, coefficients ``--muon-coefficient-type``, on
   the Frobenius-normalized ``U``, transposed when it has more rows than columns) times
   ``--muon-scale-mode``'s factor (spectral: ``sqrt(max(rows, cols))``; unit_rms_norm:
   ``sqrt(rows / cols)``; shape_scaling: ``sqrt(max(1, rows / cols))``);
   the fused QKV weight is split into its query, key and value rows first, each orthogonalized
   and scaled on its own (``--muon-no-split-qkv``: as one);
4. ``W -= lr O``.

Orthogonalization is of the whole matrix: a tensor-parallel shard is all-gathered over its TP
group first (``--muon-tp-mode duplicated``, Megatron's default; ``distributed`` computes the
same function with the Gram matrix all-reduced instead, here gathered too; ``blockwise``
orthogonalizes each shard on its own, so the update depends on the layout), each expert's
weights on their own. ``--muon-fp32-matmul-prec medium`` (Megatron's default) runs the
iterations in bf16 (emerging_optimizers converts X to bf16 under torch's "medium" float32
matmul precision), ``high`` in fp32 under torch's "high" precision (TF32 on CUDA), ``low``
in fp32 at torch's current precision (torch ignores "low" with a warning).

:class:`Muon` is one ``torch.optim.Optimizer`` over both kinds of groups (``group["muon"]``):
the LR scheduler sees every group, states are saved by parameter name (``momentum_buffer``
for Muon's, AdamW's ``step``, ``exp_avg``, ``exp_avg_sq`` for the others). The distributed
optimizer steps it on fp32 master ranges and supplies :meth:`Muon.step`'s whole-matrix update
(:class:`loom.training.distributed_optimizer.DistributedOptimizer`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from itertools import chain, cycle, islice, repeat
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

COEFFICIENTS = {
    "simple": [(3.4445, -4.7750, 2.0315)],
    "quintic": [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377),
                (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
                (2.8366, -3.0525, 1.2012)],
    "polar_express": [(8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184),
                      (3.9096, -2.8234, 0.5250), (3.2856, -2.4153, 0.4853),
                      (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)],
    "cans": [(8.4703, -25.1081, 18.6293), (4.1828, -3.1087, 0.5806), (3.9619, -2.9541, 0.5630),
             (3.2866, -2.4647, 0.5074), (2.2737, -1.6447, 0.4162)],
    "aol": [(4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
            (2.7215, -3.0494, 1.3169)],
    "deepseekv4": [(3.4445, -4.7750, 2.0315)] * 8 + [(2.0, -1.5, 0.5)] * 2,
}
"""Newton-Schulz coefficients ``(a, b, c)`` per iteration, by ``--muon-coefficient-type``
(emerging_optimizers 0.3.0's ``_COEFFICIENT_SETS``: simple, Keller Jordan's quintic, Polar
Express, CANS, AOL, DeepSeek-V4)."""
REPEAT_LAST = ("polar_express", "cans", "deepseekv4")
"""Coefficient sets whose last triple repeats beyond their length (the others cycle)."""
NS_EPS = 1e-7  # the normalization's floor (emerging_optimizers' default)


def coefficient_sequence(kind: str, steps: int) -> list[tuple[float, float, float]]:
    """The ``steps`` triples of coefficient set ``kind``: cycled, or the last one repeated
    (:data:`REPEAT_LAST`)."""
    sets = COEFFICIENTS[kind]
    base = chain(sets, repeat(sets[-1])) if kind in REPEAT_LAST else cycle(sets)
    return list(islice(base, steps))


def newton_schulz(x: torch.Tensor, steps: int, kind: str = "quintic",
                  bf16: bool = True) -> torch.Tensor:
    """The (approximate) orthogonal polar factor of ``x`` (``[m, n]``, or ``[B, m, n]``, each
    matrix on its own; fp32): ``x / ||x||_F`` (transposed when m > n), ``steps`` iterations
    ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` (``torch.addmm`` as emerging_optimizers
    computes them), in bf16 when ``bf16``; fp32 out, x's shape."""
    if x.dtype != torch.float32:
        raise TypeError(f"Newton-Schulz takes fp32, got {x.dtype}")
    transpose = x.size(-2) > x.size(-1)
    X = x.mT if transpose else x
    X = torch.nn.functional.normalize(X, p=2, dim=(-2, -1), eps=NS_EPS)
    if bf16:
        X = X.to(torch.bfloat16)
    for a, b, c in coefficient_sequence(kind, steps):
        A = X @ X.mT
        if X.ndim == 2:
            X = torch.addmm(X, torch.addmm(A, A, A, alpha=c, beta=b), X, alpha=1.0, beta=a)
        else:
            X = torch.baddbmm(X, torch.baddbmm(A, A, A, alpha=c, beta=b), X, alpha=1.0, beta=a)
    X = X.to(torch.float32)
    return X.mT if transpose else X


def scale_factor(rows: int, cols: int, mode: str) -> float:
    """``--muon-scale-mode``'s factor for a ``[rows, cols]`` update (emerging_optimizers'
    ``get_muon_scale_factor``)."""
    if mode == "shape_scaling":
        return max(1.0, rows / cols) ** 0.5
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    raise ValueError(f"unknown Muon scale mode {mode!r}")


@contextlib.contextmanager
def matmul_precision(prec: str):
    """torch's float32 matmul precision set to ``prec`` for the block, as emerging_optimizers'
    ``fp32_matmul_precision`` does ("low", not one of torch's, leaves it unchanged: torch warns
    and ignores it)."""
    if prec not in ("highest", "high", "medium"):
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(prec)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


@dataclass(frozen=True)
class MuonSettings:
    """The ``--muon-*`` flags (:mod:`loom.config.optimizer_muon`)."""

    momentum: float = 0.9
    nesterov: bool = False
    scale_mode: str = "spectral"
    extra_scale: float = 1.0
    steps: int = 5
    coefficients: str = "quintic"
    matmul_prec: str = "medium"
    split_qkv: bool = True
    tp_mode: str = "duplicated"

    @classmethod
    def of(cls, t: Any) -> "MuonSettings":
        return cls(t.muon_momentum, t.muon_nesterov, t.muon_scale_mode,
                   t.muon_extra_scale_factor, t.muon_num_ns_steps, t.muon_coefficient_type,
                   t.muon_fp32_matmul_prec, t.muon_split_qkv, t.muon_tp_mode)

    def orthogonalize(self, u: torch.Tensor, rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        """``NS(u) x scale x extra`` of a whole matrix ``u [m, n]`` (or a stack ``[E, m, n]``),
        in row blocks of sizes ``rows`` each on its own (the split QKV), else as one."""
        if rows is not None:
            return torch.cat([self.orthogonalize(part) for part in
                              u.split(list(rows), dim=-2)], dim=-2)
        bf16 = torch.get_float32_matmul_precision() == "medium"
        out = newton_schulz(u, self.steps, self.coefficients, bf16=bf16)
        return out * scale_factor(u.size(-2), u.size(-1), self.scale_mode) * self.extra_scale


@dataclass(frozen=True)
class MatrixInfo:
    """How a Muon-managed parameter's (TP-local) update becomes a whole matrix: ``meta`` (its
    :class:`~loom.parallel.registry.ParamMeta`, None or without a shard when not split over
    TP), the TP ``group`` and this rank's place in it, ``qkv`` (the fused QKV's row segments in
    the full matrix, or None)."""

    meta: Any = None
    group: Any = None
    tp_rank: int = 0
    tp_size: int = 1
    qkv: Optional[tuple] = None

    def orthogonalize(self, u: torch.Tensor, settings: MuonSettings) -> torch.Tensor:
        """The orthogonalized update of this rank's ``u`` (the parameter's TP-local shape)."""
        from loom.parallel.registry import full_from_shards, local_shard
        t, shard = self.tp_size, getattr(self.meta, "shard", None)
        if shard is None or t == 1 or settings.tp_mode == "blockwise":
            rows = None
            if self.qkv is not None and settings.split_qkv:
                rows = [r // t for r in self.qkv] if shard is not None else list(self.qkv)
            return settings.orthogonalize(u, rows)
        parts = [torch.empty_like(u) for _ in range(t)]
        dist.all_gather(parts, u.contiguous(), group=self.group)
        full = full_from_shards(parts, shard)
        rows = self.qkv if settings.split_qkv else None
        return local_shard(settings.orthogonalize(full, rows), self.meta, self.tp_rank, t)


def matrix_info(name: str, meta: Any, mesh: Any) -> MatrixInfo:
    """:class:`MatrixInfo` of parameter ``name`` with registry entry ``meta`` on ``mesh``
    (expert weights split over TP gather over the expert-TP group when the mesh has one)."""
    qkv = None
    if name.endswith("linear_qkv.weight") and meta.shard is not None and \
            len(meta.shard.segments or ()) in (3, 4):  # [Q; (gate;) K; V]
        qkv = tuple(meta.shard.segments)
    if meta.shard is None or mesh is None or mesh.tp_size == 1:
        return MatrixInfo(qkv=qkv)
    group = (mesh.groups.get("etp") if meta.expert_parallel else None) or mesh.groups["tp"]
    return MatrixInfo(meta, group, dist.get_rank(group), dist.get_world_size(group), qkv)


class Muon(torch.optim.Optimizer):
    """Muon on the groups with ``muon=True``, AdamW (``adam``: its keyword arguments, lr,
    betas, eps, fused/foreach) on the others, one ``torch.optim.Optimizer`` (see the module).
    ``orthogonalize([(tensor, update)]) -> [orthogonalized update]``: the whole-matrix step 3
    for every Muon tensor holding a gradient, in group order (default: each tensor a whole
    TP-local parameter, ``infos[id(tensor)]`` its :class:`MatrixInfo`)."""

    def __init__(self, groups: list, settings: MuonSettings, adam: dict,
                 infos: Optional[dict] = None,
                 orthogonalize: Optional[Callable[[list], list]] = None):
        super().__init__(groups, dict(lr=adam["lr"], muon=False))
        self.settings = settings
        self.infos = infos or {}
        self._orthogonalize = orthogonalize or self._whole
        scalar = [g for g in self.param_groups if not g["muon"]]
        self.adam = torch.optim.AdamW(scalar, **adam) if scalar else None
        if self.adam is not None:
            self.adam.state = self.state  # one state dict: saved and loaded by parameter name

    def _whole(self, items: list) -> list:
        return [self.infos.get(id(p), MatrixInfo()).orthogonalize(u.view_as(p), self.settings)
                for p, u in items]

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("Muon takes no closure")
        if self.adam is not None:
            self.adam.step()
        s, items, lrs = self.settings, [], []
        for group in self.param_groups:
            if not group["muon"]:
                continue
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                if wd:
                    p.add_(p, alpha=-wd * lr)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - s.momentum)
                items.append((p, p.grad.lerp(buf, s.momentum) if s.nesterov else buf))
                lrs.append(lr)
        with matmul_precision(s.matmul_prec):
            orth = self._orthogonalize(items)
        for (p, _), o, lr in zip(items, orth, lrs):
            if o is not None:
                p.add_(o.reshape(p.shape), alpha=-lr)
        return None
