"""Mixture-of-experts terms of the planner: parameters (total / active, expert / dense), FLOPs,
activations, expert GEMM time and the expert-parallel all-to-all.

Symbols: E experts of width ``f_e`` (``--moe-ffn-hidden-size``), top-k routing, shared expert of
width ``f_sh`` (0 without one), ``t`` TP, ``u`` expert TP (``--expert-tensor-parallel-size``,
layout key ``etp``; Megatron-Core's default u = t; :func:`expert_tp`), ``e`` the EP size,
``S = s b / c`` tokens per GPU and micro-batch, ``lambda`` the load-imbalance factor
(``Options.moe_load_imbalance``, ``--moe-load-imbalance``, default :data:`MOE_LOAD_IMBALANCE`).

Expert grid (``loom/parallel/mesh.py`` module docstring, Megatron-Core's ``parallel_state``
expert rank generator): the ``n = t c d`` ranks of a pipeline stage re-fold as
``u x e x n/(u e)``, stage rank ``q = etp_rank + u (ep_rank + e edp_rank)``. loom train's rules
(``loom/config/validate.py::_check_moe``): u divides t, ``u e`` divides ``t c d``, e divides E,
u divides ``f_e``. So EP is not only "carved out of DP": with u < t an EP group may hold the
ranks of one TP group (TP2 ETP1 EP2 on 2 GPUs).

Expert TP u < t (``loom/parallel/expert.py`` module docstring, ``expert_dispatch.py``
``ParallelDispatcher._pairs``): every TP rank routes all S tokens, the kept (token, expert)
pairs sorted by expert are split over the ``t/u`` expert-TP groups of the TP group (each rank
owns every ``(t/u)``-th pair), so a rank dispatches and runs a share ``u/t`` of the ``S k``
pairs, each on an expert shard of width ``f_e / u``: the same expert FLOPs per rank
(``S k f_e / t``), on ``u/t`` as many rows of ``t/u`` times the width. The split is local
indexing: loom has no token gather / scatter between the TP and the expert-TP layouts (the
one TP all-reduce after the combine sums every rank's partial pair outputs as for u = t).
The layer structure is that of ``loom/models/moe.py`` / ``loom/parallel/expert.py``:

* parameters of an MoE layer: attention and norms as a dense layer; router ``h E`` (replicated
  across TP, no bias); E experts of ``h mlp_in + f_e h`` (``mlp_in = 2 f_e`` with SwiGLU, biases
  ``mlp_in + h`` when the model has them), each split over ``u x e`` GPUs (their weights,
  gradients and optimizer states; ZeRO shards the latter over the expert-DP group ``t c d /
  (u e)``, :func:`expert_dp`); a shared expert like a dense MLP of width ``f_sh`` (split over
  t), its gate ``h`` (``--moe-shared-expert-gate``).
* FLOPs per token (multiply-add = 2): ``k (6|4) h f_e + (6|4) h f_sh + 2 h E`` instead of the dense
  MLP's ``(6|4) h f`` (6 with SwiGLU): the *active* parameters (Switch sec 2, Mixtral sec 2).
* time: the k S assignments of a GPU's tokens land, on average, on ``S k u / t`` expert rows of
  each EP rank (``lambda S k u / t`` on the busiest), spread over its ``E/e`` experts:
  ``S k e u / (t E)`` tokens per expert GEMM of inner width ``min(h, f_e) / u``, whose
  efficiency falls with that count (:func:`gemm_efficiency`).
* dispatcher (``--moe-token-dispatcher-type``), 4 collectives per MoE layer and micro-batch
  (dispatch and combine forward, their transposes backward; ``docs/moe.md``), the ``a2a`` term
  being their mean. ``alltoall``: each moves the rank's own pairs, ``2 S k h u / t`` bytes
  (bf16), of which ``(e-1)/e`` leave the GPU; EP ranks are ``u`` ranks apart (the expert grid),
  so ``gpus_per_node / u`` of them share a node (:func:`ep_members_per_node`). ``allgather``:
  an all-gather of the EP group's tokens (``2 e S h`` bytes gathered: every rank's whole
  ``[T, h]``, whatever u) and a reduce-scatter of the ``[e S k, h]`` outputs (``2 e S k h``
  bytes; ``ParallelDispatcher._allgather``), ring collectives on the slowest link the group
  crosses: about ``e (1 + 1/k) / 2`` times the all-to-all's bytes at u = t. The dispatcher
  does not change the numbers (``--moe-token-dispatcher-type``'s help), so at EP > 1 the
  search chooses it unless the flag, a config file or a preset names one (layout key
  ``disp``, :func:`allgather_rows`): alltoall, which moves fewer bytes (allgather ``e (1 + k)
  / 2k`` times them: Megatron's default is 30x the all-to-all at EP 64 across nodes,
  DeepSeek-V3 on 2,048 H800), and allgather where it fits and alltoall does not (it keeps
  less under loom's layer: :func:`loom.planner.refine.refine`, kind ``disp``).
* ``--moe-grouped-gemm``: the local experts' GEMMs run as one grouped GEMM of all
  ``lambda S k u / t`` rows, whose efficiency is that of the whole row count instead of
  ``S k e u / (t E)`` per expert.
* TP: loom sums the k expert partial outputs and the shared expert's over TP in ONE all-reduce
  of ``[T (k + 1_sh), h]`` before the router weights combine them (``loom/parallel/expert.py``),
  instead of the dense MLP's ``[T, h]``; backward still one ``[T, h]`` all-reduce. The same
  for any u (the pair outputs of the u < t groups are partial sums like the shards').
* expert-DP gradient reduction: over the ``t c d / (u e)`` ranks holding the same expert shard,
  ``u e`` ranks apart (:func:`expert_dp`; ``loom/parallel/expert.py`` "Gradients").

Models mixing MoE and dense layers (``--moe-layer-freq``, DeepSeek-V3's leading dense layers)
are modelled per pipeline stage with the MoE layers that stage holds
(:func:`stage_moe_layers`).
"""

