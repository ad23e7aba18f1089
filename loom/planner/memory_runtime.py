"""What a training runtime keeps alive beyond KOR table 2: the runtime-specific memory terms.

KOR table 2 (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models") counts the tensors a transformer layer *needs* for its backward pass. A real runtime keeps
some more, and its peak (``torch.cuda.max_memory_allocated``) also holds the largest transient.
:attr:`loom.planner.layout.Options.runtime` names the runtime:

* ``"loom"``: loom's own layer (``loom train --dry-run`` and ``benchmarks/planner_vs_measured.py``
  use it): the KOR count plus what loom's modules keep beyond it, measured with
  ``saved_tensors_hooks`` (:mod:`loom.planner.layer_bytes`, :func:`loom_layer_extra`: the
  gathered sequence-parallel GEMM inputs, RoPE's rotated Q / K, the SwiGLU's SiLU output, the
  norms' statistics, the CP cores' own tensors; MLA's and, per kind, a Mamba hybrid stack's
  layers by their own formulas). Loss: loom's
  fused linear cross-entropy (``loom/parallel/cross_entropy.py``) never holds the logits; it
  saves ``dL/dx`` ``[S, h]``, ``dL/dw`` ``[Vp/t, h]`` and the log-sum-exp ``[S]`` (fp32) per
  micro-batch, ``4 S h + 4 Vp h / t + 4 S``, and its forward peaks with one chunk's logits,
  ``(4 + 2) n Vp / t`` for ``n`` tokens of its chunk rule (16-bit GEMMs), freed before it
  returns (:mod:`loom.parallel.cross_entropy_cost`). A model with final-logit soft-capping
  (Gemma 3) runs the loss unfused: the fp32 logits ``4 S Vp / t`` (KOR sec 4.3). No backward
  transient.
* ``"megatron-core"``: Megatron-Core with Transformer Engine (d98e8a6). Per layer the KOR count:
  TE's fused LayerNorm-linear saves the norm input and output, the fused bias-SwiGLU
  (``megatron/core/fusions/fused_bias_swiglu.py``) saves only its ``[S, 2f/t]`` input and fc2 its
  ``[S, f/t]`` input, the attention output is the tensor ``linear_proj`` saves. Logits
  (``megatron/core/tensor_parallel/cross_entropy.py``): the bf16 logits stay referenced by the
  caller while the loss works on their fp32 copy *in place* (``vocab_parallel_logits -=
  logits_max``, ``torch.exp(..., out=...)``): ``(2 + 4) S V / t``. Backward transient below.
* ``"megatron-legacy"``: Megatron-LM's 2023 ``ParallelTransformerLayer`` with ``--use-flash-attn``
  (flash-attn's varlen function) and an unfused ``--swiglu``, the code Megatron-LM PR 482
  measured (``tools/get_training_info``). Beyond KOR, per layer:
  the flash-attention output ``[b s, a/t, d]`` that flash-attn saves *and* its re-laid-out
  contiguous copy ``[s, b, a d/t]`` that the output projection saves (``rearrange(...)
  .contiguous()``): ``+2 S a d / t``; the SwiGLU ``F.silu(x[0]) * x[1]``: the product saves the
  SiLU output ``[S, f/t]`` (and SiLU its input, a view of the bias-added ``[S, 2f/t]``):
  ``+2 S f / t``. Logits: ``vocab_parallel_cross_entropy(output.float(), ...)`` keeps the bf16
  logits (caller), the fp32 copy (the Function's argument) and the *out-of-place* shifted
  ``vocab_parallel_logits - logits_max``: ``(2 + 4 + 4) S V / t`` at the end of the forward.

Backward transient (both Megatron runtimes; :func:`backward_working_bytes`): at the start of the
backward of a stage's last layer every saved tensor is still alive; the MLP's backward then holds
the incoming ``[S, f/t]`` gradient of fc2's input and creates the activation's input gradient
(``[S, 2f/t]`` gated, ``[S, f/t]`` GeLU) before fc2's saved input (``[S, f/t]``) is released:
``+4 S f / t`` bytes (gated; ``+2 S f / t`` GeLU), alongside the residual-stream gradient received
and its dropout/bias-add copy ``2 x 2 S h`` (``/ t`` with SP). On the stage with the output layer
the forward's logits peak and this backward peak do not coexist: the stage holds the larger.

Every factor above is read off the code named, not fitted; the PR's four measured peaks are a
check (tests/planner/test_planner_memory_runtime.py).
"""

