"""Reading ``loom-checkpoint-v1`` checkpoints (read-only; loom writes
``loom-checkpoint-v2``, :mod:`loom.checkpoint.io`).

v1 was one ``torch.save`` file per shard::

    model_tpXX_ppYYY[_epZZZ].pt   {"model": {name: shard}, "specs": {name: {full_shape, shard}}}
    optim_tpXX_ppYYY[_epZZZ]_dpNNN.pt   {name: {state key: value}}
    rng_RRRRR.pt                  every rank's generators

:class:`LegacyIndex` answers the same questions as the v2 reader
(:class:`loom.checkpoint.io.DcpIndex`), so a v1 checkpoint loads at any layout as before;
parameter names of checkpoints written before recomputation kept names
(``layers.N.layer.*``) or before the modules took Megatron-Core's names (``input_norm`` ...)
map to today's (:func:`canonical_name`, applied by both readers).
"""

from __future__ import annotations

import glob
import os
import re
from typing import Iterable, Optional

import torch

from loom.parallel.registry import ShardSpec, full_from_shards

LEGACY_FORMAT = "loom-checkpoint-v1"


# Modules renamed to Megatron-Core's spelling (issue 22): (pattern, today's) over the dotted
# parameter name. Megatron-Core: ``TransformerLayer.input_layernorm`` / ``pre_mlp_layernorm``
# (and ``post_self_attn_layernorm`` / ``post_mlp_layernorm``, Gemma's sandwich norms),
# ``TransformerBlock.final_layernorm``, ``SelfAttention.q_layernorm`` / ``k_layernorm``,
# ``BertLMHead.layer_norm``, ``BertModel.output_layer.bias``, ``MoELayer.shared_experts``.
RENAMED = (
    (r"(^|\.)input_norm\.", r"\1input_layernorm."),
    (r"(^|\.)pre_mlp_norm\.", r"\1pre_mlp_layernorm."),
    (r"(^|\.)post_attention_norm\.", r"\1post_self_attn_layernorm."),
    (r"(^|\.)post_mlp_norm\.", r"\1post_mlp_layernorm."),
    (r"^final_norm\.", "final_layernorm."),
    (r"\.self_attention\.q_norm\.", ".self_attention.q_layernorm."),
    (r"\.self_attention\.k_norm\.", ".self_attention.k_layernorm."),
    (r"^lm_head\.norm\.", "lm_head.layer_norm."),
    (r"^output_bias\.bias$", "output_layer.bias"),
    (r"\.mlp\.shared_expert\.", ".mlp.shared_experts."),
)


def canonical_name(name: str) -> str:
    """Today's name of a parameter saved under an older one: names of checkpoints written
    before recomputation kept names (``layers.N.layer.*`` under ``--recompute-granularity
    full``), and before the modules took Megatron-Core's names (:data:`RENAMED`:
    ``layers.N.input_norm.weight`` -> ``layers.N.input_layernorm.weight``, ...). Applied to
    every checkpoint read (v1 and v2); today's names map to themselves."""
    name = re.sub(r"^layers\.(\d+)\.layer\.", r"layers.\1.", name)
    for pattern, new in RENAMED:
        name = re.sub(pattern, new, name)
    return name


def is_legacy(ckpt_dir: str) -> bool:
    """A v1 checkpoint: ``model_tp*_pp*.pt`` files and no DCP ``.metadata``."""
    return not os.path.exists(os.path.join(ckpt_dir, ".metadata")) and \
        bool(glob.glob(os.path.join(ckpt_dir, "model_tp*_pp*.pt")))


class LegacyIndex:
    """Which v1 file holds each parameter, and its spec; tensors memory-mapped on demand."""

    def __init__(self, ckpt_dir: str):
        self.path = ckpt_dir
        self.files = {}
        for path in sorted(glob.glob(os.path.join(ckpt_dir, "model_tp*_pp*.pt"))):
            m = re.search(r"model_tp(\d+)_pp(\d+)(?:_ep(\d+))?\.pt$", path)
            self.files[(int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))] = torch.load(
                path, map_location="cpu", mmap=True, weights_only=True)
        if not self.files:
            raise FileNotFoundError(f"no model shards in {ckpt_dir}")
        for sd in self.files.values():
            sd["optimizer"] = {}
        for path in sorted(glob.glob(os.path.join(ckpt_dir, "optim_tp*_pp*_dp*.pt"))):
            m = re.search(r"optim_tp(\d+)_pp(\d+)(?:_ep(\d+))?_dp\d+\.pt$", path)
            self.files[(int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))]["optimizer"].update(
                torch.load(path, map_location="cpu", mmap=True, weights_only=True))
        self.owner: dict[str, list[tuple[int, int, int]]] = {}
        self.saved_name: dict[str, str] = {}  # today's name -> the name in the files
        for key, sd in self.files.items():
            for name in sd["model"]:
                self.owner.setdefault(canonical_name(name), []).append(key)
                self.saved_name[canonical_name(name)] = name

    @property
    def names(self) -> list[str]:
        return list(self.owner)

    def _full(self, name: str, state_key: Optional[str] = None) -> torch.Tensor:
        keys = self.owner.get(name)
        if not keys:
            raise KeyError(f"parameter {name} not in checkpoint {self.path}")
        saved = self.saved_name[name]
        pp = keys[0][1]
        keys = sorted(k for k in keys if k[1] == pp)  # one stage's TP shards, by tp rank
        spec = ShardSpec.from_dict(self.files[keys[0]]["specs"][saved]["shard"])
        if state_key is None:
            shards = [self.files[k]["model"][saved] for k in keys]
        else:
            shards = [self.files[k]["optimizer"][saved][state_key] for k in keys]
        return full_from_shards(shards, spec)

    def parameters(self) -> dict[str, dict]:
        """``name -> {shape (global), dtype}``."""
        out = {}
        for name, keys in self.owner.items():
            sd = self.files[keys[0]]
            saved = self.saved_name[name]
            out[name] = {"shape": list(sd["specs"][saved]["full_shape"]),
                         "dtype": sd["model"][saved].dtype}
        return out

    def load(self, names: Iterable[str], optim_names: Iterable[str] = (),
             rng_rank: Optional[int] = None) -> tuple[dict, dict, Optional[dict]]:
        """(full weights by name, Adam states by name: full tensors for parameter-shaped
        states, the saved value otherwise, the generators of ``rng_rank`` or None)."""
        model = {n: self._full(n) for n in names}
        optim = {}
        for name in optim_names:
            key = self.owner[name][0]
            shard_shape = self.files[key]["model"][self.saved_name[name]].shape
            saved = self.files[key]["optimizer"].get(self.saved_name[name], {})
            optim[name] = {k: self._full(name, k) if torch.is_tensor(v) and v.ndim > 0
                           and v.shape == shard_shape else v for k, v in saved.items()}
        rng = None
        path = os.path.join(self.path, f"rng_{rng_rank:05d}.pt") if rng_rank is not None else ""
        if path and os.path.exists(path):
            rng = torch.load(path, weights_only=False)
        return model, optim, rng

    def has_optimizer_state(self, name: str) -> bool:
        return bool(self.owner.get(name)) and bool(
            self.files[self.owner[name][0]]["optimizer"].get(self.saved_name[name]))