from __future__ import annotations

from typing import get_args

import numpy as np

from loom.config import ModelConfig
from loom.config.model_moe import Dispatcher
from loom.planner.hardware import Cluster
from loom.planner.primitives import all_gather_time, all_reduce_time, gemm_efficiency, link
from loom.planner.layer_shape import gated_mlp

# Busiest EP rank's expert tokens over the mean. An assumption, not fitted: the Switch
# Transformer (Fedus et al. 2021, sec 2.2) trains well with capacity factors of 1.0-1.25, i.e.
# with expert loads capped at 1-1.25x the mean, and auxiliary-loss (or DeepSeek-V3's bias,
# sec 2.1.2) balancing keeps the busiest rank near the mean; 1.1 is in that range.
MOE_LOAD_IMBALANCE = 1.1
BYTES_PER_ELEMENT = 2  # bf16 tokens in the all-to-all


def load_imbalance(model: ModelConfig, imbalance: float) -> float:
    """The busiest EP rank's expert tokens over the mean for ``model``: ``imbalance``
    (``--moe-load-imbalance``), capped by ``--moe-expert-capacity-factor`` F where one is set:
    each expert keeps at most ``F T k / E`` of its tokens and drops the rest
    (``loom/models/moe.py``, Megatron's token dropping; Fedus et al. 2021, sec 2.2), so no
    rank holds more than F times the mean (below 1, every expert is cut to F)."""
    cap = model.moe_expert_capacity_factor
    return imbalance if cap is None else min(imbalance, cap)


def expert_tp(L: dict):
    """u, the expert TP size of each row of layout ``L`` (array): its ``etp`` where > 0, else t
    (a layout without ``etp``, or 0: Megatron-Core's default, ``--expert-tensor-parallel-size``
    equal to ``--tensor-model-parallel-size``; ``loom/parallel/mesh.py``
    ``ParallelMesh.build(etp=None)``)."""
    t = L["tp"]
    u = L.get("etp")
    return t if u is None else np.where(np.asarray(u) > 0, u, t)


