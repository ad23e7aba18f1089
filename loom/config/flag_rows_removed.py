"""The Megatron flag table, part 3: flags of Megatron-LM's earlier releases (v1.0 .. core_v0.19.0,
``loom/config/megatron_removed_flags.json``) that the snapshot's commit no longer takes. A launch
script written for such a release meets the answer its flag has in loom: implemented (the
loom field the flag was renamed to, with the meaning it had), accepted without effect, or
refused naming the fix. Each row says what the flag did in the releases that had it (their
help text and code, read at the release named in the snapshot's ``source``).
"""

from __future__ import annotations

from loom.config.flag_kinds import field, no_effect, refused, words


def _block(row, text: str) -> tuple:
    return tuple((flag, row) for flag in words(text))


def _renamed(new: str) -> str:
    return f"renamed {new} in later Megatron-LM releases"


REMOVED_ROWS = (
    # -- renamed: the field of the flag's later name, same meaning and default ----------------
    ("--layernorm-epsilon", field("norm_epsilon", note=_renamed("--norm-epsilon"))),
    ("--min-scale", field("min_loss_scale", note=_renamed("--min-loss-scale"))),
    ("--use-checkpoint-lr-scheduler", field("use_checkpoint_opt_param_scheduler",
                                            note=_renamed("--use-checkpoint-opt_param-scheduler"))),
    ("--override-lr-scheduler", field("override_opt_param_scheduler",
                                      note=_renamed("--override-opt_param-scheduler"))),
    ("--use-custom-fsdp", field("use_megatron_fsdp", note=_renamed("--use-megatron-fsdp"))),
    ("--muon-use-nesterov", field("muon_nesterov", note=_renamed("--muon-nesterov"))),
    ("--activations-checkpoint-method", field("recompute_method",
                                              note=_renamed("--recompute-method"))),
    ("--activations-checkpoint-num-layers", field(
        "recompute_num_layers", default=None, note=_renamed("--recompute-num-layers") +
        "; its default 1 meant nothing without --activations-checkpoint-method, as None does")),
    ("--checkpoint-num-layers", field(note=(
        "the chunk of --checkpoint-activations (v1-v2), its --recompute-num-layers; without "
        "--checkpoint-activations nothing, as in those releases"))),
    ("--hybrid-attention-ratio", field(note=(
        "Megatron's MambaModel placed round(L x ratio) attention layers evenly among the Mamba "
        "ones (megatron/core/ssm/mamba_hybrid_layer_allocation.py, _allocate_auto) unless "
        "--hybrid-override-pattern gave the layers, whose counts then had to match; later "
        "releases take the pattern only"))),
    ("--hybrid-mlp-ratio", field(note="the MLP layers' share, placed as "
                                      "--hybrid-attention-ratio places attention")),
    # -- accepted without effect ---------------------------------------------------------------
    ("--use-legacy-models", no_effect("internal", note=(
        "Megatron's legacy GPT / BERT code computes the model Megatron-Core's computes (its "
        "checkpoint converter maps one onto the other); loom has one implementation of each; "
        "a legacy model's checkpoint (language_model.* keys) is refused at --load naming "
        "that converter"))),
    ("--no-query-key-layer-scaling", no_effect("kernel", note=(
        "the legacy default scaled fp16 scores by 1/L and back by L in the softmax: loom "
        "computes scores and softmax in fp32 (see --apply-query-key-layer-scaling)"))),
    *_block(no_effect("kernel"), """
        --no-scaled-masked-softmax-fusion --scaled-upper-triang-masked-softmax-fusion
        --moe-use-legacy-grouped-gemm --embedding-weights-in-fp32"""),
    ("--no-async-tensor-model-parallel-allreduce", no_effect(
        "runtime", note="Megatron-LM itself ignored it in its last releases (help: "
                        "'DEPRECATED. This flag is ignored.')")),
    ("--DDP-impl", no_effect("runtime", note=(
        "local (Megatron's) and torch (PyTorch's DistributedDataParallel) average the same "
        "gradients"))),
    *_block(no_effect("runtime"), """
        --use-contiguous-buffers-in-ddp --no-contiguous-buffers-in-local-ddp
        --no-scatter-gather-tensors-in-pipeline --delay-param-gather --no-delay-grad-reduce
        --align-param-gather --overlap-p2p-communication"""),
    ("--fp32-allreduce", no_effect("already", note=(
        "loom keeps and reduces gradients in fp32 unless --grad-reduce-in-bf16"))),
    ("--log-batch-size-to-tensorboard", no_effect("already", note=(
        "every training record carries batch_size (TensorBoard train/batch_size), as "
        "Megatron-LM logs batch-size unconditionally since it dropped the flag"))),
    ("--no-log-learnig-rate-to-tensorboard", no_effect("logging", note=(
        "the learning rate stays in loom's records (Megatron-LM's spelling, typo included)"))),
    *_block(no_effect("te"), """
        --fp8-e4m3 --fp8-hybrid --keep-fp8-transpose-cache-when-using-custom-fsdp
        --kitchen-config-file --kitchen-recipe-number"""),
    *_block(no_effect("memory"), """
        --distribute-checkpointed-activations --offload-optimizer-states"""),
    ("--data-impl", no_effect("data_io", note=(
        "mmap / lazy / cached / infer were ways of reading Megatron's indexed dataset; loom "
        "reads its own (loom preprocess), or Megatron's .bin/.idx, one way"))),
    *_block(no_effect("data_io"), "--mmap-warmup --s3-cache-path"),
    *_block(no_effect("tokenizer"), """
        --legacy-tokenizer --tiktoken-special-tokens --tokenizer-hf-use-fast
        --tokenizer-hf-include-special-tokens"""),
    ("--local_rank", no_effect("cluster", note=(
        "what torch.distributed.launch passes; loom reads LOCAL_RANK from torchrun"))),
    *_block(no_effect("cluster"), "--enable-one-logger --one-logger-entity"),
    *_block(no_effect("inference_engine"), """
        --inference-dynamic-batching-buffer-guaranteed-fraction
        --inference-dynamic-batching-buffer-overflow-factor
        --inference-dynamic-batching-chunk-size --inference-dynamic-batching-cuda-graph-max-tokens
        --inference-dynamic-batching-max-requests-override
        --inference-dynamic-batching-max-tokens-override --inference-max-batch-size
        --disable-chunked-prefill --initialize-socket-comms"""),
    # -- refused -------------------------------------------------------------------------------
    ("--moe-token-dropping", refused("deprecated", (
        "Megatron-LM never ran it (its help: 'Currently unsupported'); use "
        "--moe-expert-capacity-factor"))),
    ("--moe-extended-tp", refused("deprecated", "use --expert-tensor-parallel-size")),
    ("--renormalize-blend-weights", refused("deprecated", (
        "later releases (and loom) blend with the given weights; the flag recomputed them from "
        "the oversampled dataset sizes, another sample order"))),
    ("--standalone-embedding-stage", refused("deprecated", (
        "a legacy-model layout Megatron-Core never built; give the first stage no layers with "
        "--pipeline-model-parallel-layout 'E|...'"))),
    ("--sft-mock-dataset-config-json", refused("data_options", (
        "mock SFT data of given sequence lengths (--mock-data draws full-length samples)"))),
    *_block(refused("t5"), """
        --encoder-pipeline-model-parallel-size --encoder-tensor-model-parallel-size
        --pipeline-model-parallel-split-rank"""),
    ("--img-dim", refused("vision")),
    *_block(refused("retrieval"), """
        --retro-add-retriever --retro-attention-gate --retro-cyclic-train-iters
        --retro-encoder-attention-dropout --retro-encoder-hidden-dropout --retro-encoder-layers
        --retro-no-verify-neighbor-count --retro-num-neighbors --retro-num-retrieved-chunks
        --retro-project-dir --retro-return-doc-ids --retro-workdir --retriever-seq-length
        --faiss-use-gpu --report-topk-accuracies"""),
    *_block(refused("rl"), """
        --grpo-default-temperature --grpo-default-top-p --langrl-external-server
        --langrl-inference-server-conversation-template --langrl-inference-server-type
        --rl-calculate-intra-group-similarity --rl-generation-batch-size
        --rl-num-parallel-generation-batches --rl-num-parallel-generations
        --rl-offload-kv-cache-during-training --rl-parallel-generation-tasks
        --rl-remove-kv-cache-during-training --rl-reset-cuda-graphs
        --rl-sequence-packing-bin-size"""),
    ("--load-model-opt-format", refused("modelopt")),
)
"""``(flag, row)`` of every flag in ``loom/config/megatron_removed_flags.json``."""
