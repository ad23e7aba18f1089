"""Context parallelism (CP) cost per transformer layer and micro-batch, per communication type
(Megatron-Core's ``--cp-comm-type``), vectorized over layouts. The bytes follow
:mod:`loom.parallel.context.cost` (what loom's CP implementation sends and holds; a test checks
p2p and allgather against ``cp_cost``); not taken from it: a2a's repetition of K/V groups to
``lcm(g, c)`` (here ``g d`` per group, a2a needing ``c t`` to divide ``a`` and ``g``) and a
single-replica K/V when ``g < t`` (here ``g/t``).

Symbols: ``c`` CP ranks, ``t`` TP, ``S = s b / c`` local tokens, ``a`` query heads, ``g`` KV
groups of head dim ``d``; 16-bit K/V: one local K/V block is ``M_kv = 4 S g d / t`` bytes, one
local Q or O block ``2 S a d / t``. ``k_n = min(c, gpus_per_node / t)`` CP ranks share a node.
Attention FLOPs per GPU are the same for every type (load-balanced causal chunks: each rank
computes ``1/c`` of the score matrix): ``4 s a d S / t`` counted FLOPs, timed by the caller.

* ``p2p`` (ring attention; Liu et al. 2023, "Ring Attention with Blockwise Transformers";
  Megatron-Core's default): ``c - 1`` exchanges of ``M_kv`` forward, each overlapped with one
  block of attention (``1/c`` of it); backward ``2c - 1`` blocks (K/V and their gradients).
  Extra memory: the next K/V block in flight, ``M_kv`` (double buffer).
* ``allgather`` (Megatron-Core ``allgather``; Llama 3 sec 3.3.2): all-gather of K/V, ``(c-1)/c
  x c M_kv`` per GPU, before the attention (exposed); backward a reduce-scatter of the K/V
  gradients of the same size. Extra memory: the gathered K/V of the whole sequence, ``c M_kv``
  (transient, one layer).
* ``a2a`` (DeepSpeed-Ulysses; Jacobs et al. 2023): all-to-all of Q, K, V before and of O after
  the attention, each moving ``(c-1)/c`` of the local tensor (``2 M_q + M_kv`` in, ``M_q``
  out); backward the same; not overlapped. Needs ``a`` and ``g`` divisible by ``c t``. No extra
  memory beyond the re-laid-out copies (``2 M_q + M_kv``, transient).
* ``a2a+p2p`` (hierarchical, Megatron-Core): all-to-all over the ``k_n`` CP ranks of a node,
  ring over the ``c / k_n`` node groups on NVLink-free links (the ring's blocks are ``k_n``
  times larger, its steps ``c/k_n - 1``).
"""

from __future__ import annotations

import numpy as np

from loom.planner.hardware import Cluster
from loom.planner.primitives import all_gather_time, link, p2p_time

CP_COMM_TYPES = ("p2p", "allgather", "a2a", "a2a+p2p")


def _link(n_span, cluster: Cluster):
    """Bandwidth and latency of a group spanning ``n_span`` consecutive GPUs."""
    return link(n_span > cluster.gpus_per_node, cluster)


def _a2a(n, nbytes, bw, alpha):
    n = np.asarray(n, dtype=np.float64)
    return np.where(n > 1, (n - 1) / n * nbytes / bw + (n - 1) * alpha, 0.0)