def expert_shards(L: dict):
    """``u e``: the GPUs one MoE layer's experts are split over (array): E/e experts per EP
    rank, each sharded over u expert-TP ranks (``loom/parallel/expert.py::MoEParallel``)."""
    return expert_tp(L) * L.get("ep", 1.0)


def expert_dp(L: dict):
    """Expert-data-parallel size ``t c d / (u e)`` (array): the ranks of a pipeline stage
    holding the same expert shard, over which expert gradients are reduced and (ZeRO) the
    expert optimizer states sharded (Megatron-Core 0.16.1 ``parallel_state.
    initialize_model_parallel``: ``expert_data_parallel_size = world_size // (u e p)``, its
    expert rank generator having no CP axis; loom's ``edp`` group, ``loom/parallel/mesh.py``;
    counted by ``meta_count.count_rank_states``' ``edp``); ``d c / e`` when u = t, and larger
    than the dense ``d c`` when u < t (it then spans TP ranks)."""
    return L["tp"] * L["cp"] * L["dp"] / expert_shards(L)


def num_moe_layers(model: ModelConfig) -> int:
    """Layers with an MoE MLP (``model.is_moe_layer``); 0 for a dense model."""
    if not model.num_experts:
        return 0
    return sum(1 for i in range(model.num_layers) if model.is_moe_layer(i))


def moe_fraction(model: ModelConfig) -> float:
    """Share of the layers that are MoE (0 for a dense model)."""
    return num_moe_layers(model) / model.num_layers


def mlp_params(model: ModelConfig, width: int, h: int | None = None) -> tuple[int, int]:
    """``(tp_sharded, replicated)`` parameters of an MLP of hidden width ``width`` on ``h``-wide
    rows (default ``--hidden-size``): fc1 ``h (2 width | width)`` and fc2 ``width h``; biases:
    fc1's sharded, fc2's ``h`` replicated."""
    h = model.hidden_size if h is None else h
    mlp_in = 2 * width if gated_mlp(model) else width
    sharded, replicated = h * mlp_in + width * h, 0
    if not model.disable_bias_linear:
        sharded += mlp_in
        replicated += h
    return sharded, replicated


def routed_width(model: ModelConfig) -> int:
    """The width of the routed rows, the experts' input and output: ``--moe-latent-size`` L
    (latent MoE, ``loom/models/moe.py``), else h."""
    return model.moe_latent_size or model.hidden_size


def latent_params(model: ModelConfig) -> int:
    """The latent MoE's projections of one MoE layer (replicated over TP, like the router):
    ``h L`` down, ``L h`` up, biases ``L + h`` with the linear biases; 0 without
    ``--moe-latent-size``."""
    L, h = model.moe_latent_size or 0, model.hidden_size
    return (2 * h * L + (0 if model.disable_bias_linear else L + h)) if L else 0


def expert_params_per_layer(model: ModelConfig) -> int:
    """Parameters of the E routed experts of one MoE layer (count), biases included (on
    :func:`routed_width` rows)."""
    sh, rep = mlp_params(model, model.moe_ffn_size, routed_width(model))
    return model.num_experts * (sh + rep)


def expert_params_per_gpu(model: ModelConfig, L: dict):
    """Expert parameters of one MoE layer on one GPU (count, array): the E/e local experts'
    weights and FC1 biases split over the u expert-TP ranks, their FC2 biases whole on each
    (``loom/parallel/expert.py::_shard_mlp``; only shard 0 adds it)."""
    whole = 0 if model.disable_bias_linear else model.num_experts * routed_width(model)
    return (expert_params_per_layer(model) - whole) / expert_shards(L) \
        + whole / L.get("ep", 1.0)


def moe_layer_params(model: ModelConfig, dense_layer: tuple[int, int]) -> tuple[int, int, int]:
    """``(tp_sharded, replicated, expert)`` parameters of one MoE layer, from the dense layer's
    ``(tp_sharded, replicated)`` (:func:`loom.planner.memory.layer_params`): its MLP replaced by
    the shared expert (sharded), router ``h E``, shared gate ``h`` and the latent projections
    (:func:`latent_params`; replicated), experts."""
    h = model.hidden_size
    d_sh, d_rep = mlp_params(model, model.ffn_size)
    f_sh = model.moe_shared_expert_intermediate_size or 0
    s_sh, s_rep = mlp_params(model, f_sh) if f_sh else (0, 0)
    sharded = dense_layer[0] - d_sh + s_sh
    replicated = (dense_layer[1] - d_rep + s_rep + h * model.num_experts
                  + latent_params(model))
    if not model.disable_bias_linear:  # the router's bias [E] (Megatron's TopKRouter)
        replicated += model.num_experts
    if f_sh and model.moe_shared_expert_gate:
        replicated += h
    return sharded, replicated, expert_params_per_layer(model)