from __future__ import annotations

import numpy as np

from loom.config import ModelConfig
from loom.parallel.cross_entropy_cost import forward_transient_bytes, saved_bytes
from loom.planner.layer_shape import gated_mlp

RUNTIMES = ("loom", "megatron-core", "megatron-legacy")

# bytes per logit element at the forward peak of the loss (see the module docstring); "loom":
# its unfused loss only (final-logit soft-capping)
LOGITS_BYTES = {"loom": 4.0, "megatron-core": 6.0, "megatron-legacy": 10.0}


def check_runtime(runtime: str) -> str:
    """``runtime`` if known; raises ValueError naming :data:`RUNTIMES` otherwise."""
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r}: choose one of {', '.join(RUNTIMES)}")
    return runtime


def layer_extra_bytes(model: ModelConfig, S, t, runtime: str, flash_attention: bool):
    """Bytes one layer keeps per micro-batch beyond KOR table 2 (``S`` tokens per GPU, TP ``t``):
    ``megatron-legacy``: ``2 S a d / t`` (flash output and its contiguous copy, with flash
    attention) + ``2 S f / t`` (the unfused SwiGLU's SiLU output, gated MLPs); 0 otherwise."""
    if check_runtime(runtime) != "megatron-legacy":
        return 0.0 * S
    flash = 2.0 * S * model.num_attention_heads * model.head_dim if flash_attention else 0.0
    gated = 2.0 * S * model.ffn_size if gated_mlp(model) else 0.0
    return (flash + gated) / t


def loom_layer_extra(model: ModelConfig, seq_length: int, L: dict, opts,
                     mlp: bool = True) -> dict:
    """``{"none", "selective"}``: bytes loom's own layer keeps per micro-batch beyond KOR table 2
    with flash attention, per recompute mode (:func:`loom.planner.layer_bytes.loom_extra_over_kor`,
    measured on loom's modules), when ``opts`` (:class:`~loom.planner.layout.Options`) asks for
    it: ``layer_memory = "loom"``, ``runtime = "loom"``, fused attention (loom's only
    attention); MLA layers by their own formula (0 on CP rows and under DSA, whose loom forms
    are not derived); 0 otherwise and for hybrid stacks (:func:`loom_kind_extra`). ``mlp``
    False (a model with MoE layers): the attention side only, for MLA (the same numbers, the
    dense MLP keeping nothing beyond KOR's count); 0 for a GQA MoE model, whose layers of
    both kinds are :func:`loom_moe_extra`'s."""
    from loom.planner.context_parallel import row_comm_types
    from loom.planner.layer_bytes import loom_extra_over_kor
    from loom.planner.mamba import is_hybrid
    zero = 0.0 * L["tp"]
    if (not _counts_loom(opts) or model.dsa or is_hybrid(model)
            or (not mlp and not model.multi_latent_attention)):
        return {"none": zero, "selective": zero}
    return loom_extra_over_kor(model, seq_length, L, row_comm_types(L, opts.cp_comm_type), mlp)