def cp_layer_cost(comm_type: str, S, t, c, q_width: int, kv_width: int, attn_s,
                  cluster: Cluster, a2a_size: int = 0) -> dict:
    """Exposed CP communication of one layer and micro-batch, ``fwd`` and ``bwd`` (seconds),
    and its transient extra memory ``mem`` (bytes), for arrays ``S`` (local tokens), ``t``,
    ``c``, the query width ``q_width = a d`` and the K plus V width ``kv_width`` (``2 g d``;
    MLA: its expanded heads) per token, and the attention compute time ``attn_s`` (s) that
    the ring overlaps. Raises ValueError for an unknown ``comm_type`` (one of
    :data:`CP_COMM_TYPES`)."""
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(f"--cp-comm-type {comm_type}: one of {', '.join(CP_COMM_TYPES)}")
    kv = 2.0 * S * kv_width / t
    q = 2.0 * S * q_width / t
    bw, alpha = _link(t * c, cluster)
    zero = 0.0 * S
    if comm_type == "p2p":
        ring = (c - 1) * p2p_time(kv, bw, alpha)
        back = (2 * c - 1) * p2p_time(kv, bw, alpha)  # K/V blocks and c gradient blocks
        fwd = np.maximum(0.0, ring - attn_s)
        return {"fwd": np.where(c > 1, fwd, zero),
                "bwd": np.where(c > 1, np.maximum(0.0, back - 2 * attn_s), zero),
                "mem": np.where(c > 1, kv, zero)}
    if comm_type == "allgather":
        ag = all_gather_time(c, c * kv, bw, alpha)
        return {"fwd": ag, "bwd": ag, "mem": np.where(c > 1, c * kv, zero)}
    if comm_type == "a2a":
        fwd = _a2a(c, 2 * q + kv, bw, alpha)
        return {"fwd": fwd, "bwd": fwd, "mem": np.where(c > 1, 2 * q + kv, zero)}
    # a2a+p2p: all-to-all inside the node, ring across node groups
    k_n = a2a_ranks(cluster.gpus_per_node, t, c, a2a_size)
    outer = np.maximum(c / k_n, 1.0)
    bw_in, a_in = _link(t * k_n, cluster)
    bw_out, a_out = _link(t * c, cluster)
    inner = _a2a(k_n, 2 * q + kv, bw_in, a_in)
    ring = (outer - 1) * p2p_time(k_n * kv, bw_out, a_out)
    fwd = inner + np.maximum(0.0, ring - attn_s)
    bwd = inner + np.maximum(0.0, 2 * ring - 2 * attn_s)
    return {"fwd": np.where(c > 1, fwd, zero), "bwd": np.where(c > 1, bwd, zero),
            "mem": np.where(c > 1, 2 * q + kv + k_n * kv, zero)}


def a2a_ranks(gpus_per_node: int, t, c, a2a_size: int = 0):
    """a2a+p2p's all-to-all group: ``a2a_size`` when given (``--hierarchical-context-parallel-
    sizes A B``: A), else the CP ranks of a node ``min(c, gpus_per_node / t)`` (at least 1)."""
    if a2a_size:
        return np.minimum(float(a2a_size), np.maximum(np.asarray(c, dtype=np.float64), 1.0))
    return np.clip(np.floor(gpus_per_node / np.asarray(t, dtype=np.float64)), 1.0,
                   np.maximum(c, 1.0))


def cp_memory(comm_type, S, t, c, q_width: int, kv_width: int,
              gpus_per_node: int = 8, a2a_size: int = 0):
    """The transient extra memory (bytes) of :func:`cp_layer_cost` without a cluster (its
    ``mem``; ``a2a+p2p`` with ``gpus_per_node`` GPUs per node); ``comm_type`` a name or an
    array of row codes (:func:`row_comm_types`)."""
    from loom.planner.hardware import make_cluster
    cl = make_cluster("A100-80GB", None, gpus_per_node)
    if not isinstance(comm_type, str):
        return cp_layer_cost_rows(comm_type, S, t, c, q_width, kv_width, 0.0 * S, cl,
                                  a2a_size)["mem"]
    return cp_layer_cost(comm_type, S, t, c, q_width, kv_width, 0.0 * S, cl, a2a_size)["mem"]


def a2a_divides(comm_type: str, heads: int, groups: int, t: int, c: int) -> bool:
    """Whether the all-to-all types can split the heads: ``a`` and ``g`` divisible by ``c t``
    (``a2a``) or by ``k_n t`` (the all-to-all part of ``a2a+p2p``, checked by the caller with
    ``c = k_n``); ``p2p`` and ``allgather`` always can."""
    if comm_type not in ("a2a", "a2a+p2p"):
        return True
    return heads % (c * t) == 0 and groups % (c * t) == 0


def row_comm_types(L: dict, default: str | None) -> np.ndarray:
    """Index into :data:`CP_COMM_TYPES` of every row: its ``cpt`` when set (>= 0), else
    ``default`` (p2p when None)."""
    base = CP_COMM_TYPES.index(default or "p2p")
    cpt = L.get("cpt")
    if cpt is None:
        return np.full(np.shape(L["tp"]), base)
    return np.where(np.asarray(cpt) >= 0, np.asarray(cpt), base).astype(int)


def cp_layer_cost_rows(codes: np.ndarray, S, t, c, q_width: int, kv_width: int, attn_s,
                       cluster: Cluster, a2a_size: int = 0) -> dict:
    """:func:`cp_layer_cost` with each row's own type (``codes``, :func:`row_comm_types`)."""
    out = None
    for k in np.unique(codes) if np.size(codes) else [0]:
        got = cp_layer_cost(CP_COMM_TYPES[int(k)], S, t, c, q_width, kv_width, attn_s, cluster,
                            a2a_size)
        out = got if out is None else {n: np.where(codes == k, got[n], out[n]) for n in got}
    return out