def stage_moe_layers(model: ModelConfig, L: dict, lf, lm, ll) -> tuple:
    """MoE layers ``(first, middle, last)`` of the pipeline stages (arrays) whose transformer
    layers are ``lf, lm, ll`` (:func:`loom.planner.stage_table.stage_layers`; 0 for a dense model).

    Without interleaving the first stage holds layers ``[0, lf)`` and the last ``[L - ll, L)``;
    with ``v`` virtual stages (even split) stage i holds chunks ``j p + i`` of ``L / (p v)``
    layers, ``j < v``; a middle stage holds the average of the rest. Fractional bounds (p not
    dividing L without a given split) are interpolated. Uneven interleaved splits: the average
    MoE share."""
    return stage_flag_layers([model.is_moe_layer(i) for i in range(model.num_layers)],
                             L, lf, lm, ll)


def stage_flag_layers(flags, L: dict, lf, lm, ll) -> tuple:
    """Layers with ``flags[i]`` true on the ``(first, middle, last)`` pipeline stages (arrays),
    by the rule of :func:`stage_moe_layers` (MoE layers; Mamba's layer kinds use it too)."""
    n = len(flags)
    if all(flags) or not any(flags):
        return (lf, lm, ll) if any(flags) else (0 * lf, 0 * lm, 0 * ll)
    cum = np.concatenate([[0.0], np.cumsum(flags, dtype=np.float64)])
    pos = np.arange(n + 1, dtype=np.float64)

    def count(a, b):
        return float(np.interp(b, pos, cum) - np.interp(a, pos, cum))

    n_moe = cum[-1]
    keys = np.stack([L["pp"], L["vp"], lf, ll, lm], axis=1)
    uniq, inv = np.unique(keys, axis=0, return_inverse=True)
    out = np.zeros((len(uniq), 3))
    for r, (p, v, a, b, m) in enumerate(uniq):
        p, v = int(p), int(v)
        if p == 1:
            out[r] = (n_moe, n_moe, n_moe)
            continue
        if v > 1 and a == b == n / p:
            c = n / (p * v)
            first = sum(count(j * p * c, (j * p + 1) * c) for j in range(v))
            last = sum(count((j * p + p - 1) * c, (j * p + p) * c) for j in range(v))
        elif v > 1:
            first, last = a * n_moe / n, b * n_moe / n
        else:
            first, last = count(0, a), count(n - b, n)
        mid = (n_moe - first - last) / (p - 2) if p > 2 else m * n_moe / n
        out[r] = (first, mid, last)
    res = out[inv.reshape(-1)]
    return res[:, 0], res[:, 1], res[:, 2]


def layer_param_totals(model: ModelConfig, dense_layer: tuple[int, int]) -> tuple[float, float]:
    """``(total, active)`` parameters of all transformer layers: active counts k of the E
    experts (the shared expert and router always)."""
    n_moe = num_moe_layers(model)
    dense = sum(dense_layer)
    sh, rep, ex = moe_layer_params(model, dense_layer)
    rest = (model.num_layers - n_moe) * dense + n_moe * (sh + rep)
    return (float(rest + n_moe * ex),
            float(rest + n_moe * ex * model.moe_router_topk / model.num_experts))