def loom_moe_extra(model: ModelConfig, seq_length: int, L: dict, opts) -> dict | None:
    """``{"dense": {"none", "selective"}, "moe": {...}}``: bytes loom's own dense and MoE
    layers of a GQA MoE model keep per micro-batch beyond the planner's KOR counts
    (:func:`loom.planner.layer_bytes.loom_extra_over_kor`,
    :func:`loom.planner.layer_bytes.loom_moe_extra_over_kor`, measured on loom's modules),
    under the conditions of :func:`loom_layer_extra`; None otherwise (MLA: the attention side
    of :func:`loom_layer_extra` in both kinds)."""
    from loom.planner.context_parallel import row_comm_types
    from loom.planner.layer_bytes import loom_extra_over_kor, loom_moe_extra_over_kor
    from loom.planner.mamba import is_hybrid
    if (not model.num_experts or not _counts_loom(opts) or model.dsa or is_hybrid(model)
            or model.multi_latent_attention):
        return None
    codes = row_comm_types(L, opts.cp_comm_type)
    return {"dense": loom_extra_over_kor(model, seq_length, L, codes),
            "moe": loom_moe_extra_over_kor(model, seq_length, L, codes,
                                           opts.moe_load_imbalance)}


def _counts_loom(opts) -> bool:
    return (opts.layer_memory == "loom" and check_runtime(opts.runtime) == "loom"
            and opts.flash_attention)


def loom_kind_extra(model: ModelConfig, seq_length: int, L: dict, opts) -> dict:
    """``{kind: {"none", "selective"}}``: bytes loom's own layer of each kind of a hybrid
    (Mamba) stack keeps per micro-batch beyond :func:`loom.planner.mamba.kind_activation_bytes`
    (:func:`loom.planner.layer_bytes.loom_kind_extra_over_kor`, measured on loom's modules)
    under the conditions of :func:`loom_layer_extra`; 0 otherwise."""
    from loom.planner.context_parallel import row_comm_types
    from loom.planner.layer_bytes import loom_kind_extra_over_kor
    from loom.planner.mamba import KINDS
    zero = 0.0 * L["tp"]
    if not _counts_loom(opts):
        return {k: {"none": zero, "selective": zero} for k in KINDS}
    return loom_kind_extra_over_kor(model, seq_length, L, row_comm_types(L, opts.cp_comm_type))


def _fused(model: ModelConfig, runtime: str) -> bool:
    return runtime == "loom" and not model.final_logit_softcapping


def logits_bytes(model: ModelConfig, S, Vp, t, runtime: str):
    """Bytes the loss keeps per micro-batch on the output stage from its forward to its
    backward (``S`` tokens, ``Vp`` the padded vocabulary, TP ``t``): loom's fused loss
    ``4 S h + 4 Vp h / t + 4 S`` (:func:`loom.parallel.cross_entropy_cost.saved_bytes`); else
    ``k S Vp / t`` with ``k`` of :data:`LOGITS_BYTES`."""
    if _fused(model, check_runtime(runtime)):
        return saved_bytes(S, model.hidden_size, Vp / t)
    return LOGITS_BYTES[runtime] * S * Vp / t


def loss_transient_bytes(model: ModelConfig, S, Vp, t, runtime: str):
    """Bytes the loss's forward holds on top of :func:`logits_bytes` and frees before it returns:
    loom's fused loss, one chunk's logits (fp32) and their copy in the 16-bit GEMM dtype the
    planner assumes (:func:`loom.parallel.cross_entropy_cost.forward_transient_bytes`); 0
    otherwise."""
    if not _fused(model, check_runtime(runtime)):
        return 0.0 * S
    return forward_transient_bytes(S, model.hidden_size, Vp / t, gemm_bytes=2)


def backward_working_bytes(model: ModelConfig, S, t, sp, runtime: str):
    """Transient of the backward of a stage's last layer over its saved tensors (bytes): 0 for
    ``loom``; for the Megatron runtimes ``(4 | 2) S f / t`` (gated | GeLU MLP) + ``4 S h``
    (``/ t`` with sequence parallelism ``sp``); see the module docstring."""
    if check_runtime(runtime) == "loom":
        return 0.0 * S
    f_part = (4.0 if gated_mlp(model) else 2.0) * S * model.ffn_size / t
    return f_part + 4.0 * S * model.hidden_size / np.where(np.asarray(sp) > 0, t, 1.0)
