"""Mixture-of-experts fields of :class:`~loom.config.sections.ModelConfig` (Megatron's
``--moe-*`` flags and ``--num-experts``; Switch, Mixtral, DeepSeek-V3, Qwen2-MoE)."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Literal, Optional

from loom.config.fields import opt
from loom.errors import ConfigError

RouterScore = Literal["softmax", "sigmoid", "sqrtsoftplus"]
LoadBalancing = Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"]
RouterDtype = Literal["fp32", "fp64"]
Dispatcher = Literal["allgather", "alltoall", "flex"]


def _pattern_value(node: ast.AST):
    """Evaluate one node of a ``--moe-layer-freq`` list expression: int literals, lists of them,
    ``+`` of lists and ``*`` of a list by an int; anything else is refused (no eval)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        return [_pattern_value(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern_value(node.left), _pattern_value(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
        if isinstance(node.op, ast.Mult) and isinstance(left, list) and type(right) is int:
            return left * right
        if isinstance(node.op, ast.Mult) and type(left) is int and isinstance(right, list):
            return right * left
    raise ValueError(ast.dump(node)[:60])


def parse_moe_layer_freq(value, num_layers: int, flag: str = "--moe-layer-freq") -> list[int]:
    """``--moe-layer-freq`` (Megatron's ``moe_freq_type``) as one 0/1 per layer (1 = MoE): an
    int N (layer i is MoE when i % N == 0), or a list expression such as ``"[1,0,1]"`` or
    ``"([0]*3+[1]*58)"`` of length ``num_layers``, parsed with :mod:`ast` (int literals, lists,
    ``+`` and ``*`` only). Raises ConfigError naming the flag (``flag``: another flag of this
    form, e.g. ``--linear-attention-freq``)."""
    text = str(value).strip()
    if "[" not in text:
        try:
            n = int(text)
        except ValueError:
            raise ConfigError(f"{flag} {text!r}: give an int N >= 1 or a list such as "
                              f"'([0]*3+[1]*{max(num_layers - 3, 1)})'") from None
        if n < 1:
            raise ConfigError(f"{flag} must be >= 1, got {n}")
        return [int(i % n == 0) for i in range(num_layers)]
    try:
        pattern = _pattern_value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError, RecursionError):
        pattern = None
    if not isinstance(pattern, list) or any(v not in (0, 1) or type(v) is not int
                                            for v in pattern):
        raise ConfigError(f"{flag} {text!r}: a list expression of 0s and 1s (lists, "
                          f"+ and * by an int), e.g. '([0]*3+[1]*{max(num_layers - 3, 1)})'")
    if len(pattern) != num_layers:
        raise ConfigError(f"{flag} {text!r} has {len(pattern)} entries; "
                          f"--num-layers is {num_layers}: give one 0/1 per layer")
    return pattern


@dataclass
class MoEFields:
    """The MoE flags (dense MLPs without ``--num-experts``); a mixin of ModelConfig."""

    # -- mixture of experts (Megatron's --moe-* flags; Switch, Mixtral, DeepSeek-V3) ----------
    num_experts: Optional[int] = opt(None, "E: experts per MoE layer (default: dense MLPs)", ge=1)
    moe_router_topk: int = opt(2, "k: experts each token is routed to", ge=1)
    moe_ffn_hidden_size: Optional[int] = opt(None, "hidden size of each expert's MLP (default: "
                                                   "--ffn-hidden-size)", ge=1)
    moe_shared_expert_intermediate_size: Optional[int] = opt(
        None, "hidden size of an always-on shared expert (DeepSeek, Qwen; default: none)", ge=1)
    moe_layer_freq: str = opt("1", "which layers are MoE: an int N (layer i when i % N == 0) "
                                   "or a list expression of 0/1 per layer, e.g. "
                                   "'([0]*3+[1]*58)' (Megatron's; parsed, never eval'd)")
    moe_router_score_function: RouterScore = opt(
        "softmax", "router scores: softmax (Mixtral), or sigmoid (DeepSeek-V3) or sqrtsoftplus "
                   "(sqrt(softplus(x))) with normalized top-k weights")
    moe_router_pre_softmax: bool = opt(False, "softmax over all experts, top-k weights not "
                                              "renormalized (Qwen2-MoE)")
    moe_aux_loss_coeff: float = opt(0.0, "coefficient of the Switch/GShard load-balancing loss",
                                    ge=0)
    moe_z_loss_coeff: float = opt(0.0, "coefficient of the router z-loss (ST-MoE)", ge=0)
    moe_expert_capacity_factor: Optional[float] = opt(
        None, "tokens per expert capped at factor x T k / E, the rest dropped (default: "
              "dropless)", gt=0)
    moe_shared_expert_gate: bool = opt(False, "scale the shared expert's output by "
                                              "sigmoid(x w) (Qwen2-MoE)")
    moe_router_load_balancing_type: LoadBalancing = opt(
        "aux_loss", "load balancing: the loss aux_loss (per micro-batch), seq_aux_loss (per "
                    "sequence, DeepSeek-V3) or global_aux_loss (load over all DP ranks and the "
                    "step's micro-batches); sinkhorn (S-BASE: experts from the Sinkhorn-"
                    "balanced assignment in training, weights sigmoid (k = 1) or softmax, no "
                    "aux loss); or none")
    moe_router_enable_expert_bias: bool = opt(
        False, "aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the sigmoid "
               "scores for the top-k choice, updated after each step from the global load; "
               "with softmax scores added to the probabilities (torchtitan's router; "
               "Megatron-LM refuses softmax with the bias)")
    moe_router_bias_update_rate: float = opt(1e-3, "step of the expert bias update: b += rate "
                                                   "* sign(mean load - load)", ge=0)
    moe_router_num_groups: Optional[int] = opt(
        None, "group-limited routing: experts split into this many groups (e.g. the EP size "
              "or node count)", ge=1)
    moe_router_group_topk: Optional[int] = opt(
        None, "group-limited routing: groups each token may use", ge=1)
    moe_router_topk_scaling_factor: Optional[float] = opt(
        None, "multiply the top-k combine weights by this factor (DeepSeek-V3: 2.5)", gt=0)
    moe_router_dtype: Optional[RouterDtype] = opt(
        None, "router logits, scores and weights in fp32 or fp64 (default: fp32 in loom)")
    moe_token_dispatcher_type: Dispatcher = opt(
        "allgather", "expert-parallel dispatch: allgather (gather every EP rank's tokens, run "
                     "the local experts, reduce-scatter back) or alltoall (send each token "
                     "only where its experts live; flex, Megatron's DeepEP/HybridEP kernels, runs "
                     "as alltoall here); same numbers")
    moe_grouped_gemm: bool = opt(False, "run the local experts as one grouped GEMM "
                                        "(torch grouped_mm; per-expert loop fallback, logged)")
    moe_shared_expert_overlap: bool = opt(
        False, "compute the shared expert while the dispatch all-to-all is in flight "
               "(alltoall dispatcher)")
    moe_router_force_load_balancing: bool = opt(
        False, "benchmarks only: random router logits (straight-through gradient), so the "
               "experts get a balanced load whatever the weights")
    moe_router_force_biased: Optional[float] = opt(
        None, "benchmarks only: random router logits plus a per-expert N(0, |std|^2) bias "
              "shared by every rank, drawn each forward (std > 0) or once per layer (std < 0)")
    moe_input_jitter_eps: Optional[float] = opt(
        None, "multiply the router's input by uniform noise in [1 - eps, 1 + eps] (Switch "
              "Transformer's jitter; the experts see the plain input)", gt=0)
    moe_apply_probs_on_input: bool = opt(
        False, "scale each token's expert input by its router probability instead of the "
               "expert output (top-1 routing only)")
    moe_latent_size: Optional[int] = opt(
        None, "latent MoE (Nemotron-3): the routed experts work in this width, between a "
              "down projection of the tokens and an up projection of their combined output "
              "(router and shared expert see the full hidden state)", ge=1)
    qk_layernorm: bool = opt(False, "normalize each attention head's query and key "
                                    "(--normalization kind, per head dim; Qwen3, OLMo 2)")

    @property
    def moe_ffn_size(self) -> int:
        """Expert MLP hidden size: ``--moe-ffn-hidden-size`` or the dense one."""
        return self.moe_ffn_hidden_size or self.ffn_size

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether global layer ``layer_number`` (0-based) has an MoE instead of a dense MLP."""
        if not self.num_experts:
            return False
        text = str(self.moe_layer_freq).strip()
        if text.isdigit() and int(text) > 0:  # the common case, without building the list
            return layer_number % int(text) == 0
        return bool(parse_moe_layer_freq(text, self.num_layers)[layer_number])

    def _check_sinkhorn(self) -> None:
        """Megatron's sinkhorn routing takes no aux loss (it asserts the coefficient is 0) and
        picks its own scores (sigmoid for k = 1, softmax otherwise): the router options it
        would silently ignore are refused."""
        if self.moe_aux_loss_coeff:
            raise ConfigError("--moe-router-load-balancing-type sinkhorn balances the load "
                              "itself and takes no auxiliary loss (Megatron asserts "
                              "--moe-aux-loss-coeff 0): drop --moe-aux-loss-coeff")
        ignored = [f for f, on in (
            (f"--moe-router-score-function {self.moe_router_score_function}",
             self.moe_router_score_function != "softmax"),
            ("--moe-router-pre-softmax", self.moe_router_pre_softmax),
            ("--moe-router-enable-expert-bias", self.moe_router_enable_expert_bias),
            ("--moe-router-num-groups", self.moe_router_num_groups is not None),
            ("--moe-router-topk-scaling-factor", self.moe_router_topk_scaling_factor))
            if on]
        if ignored:
            raise ConfigError(f"{ignored[0]}: sinkhorn routing (--moe-router-load-balancing-"
                              f"type sinkhorn) chooses by the balanced assignment and weighs by "
                              f"sigmoid (top-1) or softmax scores, without it (Megatron ignores "
                              f"it): drop {ignored[0].split()[0]}")

    def check_moe_fields(self, tensor_parallel: int, zero3: bool = False) -> None:
        """The router / dispatcher flags' own rules (Megatron's TransformerConfig checks).
        Raises ConfigError naming the flag and a fix."""
        parse_moe_layer_freq(self.moe_layer_freq, self.num_layers)
        E, k = self.num_experts, self.moe_router_topk
        G, g = self.moe_router_num_groups, self.moe_router_group_topk
        if (G is None) != (g is None):
            raise ConfigError("group-limited routing needs both --moe-router-num-groups and "
                              "--moe-router-group-topk")
        if G is not None:
            if E % G or g > G or g > k or g * (E // G) < k:
                raise ConfigError(
                    f"--moe-router-num-groups {G} must divide --num-experts {E}, and "
                    f"--moe-router-group-topk {g} must be <= {G} and <= --moe-router-topk {k}, "
                    f"its groups holding >= k experts: e.g. --moe-router-num-groups "
                    f"{next(n for n in range(E, 0, -1) if E % n == 0 and n <= max(1, E // k))} "
                    f"--moe-router-group-topk 1")
        if self.moe_shared_expert_overlap and (self.moe_token_dispatcher_type == "allgather" or
                                               not self.moe_shared_expert_intermediate_size):
            raise ConfigError("--moe-shared-expert-overlap needs --moe-token-dispatcher-type "
                              "alltoall and --moe-shared-expert-intermediate-size")
        if self.moe_router_load_balancing_type == "sinkhorn":
            self._check_sinkhorn()
        if self.moe_apply_probs_on_input and k != 1:
            raise ConfigError(f"--moe-apply-probs-on-input works with top-1 routing only "
                              f"(Megatron asserts it): set --moe-router-topk 1, not {k}")
        if self.moe_latent_size and self.moe_shared_expert_overlap:
            raise ConfigError("--moe-latent-size with --moe-shared-expert-overlap: Megatron "
                              "refuses the overlap with latent projections; drop "
                              "--moe-shared-expert-overlap")