def moe_mlp_flops_per_token(model: ModelConfig) -> float:
    """Forward FLOPs per token of an MoE MLP: ``k (6|4) w f_e + (6|4) h f_sh + 2 h E + 4 h L``
    (``w`` the routed width, :func:`routed_width`; the latent projections ``4 h L``, 0
    without ``--moe-latent-size``)."""
    h, c = model.hidden_size, (6 if gated_mlp(model) else 4)
    f_sh = model.moe_shared_expert_intermediate_size or 0
    return float(model.moe_router_topk * c * routed_width(model) * model.moe_ffn_size
                 + c * h * f_sh + 2 * h * model.num_experts
                 + 4 * h * (model.moe_latent_size or 0))


def moe_activation_bytes(model: ModelConfig, S, imbalance: float, pair_share=1.0) -> tuple:
    """Activation bytes of one MoE MLP for ``S = s b / c`` tokens (the rank's CP shard of the
    micro-batch: routing, experts and combine are per token, so CP divides them all by c):
    ``(tp_split, replicated, gathered)``, 16-bit except the fp32 router; ``pair_share`` = u / t,
    the share of the pairs a rank runs (module docstring; 1 at u = t). What Megatron-Core's MoE
    layer needs (the ``kor`` layer memory, :func:`loom.planner.activations.
    activation_bytes_per_layer`); loom's own layer, measured, is :func:`loom.planner.
    layer_bytes.loom_moe_mlp_terms`.

    * ``tp_split`` (the caller divides by t): per expert row ``(6|4) f_e`` (fc1 output and
      activation, as KOR's MLP), on ``lambda S k`` rows (the busiest rank); with u < t a rank
      holds ``u / t`` of the rows at ``t / u`` times the width ``f_e / t``: the same bytes; the
      shared expert ``(6|4) S f_sh``;
    * ``replicated`` (divided by t under sequence parallelism, like KOR's ``10 s b h``): the k
      expert outputs kept for the weighted combine ``2 S k h`` and the router's logits and
      probabilities ``8 S E`` (fp32). Under SP Megatron-Core routes, permutes and combines
      each TP rank's own ``S / t`` tokens (``megatron/core/transformer/moe/token_dispatcher.py``,
      ``MoEAlltoAllTokenDispatcher``: the hidden states enter the layer as ``[s/t, b, h]``);
    * ``gathered`` (never divided by t): the experts' inputs ``2 h`` per row on the rank's
      ``lambda S k u / t`` rows. Under SP each TP rank dispatches its ``S k / t`` pairs over EP
      and Megatron-Core all-gathers the received rows over the u expert-TP ranks
      (``dispatch_postprocess``: ``gather_from_sequence_parallel_region`` over the expert TP
      group) before the expert GEMMs: ``lambda S k u / t`` rows with or without SP.

    Latent MoE (``--moe-latent-size`` L): rows and expert outputs are L wide instead of h, and
    the projections keep their inputs ``2 S h + 2 S L`` (replicated: Megatron-Core runs them
    on each TP rank's tokens)."""
    h, c, k = model.hidden_size, (6 if gated_mlp(model) else 4), model.moe_router_topk
    f_sh = model.moe_shared_expert_intermediate_size or 0
    w, L = routed_width(model), model.moe_latent_size or 0
    rows = imbalance * S * k
    split = rows * c * model.moe_ffn_size + S * c * f_sh
    repl = 2 * S * k * w + 8 * S * model.num_experts + (2 * S * (h + L) if L else 0)
    return split, repl, rows * pair_share * 2 * w


DISPATCHERS = get_args(Dispatcher)  # layout key ``disp`` indexes it: allgather, alltoall, flex


def allgather_rows(model: ModelConfig, L: dict):
    """Whether each row of layout ``L`` dispatches with ``allgather`` (bool array): its
    ``disp`` code (:data:`DISPATCHERS`), the model's ``moe_token_dispatcher_type`` where the
    code is -1 or absent."""
    own = model.moe_token_dispatcher_type == "allgather"
    d = L.get("disp")
    if d is None:
        return np.full(np.shape(L["tp"]), own)
    d = np.asarray(d)
    return np.where(d < 0, own, d == DISPATCHERS.index("allgather"))


