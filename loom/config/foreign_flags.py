"""Flags of Megatron-LM's derivatives that no Megatron-LM release declares, with loom's fix.

A launch script from Megatron-DeepSpeed (microsoft/Megatron-DeepSpeed f4157be,
``megatron/arguments.py`` and DeepSpeed's ``add_config_arguments``), megablocks, Alibaba's
Pai-Megatron-Patch, THUDM's slime or epfLLM's Megatron-LLM carries such flags. loom does not take them (their
meaning is their fork's, and a flag of Megatron's name keeps Megatron's meaning), but it answers
each with what it is and the loom flags that do the same, instead of "not supported by loom"
(:func:`foreign_fix`, read by ``loom.cli``'s refusal of unknown flags).
``benchmarks/megatron_wild.py`` counts such flags in 66 repositories' launch scripts;
``tests/unit/test_foreign_flags.py`` checks that none is a Megatron-LM flag and that every loom
flag a fix names exists.
"""

from __future__ import annotations

from typing import Optional

DS = "Megatron-DeepSpeed"
_ENGINE = "loom is the training engine itself: drop it (ZeRO: --zero-stage N)"
_DS_CONFIG = ("loom reads no DeepSpeed JSON: give its settings as flags (--micro-batch-size, "
              "--global-batch-size, --zero-stage, --bf16, --clip-grad)")
_CKPT = ("DeepSpeed's activation checkpointing: drop it; recompute with --recompute-granularity "
         "full --recompute-method uniform, or --recompute-granularity selective")
_KD = ("knowledge distillation: --export-kd-teacher-load TEACHER_CKPT --export-kd-cfg YAML "
       "(the teacher's shape comes from its checkpoint)")
_DATA_EFF = "DeepSpeed's data-efficiency library: not in loom; drop it"
_ZERO_TUNING = "a DeepSpeed ZeRO tuning knob: drop it (--zero-stage chooses the sharding)"
_KERNEL = "a kernel choice: drop it (loom runs PyTorch's attention and norm kernels)"
_NOT_IN_LOOM = "not in loom; drop it"

