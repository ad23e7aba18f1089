"""Megatron-LM's implementation switches: flags that pick a kernel, a memory or I/O strategy, or
a launcher detail, and leave the trained model unchanged. loom accepts each one with
Megatron's name, type and default (so Megatron's own example scripts run unchanged) and reports
once at start, on rank 0, every one given a non-default value: "no effect in loom: ...".
Never silently dropped (:func:`no_effect_report`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, Optional

from loom.config.fields import flag, opt

TransformerImpl = Literal["local", "transformer_engine", "inference_optimized"]
AttentionBackend = Literal["flash", "fused", "unfused", "local", "auto"]
CudaGraphImpl = Literal["none", "local", "transformer_engine", "full_iteration"]
Fp8Format = Literal["e4m3", "hybrid"]
Fp8AmaxAlgo = Literal["most_recent", "max"]
DataLoaderType = Literal["single", "cyclic", "external"]
ShardingStrategy = Literal["no_shard", "optim", "optim_grads", "optim_grads_params"]
GradDtype = Literal["fp32", "bf16", "fp16", "auto"]


@dataclass
class ImplementationSwitches:
    """Megatron's kernel, memory and launcher switches (a mixin of TrainingConfig);
    reported at start when set, changing nothing loom computes."""

    use_mcore_models: bool = opt(False, "Megatron: use Megatron-Core models (loom's models are "
                                        "its own; no effect)")
    transformer_impl: TransformerImpl = opt("transformer_engine", "Megatron: layer "
                                            "implementation (no effect in loom)")
    attention_backend: AttentionBackend = opt("auto", "Megatron: attention kernel (no effect "
                                                      "in loom)")
    no_masked_softmax_fusion: bool = opt(False, "Megatron: unfused masked softmax (no effect)")
    no_rope_fusion: bool = opt(False, "Megatron: unfused RoPE kernel (no effect)")
    no_bias_swiglu_fusion: bool = opt(False, "Megatron: unfused bias+SwiGLU (no effect)")
    no_bias_gelu_fusion: bool = opt(False, "Megatron: unfused bias+GeLU (no effect)")
    no_bias_dropout_fusion: bool = opt(False, "Megatron: unfused bias+dropout+add (no effect)")
    no_gradient_accumulation_fusion: bool = opt(False, "Megatron: unfused weight-gradient "
                                                       "accumulation (no effect)")
    cross_entropy_loss_fusion: bool = opt(False, "Megatron: fused cross-entropy kernel "
                                                 "(no effect)")
    use_flash_attn: bool = opt(False, "Megatron: FlashAttention kernel (no effect in loom)")
    export_force_local_attention: bool = opt(
        False, "Megatron ModelOpt: local DotProductAttention instead of TransformerEngine's "
               "(no effect in loom)")
    cuda_graph_impl: CudaGraphImpl = opt("none", "Megatron: CUDA graph capture (no effect)")
    disable_gloo_process_groups: bool = opt(False, "Megatron: no gloo side groups (no effect)")
    manual_gc: bool = opt(False, "Megatron: manual Python garbage collection (no effect)")
    manual_gc_interval: int = opt(0, "Megatron: iterations between manual collections "
                                     "(no effect)", ge=0)
    empty_unused_memory_level: int = opt(0, "Megatron: empty the CUDA cache each iteration, "
                                            "0-2 (no effect)", ge=0, lt=3)
    attention_softmax_in_fp32: bool = opt(False, "Megatron: masking and softmax in fp32 (no "
                                                 "effect: loom's attention kernel chooses)")
    apply_query_key_layer_scaling: bool = opt(
        False, "Megatron: q k^T scaled by 1/layer number in the fp16 score matrix and back by "
               "the layer number in an fp32 softmax (no effect: loom's attention kernel "
               "computes scores and softmax in fp32 and (s/L) L = s; Megatron's fused kernels "
               "ignore it too)")
    grad_reduce_in_bf16: bool = opt(False, "Megatron: reduce gradients in bf16 (no effect: "
                                           "loom reduces them in fp32)")
    fp8_format: Optional[Fp8Format] = opt(None, "Megatron: FP8 training recipe (no effect: "
                                                "loom trains in fp32/bf16/fp16)")
    fp8_amax_history_len: int = opt(1, "Megatron: FP8 amax history (no effect)", ge=1)
    fp8_amax_compute_algo: Fp8AmaxAlgo = opt("most_recent", "Megatron: FP8 amax algorithm "
                                                            "(no effect)")
    fp8_param_gather: bool = opt(False, "Megatron: FP8 parameter all-gather (no effect)")
    init_model_with_meta_device: bool = opt(False, "Megatron: build on the meta device (loom "
                                                   "always does; no effect)")
    use_nccl_ub: bool = opt(False, "Megatron: NCCL user buffers (no effect)")
    fsdp_double_buffer: bool = opt(False, "Megatron FSDP: double buffering (no effect)")
    fsdp_manual_registration: bool = opt(False, "Megatron FSDP: manual buffer registration "
                                                "(no effect)")
    megatron_fsdp_grad_comm_dtype: GradDtype = opt(
        "auto", "Megatron FSDP: gradient communication dtype (no effect: fp32 in loom)")
    megatron_fsdp_main_grads_dtype: GradDtype = opt(
        "auto", "Megatron FSDP: main-gradient dtype (no effect: fp32 in loom)")
    moe_permute_fusion: bool = opt(False, "Megatron: fused MoE token permutation (no effect)")
    moe_flex_dispatcher_backend: Literal["deepep", "hybridep", "ncclep"] = opt(
        "deepep", "Megatron: backend of the flex token dispatcher (no effect)")
    enable_experimental: bool = opt(False, "Megatron: experimental features (no effect)")
    spec: Optional[str] = opt(None, "Megatron: MODULE NAME of a layer spec (no effect: "
                                    "--model-type picks loom's family)",
                                    words=True)
    recompute_modules: Optional[str] = opt(
        None, "Megatron: modules selective recomputation covers (no effect: loom's selective "
              "recomputation covers the attention core)", words=True)
    no_check_for_nan_in_loss_and_grad: bool = opt(
        False, "Megatron: do not stop on a NaN loss or gradient (no effect: loom skips and "
               "reports non-finite steps either way; --exit-on-nonfinite N stops)")
    log_validation_ppl_to_tensorboard: bool = opt(
        False, "Megatron: validation perplexity to TensorBoard (no effect: loom logs it always)")
    log_throughput: bool = opt(False, "Megatron: log throughput (no effect: loom logs tokens/s "
                                      "and TFLOP/s always)")
    logging_level: Optional[int] = opt(None, "Megatron: Python logging level (no effect)",
                                       ge=0)
    num_workers: int = opt(2, "Megatron: DataLoader worker processes (no effect: loom reads "
                              "batches in the training process)", ge=0)
    no_create_attention_mask_in_dataloader: bool = opt(
        False, "Megatron: no attention mask from the data loader (no effect: loom never makes "
               "one)")
    no_mmap_bin_files: bool = opt(False, "Megatron: read .bin files without mmap (no effect)")
    data_cache_path: Optional[str] = opt(None, "Megatron: directory of cached index files "
                                               "(no effect: loom builds them in memory)")
    dataloader_type: Optional[DataLoaderType] = opt(
        None, "Megatron: single (one pass in order, loom's) or cyclic / external (refused)")
    apply_layernorm_1p: bool = opt(
        False, "Megatron: zero-centred norm gain (weight w, gain 1 + w, w from 0); no effect: "
               "with no weight decay on norms (Megatron's and loom's rule) it trains the same "
               "gains as loom's (gain from 1)")
    auto_detect_ckpt_format: bool = opt(False, "Megatron: detect the --load format (loom "
                                               "always detects its own; no effect)")
    dist_ckpt_strictness: Literal["assume_ok_unexpected", "log_unexpected", "log_all",
                                  "raise_unexpected", "raise_all", "return_unexpected",
                                  "return_all", "ignore_all"] = opt(
        "assume_ok_unexpected", "Megatron: tolerance of mismatched checkpoint keys (no "
                                "effect: loom's loading is strict)")


SWITCHES = tuple(f.name for f in fields(ImplementationSwitches))
"""Field names of every implementation switch."""


def no_effect_report(values: dict) -> str | None:
    """One line naming every switch in ``values`` (flat ``{field: value}``) that differs from
    Megatron's default, or None: what ``loom train`` prints once at start."""
    given = [f for f in fields(ImplementationSwitches)
             if f.name in values and values[f.name] is not None and values[f.name] != f.default]
    if not given:
        return None
    parts = []
    for f in given:
        v = values[f.name]
        parts.append(flag(f.name) if v is True else f"{flag(f.name)} {v}")
    return "no effect in loom (implementation switches of Megatron-LM): " + ", ".join(parts)
