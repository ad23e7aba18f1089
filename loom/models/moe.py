"""Mixture-of-experts layer as plain math (Shazeer et al. 2017; Switch, Fedus et al. 2021;
Mixtral; DeepSeek-V3 for sigmoid routing and shared experts).

``x [s, b, h]`` -> tokens ``[T, h]`` (T = s b) -> router logits ``[T, E]`` (fp32) -> top-k
experts per token with weights -> each expert (a GeLU or SwiGLU MLP) on its tokens -> the
weighted sum over the k choices, plus an always-on shared expert. Dropless by default; with
``--moe-expert-capacity-factor`` f each expert keeps at most ``ceil(f T k / E)`` tokens (those
with the highest router score) and the rest are dropped.

Auxiliary losses: the load-balancing loss ``aux = coeff * E * sum_i f_i P_i`` (``f_i``: share of
the T k assignments routed to expert i, ``P_i``: mean routing probability of expert i; Switch
eq. 4 / GShard with top-k) and the z-loss ``coeff * mean_t logsumexp(logits_t)^2`` (ST-MoE
eq. 5). They reach the gradient through :class:`AuxLossScaler` (identity on the layer's output,
injecting ``d aux = scale`` in backward) and are reported in ``MoEContext.metrics``.

Where the experts run is a strategy: :class:`LocalDispatcher` runs every expert here; the
parallel plan swaps in an expert-parallel one (all-to-all over EP) and tensor-parallel
regions, and removes the experts this rank does not hold (experts live in a ``ModuleDict``
keyed by their global index, so names never change).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class MoEContext:
    """Per-forward context: ``scale`` of the auxiliary losses' gradient (1/m: they are averaged
    over the m micro-batches like the LM loss) and ``metrics`` (filled by the MoE layers)."""

    scale: float = 1.0
    metrics: dict = field(default_factory=dict)


class AuxLossScaler(torch.autograd.Function):
    """Identity on ``output``; backward also sends ``scale`` into ``aux_loss`` (Megatron's
    ``MoEAuxLossAutoScaler``), so auxiliary losses train without travelling to the last stage."""

    @staticmethod
    def forward(ctx, output, aux_loss, scale: float):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.ones_like(aux_loss) * ctx.scale, None


@dataclass
class Routing:
    """Top-k routing of T tokens: ``experts [T, k]`` (ids), ``weights [T, k]`` (combine
    weights, 0 where dropped), ``kept [T, k]`` (bool), ``counts [E]`` (kept assignments per
    expert), ``aux_loss`` and ``z_loss`` (scalars, already multiplied by their coefficients)."""

    experts: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor
    counts: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor


def route(logits: torch.Tensor, k: int, score_function: str = "softmax",
          aux_coeff: float = 0.0, z_coeff: float = 0.0,
          capacity_factor: Optional[float] = None, pre_softmax: bool = False,
          stats=None) -> Routing:
    """Route ``logits [T, E]`` (fp32) to the top ``k`` experts.

    softmax: the top-k probabilities renormalized to sum 1 (Megatron's default, = softmax over
    the top-k logits; Mixtral), or with ``pre_softmax`` the softmax over all experts kept as
    is (``--moe-router-pre-softmax``; Qwen2-MoE's ``norm_topk_prob=False``). sigmoid:
    per-expert scores, top-k normalized to sum 1 (DeepSeek-V3). ``stats``: a strategy that
    sums the load-balancing statistics (assignments per expert, probability mass per expert,
    tokens) over the ranks sharing a sequence (context parallelism), or None.
    """
    T, E = logits.shape
    scores = logits.softmax(-1) if score_function == "softmax" else logits.sigmoid()
    top, experts = scores.topk(k, dim=-1)
    renormalize = score_function != "softmax" or not pre_softmax
    weights = top / top.sum(-1, keepdim=True) if renormalize else top
    kept = torch.ones_like(experts, dtype=torch.bool)
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * T * k / E)
        flat_e, flat_w = experts.reshape(-1), top.detach().reshape(-1)
        # rank assignments within each expert by router score (highest first); keep the first C
        order = torch.argsort(flat_w, descending=True, stable=True)
        order = order[torch.argsort(flat_e[order], stable=True)]
        start = torch.cumsum(torch.bincount(flat_e, minlength=E), 0) - torch.bincount(flat_e, minlength=E)
        rank_in_expert = torch.empty_like(order)
        rank_in_expert[order] = torch.arange(order.numel(), device=order.device) - start[flat_e[order]]
        kept = (rank_in_expert < capacity).view(T, k)
        weights = weights * kept
    counts = torch.bincount(experts[kept], minlength=E)
    probs = scores if score_function == "softmax" else scores / scores.sum(-1, keepdim=True)
    routed = torch.bincount(experts.reshape(-1), minlength=E).to(probs.dtype)
    prob_mass, tokens = probs.sum(0), torch.tensor(float(T), device=logits.device)
    if stats is not None:
        routed, prob_mass, tokens = stats(routed, prob_mass, tokens)
    aux = aux_coeff * E * (routed / (tokens * k) * prob_mass / tokens).sum()
    z = z_coeff * torch.logsumexp(logits, dim=-1).pow(2).mean()
    return Routing(experts, weights, kept, counts, aux, z)


class ExpertMLP(nn.Module):
    """One expert: ``[n, h] -> [n, h]`` through ``f`` features, GeLU or SwiGLU."""

    def __init__(self, h: int, f: int, swiglu: bool, bias: bool):
        super().__init__()
        self.swiglu = swiglu
        self.linear_fc1 = nn.Linear(h, 2 * f if swiglu else f, bias=bias)
        self.linear_fc2 = nn.Linear(f, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_fc1(x)
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        else:
            y = F.gelu(y)
        return self.linear_fc2(y)


def run_experts(tokens: torch.Tensor, expert_ids: torch.Tensor, experts: nn.ModuleDict,
                first_expert: int = 0) -> torch.Tensor:
    """``tokens [n, h]`` sorted by ``expert_ids [n]`` (global ids, ascending) through their
    experts (``experts[str(id)]``); returns ``[n, h]`` in the same order."""
    counts = torch.bincount(expert_ids - first_expert, minlength=len(experts)).tolist()
    outs = [experts[str(first_expert + i)](chunk)
            for i, chunk in enumerate(tokens.split(counts)) if counts[i] > 0]
    return torch.cat(outs) if outs else tokens[:0] * 0


class LocalDispatcher(nn.Module):
    """Every expert on this rank: permute the kept (token, choice) pairs by expert, run the
    experts, return their outputs ``[T, k, h]`` (zeros where dropped) and the shared expert's
    ``[T, h]`` (or None)."""

    def forward(self, tokens, routing: Routing, experts: nn.ModuleDict,
                shared: Optional[nn.Module] = None):
        T, k = routing.experts.shape
        flat = routing.experts.reshape(-1)
        pairs = routing.kept.reshape(-1).nonzero().squeeze(-1)
        pairs = pairs[torch.argsort(flat[pairs], stable=True)]
        out = run_experts(tokens[pairs // k], flat[pairs], experts)
        full = tokens.new_zeros(T * k, tokens.shape[-1]).index_copy(0, pairs, out)
        return full.view(T, k, -1), (shared(tokens) if shared is not None else None)


class MoELayer(nn.Module):
    """``x [s, b, h] -> [s, b, h]``: router, top-k experts, weighted combine, shared expert."""

    def __init__(self, cfg, layer_number: int):
        super().__init__()
        h, E = cfg.hidden_size, cfg.num_experts
        bias = not cfg.disable_bias_linear
        self.layer_number, self.cfg = layer_number, cfg
        self.router = nn.Linear(h, E, bias=False)
        self.experts = nn.ModuleDict({str(i): ExpertMLP(h, cfg.moe_ffn_size, cfg.swiglu, bias)
                                      for i in range(E)})
        self.shared_experts = None
        if cfg.moe_shared_expert_intermediate_size:
            self.shared_experts = ExpertMLP(h, cfg.moe_shared_expert_intermediate_size,
                                           cfg.swiglu, bias)
        self.shared_expert_gate = None
        if self.shared_experts is not None and cfg.moe_shared_expert_gate:
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        self.dispatcher = LocalDispatcher()
        self.aux_stats = None  # strategy summing router statistics over CP ranks (the plan's)
        self.aux_scale = 1.0  # the aux loss's gradient multiplier (c under context parallelism)

    def forward(self, x: torch.Tensor, moe: Optional[MoEContext] = None) -> torch.Tensor:
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        c = self.cfg
        logits = F.linear(tokens.float(), self.router.weight.float())  # router in fp32
        routing = route(logits, c.moe_router_topk, c.moe_router_score_function,
                        c.moe_aux_loss_coeff, c.moe_z_loss_coeff, c.moe_expert_capacity_factor,
                        c.moe_router_pre_softmax, self.aux_stats)
        expert_out, shared_out = self.dispatcher(tokens, routing, self.experts, self.shared_experts)
        y = (expert_out * routing.weights.unsqueeze(-1).to(expert_out.dtype)).sum(1)
        if shared_out is not None:
            if self.shared_expert_gate is not None:
                shared_out = torch.sigmoid(self.shared_expert_gate(tokens)) * shared_out
            y = y + shared_out
        y = y.view(s, b, h)
        aux = routing.aux_loss * self.aux_scale + routing.z_loss
        if moe is not None and aux.requires_grad:
            y = AuxLossScaler.apply(y, aux, moe.scale)
        if moe is not None:
            n = self.layer_number
            moe.metrics[f"moe aux loss/{n}"] = routing.aux_loss.detach()
            moe.metrics[f"moe z loss/{n}"] = routing.z_loss.detach()
            moe.metrics[f"moe load/{n}"] = routing.counts.detach()
            moe.metrics[f"moe dropped/{n}"] = (~routing.kept).sum().detach()
        return y
