"""``--optimizer muon`` in the planner: which weights Muon manages, the bytes of its state, and
the Newton-Schulz FLOPs of its step (loom's Muon: :mod:`loom.training.muon`, Megatron-Core's
``TensorParallelMuon`` over emerging_optimizers 0.3.0).

* **Managed weights** (``loom.training.param_groups.muon_managed``): every 2-D weight of the
  transformer layers (attention projections, MLP, router, experts; Mamba's ``out_proj``), not
  the word embeddings or the output layer, not Mamba's ``in_proj`` (Megatron's
  ``use_muon=False``), nor any vector (norms, biases). Those keep AdamW.
* **State** (bytes per managed parameter): one fp32 momentum, :data:`MUON_STATE_BYTES` = 4,
  against AdamW's 8 (both beside the master copy of a 16-bit run).
* **Step FLOPs**: ``--muon-num-ns-steps`` iterations of ``X <- a X + (b A + c A^2) X`` with
  ``A = X X^T`` on an ``m x n`` matrix (``m <= n``: transposed when taller): ``X X^T`` is
  ``2 m^2 n``, ``A^2`` ``2 m^3``, ``(.) X`` ``2 m^2 n``, so ``4 m^2 n + 2 m^3`` per iteration
  (Jordan et al. 2024; checked against torch's FLOP counter on loom's ``newton_schulz`` in
  tests/planner/test_planner_muon.py). The query, key and value rows of a fused QKV weight are
  three matrices (``--muon-split-qkv``, the default).
* **Where**: ``--muon-tp-mode duplicated`` (the default) gathers each TP shard and
  orthogonalizes the whole matrix on every TP rank (``distributed`` computes the same function,
  and loom gathers there too; ``blockwise`` orthogonalizes each shard, ``1/t`` of the rows of a
  column-parallel weight or of the columns of a row-parallel one); each local expert (``E / e``
  per GPU) is one matrix pair, whole over expert TP. Across data parallelism loom
  orthogonalizes a matrix on every rank that owns part of it after the reduce-scatter: a matrix
  larger than a bucket's 1/d share is owned by every DP rank, so the planner prices every stage
  matrix on every rank
  (exact for matrices that large, an upper bound for small ones sharing a bucket; Megatron's
  layer-wise optimizer instead spreads whole matrices over the DP ranks). The iterations run in
  bf16 (``--muon-fp32-matmul-prec medium``, Megatron's default) at the GEMM efficiency of an
  ``m``-wide, ``n``-long GEMM; ``high`` / ``low`` (fp32, TF32 on a GPU) at half that rate (H100's
  dense TF32 peak is half its bf16 peak).
"""

from __future__ import annotations

import numpy as np

from loom.config import ModelConfig
from loom.planner.layer_shape import gated_mlp

MUON_STATE_BYTES = 4.0
"""Muon's state per managed parameter: one fp32 momentum buffer."""


COL, ROW, WHOLE = 0, 1, None
"""How TP splits a weight ``[rows, cols]``: column-parallel (rows split), row-parallel (cols
split), or replicated whole."""


def _attention(model: ModelConfig, split_qkv: bool) -> list[tuple]:
    """``(rows, cols, count, split)`` of one layer's attention weights."""
    h, a = model.hidden_size, model.num_attention_heads
    if model.multi_latent_attention:
        q, r = model.q_lora_rank or 0, model.kv_lora_rank
        dn, dr, dv = model.qk_head_dim, model.qk_pos_emb_head_dim, model.v_head_dim
        out = [(q, h, 1, WHOLE), (a * (dn + dr), q, 1, COL)] if q else \
            [(a * (dn + dr), h, 1, COL)]
        return out + [(r + dr, h, 1, WHOLE), (a * (dn + dv), r, 1, COL), (h, a * dv, 1, ROW)]
    g, d = model.num_kv_groups, model.head_dim
    qkv = [(a * d, h, 1, COL), (g * d, h, 2, COL)] if split_qkv else \
        [((a + 2 * g) * d, h, 1, COL)]
    return qkv + [(h, a * d, 1, ROW)]


def _mlp(model: ModelConfig, width: int, h: int | None = None) -> list[tuple]:
    h = model.hidden_size if h is None else h  # an expert of a latent MoE: L-wide rows
    return [((2 if gated_mlp(model) else 1) * width, h, 1, COL), (h, width, 1, ROW)]