# flag -> (origin, what loom does instead)
FOREIGN: dict[str, tuple[str, str]] = {
    **{f: (DS, _ENGINE) for f in ("--deepspeed", "--deepscale")},
    **{f: (DS, _DS_CONFIG) for f in ("--deepspeed_config", "--deepspeed-config",
                                     "--deepscale_config")},
    "--deepspeed_mpi": (DS, "torchrun starts loom's ranks: drop it"),
    "--no-pipeline-parallel": (DS, "loom pipelines only with --pipeline-model-parallel-size > 1: "
                                   "drop it"),
    **{f: (DS, _CKPT) for f in ("--deepspeed-activation-checkpointing",
                                "--partition-activations", "--contigious-checkpointing",
                                "--checkpoint-in-cpu", "--synchronize-each-layer",
                                "--profile-backward")},
    "--train-tokens": (DS, "give the length in samples: --train-samples TOKENS/--seq-length"),
    "--lr-decay-tokens": (DS, "--lr-decay-samples TOKENS/--seq-length (with --train-samples)"),
    "--lr-warmup-tokens": (DS, "--lr-warmup-samples TOKENS/--seq-length (with --train-samples)"),
    "--log-optimizer-states-to-tensorboard": (
        DS, "loom logs no optimizer-state norms: drop it (--log-params-norm logs the parameters')"),
    "--num-key-value-heads": (DS, "--group-query-attention --num-query-groups N"),
    "--rotary-position-embeddings-theta": (DS, "--rotary-base"),
    **{f: (DS, _KERNEL) for f in ("--use-flash-attn-v2", "--use-flash-attn-triton",
                                  "--use-flash-attn-builder", "--disable-mem-efficient-ln",
                                  "--use-tutel")},
    "--moe-expert-parallel-size": (DS, "--expert-model-parallel-size"),
    "--topk": (DS, "--moe-router-topk"),
    "--moe-loss-coeff": (DS, "--moe-aux-loss-coeff"),
    "--moe-train-capacity-factor": (
        DS, "--moe-expert-capacity-factor (Megatron's dropping, by router probability, not "
            "DeepSpeed's random token selection)"),
    "--moe-eval-capacity-factor": (DS, "Megatron's capacity has no evaluation factor: drop it "
                                       "(--moe-expert-capacity-factor applies to both)"),
    "--moe-min-capacity": (DS, "Megatron's capacity has no minimum: drop it"),
    "--disable-moe-token-dropping": (DS, "drop it and --moe-expert-capacity-factor: without a "
                                         "capacity no token is dropped (Megatron's default)"),
    "--disable-moe-top2-2nd-expert-sampling": (
        DS, "Megatron's top-2 takes the second expert by score, never sampled: drop it"),
    "--create-moe-param-group": (DS, "DeepSpeed's optimizer grouping of expert parameters: "
                                     "drop it"),
    "--mlp-type": (DS, "PR-MoE's residual MLP is not built by loom; a shared expert is "
                       "--moe-shared-expert-intermediate-size"),
    "--expert-interval": (DS, "--moe-layer-freq N"),
    "--num-experts-switch": (DS, _NOT_IN_LOOM),
    "--enable-expert-tensor-parallelism": (DS, "--expert-tensor-parallel-size"),
    "--enable-zbh1-pipeline": (DS, "--pipeline-schedule zero-bubble"),
    "--enable-zbh1-exact-semantics": (DS, "--pipeline-schedule zero-bubble: drop it"),
    "--ds-sequence-parallel-size": (
        DS, "DeepSpeed-Ulysses: --context-parallel-size N --cp-comm-type a2a"),
    "--force-ds-sequence-parallel": (DS, "--context-parallel-size N --cp-comm-type a2a"),
    **{f: (DS, "FPDT (chunked Ulysses with offloading) is not in loom; --context-parallel-size "
               "N --cp-comm-type a2a")
       for f in ("--ds-sequence-parallel-fpdt", "--ds-sequence-parallel-fpdt-chunk-size",
                 "--ds-sequence-parallel-fpdt-offloading")},
    **{f: (DS, _KD) for f in ("--kd", "--kd-alpha-ce", "--kd-beta-ce", "--kd-temp",
                              "--num-layers-teacher", "--hidden-size-teacher",
                              "--num-attention-heads-teacher", "--num-experts-teacher",
                              "--load-teacher", "--mos")},
    "--reset-iteration": (DS, "--finetune (weights of --load only, iteration 0)"),
    "--no-load-lr-state": (DS, "--override-opt-param-scheduler (the schedule from these flags)"),
    "--load-tag": (DS, "--ckpt-step N"),
    "--universal-checkpoint": (DS, "loom's torch_dist checkpoints load at any parallel layout: "
                                   "drop it"),
    **{f: (DS, "--optimizer-cpu-offload") for f in ("--cpu-optimizer", "--cpu_torch_adam",
                                                    "--ds_fused_adam")},
    **{f: (DS, _ZERO_TUNING) for f in ("--zero-reduce-scatter", "--zero-contigious-gradients",
                                       "--remote-device", "--use-pin-memory",
                                       "--memory-centric-tiled-linear", "--tile-factor",
                                       "--scattered-embeddings", "--split-transformers")},
    **{f: (DS, "--ddp-bucket-size N (elements per gradient bucket)")
       for f in ("--zero-reduce-bucket-size", "--zero-allgather-bucket-size")},
    "--profile_steps": (DS, "--profile --profile-step-start N --profile-step-end M"),
    **{f: (DS, _DATA_EFF) for f in (
        "--random-ltd", "--data-efficiency-curriculum-learning", "--train-data-exact-num-epochs",
        "--return-data-index", "--train-idx-path", "--train-desc-path", "--train-doc-idx-path",
        "--train-sample-idx-path", "--train-shuffle-idx-path", "--repeated-dataloader",
        "--use-dataset-only", "--aml-data-download-path")},
    **{f: (DS, "loom generate (inference of a checkpoint)") for f in ("--ds-inference",
                                                                     "--inference")},
    "--kill-switch-file": (DS, _NOT_IN_LOOM),
    # megablocks (stanford-futuredata/megablocks, its Megatron-LM fork's third_party scripts)
    "--moe-num-experts": ("megablocks", "--num-experts"),
    "--moe-top-k": ("megablocks", "--moe-router-topk"),
    "--moe-capacity-factor": ("megablocks", "--moe-expert-capacity-factor"),
    "--moe-loss-weight": ("megablocks", "--moe-aux-loss-coeff"),
    "--moe-expert-model-parallelism": ("megablocks", "--expert-model-parallel-size N"),
    # Pai-Megatron-Patch (alibaba/Pai-Megatron-Patch)
    "--patch-tokenizer-type": ("Pai-Megatron-Patch", "--tokenizer-type HuggingFaceTokenizer "
                                                     "--tokenizer-model HF_DIR"),
    "--extra-vocab-size": ("Pai-Megatron-Patch", "--vocab-size N (the padded size follows "
                                                 "--make-vocab-size-divisible-by)"),
    "--max-padding-length": ("Pai-Megatron-Patch", "--seq-length"),
    "--dataset": ("Pai-Megatron-Patch", "--data-path PREFIX of a dataset built by "
                                        "loom preprocess (Megatron's indexed format)"),
    # slime (THUDM/slime: its Megatron-LM patch and its scripts/models/*.sh)
    "--use-gated-attention": ("slime", "--attention-output-gate (Megatron-LM's flag for "
                                       "Qwen3-Next's gated attention)"),
    **{f: ("slime", "GLM-4's norm after the attention / MLP output is not built by loom's gpt "
                    "family") for f in ("--post-self-attn-layernorm", "--post-mlp-layernorm")},
    "--allgather-cp": ("slime", "--context-parallel-size N --cp-comm-type allgather"),
    # Megatron-LLM (epfLLM): its underscore spellings of Megatron-LM's flags are read
    # (loom.cli.hyphenated); these are its own
    "--use-rms-norm": ("Megatron-LLM", "--normalization RMSNorm"),
    "--glu-activation": ("Megatron-LLM", "--swiglu (swiglu), --quick-geglu"),
    "--no-tie-embed-logits": ("Megatron-LLM", "--untie-embeddings-and-output-weights"),
    "--use-post-ln": ("Megatron-LLM", _NOT_IN_LOOM),
}


def foreign_fix(word: str) -> Optional[str]:
    """``"--deepspeed: Megatron-DeepSpeed's flag; loom is ..."`` for a flag of
    :data:`FOREIGN` (an underscore spelling read hyphenated too), else None."""
    name = word.split("=")[0]
    hit = FOREIGN.get(name) or FOREIGN.get("--" + name[2:].replace("_", "-"))
    if hit is None:
        return None
    origin, fix = hit
    owner = origin + ("'" if origin.endswith("s") else "'s")
    return f"{name}: {owner} flag; {fix}"