def all_to_all_time(n, per_node, nbytes, cluster: Cluster):
    """All-to-all of ``nbytes`` per GPU over ``n`` ranks of which ``per_node`` share a node
    (seconds): each GPU keeps ``1/n`` and sends ``(per_node - 1)/n`` of its bytes over NVLink and
    ``(n - per_node)/n`` over its own NIC, concurrently: ``max(M (k-1)/(n W_intra),
    M (n-k)/(n W_inter)) + (n-1) alpha`` (alpha of the slowest link crossed; pairwise exchange,
    references.md's alpha-beta model). All ranks in one node: ``(n-1)/n M / W_intra``."""
    n = np.asarray(n, dtype=np.float64)
    k = np.clip(per_node, 1.0, np.maximum(n, 1.0))
    intra = nbytes * (k - 1) / n / cluster.intra_bw
    inter = nbytes * (n - k) / n / cluster.inter_bw
    alpha = np.where(n > k, cluster.inter_alpha, cluster.intra_alpha)
    return np.where(n > 1, np.maximum(intra, inter) + (n - 1) * alpha, 0.0)


def dispatch_time(kind: str, e, per_node, pair_elems, token_elems, cluster: Cluster,
                  pair_share=1.0):
    """Mean time of the 4 dispatcher collectives of one MoE layer and micro-batch (seconds) over
    ``e`` EP ranks, ``per_node`` of them per node, for ``pair_elems = S k h`` routed elements
    and ``token_elems = S h`` token elements per GPU (bf16): ``alltoall``: one all-to-all of the
    rank's own pairs, ``pair_share`` (u / t) of them; ``allgather``: the mean of an all-gather
    of ``e S h`` and a reduce-scatter of ``e S k h`` elements (ring, on the slowest link the
    group crosses; every rank gathers whole ``[T, h]`` tokens and ``[e T k, h]`` outputs
    whatever u: ``expert_dispatch.py::ParallelDispatcher._allgather``)."""
    if kind != "allgather":
        return all_to_all_time(e, per_node, BYTES_PER_ELEMENT * pair_elems * pair_share,
                               cluster)
    e = np.asarray(e, dtype=np.float64)
    bw, alpha = link(e > np.clip(per_node, 1.0, None), cluster)
    gather = all_gather_time(e, BYTES_PER_ELEMENT * e * token_elems, bw, alpha)
    scatter = all_gather_time(e, BYTES_PER_ELEMENT * e * pair_elems, bw, alpha)
    return (gather + scatter) / 2


def ep_members_per_node(L: dict, cluster: Cluster):
    """EP ranks sharing a node: an EP group's ranks are ``u`` apart (the expert grid's
    ``q = etp_rank + u (ep_rank + e edp_rank)``, ``loom/parallel/mesh.py``; at u = t
    consecutive DP ranks, or CP ranks first under CP)."""
    stride = expert_tp(L)
    return np.where(stride >= cluster.gpus_per_node, 1.0, np.floor(cluster.gpus_per_node / stride))