def layer_matrices(model: ModelConfig, split_qkv: bool = True) -> list[dict]:
    """Per layer kind (:func:`loom.planner.memory.kind_layer_params`' order: dense [, MoE]; a
    hybrid stack's ``M``, ``*``, ``-``), the weights Muon manages: ``{"dense": [(rows, cols,
    count, split)], "expert": [(rows, cols)] per expert, "experts": E}`` (``split``:
    :data:`COL`, :data:`ROW` or :data:`WHOLE`)."""
    from loom.planner.mamba import KINDS, is_hybrid, mamba_dims
    if is_hybrid(model):
        d_i = mamba_dims(model)[0]
        kinds = {"M": [(model.hidden_size, d_i, 1, ROW)], "*": _attention(model, split_qkv),
                 "-": _mlp(model, model.ffn_size)}
        return [{"dense": kinds[k], "expert": [], "experts": 0} for k in KINDS]
    att = _attention(model, split_qkv)
    out = [{"dense": att + _mlp(model, model.ffn_size), "expert": [], "experts": 0}]
    if model.num_experts:
        E, h = model.num_experts, model.hidden_size
        shared = model.moe_shared_expert_intermediate_size or 0
        dense = att + [(E, h, 1, WHOLE)] + (_mlp(model, shared) if shared else [])
        if shared and model.moe_shared_expert_gate:
            dense.append((1, h, 1, WHOLE))
        L = model.moe_latent_size
        if L:  # the latent projections, replicated
            dense += [(L, h, 1, WHOLE), (h, L, 1, WHOLE)]
        out.append({"dense": dense, "expert": [(r, c) for r, c, _, _ in
                                                _mlp(model, model.moe_ffn_size, L)],
                    "experts": E})
    return out


def ns_flops(rows, cols, steps: int):
    """FLOPs of ``steps`` Newton-Schulz iterations on a ``rows x cols`` matrix (numbers or
    arrays): ``steps (4 m^2 n + 2 m^3)``, ``m = min``, ``n = max`` (module docstring)."""
    m, n = np.minimum(rows, cols) * 1.0, np.maximum(rows, cols) * 1.0
    return steps * (4.0 * m * m * n + 2.0 * m ** 3)


def kind_muon_params(model: ModelConfig, L: dict, split_qkv: bool = True) -> list:
    """Per layer kind, the parameters per GPU (count, arrays over the layouts ``L``) that Muon
    manages, as stored: TP-sharded weights ``/ t``, replicated ones whole, experts ``E x`` their
    size ``/ (u e)`` (:func:`loom.planner.moe.expert_shards`)."""
    from loom.planner.moe import expert_shards
    t = np.asarray(L["tp"], dtype=np.float64)
    out = []
    for k in layer_matrices(model, split_qkv):
        dense = sum(r * c * n / (1.0 if sp is WHOLE else t) for r, c, n, sp in k["dense"])
        experts = k["experts"] * sum(r * c for r, c in k["expert"]) / expert_shards(L) \
            if k["experts"] else 0.0 * t
        out.append((dense + 0.0 * t, experts + 0.0 * t))
    return out


def kind_ns_seconds(model: ModelConfig, L: dict, cluster, steps: int, split_qkv: bool = True,
                    fp32: bool = False, blockwise: bool = False) -> list:
    """Per layer kind, seconds per GPU of one step's Newton-Schulz iterations of one layer
    (arrays over ``L``): every managed matrix whole (TP duplicated; ``blockwise``:
    ``--muon-tp-mode blockwise``, each TP shard on its own), the ``E / e`` local experts, at
    :func:`loom.planner.primitives.gemm_efficiency` of an ``m x n`` GEMM, half the rate with
    ``fp32`` (module docstring)."""
    from loom.planner.primitives import gemm_efficiency
    t = np.asarray(L["tp"], dtype=np.float64)
    e = np.asarray(L.get("ep", 1.0), dtype=np.float64)
    rate = cluster.peak_flops * (0.5 if fp32 else 1.0)

    def secs(rows, cols):
        m, n = np.minimum(rows, cols), np.maximum(rows, cols)
        return ns_flops(rows, cols, steps) / (rate * gemm_efficiency(m, n, cluster))

    def shard(r, c, sp):
        if not blockwise or sp is WHOLE:
            return r + 0.0 * t, c + 0.0 * t
        return (r / t, c + 0.0 * t) if sp == COL else (r + 0.0 * t, c / t)

    out = []
    for k in layer_matrices(model, split_qkv):
        dense = sum(n * secs(*shard(r, c, sp)) for r, c, n, sp in k["dense"])
        experts = k["experts"] / e * sum(secs(r, c) for r, c in k["expert"]) \
            if k["experts"] else 0.0
        out.append(dense + experts + 0.0 * e)
    return out
