"""MoE upcycling: a dense checkpoint made into this MoE model's initial weights
(``--moe-use-upcycling``, ``--moe-upcycling-granularity G``; Megatron-Core's
``moe/upcycling_utils.py``; Komatsuzaki et al. 2023, "Sparse Upcycling"; He et al. 2024,
"Upcycling Large Language Models into Mixture of Experts", arXiv 2410.07524).

Every tensor the two models share by name (embeddings, attention, norms, dense layers' MLPs,
the output layer) is copied. In each MoE layer, with E experts, top-k routing, the dense MLP
``f_d = G f`` wide (f: the expert width) and ``r = E / G`` copies of each slice:

* expert e takes slice ``e mod G`` of the dense MLP: the rows ``[j f, (j + 1) f)`` of
  ``linear_fc1`` (of its gate and of its up half apart, with a gated MLP) and of its bias, the
  columns of ``linear_fc2``; ``linear_fc2``'s bias as it is;
* both weights (and ``linear_fc1``'s bias) are scaled by ``c^(1/3)`` (a gated MLP or squared
  ReLU) or ``c^(1/2)`` (otherwise), with ``c = r G^2 / k`` under ``--moe-router-pre-softmax``
  (the top-k weights sum to about ``k / E``) and ``c = G`` otherwise (they sum to 1), so the
  MoE layer starts near the dense one's output; with G = 1 and a normalizing router it is
  exactly the dense MLP;
* the router is this model's own initialization with expert e given row ``e // G`` (the G
  slices of one copy route alike); the shared experts and the expert bias keep theirs.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

from loom.errors import ConfigError

_EXPERT = re.compile(r"^(?P<layer>(?:.*\.)?layers\.\d+\.)mlp\.experts\.(?P<e>\d+)\."
                     r"(?P<what>linear_fc[12]\.(?:weight|bias))$")
_ROUTER = re.compile(r"^(?P<layer>(?:.*\.)?layers\.\d+\.)mlp\.router\.weight$")


def dense_counterpart(cfg, granularity: int):
    """The dense model an MoE ``ModelConfig`` upcycles from: no experts, its MLP
    ``granularity x --ffn-hidden-size`` wide (Megatron-LM's ``setup_model_and_optimizer``)."""
    import dataclasses
    default = {f.name: f.default for f in dataclasses.fields(cfg)}["moe_layer_freq"]
    return dataclasses.replace(cfg, num_experts=None, moe_layer_freq=default,
                               moe_ffn_hidden_size=None,
                               moe_shared_expert_intermediate_size=None,
                               ffn_hidden_size=cfg.ffn_size * granularity)


def weight_scale(cfg, granularity: int) -> float:
    """The factor both expert weights are scaled by (module docstring; Megatron-Core's
    ``_get_weight_scale``)."""
    E, k, G = cfg.num_experts, cfg.moe_router_topk, granularity
    c = (E // G) * G * G / k if cfg.moe_router_pre_softmax else G
    return c ** (1 / 3) if cfg.swiglu or cfg.squared_relu else c ** (1 / 2)


KEPT = ("mlp.shared_experts.", "mlp.shared_expert_gate.", "mlp.router.expert_bias")
"""The MoE model's tensors no dense MLP gives: they keep this model's initialization."""


def upcycle(dense: Mapping[str, torch.Tensor], moe_names, routers: Mapping[str, torch.Tensor],
            cfg, granularity: int) -> dict[str, torch.Tensor]:
    """Full tensors of the MoE model ``cfg`` for the names ``moe_names`` from the dense model's
    full tensors ``dense`` (module docstring), but those of :data:`KEPT`; ``routers``: this
    model's own initialized router weights (full). Raises ConfigError for a tensor neither
    model explains."""
    G, f = granularity, cfg.moe_ffn_size
    scale = weight_scale(cfg, G)
    out: dict[str, torch.Tensor] = {}
    for name in moe_names:
        expert, router = _EXPERT.match(name), _ROUTER.match(name)
        if expert:
            j = int(expert["e"]) % G
            src = dense.get(expert["layer"] + "mlp." + expert["what"])
            if src is None:
                raise ConfigError(f"--moe-use-upcycling: the dense checkpoint has no "
                                  f"{expert['layer']}mlp.{expert['what']} for {name}")
            out[name] = _slice(src, expert["what"], j, f, cfg.swiglu, scale)
        elif router:
            init = routers[name]
            out[name] = init[torch.arange(init.shape[0]) // G].clone()
        elif name in dense:
            out[name] = dense[name]
        elif any(k in name for k in KEPT):
            continue  # as this model initialized it
        else:
            raise ConfigError(f"--moe-use-upcycling: {name} is in neither the dense checkpoint "
                              f"nor the MoE model's own initialization")
    return out


def _slice(src: torch.Tensor, what: str, j: int, f: int, gated: bool,
           scale: float) -> torch.Tensor:
    """Expert slice ``j`` (of width ``f``) of a dense MLP tensor ``what``."""
    if what == "linear_fc2.bias":
        return src.clone()
    if what == "linear_fc2.weight":
        return src[:, j * f:(j + 1) * f] * scale
    if gated:  # [gate; up] rows: slice j of each half
        gate, up = src.chunk(2, dim=0)
        return torch.cat([gate[j * f:(j + 1) * f], up[j * f:(j + 1) * f]]) * scale
    return src[j * f:(j + 1) * f] * scale