def moe_layer_times(model: ModelConfig, S, L: dict, cluster: Cluster,
                    imbalance: float) -> dict:
    """Per MoE layer and micro-batch on one GPU (seconds): ``gemm`` (experts on the busiest rank,
    shared expert, router; forward), ``a2a`` (one all-to-all), ``tp_extra`` / ``tp_extra_bwd``
    (forward / backward TP collective time beyond the dense MLP's), ``cp_extra`` (the router's
    load statistics summed over CP), ``tokens_per_expert``. ``S = s b / c``: the rank's tokens.

    Sequence parallelism (loom's layer, ``loom/parallel/expert.py::MoEParallel``): the layer
    all-gathers its ``[s/t, b, h]`` tokens (``2 S h`` bytes gathered) and keeps its own slice of
    the output (a local split, no collective: the reduction is the dispatcher's one all-reduce),
    where a dense SP MLP all-gathers and reduce-scatters ``2 S h``: forward ``AG(2 S h) +
    AR(2 S h (k + 1_sh))`` against the dense ``AG + RS``, i.e. the no-SP ``tp_extra`` plus one
    ``AG(2 S h)``; backward the split's all-gather and the input copy's all-reduce against the
    dense ``AG + RS``: one ``AG(2 S h)`` more. Every TP rank routes all S tokens and
    dispatches its ``u / t`` share of the pairs whether SP is on or not, so the router and the
    EP all-to-all do not change with SP. (Megatron-Core instead routes each TP rank's ``S / t``
    tokens, dispatches their ``S k / t`` pairs over EP and all-gathers / reduce-scatters the
    received rows over the expert-TP group: ``token_dispatcher.py``; not what ``loom train``
    runs.) Context parallelism: S is already the CP shard; the router's load statistics
    (``ContextParallelRouterStats``: assignments and token count, then the probability mass,
    ``E + 1`` and ``E`` fp32) are two all-reduces over the c CP ranks (``t`` apart, latency
    bound) per MoE layer forward. Latent MoE (``--moe-latent-size`` L): the routed rows are L
    wide (expert GEMMs, dispatch, the all-reduce ``[S (k L + h_sh)]``), the projections add
    ``4 S h L`` FLOPs on every TP rank, and backward all-reduces the latent tokens' gradient
    (and the shared expert's tokens') instead of the dense ``[S, h]``."""
    h, c, k, E = (model.hidden_size, (6 if gated_mlp(model) else 4), model.moe_router_topk,
                  model.num_experts)
    lat = model.moe_latent_size or 0
    w = routed_width(model)  # routed rows: L wide in a latent MoE
    t, e, u = L["tp"], L.get("ep", 1.0), expert_tp(L)
    share = u / t  # the pairs this rank owns (module docstring)
    f_e, f_sh = model.moe_ffn_size, model.moe_shared_expert_intermediate_size or 0
    peak = cluster.peak_flops
    per_expert = S * k * e * share / E
    # rows per GEMM call
    rows = imbalance * S * k * share if model.moe_grouped_gemm else per_expert
    expert = imbalance * S * k * c * w * f_e / t / (
        peak * gemm_efficiency(min(w, f_e) / u, rows, cluster))
    shared = (S * c * h * f_sh / t / (peak * gemm_efficiency(min(h, f_sh) / t, S, cluster))
              if f_sh else 0.0)
    router = 2 * h * E * S / (peak * gemm_efficiency(min(h, E), S, cluster))
    # the latent projections, replicated: every TP rank projects all S tokens down and up
    latent = (4 * h * lat * S / (peak * gemm_efficiency(min(h, lat), S, cluster))
              if lat else 0.0)
    per_node = ep_members_per_node(L, cluster)
    a2a = np.where(allgather_rows(model, L),
                   dispatch_time("allgather", e, per_node, S * k * w, S * w, cluster, share),
                   dispatch_time("alltoall", e, per_node, S * k * w, S * w, cluster, share))
    tp_bw, tp_alpha = link(t > cluster.gpus_per_node, cluster)
    sp_gather = np.where(np.asarray(L.get("sp", 0.0)) > 0,
                         all_gather_time(t, 2 * S * h, tp_bw, tp_alpha), 0.0)
    tp_extra = (all_reduce_time(t, 2 * S * (k * w + (h if f_sh else 0)), tp_bw, tp_alpha)
                - all_reduce_time(t, 2 * S * h, tp_bw, tp_alpha)) + sp_gather
    # backward: a latent MoE's input copies are the latent tokens' (and the shared expert's
    # tokens') all-reduce in place of the dense MLP's [S, h] one
    latent_bwd = ((all_reduce_time(t, 2 * S * lat, tp_bw, tp_alpha)
                   + (0.0 if f_sh else -all_reduce_time(t, 2 * S * h, tp_bw, tp_alpha)))
                  if lat else 0.0)
    cp = L.get("cp", 1.0)
    cp_bw, cp_alpha = link(t * cp > cluster.gpus_per_node, cluster)
    cp_extra = (all_reduce_time(cp, 4 * (E + 1), cp_bw, cp_alpha)
                + all_reduce_time(cp, 4 * E, cp_bw, cp_alpha))
    return {"gemm": expert + shared + router + latent, "a2a": a2a, "tp_extra": tp_extra,
            "tp_extra_bwd": sp_gather + latent_bwd, "cp_extra": cp_extra,
            "tokens_per_expert": per_expert}
