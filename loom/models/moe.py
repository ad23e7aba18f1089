"""Mixture-of-experts layer as plain math (Shazeer et al. 2017; Switch, Fedus et al. 2021;
Mixtral; DeepSeek-V3 for sigmoid routing and shared experts).

``x [s, b, h]`` -> tokens ``[T, h]`` (T = s b) -> router logits ``[T, E]`` (fp32) -> top-k
experts per token with weights -> each expert (a GeLU, SwiGLU, gated or squared-ReLU MLP) on
its tokens -> the
weighted sum over the k choices, plus an always-on shared expert. Dropless by default; with
``--moe-expert-capacity-factor`` f each expert keeps at most ``ceil(f T k / E)`` tokens (those
with the highest router score) and the rest are dropped. ``--moe-latent-size L`` runs the routed
experts on ``[T, L]`` projections of the tokens, ``--moe-apply-probs-on-input`` (top-1) scales
their input by the router probability instead of their output (:class:`MoELayer`).

Auxiliary losses: the load-balancing loss ``aux = coeff * E * sum_i f_i P_i`` (``f_i``: share of
the T k assignments routed to expert i, ``P_i``: mean routing probability of expert i; Switch
eq. 4 / GShard with top-k) and the z-loss ``coeff * mean_t logsumexp(logits_t)^2`` (ST-MoE
eq. 5). They reach the gradient through :class:`AuxLossScaler` (identity on the layer's output,
injecting ``d aux = scale`` in backward) and are reported in ``MoEContext.metrics``; with
``--moe-per-layer-logging`` each layer also sums them over the step's training micro-batches
(:func:`enable_layer_loss_log`, read by :func:`loom.parallel.expert.moe_layer_losses`).

Where the experts run is a strategy: :class:`LocalDispatcher` runs every expert here; the
parallel plan swaps in an expert-parallel one (all-to-all over EP) and tensor-parallel
regions, and removes the experts this rank does not hold (experts live in a ``ModuleDict``
keyed by their global index, so names never change).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from loom.models.activation import expert_activation, swiglu as _swiglu
from loom.models.moe_router import Routing, TopKRouter, route  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)


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


class AddBias(torch.autograd.Function):
    """``x + bias`` where ``include`` (else ``x``); backward gives ``bias`` the full gradient
    either way. A TP-sharded row-parallel output is a partial sum whose reduction comes later:
    only one TP rank adds the bias, yet every rank's bias gets the gradient of the reduced
    output (Megatron's RowParallelLinear adds it after its all-reduce). ``bias`` is ``[h]`` or
    ``[n, h]`` (per row)."""

    @staticmethod
    def forward(ctx, x, bias, include: bool):
        ctx.per_row = bias.dim() == x.dim()
        return x + bias.to(x.dtype) if include else x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, (grad if ctx.per_row else grad.reshape(-1, grad.shape[-1]).sum(0)), None


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (the grouped GEMM's backward
    refuses expanded / strided ones)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def activate(y: torch.Tensor, swiglu: bool, act=None) -> torch.Tensor:
    """GeLU, or SwiGLU ``silu(gate) * up`` of ``[gate; up]`` along the last dimension, or
    ``act(y)`` when given (:func:`loom.models.activation.gated_activation`)."""
    if act is not None:
        return act(y)
    if swiglu:
        return _swiglu(y)  # saves y only: silu(gate) is recomputed in backward
    return F.gelu(y)


class ExpertMLP(nn.Module):
    """One expert: ``[n, h] -> [n, h]`` through ``f`` features, GeLU, SwiGLU or ``act`` (a gated
    activation, or ``--squared-relu``: :func:`~loom.models.activation.expert_activation`;
    FC1 is ``2f`` wide when ``swiglu``, the gate). ``add_fc2_bias``:
    whether this rank's (partial, TP-sharded) output carries FC2's bias (:class:`AddBias`)."""

    def __init__(self, h: int, f: int, swiglu: bool, bias: bool, act=None):
        super().__init__()
        self.swiglu, self.act = swiglu, act  # swiglu: FC1 is gated; act: its activation
        self.add_fc2_bias = True
        self.linear_fc1 = nn.Linear(h, 2 * f if swiglu else f, bias=bias)
        self.linear_fc2 = nn.Linear(f, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = activate(self.linear_fc1(x), self.swiglu, self.act)
        out = F.linear(y, self.linear_fc2.weight)
        if self.linear_fc2.bias is not None:
            out = AddBias.apply(out, self.linear_fc2.bias, self.add_fc2_bias)
        return out


def run_experts(tokens: torch.Tensor, expert_ids: torch.Tensor, experts: nn.ModuleDict,
                first_expert: int = 0) -> torch.Tensor:
    """``tokens [n, h]`` sorted by ``expert_ids [n]`` (global ids, ascending) through their
    experts (``experts[str(id)]``), one GEMM pair per expert; returns ``[n, h]`` in the same
    order."""
    counts = torch.bincount(expert_ids - first_expert, minlength=len(experts)).tolist()
    outs = [experts[str(first_expert + i)](chunk)
            for i, chunk in enumerate(tokens.split(counts)) if counts[i] > 0]
    return torch.cat(outs) if outs else tokens[:0] * 0


def grouped_gemm_supported(tokens: torch.Tensor, mlps: list) -> Optional[str]:
    """None when ``torch.nn.functional.grouped_mm`` can run these experts on ``tokens``, else
    why not (no such function in this torch, a dtype it lacks, rows not 16-byte aligned)."""
    if not hasattr(F, "grouped_mm"):
        return "torch.nn.functional.grouped_mm is missing in this torch build"
    if tokens.dtype not in (torch.float32, torch.bfloat16):
        return f"grouped_mm does not take {tokens.dtype}"
    dims = [tokens.shape[-1]] + [d for m in mlps for d in m.linear_fc1.weight.shape[:1]] \
        + [m.linear_fc2.weight.shape[1] for m in mlps]
    if any((d * tokens.element_size()) % 16 for d in dims):
        return f"feature sizes {sorted(set(dims))} are not 16-byte aligned for {tokens.dtype}"
    return None


def run_experts_grouped(tokens: torch.Tensor, expert_ids: torch.Tensor, experts: nn.ModuleDict,
                        first_expert: int = 0) -> torch.Tensor:
    """:func:`run_experts` as two grouped GEMMs over all local experts
    (``torch.nn.functional.grouped_mm`` on the stacked weights ``[G, out, in]``, row offsets
    from the per-expert counts; ``--moe-grouped-gemm``). Where grouped_mm cannot run (see
    :func:`grouped_gemm_supported`, or it raises for this device / dtype) it falls back to the
    per-expert loop, logging the reason once per layer ("grouped GEMM fallback: per-expert
    loop")."""
    mlps = [experts[str(first_expert + i)] for i in range(len(experts))]
    why = grouped_gemm_supported(tokens, mlps) if tokens.shape[0] else "no tokens"
    if why is None:
        try:
            return _grouped(tokens, expert_ids - first_expert, mlps)
        except RuntimeError as e:  # e.g. a CUDA build whose grouped_mm lacks this dtype
            why = f"grouped_mm raised {str(e).splitlines()[0][:120]}"
    if why != "no tokens" and not getattr(experts, "_grouped_fallback_logged", False):
        log.warning("grouped GEMM fallback: per-expert loop (%s)", why)
        experts._grouped_fallback_logged = True
    return run_experts(tokens, expert_ids, experts, first_expert)


def _grouped(tokens: torch.Tensor, local: torch.Tensor, mlps: list) -> torch.Tensor:
    offs = torch.cumsum(torch.bincount(local, minlength=len(mlps)), 0).to(torch.int32)
    fc1, fc2 = [m.linear_fc1 for m in mlps], [m.linear_fc2 for m in mlps]
    w1 = torch.stack([l.weight for l in fc1]).to(tokens.dtype)
    y = F.grouped_mm(tokens, w1.transpose(-2, -1), offs=offs)
    if fc1[0].bias is not None:
        y = y + torch.stack([l.bias for l in fc1]).to(y.dtype)[local]
    y = activate(_ContiguousGrad.apply(y), mlps[0].swiglu, mlps[0].act)
    w2 = torch.stack([l.weight for l in fc2]).to(tokens.dtype)
    out = _ContiguousGrad.apply(F.grouped_mm(y.contiguous(), w2.transpose(-2, -1), offs=offs))
    if fc2[0].bias is not None:
        out = AddBias.apply(out, torch.stack([l.bias for l in fc2])[local], mlps[0].add_fc2_bias)
    return out


class LocalDispatcher(nn.Module):
    """Every expert on this rank: permute the kept (token, choice) pairs by expert, run the
    experts (``run_experts``: :func:`run_experts` or :func:`run_experts_grouped`), return their
    outputs ``[T, k, w]`` (zeros where dropped; ``w`` the routed tokens' width: h, or the
    latent size) and the shared expert's ``[T, h]`` on ``shared_tokens`` (default: ``tokens``;
    or None)."""

    def __init__(self, run_experts=run_experts):
        super().__init__()
        self.run_experts = run_experts

    def forward(self, tokens, routing: Routing, experts: nn.ModuleDict,
                shared: Optional[nn.Module] = None, shared_tokens=None):
        T, k = routing.experts.shape
        flat = routing.experts.reshape(-1)
        pairs = routing.kept.reshape(-1).nonzero().squeeze(-1)
        pairs = pairs[torch.argsort(flat[pairs], stable=True)]
        out = self.run_experts(tokens[pairs // k], flat[pairs], experts)
        full = tokens.new_zeros(T * k, tokens.shape[-1]).index_copy(0, pairs, out)
        shared_in = tokens if shared_tokens is None else shared_tokens
        return full.view(T, k, -1), (shared(shared_in) if shared is not None else None)


LAYER_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                    "global_aux_loss": "global_load_balancing_loss"}
"""Megatron's per-layer metric name of each load-balancing loss type (its router's
``attach_and_log_load_balancing_loss``); the z-loss is ``z_loss``."""


def layer_loss_names(cfg) -> tuple[str, ...]:
    """The per-layer losses Megatron's training log tracks for a model config: the
    load-balancing loss of ``--moe-router-load-balancing-type`` (none for sinkhorn / none),
    and ``z_loss`` with a z-loss coefficient."""
    names = [LAYER_LOSS_NAMES[cfg.moe_router_load_balancing_type]] \
        if cfg.moe_router_load_balancing_type in LAYER_LOSS_NAMES else []
    return tuple(names + (["z_loss"] if cfg.moe_z_loss_coeff else []))


def enable_layer_loss_log(model_chunks) -> list:
    """Make every MoE layer of these chunks sum its losses per step (``loss_log``, read and
    reset by :func:`loom.parallel.expert.moe_layer_losses`); returns the layers."""
    layers = [m for c in model_chunks for m in c.modules() if isinstance(m, MoELayer)]
    for m in layers:
        m.loss_log = {}
    return layers


class MoELayer(nn.Module):
    """``x [s, b, h] -> [s, b, h]``: router (:class:`~loom.models.moe_router.TopKRouter`), top-k
    experts, weighted combine, shared expert.

    ``--moe-latent-size L`` (latent MoE, Nemotron-3; Megatron-Core's ``MoELayer`` with
    ``moe_latent_size``): the routed tokens are first projected down, ``fc1_latent_proj``
    ``[T, h] -> [T, L]``, the experts map ``L -> L`` and their combined output is projected
    back up, ``fc2_latent_proj`` ``[T, L] -> [T, h]`` (both with the linear biases unless
    ``--disable-bias-linear``; replicated over TP, like the router). The router and the shared
    expert read the un-projected ``[T, h]`` tokens. ``--moe-apply-probs-on-input`` (top-1): the
    router probability scales the expert's input (``p x``, cast back to the input's dtype)
    and the expert outputs are summed unweighted (Megatron-Core's experts with
    ``moe_apply_probs_on_input``: the probabilities become ones)."""

    def __init__(self, cfg, layer_number: int):
        super().__init__()
        h, E = cfg.hidden_size, cfg.num_experts
        bias = not cfg.disable_bias_linear
        self.layer_number, self.cfg = layer_number, cfg
        self.router = TopKRouter(cfg)
        latent = cfg.moe_latent_size
        self.fc1_latent_proj = nn.Linear(h, latent, bias=bias) if latent else None
        self.fc2_latent_proj = nn.Linear(latent, h, bias=bias) if latent else None
        gated, act = cfg.gated_linear_unit, expert_activation(cfg)
        w = latent or h  # the width the routed experts see
        self.experts = nn.ModuleDict({str(i): ExpertMLP(w, cfg.moe_ffn_size, gated, bias, act)
                                      for i in range(E)})
        self.shared_experts = None
        if cfg.moe_shared_expert_intermediate_size:
            self.shared_experts = ExpertMLP(h, cfg.moe_shared_expert_intermediate_size,
                                            gated, bias, act)
        self.shared_expert_gate = None
        if self.shared_experts is not None and cfg.moe_shared_expert_gate:
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        self.dispatcher = LocalDispatcher(run_experts_grouped if cfg.moe_grouped_gemm
                                          else run_experts)
        self.aux_scale = 1.0  # the aux loss's gradient multiplier (c under context parallelism)
        self.loss_log: Optional[dict] = None  # {name: sum over the step}: enable_layer_loss_log

    def forward(self, x: torch.Tensor, moe: Optional[MoEContext] = None) -> torch.Tensor:
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        routing = self.router(tokens, (s, b))
        routed = tokens if self.fc1_latent_proj is None else self.fc1_latent_proj(tokens)
        if self.cfg.moe_apply_probs_on_input:  # top-1: one probability per token
            routed = (routing.weights[:, :1] * routed).to(routed.dtype)
        expert_out, shared_out = self.dispatcher(routed, routing, self.experts,
                                                 self.shared_experts, tokens)
        if self.cfg.moe_apply_probs_on_input:
            y = expert_out.sum(1)
        else:
            y = (expert_out * routing.weights.unsqueeze(-1).to(expert_out.dtype)).sum(1)
        if self.fc2_latent_proj is not None:
            y = self.fc2_latent_proj(y)
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
            moe.metrics[f"moe aux loss/{n}"] = routing.aux_loss.detach().float()
            moe.metrics[f"moe z loss/{n}"] = routing.z_loss.detach().float()
            moe.metrics[f"moe load/{n}"] = routing.counts.detach()
            moe.metrics[f"moe dropped/{n}"] = (~routing.kept).sum().detach()
            if self.loss_log is not None and self.router._counting():
                self._log_losses(routing, moe.scale)
        return y

    def _log_losses(self, routing: Routing, scale: float) -> None:
        """Add this training micro-batch's losses without their coefficients, times ``scale``
        (1/m: the step's mean), under Megatron's names (the value it records); 0 for a
        tracked loss whose coefficient is 0 (Megatron logs its zeros)."""
        c = self.cfg
        for name in layer_loss_names(c):
            loss, coeff = ((routing.z_loss, c.moe_z_loss_coeff) if name == "z_loss"
                           else (routing.aux_loss, c.moe_aux_loss_coeff))
            value = loss.detach().float() / coeff * scale if coeff else loss.new_zeros(())
            self.loss_log[name] = self.loss_log.get(name, 0.0) + value
