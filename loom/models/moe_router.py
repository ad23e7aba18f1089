"""The MoE router as plain math: top-k routing (softmax or sigmoid scores, group-limited
selection, the aux-loss-free expert bias, a scaling factor) and the load-balancing losses
(Megatron-Core's ``TopKRouter`` and ``topk_routing_with_score_function``).

Formulas:

* scores: ``softmax(logits)`` or ``sigmoid(logits)`` (DeepSeek-V3 eq. 15); selection by
  ``scores + expert_bias`` when the aux-loss-free bias is on (Wang et al. 2024, "Auxiliary-Loss-
  Free Load Balancing", arXiv 2408.15664, eq. 3; DeepSeek-V3 eq. 16), the combine weights from
  the unbiased scores. Sigmoid weights are normalized over the k choices when k > 1. With
  softmax scores the bias is added to the probabilities over all E (torchtitan's
  ``TokenChoiceTopKRouter``, which loads its DeepSeek and Qwen3-MoE softmax routers so;
  Megatron-Core refuses the bias with softmax).
* group-limited routing (DeepSeek-V2 sec. 2.1.2 device-limited, DeepSeek-V3 node-limited): the
  E experts form G groups; a token keeps the ``group_topk`` groups with the highest sum of
  their top ``k / group_topk`` scores, then picks its k experts inside them.
* load balancing (Switch eq. 4): ``aux = coeff E / (k T^2) sum_i n_i P_i`` with ``n_i`` the
  assignments to expert i and ``P_i`` its summed probability, over the micro-batch
  (``aux_loss``), per sequence and averaged over sequences (``seq_aux_loss``, DeepSeek-V3
  eq. 17-20), or with ``n_i`` summed over every data-parallel rank and averaged over the step's
  micro-batches so far (``global_aux_loss``, Qiu et al. 2025, arXiv 2501.11873; T then counts
  every DP x CP rank's tokens). As in Megatron the loss's assignments are the plain top-k of
  the (normalized) scores, without bias or groups.
* the expert bias update (after the optimizer step, :func:`loom.parallel.expert.
  update_expert_bias`): ``b_i += rate * sign(mean(n) - n_i)`` with ``n`` the step's global load.
* sinkhorn routing (``--moe-router-load-balancing-type sinkhorn``; S-BASE, Clark et al. 2022,
  "Unified Scaling Laws for Routed Language Models", arXiv 2202.01169, sec. 2.2 / app. A.2;
  Megatron-Core's ``TopKRouter.sinkhorn_load_balancing``): in training the experts are the top k
  of the Sinkhorn-Knopp balanced ``exp(logits)`` (:func:`sinkhorn`, no gradient), in evaluation
  the top k of the scores; the combine weights are the scores at the chosen experts, not
  renormalized: ``sigmoid(logits)`` for k = 1, ``softmax(logits)`` over all E for k > 1. No
  auxiliary loss (Megatron asserts its coefficient is 0); the z-loss applies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from loom.parallel.interface import RecomputeReplay

ROUTER_DTYPES = {None: torch.float32, "fp32": torch.float32, "fp64": torch.float64}


@dataclass
class Routing:
    """Top-k routing of T tokens: ``experts [T, k]`` (ids), ``weights [T, k]`` (combine
    weights, 0 where dropped; in the router's dtype), ``kept [T, k]`` (bool), ``counts [E]``
    (kept assignments per expert), ``aux_loss`` and ``z_loss`` (scalars, already multiplied by
    their coefficients)."""

    experts: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor
    counts: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor


def group_limited_topk(scores: torch.Tensor, k: int, num_groups: int,
                       group_topk: int) -> torch.Tensor:
    """Expert ids ``[T, k]`` chosen among each token's ``group_topk`` best of ``num_groups``
    equal groups of experts (group score: the sum of its top ``k // group_topk`` scores);
    ``scores [T, E]``."""
    T, E = scores.shape
    grouped = scores.view(T, num_groups, E // num_groups)
    group_scores = grouped.topk(k // group_topk, dim=-1).values.sum(-1)
    chosen = group_scores.topk(group_topk, dim=-1).indices
    mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
    masked = scores.masked_fill(~mask.repeat_interleave(E // num_groups, dim=1), float("-inf"))
    return masked.topk(k, dim=-1).indices


def _capacity_keep(experts: torch.Tensor, top: torch.Tensor, capacity: int) -> torch.Tensor:
    """``kept [T, k]``: per expert, its ``capacity`` assignments of highest score."""
    T, k = experts.shape
    E = int(experts.max()) + 1 if experts.numel() else 1
    flat_e, flat_w = experts.reshape(-1), top.detach().reshape(-1)
    order = torch.argsort(flat_w, descending=True, stable=True)
    order = order[torch.argsort(flat_e[order], stable=True)]
    per = torch.bincount(flat_e, minlength=E)
    start = torch.cumsum(per, 0) - per
    rank_in_expert = torch.empty_like(order)
    rank_in_expert[order] = torch.arange(order.numel(), device=order.device) - start[flat_e[order]]
    return (rank_in_expert < capacity).view(T, k)


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4, sum_tokens=None) -> torch.Tensor:
    """Sinkhorn-Knopp balancing of ``exp(cost)`` ``[T, E]`` (fp32): per-token scales ``d0 [T]``
    and per-expert scales ``d1 [E]`` are alternately set so that the rows of
    ``d0 exp(cost) d1`` sum to 1/T and its columns to 1/E (``+ 1e-8`` in each denominator),
    until the mean change of ``d1`` is at most ``tol``; returns ``d0 exp(cost) d1`` ``[T, E]``
    (Megatron-Core's ``moe_utils.sinkhorn``: the same updates, order and stopping rule).

    ``sum_tokens(t)``: sums ``t`` over the ranks holding the other tokens of the same
    sequences (context parallelism), so that the column sums and T are the whole
    micro-batch's, as on one rank, and every rank stops at the same iteration; None on one
    rank."""
    k = torch.exp(cost)
    T, E = k.shape
    if sum_tokens is not None:
        T = float(sum_tokens(torch.tensor([float(T)], dtype=k.dtype, device=k.device)))
    eps = 1e-8
    d1 = torch.ones(E, dtype=k.dtype, device=k.device)
    error = float("inf")
    while error > tol:
        d0 = (1 / T) * 1 / (torch.sum(d1 * k, 1) + eps)
        col = torch.sum(d0.unsqueeze(1) * k, 0)
        if sum_tokens is not None:
            col = sum_tokens(col)
        new = (1 / E) * 1 / (col + eps)
        error = torch.mean(torch.abs(d1 - new))
        d1 = new
    return d1 * k * d0.unsqueeze(1)


def sinkhorn_routing(logits: torch.Tensor, k: int, training: bool, sum_tokens=None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(experts [T, k], weights [T, k], scores [T, E])`` of sinkhorn routing (module
    docstring): the experts are the top k of :func:`sinkhorn` of the fp32 logits in training
    (no gradient), of the scores otherwise; the scores are ``sigmoid(logits)`` for k = 1, else
    ``softmax(logits)`` in fp32 cast back to the logits' dtype."""
    if k == 1:
        scores = torch.sigmoid(logits)
    else:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32).to(logits.dtype)
    if training:
        with torch.no_grad():
            experts = sinkhorn(logits.float(), sum_tokens=sum_tokens).topk(k, dim=1).indices
    else:
        experts = scores.topk(k, dim=1).indices
    return experts, scores.gather(1, experts), scores


def route(logits: torch.Tensor, k: int, score_function: str = "softmax",
          aux_coeff: float = 0.0, z_coeff: float = 0.0,
          capacity_factor: Optional[float] = None, pre_softmax: bool = False,
          stats=None, *, expert_bias: Optional[torch.Tensor] = None,
          num_groups: Optional[int] = None, group_topk: Optional[int] = None,
          scaling_factor: Optional[float] = None, balancing: str = "aux_loss",
          seq_batch: Optional[tuple[int, int]] = None, global_load=None,
          training: bool = True) -> Routing:
    """Route ``logits [T, E]`` (fp32 or fp64) to the top ``k`` experts (module docstring).

    softmax: the top-k probabilities renormalized to sum 1 (Megatron's default, = softmax over
    the top-k logits), or with ``pre_softmax`` the softmax over all experts kept as is
    (``--moe-router-pre-softmax``), the choice by the probabilities + ``expert_bias`` when
    given (torchtitan's). sigmoid or sqrtsoftplus (``sqrt(softplus(logits))``):
    per-expert scores (+ ``expert_bias [E]`` for the choice only), top-k normalized to sum 1
    when k > 1; the balancing losses use them normalized over all E. ``balancing``: ``aux_loss``,
    ``seq_aux_loss`` (needs ``seq_batch = (s, b)``, tokens ordered ``[s, b]``),
    ``global_aux_loss`` (needs ``global_load(n [E]) -> (running mean of the global n [E],
    the global token count)``), ``none`` or ``sinkhorn`` (:func:`sinkhorn_routing`, which
    ignores the score function and the options above but the capacity; ``training``: whether
    the experts come from the balanced assignment). ``stats``: a strategy summing the
    statistics over the ranks sharing a sequence (context parallelism), or None.
    """
    T, E = logits.shape
    if balancing == "sinkhorn":
        experts, top, scores = sinkhorn_routing(logits, k, training, getattr(stats, "sum", None))
        weights = top
    else:
        experts, top, weights, scores = _topk(logits, k, score_function, pre_softmax,
                                              expert_bias, num_groups, group_topk)
    if scaling_factor:
        weights = weights * scaling_factor
    kept = torch.ones_like(experts, dtype=torch.bool)
    if capacity_factor is not None:
        kept = _capacity_keep(experts, top, math.ceil(capacity_factor * T * k / E))
        weights = weights * kept
    counts = torch.bincount(experts[kept], minlength=E)
    aux = _balancing_loss(logits, scores, k, score_function, aux_coeff, balancing, stats,
                          seq_batch, global_load)
    z = z_coeff * torch.logsumexp(logits, dim=-1).pow(2).mean()
    return Routing(experts, weights, kept, counts, aux, z)


def _topk(logits, k, score_function, pre_softmax, expert_bias, num_groups, group_topk):
    """``(experts [T, k], their scores [T, k], combine weights [T, k], scores [T, E])`` of
    softmax / sigmoid top-k routing (:func:`route`)."""
    if score_function == "softmax":
        scores = logits.softmax(-1)
        choose = scores if pre_softmax or not group_topk else logits
        if expert_bias is not None:  # torchtitan's router: the bias shifts the probabilities
            choose = scores + expert_bias.to(scores.dtype)
    else:  # per-expert scores: sigmoid, or sqrtsoftplus (Megatron-LM d98e8a6's moe_utils)
        scores = logits.sigmoid() if score_function == "sigmoid" else \
            torch.nn.functional.softplus(logits).sqrt()
        choose = scores if expert_bias is None else scores + expert_bias.to(scores.dtype)
    if group_topk:
        experts = group_limited_topk(choose, k, num_groups, group_topk)
    else:
        experts = choose.topk(k, dim=-1).indices
    top = scores.gather(1, experts)
    if score_function == "softmax":
        weights = top if pre_softmax else top / top.sum(-1, keepdim=True)
    else:
        weights = top / (top.sum(-1, keepdim=True) + 1e-20) if k > 1 else top
    return experts, top, weights, scores


def _balancing_loss(logits, scores, k, score_function, coeff, balancing, stats, seq_batch,
                    global_load) -> torch.Tensor:
    T, E = logits.shape
    zero = logits.new_zeros(())
    if balancing in ("none", "sinkhorn") or coeff == 0:
        return zero
    probs = scores if score_function == "softmax" else scores / (scores.sum(-1, keepdim=True)
                                                                 + 1e-20)
    onehot = F.one_hot(probs.topk(k, dim=-1).indices, E).sum(1).to(probs.dtype)  # [T, E]
    if balancing == "seq_aux_loss":
        s, b = seq_batch
        routed, prob_mass = onehot.view(s, b * E).sum(0), probs.view(s, b * E).sum(0)
        tokens = torch.tensor(float(s), dtype=probs.dtype, device=logits.device)
        if stats is not None:
            routed, prob_mass, tokens = stats(routed, prob_mass, tokens)
        return coeff * E / (k * tokens * tokens) * (routed * prob_mass).sum() / b
    if balancing == "global_aux_loss":
        load, tokens = global_load(onehot.sum(0).detach())
        return coeff * E / (k * tokens * tokens) * (load.to(probs.dtype) * probs.sum(0)).sum()
    routed, prob_mass = onehot.sum(0), probs.sum(0)
    tokens = torch.tensor(float(T), dtype=probs.dtype, device=logits.device)
    if stats is not None:
        routed, prob_mass, tokens = stats(routed, prob_mass, tokens)
    return coeff * E * (routed / (tokens * k) * prob_mass / tokens).sum()


class _RandomLogits(torch.autograd.Function):
    """``--moe-router-force-load-balancing`` (and ``--moe-router-force-biased``, which adds
    :func:`forced_bias`): N(0, 1) logits in place of the router's (from
    torch's default generator), the gradient passed straight through (Megatron's
    ``RandomSTE``; for benchmarks)."""

    @staticmethod
    def forward(ctx, logits):
        return torch.randn_like(logits)

    @staticmethod
    def backward(ctx, grad):
        return grad


def forced_bias(router, E: int, std: float, dtype, device) -> torch.Tensor:
    """``--moe-router-force-biased std``: the per-expert bias ``[E]`` ~ N(0, std^2) added to the
    random logits (Megatron-LM d98e8a6 ``moe_utils.apply_biased_logits``: a fresh draw each
    forward for std > 0; for std < 0 one draw of N(0, |std|^2) per layer, kept on ``router``).
    Drawn from the default generator, which every TP and DP rank of a pipeline stage seeds
    alike (:func:`loom.parallel.random.seed_everything`; Megatron's data-parallel RNG state),
    so all ranks routing the same tokens add the same bias."""
    if std < 0 and router._forced_bias is not None:
        return router._forced_bias
    bias = torch.randn(E, dtype=dtype, device=device) * abs(std)
    if std < 0:
        router._forced_bias = bias
    return bias


def input_jitter(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``--moe-input-jitter-eps``: ``x`` times noise ~ U[1 - eps, 1 + eps) of its shape
    (Switch Transformer, Fedus et al. 2021, sec. 2.4 / app. D; Megatron-Core's
    ``TopKRouter.apply_input_jitter``: the router's input only, every forward), from the
    default generator (the same on the TP ranks, which route the same tokens)."""
    low = torch.tensor(1.0 - eps, dtype=x.dtype, device=x.device)
    high = torch.tensor(1.0 + eps, dtype=x.dtype, device=x.device)
    return x * (low + torch.rand(x.shape, dtype=x.dtype, device=x.device) * (high - low))


class TopKRouter(nn.Module, RecomputeReplay):
    """``tokens [T, h] -> Routing``: the gating linear ``weight [E, h]`` (+ ``bias [E]`` with
    linear biases) in the router dtype
    (``--moe-router-dtype``: fp32, the default, or fp64), then :func:`route` with the
    ``--moe-router-*`` options. With ``--moe-router-enable-expert-bias`` it holds
    ``expert_bias [E]`` (fp32, a parameter without gradient, so checkpoints carry it) and
    counts its kept assignments in ``tokens_per_expert [E]`` during training forwards (not in
    a recomputation or without grad), which :func:`loom.parallel.expert.update_expert_bias`
    turns into the bias update after the optimizer step and resets. ``stats`` (CP) and
    ``global_stats`` (sum over DP x CP, for ``global_aux_loss``) are strategies the parallel
    plan installs; None on one rank. ``global_aux_loss``'s running load is updated once per
    micro-batch: a recomputed forward (activation recomputation) replays the load its first run
    used (:class:`~loom.parallel.interface.RecomputeReplay`), so recomputation changes no
    value. The input is jittered first with ``--moe-input-jitter-eps`` (:func:`input_jitter`);
    the benchmark modes replace the logits by random ones (:class:`_RandomLogits`, plus
    :func:`forced_bias` with ``--moe-router-force-biased``)."""

    def __init__(self, cfg):
        super().__init__()
        E = cfg.num_experts
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size))
        # the gating linear's bias [E] unless --disable-bias-linear (Megatron's TopKRouter
        # with add_bias_linear; gpt-oss)
        self.bias = None if cfg.disable_bias_linear else nn.Parameter(torch.empty(E))
        self.expert_bias = None
        if cfg.moe_router_enable_expert_bias:
            self.expert_bias = nn.Parameter(torch.zeros(E), requires_grad=False)
        self.tokens_per_expert: Optional[torch.Tensor] = None  # this step's load (expert bias)
        self.global_tokens: Optional[torch.Tensor] = None  # running global load (global aux)
        self.global_steps = 0
        self.stats = None
        self.global_stats = None
        self._forced_bias: Optional[torch.Tensor] = None  # --moe-router-force-biased < 0

    def reset_load(self) -> None:
        """Forget this step's counted load (after the bias update)."""
        self.tokens_per_expert = None
        self.global_tokens, self.global_steps = None, 0

    def _counting(self) -> bool:
        # not in eval, not without grad, not in a recomputation (which runs inside backward)
        return (self.training and torch.is_grad_enabled()
                and torch._C._current_graph_task_id() == -1)

    def _global_load(self, local: torch.Tensor):
        return self.replayed(lambda: self._update_global_load(local))

    def _update_global_load(self, local: torch.Tensor):
        n, ranks = local, 1
        if self.global_stats is not None:
            n, ranks = self.global_stats(local)
        if not self._counting():  # evaluation: this micro-batch alone
            return n, float(self.T * ranks)
        self.global_tokens = n if self.global_tokens is None else self.global_tokens + n
        self.global_steps += 1
        return self.global_tokens / self.global_steps, float(self.T * ranks)

    def forward(self, tokens: torch.Tensor, seq_batch: Optional[tuple[int, int]] = None
                ) -> Routing:
        c = self.cfg
        dtype = ROUTER_DTYPES[c.moe_router_dtype]
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias.data = self.expert_bias.data.float()  # kept fp32 under --bf16
        if c.moe_input_jitter_eps is not None:
            tokens = input_jitter(tokens, c.moe_input_jitter_eps)
        logits = F.linear(tokens.to(dtype), self.weight.to(dtype),
                          None if self.bias is None else self.bias.to(dtype))
        if c.moe_router_force_load_balancing or c.moe_router_force_biased is not None:
            logits = _RandomLogits.apply(logits)
        if c.moe_router_force_biased is not None:
            logits = logits + forced_bias(self, logits.shape[-1], c.moe_router_force_biased,
                                          logits.dtype, logits.device)
        self.T = logits.shape[0]
        r = route(logits, c.moe_router_topk, c.moe_router_score_function, c.moe_aux_loss_coeff,
                  c.moe_z_loss_coeff, c.moe_expert_capacity_factor, c.moe_router_pre_softmax,
                  self.stats, expert_bias=self.expert_bias,
                  num_groups=c.moe_router_num_groups, group_topk=c.moe_router_group_topk,
                  scaling_factor=c.moe_router_topk_scaling_factor,
                  balancing=c.moe_router_load_balancing_type, seq_batch=seq_batch,
                  global_load=self._global_load, training=self.training)
        if self.expert_bias is not None and self._counting():
            n = r.counts.detach().float()
            self.tokens_per_expert = n if self.tokens_per_expert is None \
                else self.tokens_per_expert + n
        return r
