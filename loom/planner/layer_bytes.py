"""Activation bytes of one loom transformer layer, term by term, read off the code it runs.

Where :func:`loom.planner.activations.activation_bytes_per_layer` counts what a layer *needs*
(Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
KOR table 2 and sec 4.2), this module counts what loom's own layer (``loom/models/gpt/model.py``
``TransformerLayer``: ``SelfAttention`` of ``loom/models/attention.py``, ``MLP`` of
``loom/models/mlp.py``, ``torch.nn.RMSNorm`` / ``LayerNorm``, the TP / SP plan of
``loom/parallel/tensor.py`` and ``sequence.py``) hands to autograd, storage by storage. The
CPU form is checked byte for byte against ``torch.autograd.graph.saved_tensors_hooks`` on the
real modules (``benchmarks/layer_memory.py``, ``tests/planner/test_planner_layer_memory.py``);
the CUDA form differs only in the three kernels PyTorch dispatches differently by device
(marked *device* below; PyTorch ``aten/src/ATen/native/layer_norm.cpp`` ``rms_norm_symint``,
``tools/autograd/derivatives.yaml`` ``_fused_rms_norm`` / ``native_layer_norm`` /
``native_dropout``, ``aten/src/ATen/native/Dropout.cpp`` ``dropout``).

Symbols: ``S = s b / c`` tokens of the rank's micro-batch, ``Sn`` the tokens of the
norm / residual region (``S / t`` with sequence parallelism, else ``S``), ``e`` bytes per
activation element (2 bf16/fp16, 4 fp32), ``h, a, g, d, f, r`` hidden, heads, KV groups, head
dimension, FFN width, rotary dimension; heads and FFN columns split over ``t``.

Terms of :func:`loom_layer_terms` (bytes):

* ``norms`` (2 per layer), *device*: RMSNorm on CPU is PyTorch's composite, upcast to fp32: its
  fp32 input ``4 Sn h`` (the input itself in fp32, a copy in bf16), the fp32 normalized
  ``4 Sn h`` and ``rstd`` ``4 Sn``; on CUDA the fused ``_fused_rms_norm`` keeps its input
  ``e Sn h`` and ``rstd`` ``4 Sn``. LayerNorm (``native_layer_norm``): input ``e Sn h``, mean and
  rstd ``Sn`` each (``e`` bytes on CPU, fp32 on CUDA). KOR: the ``2 s b h`` LayerNorm input.
* ``qkv_input``, ``fc1_input``: the QKV and FC1 inputs (the norms' outputs) ``e Sn h`` each.
  With sequence parallelism the column-parallel GEMM saves its ``1/t`` sequence shard and
  all-gathers it again in backward (``loom/parallel/tensor.py`` ``_SequenceGatherLinear``; KOR
  sec. 4.2.2 and Megatron-Core alike: the ``4 s b h / t`` of KOR's ``34/t``).
* ``qkv``: the fused QKV output ``e S (a + 2 g) d / t`` (KOR's Q, K, V): V is a view of it, so
  the attention core keeps the whole storage alive.
* ``rope``: RoPE's rotated Q and K are new tensors: ``e S (a + g) d / t``; ``rope_tables``: in
  a 16-bit layer each ``apply_rope`` casts the fp32 cos / sin tables: ``4 x e (s / c) r`` per
  layer (no ``b``).
* ``attention_out``: the attention core's output ``e S a d / t``, saved by SDPA and (the same
  storage) by the output projection (KOR's ``2 s b h`` projection input).
* ``softmax_lse``: the fused attention's fp32 log-sum-exp ``4 S a / t`` (KOR's ``5 a s^2 b``
  becomes this with flash attention). Selective recompute drops it only: the recomputed core's
  inputs Q, K, V and output are kept anyway.
* ``mlp``: FC1's output ``e S (2f | f) / t`` and what FC2 saves ``e S f / t``: ``3 e S f / t``
  gated, ``2 e S f / t`` GeLU (KOR's ``19 s b h`` at ``f = 4h``, 16-bit). The SwiGLU
  (``loom/models/activation.py`` ``swiglu``) saves only FC1's output and recomputes the SiLU in
  backward, as Megatron's fused bias-SwiGLU does (autograd's unfused ``silu(gate) * up`` kept
  the SiLU output ``e S f / t`` too).
* ``cp_core``: with ``cp > 1``, what the CP attention core adds (:func:`cp_core_terms`).
* ``dropout_masks``: with ``hidden_dropout > 0`` two masks ``Sn h``, *device*: ``e`` bytes on
  CPU (``dropout``'s multiply by a noise tensor), 1 on CUDA (``native_dropout``'s bool mask).

Full recompute (``--recompute-method uniform``, N layers per group) keeps the group input
``e Sn h / N`` per layer. Not covered (the test names what is): attention dropout, QK
layernorm, ``a2a+p2p``; the CP communication buffers are :mod:`loom.planner.context_parallel`'s.
MLA layers (:func:`mla_layer_terms`), Mamba-2 layers (:func:`mamba_layer_terms`) and the MoE
MLP (:func:`loom_moe_mlp_terms`) have their own terms.
"""

