"""The optimizer's parameter groups: which parameters step together with which learning rate,
weight decay and epsilon, and which ones Muon orthogonalizes (Megatron-Core's
``_get_param_groups`` with the config overrides of ``get_standard_config_overrides``,
``get_mup_config_overrides`` and the Muon entry of ``emerging_optimizers.py``).

Each trainable parameter falls in one :class:`Kind`:

- weight decay: none for biases and 1-D parameters (norms), ``--weight-decay`` otherwise (the
  group's ``wd_mult``, 0 or 1, times the weight-decay schedule's value,
  :mod:`loom.training.param_schedule`); ``--apply-wd-to-qk-layernorm`` decays the query / key
  norms' parameters too (Megatron-Core's Qwen3-Next rule, ``get_standard_config_overrides``),
  ``--weight-decay-norms-and-biases`` every parameter (torchtitan's optimizer);
- ``--decoupled-lr``: the word embeddings and output layer (Megatron's
  ``is_embedding_or_output_parameter``) at their own peak and minimum learning rate;
- Muon (``--optimizer muon``): the 2-D weights but those, Mamba's ``in_proj`` (Megatron sets
  ``use_muon=False`` on it) and conv1d (3-D in Megatron, ``[c, k]`` here); everything else
  steps with AdamW (``--muon-scalar-optimizer adam``);
- muP (``--use-mup``, width multiplier m != 1, :mod:`loom.config.model_mup`): under Adam the
  hidden matrices (not vector-like: 2-D or more and not an embedding-class parameter; Megatron's
  ``is_embedding_parameter``: the embedding module's and the output layer's) at peak and
  minimum learning rate / m and epsilon / m; under SGD the vector-like ones (minus
  ``--decoupled-lr``'s) at learning rates x m; under Muon the hidden matrices Muon does not
  manage at learning rates / m (no epsilon change: Megatron applies it to optimizers named
  adam only).

Every rank builds the same groups in the same order (:attr:`GroupPlan.specs`), empty ones
included: the LR scheduler's state, saved by one rank, is loaded by all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch

from loom.config.optimizer_muon import muon_managed

class Kind(NamedTuple):
    """What decides a parameter's group."""

    decay: bool
    decoupled: bool = False
    muon: bool = False
    mup: Optional[str] = None  # "hidden" (Adam, Muon: lr / m) or "vector" (SGD: lr x m)


def is_embedding_class(name: str) -> bool:
    """Megatron's muP ``is_embedding_parameter``: every parameter of the embedding module (word
    and position tables, a pipeline or MTP copy) and the output layer's weight."""
    return "embedding" in name or name == "output_layer.weight"


@dataclass(frozen=True)
class GroupPlan:
    """The groups every rank builds: ``specs[i]`` (the group's keys but ``params``) for
    ``kinds[i]``; :meth:`kind_of` puts a parameter in one."""

    kinds: tuple
    specs: tuple
    optimizer: str
    mup_width: float
    decoupled_lr: bool
    decay_qk_norm: bool = False  # --apply-wd-to-qk-layernorm
    decay_all: bool = False  # --weight-decay-norms-and-biases

    def kind_of(self, name: str, p: torch.Tensor, decoupled: bool) -> Kind:
        """The :class:`Kind` of parameter ``name`` (``decoupled``: it is an embedding / output
        weight of :func:`loom.training.optimizer.decoupled_params`, Megatron's
        ``is_embedding_or_output_parameter``)."""
        qk_norm = ".q_layernorm." in name or ".k_layernorm." in name
        decay = self.decay_all or not (p.ndim < 2 or name.endswith(".bias")) or \
            (self.decay_qk_norm and qk_norm)
        own = decoupled and self.decoupled_lr
        muon = self.optimizer == "muon" and muon_managed(name, p.ndim, decoupled)
        mup = None
        if self.mup_width != 1.0:
            vector = is_embedding_class(name) or p.ndim <= 1
            if self.optimizer == "sgd":
                mup = "vector" if vector and not own else None
            elif not vector and not muon:
                mup = "hidden"
        return Kind(decay, own, muon, mup)

    def index(self, name: str, p: torch.Tensor, decoupled: bool) -> int:
        return self.kinds.index(self.kind_of(name, p, decoupled))


def group_plan(training: Any, model: Any = None, decoupled_group: Optional[dict] = None
               ) -> GroupPlan:
    """The :class:`GroupPlan` of the training section ``training`` (``--optimizer``,
    ``--weight-decay``, ``--lr``, ``--min-lr``, ``--adam-eps``), ``model`` (muP's width
    multiplier; None: no muP) and ``decoupled_group`` (the ``--decoupled-lr`` group's keys,
    :func:`loom.training.optimizer.decoupled_group`, or None)."""
    t = training
    name = "muon" if t.optimizer in ("muon", "dist_muon") else t.optimizer
    width = model.width_multiplier if model is not None else 1.0
    kinds = [Kind(True), Kind(False)]
    if decoupled_group is not None:
        kinds.append(Kind(True, decoupled=True))
    if name == "muon":
        kinds.append(Kind(True, muon=True))
    if width != 1.0:
        if name == "sgd":
            kinds += [Kind(True, mup="vector"), Kind(False, mup="vector")]
        else:
            kinds.append(Kind(True, mup="hidden"))
    specs = []
    for k in kinds:
        spec: dict = {"weight_decay": t.weight_decay if k.decay else 0.0,  # the scheduler's
                      "wd_mult": 1.0 if k.decay else 0.0}  # wd x wd_mult (Megatron's)
        if name == "muon":
            spec["muon"] = k.muon
        if k.decoupled:
            spec.update(decoupled_group)
        if k.mup is not None:
            mult = width if k.mup == "vector" else 1.0 / width
            spec.update(lr=t.lr * mult, max_lr=t.lr * mult, min_lr=t.min_lr * mult)
            if k.mup == "hidden" and name == "adam":
                spec["eps"] = t.adam_eps / width
        specs.append(spec)
    return GroupPlan(tuple(kinds), tuple(specs), name, width, decoupled_group is not None,
                     decay_qk_norm=bool(getattr(model, "apply_wd_to_qk_layernorm", False)),
                     decay_all=bool(getattr(t, "weight_decay_norms_and_biases", False)))


def build_groups(plan: GroupPlan, tensors: list, device: torch.device) -> list[dict]:
    """``plan``'s groups holding ``tensors`` (``[(group index, tensor)]``, in order), each
    group a placeholder ``zeros(0)`` when it holds none (every rank builds every group)."""
    out = []
    for i, spec in enumerate(plan.specs):
        params = [t for j, t in tensors if j == i]
        out.append({"params": params or [torch.zeros(0, device=device)], **spec})
    return out