from __future__ import annotations

import numpy as np

from loom.config import ModelConfig
from loom.planner.layer_shape import gated_mlp

DEVICES = ("cpu", "cuda")


def loom_layer_terms(model: ModelConfig, seq_length: int, micro_batch, t=1, cp=1, sp=0,
                     elem_bytes: int = 2, device: str = "cuda", cp_comm_type: str = "p2p") -> dict:
    """The named terms of one loom layer's saved activations (bytes; the module docstring),
    for the mode without recomputation, with ``cp_comm_type``'s attention core when ``cp > 1``
    (:func:`cp_core_terms`). ``t``, ``sp``, ``micro_batch`` may be arrays."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    h, a, g, d, f = (model.hidden_size, model.num_attention_heads, model.num_kv_groups,
                     model.head_dim, model.ffn_size)
    e, cpu = float(elem_bytes), device == "cpu"
    S = seq_length * np.asarray(micro_batch, dtype=np.float64) / cp
    Sn = np.where(np.asarray(sp) > 0, S / t, S)
    norm = norm_bytes(model, Sn, h, h, e, cpu)
    rope = model.position_embedding_type in ("rope", "yarn")
    r = getattr(model, "rotary_dim", d) or d
    terms = {
        "norms": 2 * norm,
        "qkv_input": e * Sn * h,
        "fc1_input": e * Sn * h,
        "qkv": e * S * (a + 2 * g) * d / t,
        "rope": e * S * (a + g) * d / t if rope else 0.0 * S,
        "rope_tables": 4 * e * seq_length / cp * r + 0.0 * S if rope and e != 4 else 0.0 * S,
        "attention_out": e * S * a * d / t,
        "softmax_lse": 4.0 * S * a / t,
        "mlp": e * S * f * (3 if gated_mlp(model) else 2) / t,
        "dropout_masks": (2 * Sn * h * (e if cpu else 1.0) if model.hidden_dropout > 0
                          else 0.0 * S),
        "cp_core": 0.0 * S,
    }
    ring = np.asarray(cp) > 1
    for k, v in cp_core_terms(model, seq_length, micro_batch, t, cp, elem_bytes,
                              cp_comm_type).items():
        terms[k] = np.where(ring, v, terms[k])
    return terms


def norm_bytes(model: ModelConfig, Sn, width: int, stored: int, e: float, cpu: bool):
    """Bytes one norm of ``width`` channels saves for ``Sn`` tokens (the ``norms`` term of the
    module docstring), its input a view of a storage ``stored`` channels wide (MLA's key latent
    is the first ``r`` of the down projection's ``r + dr``): RMSNorm on CPU (PyTorch's fp32
    composite) its input's storage in fp32 (``4 stored``; a 16-bit input is upcast to a new
    ``4 width`` copy), the normalized ``4 width`` and ``rstd`` 4; on CUDA (``_fused_rms_norm``)
    its input's storage ``e stored`` and ``rstd`` 4; LayerNorm (``native_layer_norm``) its input
    ``e stored``, mean and rstd (``e`` bytes each on CPU, 4 on CUDA)."""
    if model.normalization == "RMSNorm":
        if cpu:
            return (4.0 * (stored if e == 4 else width) + 4.0 * width + 4.0) * Sn
        return (e * stored + 4.0) * Sn
    return (e * stored + 2.0 * (e if cpu else 4.0)) * Sn


def mla_layer_terms(model: ModelConfig, seq_length: int, micro_batch, t=1, sp=0,
                    elem_bytes: int = 2, device: str = "cuda") -> dict:
    """The named terms (bytes) of one loom layer with multi-latent attention
    (``loom/models/gpt/mla.py`` ``MLASelfAttention``; ``--experimental-attention-variant dsa``
    and context parallelism not covered) and the dense MLP, without recomputation; symbols
    of the module docstring and ``q, r, dn, dr, dv`` = ``--q-lora-rank`` (0: none),
    ``--kv-lora-rank``, ``--qk-head-dim``, ``--qk-pos-emb-head-dim``, ``--v-head-dim``,
    ``dq = dn + dr``. The down projections and their latents' norms are replicated over TP and
    run on the ``Sn`` tokens (the shard under SP); the up projections and the core on ``a / t``
    heads of all ``S`` tokens:

    * ``norms``, ``fc1_input``, ``mlp``, ``dropout_masks``, ``rope_tables`` (``r = dr``): as
      :func:`loom_layer_terms`'.
    * ``down_input``: the input norm's output ``e Sn h``, saved (one storage) by the query
      (``linear_q_down_proj`` | ``linear_q_proj``) and key-value down projections.
    * ``latent_norms`` (``--qk-layernorm``), *device*: the query latent's norm
      (``q_layernorm``, ``q`` wide) and the key latent's (``kv_layernorm``, ``r`` wide; its
      input is a view of the ``[Sn, r + dr]`` down projection output) (:func:`norm_bytes`).
    * ``q_up_input``: ``linear_q_up_proj``'s input, the query latent ``e Sn q`` (the SP
      column-parallel GEMM saves its shard); ``kv_up_input``: ``linear_kv_up_proj``'s,
      ``e Sn r`` (the normed latent), or without the norm the down projection's whole output
      ``e Sn (r + dr)`` (the latent is a view of it).
    * ``core_inputs``: the core's Q (``torch.cat`` of the content and rotated parts, or its
      YaRN-scaled copy), K (``torch.cat``) and V (made contiguous: as a view of
      ``linear_kv_up_proj``'s output it kept all ``dn + dv`` channels alive):
      ``e S a (2 dq + dv) / t`` when the core saves them (CUDA's fused kernel; the CPU math
      path only in fp32, where its fp32 ``q k^T`` reads K and V as they are).
    * ``core``, *device*: what the core keeps beyond its inputs, dropped by selective
      recompute: on CUDA (``dq != dv``: the memory-efficient SDPA kernel, flash needs equal
      head dims) the fp32 log-sum-exp ``4 S a / t``; on CPU the math path (PyTorch
      ``_scaled_dot_product_attention_math``) its fp32 softmax ``4 S a s / t`` and, in 16-bit,
      its fp32 copies of Q, K, V ``4 S a (2 dq + dv) / t`` (in fp32: the scaled Q, new,
      ``4 S a dq / t``; K and V are ``core_inputs``).
    * ``attention_out``: ``linear_proj``'s input ``e S a dv / t``.
    The decoupled RoPE key ``k_pe`` ``[S, 1, dr]`` and the rotated query part are consumed by
    ``torch.cat`` (which saves nothing)."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    h, a, f = model.hidden_size, model.num_attention_heads, model.ffn_size
    q, r = model.q_lora_rank or 0, model.kv_lora_rank
    dn, dr, dv = model.qk_head_dim, model.qk_pos_emb_head_dim, model.v_head_dim
    dq = dn + dr
    e, cpu = float(elem_bytes), device == "cpu"
    s = seq_length
    S = s * np.asarray(micro_batch, dtype=np.float64)
    Sn = np.where(np.asarray(sp) > 0, S / t, S)
    ln = model.qk_layernorm
    latent_norms = 0.0 * S
    if ln:
        latent_norms = norm_bytes(model, Sn, r, r + dr, e, cpu)
        if q:
            latent_norms = latent_norms + norm_bytes(model, Sn, q, q, e, cpu)
    if cpu:
        core = 4.0 * S * a * s / t + 4.0 * S * a * (dq if e == 4 else 2 * dq + dv) / t
        core_inputs = e * S * a * (dq + dv) / t if e == 4 else 0.0 * S
    else:
        core, core_inputs = 4.0 * S * a / t, e * S * a * (2 * dq + dv) / t
    return {
        "norms": 2 * norm_bytes(model, Sn, h, h, e, cpu),
        "down_input": e * Sn * h,
        "latent_norms": latent_norms,
        "q_up_input": e * Sn * q,
        "kv_up_input": e * Sn * (r if ln else r + dr),
        "rope_tables": 4 * e * s * dr + 0.0 * S if e != 4 else 0.0 * S,
        "core_inputs": core_inputs,
        "core": core,
        "attention_out": e * S * a * dv / t,
        "fc1_input": e * Sn * h,
        "mlp": e * S * f * (3 if gated_mlp(model) else 2) / t,
        "dropout_masks": (2 * Sn * h * (e if cpu else 1.0) if model.hidden_dropout > 0
                          else 0.0 * S),
    }


def mla_layer_bytes(model: ModelConfig, seq_length: int, micro_batch, t=1, sp=0,
                    elem_bytes: int = 2, device: str = "cuda", recompute_group: int = 1) -> dict:
    """:func:`loom_layer_bytes`' ``{"none", "selective", "full", "scores"}`` of an MLA layer
    (:func:`mla_layer_terms`): selective recompute checkpoints the core
    (``DotProductAttention``), which drops ``core`` and keeps its inputs Q, K, V
    (``e S a (2 dq + dv) / t``)."""
    terms = mla_layer_terms(model, seq_length, micro_batch, t, sp, elem_bytes, device)
    none = sum(terms.values())
    a, dq, dv = model.num_attention_heads, model.q_head_dim, model.v_head_dim
    S = seq_length * np.asarray(micro_batch, dtype=np.float64)
    Sn = np.where(np.asarray(sp) > 0, S / t, S)
    kept = elem_bytes * S * a * (2 * dq + dv) / t
    return {"none": none, "selective": none - terms["core"] - terms["core_inputs"] + kept,
            "full": elem_bytes * Sn * model.hidden_size / recompute_group,
            "scores": terms["core"]}


def cp_core_terms(model: ModelConfig, seq_length: int, micro_batch, t, cp,
                  elem_bytes: int, cp_comm_type: str) -> dict:
    """The terms a context-parallel attention core (``loom/parallel/context``) changes in
    :func:`loom_layer_terms`' ``terms``, with ``S = s b / c`` local tokens:

    * ``p2p`` (``ring.py`` ``RingAttention``): saves Q, K, V as given (``qkv``, ``rope``
      unchanged), its fp32 output accumulator ``4 S a d / t`` and log-sum-exp, and the ring's
      int64 positions ``[c, s / c]`` (``8 s``); the output projection saves its own copy of the
      output (``e S a d / t``: ``[b, a, s, d]`` re-laid-out to ``[s, b, a d]``).
    * ``allgather`` (``attention.py``): the core runs on the gathered keys: K and V
      ``2 e s b g d / t`` replace the local QKV storage and rotated K (``qkv`` and ``rope``
      keep only the rotated Q), plus the additive causal mask ``e (s / c) s`` of the fused
      kernel (``[s / c, s]``, no ``b``).
    * ``a2a`` (``a2a.py`` ``ulysses_attention``): Q, K, V after the all-to-all (``e S (a + 2g) d
      / t``, the fused storage's size; the local ones are not saved: ``rope`` keeps only the
      tables), the core's output and its all-to-all'd copy (``2 e S a d / t``), and the
      ``order`` / ``inverse`` permutations, int64 ``[s]`` each (``16 s``). Assumes ``c``
      divides ``g / t`` (else ``expand_groups`` repeats K, V)."""
    a, g, d = model.num_attention_heads, model.num_kv_groups, model.head_dim
    e = float(elem_bytes)
    s = seq_length
    S = s * np.asarray(micro_batch, dtype=np.float64) / cp
    rope = model.position_embedding_type in ("rope", "yarn")
    if cp_comm_type == "p2p":
        return {"attention_out": (e + 4.0) * S * a * d / t,
                "cp_core": 8.0 * s + 0.0 * S}
    if cp_comm_type == "allgather":
        return {"qkv": 2 * e * S * cp * g * d / t,
                "rope": e * S * a * d / t if rope else 0.0 * S,
                "cp_core": e * (s / cp) * s + 0.0 * S}
    if cp_comm_type == "a2a":
        return {"rope": 0.0 * S, "attention_out": 2 * e * S * a * d / t,
                "cp_core": 16.0 * s + 0.0 * S}
    raise ValueError(f"cp_comm_type must be p2p, allgather or a2a, got {cp_comm_type!r}")


def loom_layer_bytes(model: ModelConfig, seq_length: int, micro_batch, t=1, cp=1, sp=0,
                     elem_bytes: int = 2, device: str = "cuda", recompute_group: int = 1,
                     cp_comm_type: str = "p2p") -> dict:
    """``{"none", "selective", "full", "scores"}``: bytes one loom layer keeps per micro-batch
    without recomputation, with selective recompute, with full recompute (the group input
    ``e Sn h`` shared by ``recompute_group`` layers), and the selective working memory.

    Selective recompute checkpoints the attention core (``SelectiveRecompute`` modules), which
    keeps its inputs: without CP it drops only ``softmax_lse`` (Q, K, V and the output are
    saved by their neighbours anyway); ``allgather`` also drops the mask (``cp_core``); ``a2a``
    drops the core's output copy ``e S a d / t`` but stores the core's ``arange(s)`` positions
    (int64, ``8 s``); ``p2p``'s ``RingAttention`` is no such module: nothing is recomputed."""
    terms = loom_layer_terms(model, seq_length, micro_batch, t, cp, sp, elem_bytes, device,
                             cp_comm_type)
    none = sum(terms.values())
    S = seq_length * np.asarray(micro_batch, dtype=np.float64) / cp
    Sn = np.where(np.asarray(sp) > 0, S / t, S)
    dropped = terms["softmax_lse"]
    if cp_comm_type == "p2p":
        ring_dropped = 0.0 * S
    elif cp_comm_type == "allgather":
        ring_dropped = dropped + terms["cp_core"]
    else:  # a2a
        a, d = model.num_attention_heads, model.head_dim
        ring_dropped = dropped + elem_bytes * S * a * d / t - 8.0 * seq_length
    dropped = np.where(np.asarray(cp) > 1, ring_dropped, dropped)
    return {"none": none, "selective": none - dropped,
            "full": elem_bytes * Sn * model.hidden_size / recompute_group,
            "scores": dropped}


def loom_extra_over_kor(model: ModelConfig, seq_length: int, L: dict, cp_codes,
                        mlp: bool = True) -> dict:
    """``{"none", "selective"}`` (bytes, arrays over the rows of layout ``L``): what loom's layer
    keeps on a GPU (:func:`loom_layer_bytes`, CUDA, 16-bit) beyond the planner's KOR count with
    flash attention (:func:`loom.planner.activations.activation_bytes_per_layer`, with
    :mod:`loom.planner.mla`'s terms for MLA: :func:`mla_layer_bytes` there; 0 on CP rows), per mode;
    ``cp_codes`` each row's CP type (:data:`loom.planner.context_parallel.CP_COMM_TYPES`
    index; a2a+p2p counted as p2p, its ring). ``mlp`` False: the attention side only, for a
    layer whose MLP is counted elsewhere (the dense MLP keeps nothing beyond KOR's count, so
    the same numbers). Full recompute keeps the same input in both (no extra)."""
    from loom.planner.activations import activation_bytes_per_layer
    from loom.planner.context_parallel import CP_COMM_TYPES
    t, c, b, sp = L["tp"], L["cp"], L["mbs"], L["sp"]
    kor = activation_bytes_per_layer(model, seq_length, L, flash_attention=True, moe_share=0.0)
    codes = np.asarray(cp_codes)
    out = {"none": 0.0 * t, "selective": 0.0 * t}
    if model.multi_latent_attention:  # MLA (:func:`mla_layer_terms`); its CP forms not derived
        got = mla_layer_bytes(model, seq_length, b, t=t, sp=sp)
        return {mode: np.where(c > 1, 0.0, got[mode] - kor[mode]) for mode in out}
    for k, name in enumerate(CP_COMM_TYPES[:3]):
        got = loom_layer_bytes(model, seq_length, b, t=t, cp=c, sp=sp, cp_comm_type=name)
        rows = (codes == k) | ((codes == 3) & (k == 0))
        for mode in out:
            out[mode] = np.where(rows, got[mode] - kor[mode], out[mode])
    return out


def loom_moe_mlp_terms(model: ModelConfig, seq_length: int, micro_batch, t=1, cp=1, etp=None,
                       elem_bytes: int = 2, ep=1, imbalance: float = 1.0,
                       allgather=None) -> dict:
    """The named terms (bytes) of what loom's MoE MLP (``loom/models/moe.py``, router of
    ``moe_router.py``, under TP the dispatcher of ``loom/parallel/expert_dispatch.py``) saves
    on one rank of TP ``t`` (expert TP ``u`` = ``etp``, default t; ``r = u / t`` the share of
    the kept pairs the rank owns) x CP ``cp``, EP 1, for ``S = s b / c`` tokens (the rank's CP
    shard: routing is per token), Megatron's default router (softmax top-k renormalized, the
    load-balancing aux loss, no z-loss, dropless), ``E`` experts, ``k`` per token, ``f_e``
    wide. Sequence parallelism changes none of them: the layer all-gathers its ``[s/t, b, h]``
    tokens first and every TP rank routes all S (``loom/parallel/expert.py``; the gather and
    the final split save nothing). They replace the dense ``mlp`` and ``fc1_input`` terms of
    :func:`loom_layer_terms` (the second norm's 16-bit output is saved only by a shared
    expert's FC1; the router keeps its fp32 copy, the experts their sorted copy):

    * ``router``: its fp32 GEMM keeps the fp32 copies of its input ``4 S h`` and weight
      ``4 E h``; the fp32 probabilities, twice (the choice and the aux loss) ``2 x 4 S E``;
      the top-k values ``4 S k``, their sum ``4 S``, the int64 indices ``8 S k``, the aux
      loss's per-token sum ``4 S`` (what its count of tokens per expert saves is freed with
      its branch during the forward).
    * ``dispatch``: the rank's own pairs' tokens sorted by expert ``e S k r h`` (saved by the
      experts' FC1) and the experts' outputs in that order ``e S k r h`` (the source of the
      ``index_copy`` back to ``[S k, h]``), the kept pairs' int64 indices sorted by expert
      ``8 S k`` (the owned ones a strided view of them) and the owned pairs' tokens
      ``8 S k r``.
    * ``experts``: per routed row FC1's output and the product (gated: ``3 e f_e / u`` per row,
      the SwiGLU recomputing its SiLU in backward; GeLU ``2 e f_e / u``), ``S k r`` rows:
      ``(3|2) e S k f_e / t`` whatever u.
    * ``combine``: the ``[S, k, h]`` outputs the weighted sum multiplies (``e S k h``: at
      t = 1 the scattered-back storage, under TP the all-reduced one) and the 16-bit routing
      weights ``e S k``.
    * ``shared_expert``: its input ``e S h``; under TP its output's rows in the combine's
      all-reduced storage ``e S h`` (the dispatcher concatenates both for its one all-reduce);
      and a dense MLP of
      ``moe_shared_expert_intermediate_size`` (``mlp`` of :func:`loom_layer_terms`'s form,
      split over t) when the model has one (its gate, ``--moe-shared-expert-gate``, not
      covered).

    EP ``ep`` > 1 (read off ``loom/parallel/expert_dispatch.py``; equal to the bytes saved on
    every rank of a real gloo world, ``imbalance`` being that rank's rows over the mean:
    ``tests/planner/test_planner_moe_sp_cp.py::test_moe_layer_formula_equals_saved_bytes_at_ep``):
    the rank runs the
    pairs it receives, ``lambda S k r`` on the busiest rank (``imbalance``), so ``experts``
    scales by ``lambda`` and ``dispatch`` becomes, per ``--moe-token-dispatcher-type``:
    ``alltoall`` (``ParallelDispatcher._alltoall``) the received rows sorted by local expert
    and the experts' outputs ``2 lambda e S k r h``, the outputs returned by the reverse
    all-to-all (the last ``index_copy``'s source) ``e S k r h``, the int64 sorted pairs ``8 S
    k``, the owned pairs' tokens ``8 S k r`` and the received rows' order ``8 lambda S k r``;
    ``allgather`` (``_allgather``: the EP group's tokens gathered, the rows of the local
    experts picked) the picked rows and the experts' outputs ``2 lambda e S k r h`` and their
    int64 pair indices and tokens ``16 lambda S k r``. ``allgather`` (argument): which of the
    two, per row (bool array, a searched layout's dispatcher:
    :func:`loom.planner.moe.allgather_rows`); None: the model's.

    Latent MoE (``--moe-latent-size`` L): the routed rows and the expert outputs are ``L``
    wide instead of h (``dispatch``, ``combine``), and ``latent`` adds the up projection's
    input ``e S L`` and the down projection's input, the layer's tokens ``e S h``, unless a
    shared expert's FC1 already keeps them. ``--moe-apply-probs-on-input`` (top-1): the
    product ``p x`` keeps its routed input ``e S w`` (w = L, or h when the tokens are not
    already kept by a shared expert's FC1) and the fp32 weights ``4 S``
    (``probs_on_input``), and the unweighted sum keeps nothing (no ``combine``; under TP nor
    the shared expert's rows of the all-reduced storage).
    """
    h, E, k, fe = (model.hidden_size, model.num_experts, model.moe_router_topk,
                   model.moe_ffn_size)
    L = model.moe_latent_size or 0
    w = L or h  # the routed rows' width
    probs_in = bool(model.moe_apply_probs_on_input)
    e = float(elem_bytes)
    S = seq_length * np.asarray(micro_batch, dtype=np.float64) / cp
    t = np.asarray(t, dtype=np.float64)
    r = (t if etp is None else np.asarray(etp, dtype=np.float64)) / t
    gated = 3 if gated_mlp(model) else 2
    f_sh = model.moe_shared_expert_intermediate_size or 0
    many = np.asarray(ep) > 1
    lam = np.where(many, imbalance, 1.0)
    return {
        "router": 4 * S * h + 4 * E * h + 8 * S * E + 4 * S * k + 8 * S * k + 8 * S,
        "dispatch": np.where(
            many & (np.asarray(model.moe_token_dispatcher_type == "allgather")
                    if allgather is None else np.asarray(allgather, dtype=bool)),
            2 * lam * e * S * k * r * w + 16 * lam * S * k * r,
            e * S * k * r * w * (2 * lam + many) + 8 * S * k * (1 + r)
            + many * 8 * lam * S * k * r),
        "experts": lam * e * S * k * gated * fe / t,
        "combine": 0.0 * S if probs_in else e * S * k * w + e * S * k,
        "shared_expert": (e * S * h * (1 + ((t > 1) & (not probs_in)))
                          + e * S * gated * f_sh / t) if f_sh else 0.0 * S,
        "latent": (e * S * L + (0 if f_sh else e * S * h)) if L else 0.0 * S,
        "probs_on_input": (e * S * (L or (0 if f_sh else h)) + 4 * S) if probs_in else 0.0 * S,
    }


def loom_moe_extra_over_kor(model: ModelConfig, seq_length: int, L: dict, cp_codes,
                            imbalance: float) -> dict:
    """``{"none", "selective"}`` (bytes, arrays over the rows of layout ``L``): what loom's MoE
    layer keeps on a GPU beyond the planner's KOR count of an MoE layer
    (:func:`loom.planner.activations.activation_bytes_per_layer` with ``moe_share = 1``, flash
    attention): :func:`loom_layer_bytes`' CUDA form without the dense ``mlp`` and
    ``fc1_input``, plus :func:`loom_moe_mlp_terms` at the row's TP, CP, expert TP and EP
    (``imbalance`` on the received rows at EP > 1), per CP type as
    :func:`loom_extra_over_kor`. Negative where Megatron-Core's layer, as the KOR count
    prices it, keeps more (``imbalance`` on every expert row, even at EP 1)."""
    from loom.planner.activations import activation_bytes_per_layer
    from loom.planner.context_parallel import CP_COMM_TYPES
    from loom.planner.moe import allgather_rows, expert_tp
    t, c, b, sp = L["tp"], L["cp"], L["mbs"], L["sp"]
    kor = activation_bytes_per_layer(model, seq_length, L, flash_attention=True,
                                     moe_load_imbalance=imbalance, moe_share=1.0)
    moe = sum(loom_moe_mlp_terms(model, seq_length, b, t=t, cp=c, etp=expert_tp(L),
                                 ep=L.get("ep", 1.0), imbalance=imbalance,
                                 allgather=allgather_rows(model, L)).values())
    codes = np.asarray(cp_codes)
    out = {"none": 0.0 * t, "selective": 0.0 * t}
    for k, name in enumerate(CP_COMM_TYPES[:3]):
        terms = loom_layer_terms(model, seq_length, b, t, c, sp, cp_comm_type=name)
        got = loom_layer_bytes(model, seq_length, b, t=t, cp=c, sp=sp, cp_comm_type=name)
        dense_mlp = terms["mlp"] + terms["fc1_input"]
        rows = (codes == k) | ((codes == 3) & (k == 0))
        for mode in out:
            out[mode] = np.where(rows, got[mode] - dense_mlp + moe - kor[mode], out[mode])
    return out


def mamba_layer_terms(model: ModelConfig, seq_length: int, micro_batch, t=1, sp=0,
                      elem_bytes: int = 2, device: str = "cuda") -> dict:
    """The named terms (bytes) of what one loom Mamba-2 layer (``loom/models/mamba/model.py``
    ``MambaLayer``: ``x + drop(mixer(norm(x)))``, ``MambaMixer``, ``MambaScan``,
    ``GatedRMSNorm``, the plain-PyTorch SSD scan ``ssd.py`` ``ssd_chunked``) saves for
    backward, without recomputation; selective recompute changes nothing (no module of the
    layer is a ``SelectiveRecompute``). Symbols: ``S = s b`` tokens (no CP: Mamba layers refuse
    it), ``Sn`` the norm / residual tokens (``S / t`` with SP), heads ``H``, groups ``G``,
    head dim ``P``, state ``N``, conv kernel ``k``, chunk ``Q`` (``C = s / Q`` chunks; the
    scan pads ``s`` to a multiple of ``Q`` and this counts the unpadded case, ``Q | s``); per
    TP rank ``d = H P / t``, ``Hl = H / t``, ``Gl = G / t``, conv channels ``cd = d + 2 Gl N``,
    in-projection width ``W = 2 d + 2 Gl N + Hl``. The scan's fp32 einsums contract left to
    right (PyTorch without ``opt_einsum``); each pairwise contraction without a summed index is
    a ``mul`` (saving both operands), one with is a ``bmm`` saving its two operands permuted
    into new fp32 copies:

    * ``norm``: the layer's input norm (:func:`norm_bytes`), *device*; ``in_proj_input``:
      ``e Sn h`` (the SP column-parallel GEMM saves its shard).
    * ``conv``: ``F.conv1d``'s left-padded input ``e b cd (s + k - 1)`` and the SiLU's input
      (the conv output) ``e S cd``.
    * ``dt``: ``softplus``'s fp32 input and output ``2 x 4 S Hl``; ``A_D``: ``-exp(A_log)``'s
      ``exp`` output and ``A`` (saved by ``dt * A``), and in 16-bit ``D.float()``: ``4 Hl`` each.
    * ``x_fp32``: the scan input x in fp32, saved by ``x * dt`` and by ``D x``: one new copy
      ``4 S d`` in 16-bit (two before ``MambaScan`` shared it); in fp32 ``x`` is a view of the
      SiLU output, ``4 S cd``.
    * ``decay``: ``exp(segsum(dt A))`` ``[b, Hl, C, Q, Q]`` ``4 S Hl Q`` and ``segsum``'s two
      bool masks ``2 Q^2``; ``exp`` of the decays to each chunk's end and of the cumulative
      decays ``2 x 4 S Hl``; the chunk recurrence's ``exp(segsum)`` ``4 b Hl (C + 1)^2`` and its
      masks ``2 (C + 1)^2``.
    * ``y_diag`` (``einsum("bclhn,bcmhn,bhclm,bcmhp->bclhp")``): C and B per head copied for
      the ``bmm`` ``2 x 4 S Hl N``, ``C B^T`` and its product with the decays ``2 x 4 S Hl Q``,
      X ``4 S d``.
    * ``states`` (``einsum("bclhn,bhcl,bclhp->bchpn")``): B per head (``repeat_interleave``'s
      output, saved by the ``mul``) and the ``mul``'s output copied ``2 x 4 S Hl N``, X
      ``4 S d``; the recurrence's ``einsum("bhzc,bchpn->bzhpn")``: the states copied
      ``4 b (C + 1) Hl P N``. With one chunk (``s <= Q``) neither this copy nor ``y_off``'s
      entering states are saved (measured).
    * ``y_off`` (``einsum("bclhn,bchpn,bhcl->bclhp")``): C per head ``4 S Hl N``, the entering
      states ``4 b C Hl P N``, their product ``4 S d``.
    * ``gated_norm`` (``GatedRMSNorm``, fp32): ``y``, ``silu(z)`` and ``y silu(z)`` ``3 x 4 S d``,
      ``z`` (a new fp32 copy ``4 S d`` in 16-bit, in fp32 a view of the in-projection output
      ``4 S W``), ``rsqrt`` ``4 S Gl``, and the weight's ``mul`` input (the normalized output
      cast to ``e``: ``e S d``).
    * ``out_proj_input``: the row-parallel out-projection's input ``e S d`` (a copy:
      ``[b, s, d]`` transposed).
    * ``dropout_masks``: one mask ``Sn h`` with ``hidden_dropout > 0``, *device* as the dense
      layer's.
    """
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    h = model.hidden_size
    e, cpu = float(elem_bytes), device == "cpu"
    P, N, k, Q = (model.mamba_head_dim, model.mamba_state_dim, model.mamba_d_conv,
                  model.mamba_chunk_size)
    H, G = model.mamba_d_inner // P, model.mamba_num_groups
    s = seq_length
    b = np.asarray(micro_batch, dtype=np.float64)
    S = s * b
    Sn = np.where(np.asarray(sp) > 0, S / t, S)
    d, Hl, Gl = H * P / t, H / t, G / t
    cd = d + 2 * Gl * N
    W = 2 * d + 2 * Gl * N + Hl
    C = -(-s // Q)
    f32 = e == 4
    return {
        "norm": norm_bytes(model, Sn, h, h, e, cpu),
        "in_proj_input": e * Sn * h,
        "conv": e * b * cd * (s + k - 1) + e * S * cd,
        "dt": 8.0 * S * Hl,
        "A_D": 4.0 * Hl * (2 if f32 else 3) + 0.0 * S,
        "x_fp32": 4.0 * S * cd if f32 else 4.0 * S * d,
        "decay": (4.0 * S * Hl * Q + 2 * Q * Q + 8.0 * S * Hl
                  + 4.0 * b * Hl * (C + 1) ** 2 + 2 * (C + 1) ** 2),
        "y_diag": 8.0 * S * Hl * N + 8.0 * S * Hl * Q + 4.0 * S * d,
        "states": 8.0 * S * Hl * N + 4.0 * S * d + (C > 1) * 4.0 * b * (C + 1) * Hl * P * N,
        "y_off": 4.0 * S * Hl * N + (C > 1) * 4.0 * b * C * Hl * P * N + 4.0 * S * d,
        "gated_norm": 12.0 * S * d + (4.0 * S * W if f32 else 4.0 * S * d) + 4.0 * S * Gl
        + e * S * d,
        "out_proj_input": e * S * d,
        "dropout_masks": Sn * h * (e if cpu else 1.0) if model.hidden_dropout > 0 else 0.0 * S,
    }


def mamba_layer_bytes(model: ModelConfig, seq_length: int, micro_batch, t=1, sp=0,
                      elem_bytes: int = 2, device: str = "cuda", recompute_group: int = 1) -> dict:
    """:func:`loom_layer_bytes`' ``{"none", "selective", "full", "scores"}`` of a Mamba-2 layer
    (:func:`mamba_layer_terms`): selective = none (nothing to checkpoint), full keeps the
    group input ``e Sn h / N``."""
    none = sum(mamba_layer_terms(model, seq_length, micro_batch, t, sp, elem_bytes,
                                 device).values())
    S = seq_length * np.asarray(micro_batch, dtype=np.float64)
    Sn = np.where(np.asarray(sp) > 0, S / t, S)
    return {"none": none, "selective": none,
            "full": elem_bytes * Sn * model.hidden_size / recompute_group, "scores": 0.0 * S}


def loom_kind_extra_over_kor(model: ModelConfig, seq_length: int, L: dict, cp_codes,
                             fused: bool = True) -> dict:
    """``{kind: {"none", "selective"}}`` (bytes, arrays over the rows of layout ``L``): what
    loom's layer of each kind of a hybrid stack (``M`` Mamba-2, ``*`` attention, ``-`` MLP;
    :mod:`loom.planner.mamba`) keeps on a GPU (CUDA, 16-bit) beyond the planner's count
    :func:`loom.planner.mamba.kind_activation_bytes` (``fused``). ``M``:
    :func:`mamba_layer_bytes`; ``*`` and ``-``: the two halves of :func:`loom_layer_bytes`'
    dense layer (the MLP half its second norm, ``fc1_input``, ``mlp`` and one dropout mask; the
    attention half the rest, with ``cp_codes``' attention core as
    :func:`loom_extra_over_kor`). Kinds the pattern lacks are 0."""
    from loom.planner.context_parallel import CP_COMM_TYPES
    from loom.planner.mamba import kind_activation_bytes, kind_counts
    t, c, b, sp = L["tp"], L["cp"], L["mbs"], L["sp"]
    n = kind_counts(model)
    zero = {"none": 0.0 * t, "selective": 0.0 * t}
    out = {k: dict(zero) for k in n}
    if n["M"]:
        got = mamba_layer_bytes(model, seq_length, b, t=t, sp=sp)
        kor = kind_activation_bytes(model, seq_length, L, "M", fused)
        out["M"] = {mode: got[mode] - kor[mode] for mode in zero}
    if not (n["*"] or n["-"]):
        return out
    codes = np.asarray(cp_codes)
    kor = {k: kind_activation_bytes(model, seq_length, L, k, fused) for k in ("*", "-")}
    for k, name in enumerate(CP_COMM_TYPES[:3]):
        rows = (codes == k) | ((codes == 3) & (k == 0))
        terms = loom_layer_terms(model, seq_length, b, t, c, sp, cp_comm_type=name)
        mlp = terms["norms"] / 2 + terms["fc1_input"] + terms["mlp"] + terms["dropout_masks"] / 2
        got = loom_layer_bytes(model, seq_length, b, t=t, cp=c, sp=sp, cp_comm_type=name)
        for mode in zero:
            out["*"][mode] = np.where(rows, got[mode] - mlp - kor["*"][mode], out["*"][mode])
            out["-"][mode] = np.where(rows, mlp - kor["-"][mode], out["-"][mode])
    return out
