"""The Megatron flag table, part 2: the flags of Megatron-LM's ``parse_args()`` that are not
loom config fields: accepted without effect (by reason category,
:data:`loom.config.flag_kinds.NO_EFFECT`) or refused (by the capability loom lacks,
:data:`loom.config.flag_kinds.REFUSED`). Part 1 (implemented flags, pending capabilities):
:mod:`loom.config.flag_rows`. Flags are Megatron's first spelling; the table adds the others.
"""

from __future__ import annotations

from loom.config.flag_kinds import field, no_effect, refused, words


def _block(row, text: str) -> tuple:
    return tuple((flag, row) for flag in words(text))


def _no(what: str) -> object:
    """Refused: an architecture variant loom does not build, named."""
    return refused("architecture", what)


NO_EFFECT_ROWS = (
    *_block(no_effect("kernel"), """
        --attention-backend --no-masked-softmax-fusion --no-rope-fusion --no-bias-swiglu-fusion
        --no-bias-gelu-fusion --no-bias-dropout-fusion --no-gradient-accumulation-fusion
        --cross-entropy-loss-fusion --cross-entropy-fusion-impl --use-flash-attn
        --flash-attention-version --export-force-local-attention --no-persist-layer-norm
        --disable-bf16-reduced-precision-matmul --use-fused-weighted-squared-relu
        --fused-residual-rmsnorm --use-grouped-gemm-for-shared-expert
        --use-grouped-gemm-for-dense-mlp --moe-use-grouped-tensor --moe-single-grouped-weight
        --moe-single-grouped-bias --moe-enable-deepep --moe-permute-fusion --moe-router-fusion
        --moe-flex-dispatcher-backend --moe-permute-fusion-into-hybridep
        --moe-hybridep-pad-uneven-dispatch-inputs --moe-flex-dispatcher-num-sms
        --moe-deepep-num-sms --moe-hybridep-num-sms --moe-hybridep-num-blocks-permute
        --moe-hybridep-num-blocks-unpermute --moe-hybridep-num-sms-preprocessing
        --moe-ncclep-zero-copy --moe-pad-expert-input-to-capacity
        --moe-shared-expert-glu-interleave-size --moe-mlp-glu-interleave-size
        --disable-mamba-mem-eff-path --mla-down-proj-fusion --no-gradient-reduce-div-fusion
        --onnx-safe --attention-softmax-in-fp32 --disable-jit-fuser"""),
    ("--apply-query-key-layer-scaling", no_effect("kernel", note=(
        "Megatron divides the fp16 scores by the layer number L and multiplies them by L "
        "again in an fp32 softmax: (s/L) L = s; loom's attention computes scores and softmax "
        "in fp32, so the flag changes nothing it computes (tests/models/test_model_caps.py::"
        "test_query_key_layer_scaling_changes_nothing_loom_computes)"))),
    ("--export-te-mcore-model", no_effect("te", note=(
        "ModelOpt's model built with Transformer Engine layers: loom has one layer "
        "implementation, so the flag picks nothing"))),
    ("--muon-use-syrk", no_effect("kernel", note="Triton SYRK kernel of Muon's Gram matrix")),
    ("--mup-width-mult", no_effect("internal", note=(
        "Megatron sets it to --hidden-size / --mup-base-hidden-size under --use-mup and reads "
        "it nowhere else"))),
    ("--transformer-impl", no_effect("kernel", refuse={
        "inference_optimized": "an inference-only layer implementation: train with local or "
                               "transformer_engine (both mean loom's layers)"})),
    *_block(no_effect("te"), """
        --fp8-format --fp8-recipe --fp8-quantizer-factory --fp8-margin --fp8-interval
        --fp8-amax-history-len --fp8-amax-compute-algo --no-fp8-wgrad --fp8-output-proj
        --fp8-param-gather --first-last-layers-bf16 --num-layers-at-start-in-bf16
        --num-layers-at-end-in-bf16 --use-kitchen-attention --kitchen-attention-backend
        --fp4-format --fp4-recipe --fp4-quantizer-factory --fp4-param-gather
        --te-precision-config-file --use-transformer-engine-op-fuser --use-te-activation-func
        --te-rng-tracker --moe-router-padding-for-quantization --moe-router-padding-for-fp8
        --moe-dispatch-fwd-dtype --moe-combine-bwd-dtype --reuse-grad-buf-for-mxfp8-param-ag
        --keep-fp8-transpose-cache"""),
    *_block(no_effect("precision"), """
        --megatron-fsdp-grad-comm-dtype --megatron-fsdp-main-grads-dtype
        --megatron-fsdp-main-params-dtype --fp16-lm-cross-entropy
        --output-logit-dtype --mamba-training-ssm-states-dtype
        --ddp-reduce-scatter-with-fp32-accumulation
        --gtp-remat-reduce-scatter-with-fp32-accumulation
        --ddp-param-name-patterns-for-fp32-local-accumulation"""),
    *_block(no_effect("runtime"), """
        --tensor-parallel-num-weight-shards --pipeline-model-parallel-comm-backend
        --expert-tensor-parallel-num-weight-shards --tp-comm-overlap --no-tp-comm-bulk-wgrad
        --no-tp-comm-bulk-dgrad --no-tp-comm-overlap-ag --no-tp-comm-overlap-rs
        --tp-comm-overlap-rs-dgrad --no-tp-comm-split-ag --no-tp-comm-split-rs
        --tp-comm-bootstrap-backend --tp-comm-overlap-cfg --overlap-moe-expert-parallel-comm
        --delay-wgrad-compute --overlap-dispatch-backward-with-experts-wgrad
        --ep-overlap-early-attn-memory-release --use-ring-exchange-p2p
        --defer-embedding-wgrad-compute --wgrad-deferral-limit
        --overlap-p2p-communication-warmup-flush
        --high-priority-a2a-comm-stream --enable-cuda-graph --cuda-graph-warmup-steps
        --external-cuda-graph --cuda-graph-impl --cuda-graph-scope --cuda-graph-modules
        --optimizer-cuda-graph --no-align-grad-reduce --lazy-mpu-init
        --nccl-communicator-config-path --use-sharp --sharp-enabled-group
        --high-priority-stream-groups --distributed-timeout-seconds-after-init
        --no-overlap-p2p-communication --ddp-num-buckets --ddp-pad-buckets-for-high-nccl-busbw
        --ddp-average-in-collective --overlap-param-gather-with-optimizer-step
        --no-align-param-gather --megatron-fsdp-version --no-use-layer-wise-param-layout
        --use-nccl-ub --disable-symmetric-registration --gtp-remat-nccl-ub
        --gtp-expert-remat-nccl-ub --fsdp-manual-registration --create-all-gather-group
        --fsdp-double-buffer --suggested-communication-unit-size --enable-full-sharding-in-hsdp
        --megatron-fsdp-enable-fine-grained-param-gather --megatron-fsdp-max-pool-double-buffer
        --fsdp-db-use-persist-buf-on-alloc-fail --disable-gloo-process-groups
        --train-sync-interval --use-cpu-initialization --no-initialization
        --flight-recorder-trace-buffer-size --no-flight-recorder-dump-on-timeout
        --flight-recorder-include-stack-trace --no-flight-recorder-include-only-active
        --no-flight-recorder-extra-dump-on-exec"""),
    *_block(no_effect("memory"), """
        --cpu-offloading-num-layers --cpu-offloading-retain-pinned-cpu-buffers
        --distribute-saved-activations --recompute-modules --moe-layer-recompute
        --gtp-remat-opt-in-modules --no-clone-scatter-output-in-embedding --mlp-chunks-for-training
        --fine-grained-activation-offloading --offload-modules --min-offloaded-tensor-size
        --delay-offload-until-cuda-graph --delta-offload-bytes-across-pp-ranks
        --activation-offload-fraction --moe-paged-stash --moe-paged-stash-page-size
        --moe-paged-stash-buffer-size-factor-cuda --moe-paged-stash-buffer-size-factor-cpu
        --fine-grained-offloading-max-inflight-offloads --empty-unused-memory-level --manual-gc
        --manual-gc-interval --no-manual-gc-eval --use-torch-optimizer-for-cpu-offload
        --overlap-cpu-optimizer-d2h-h2d --no-pin-cpu-grads --no-pin-cpu-params
        --torch-fsdp2-no-reshard-after-forward --init-model-with-meta-device"""),
    *_block(no_effect("ckpt_io"), """
        --auto-detect-ckpt-format --no-ckpt-fully-parallel-save --async-strategy
        --use-persistent-ckpt-worker --async-ckpt-cpu-priority --async-ckpt-io-priority
        --async-ckpt-use-cpu-shm --ckpt-fully-parallel-load --ckpt-fully-parallel-load-exchange-algo
        --ckpt-fully-parallel-load-per-rank-objects --ckpt-fully-parallel-save-process-group
        --ckpt-fully-parallel-load-process-group --ckpt-assume-constant-structure
        --ckpt-pg-tensors-cache-path --ckpt-pg-tensors-cache-create
        --no-ckpt-load-validate-sharding-integrity --no-strict-fsdp-dtensor-load
        --dist-ckpt-strictness --dist-ckpt-save-pre-mcore-014 --dist-ckpt-optim-fully-reshardable
        --distrib-optim-fully-reshardable-mem-efficient --no-save-tokenizer-assets
        --dist-ckpt-workers --ckpt-fully-parallel-save --ckpt-drop-redundant-extra-state
        --load-main-params-from-ckpt"""),
    *_block(no_effect("data_io"), """
        --num-workers --no-create-attention-mask-in-dataloader --no-mmap-bin-files
        --data-cache-path --per-dataset-sequences-path --dataloader-fast-cache-load
        --dataloader-defer-npy-index-mmap --num-dataset-builder-threads
        --object-storage-cache-path --mid-level-dataset-surplus --exit-signal-handler-for-dataloader"""),
    ("--dataloader-type", no_effect("data_io", refuse={
        "cyclic": "loom reads the data once in order (Megatron's single): give "
                  "--dataloader-type single",
        "external": "loom reads the data once in order (Megatron's single): give "
                    "--dataloader-type single"})),
    *_block(no_effect("tokenizer"), """
        --tokenizer-metadata --tokenizer-special-tokens --tiktoken-num-special-tokens
        --tokenizer-sentencepiece-legacy --no-tokenizer-sentencepiece-ignore-extra-whitespaces
        --tokenizer-hf-no-use-fast --tokenizer-hf-no-include-special-tokens --trust-remote-code
        --null-tokenizer-eod-id --null-tokenizer-pad-id --use-gigatoken
        --allow-ambiguous-pad-tokens --no-use-tokenizer-model-from-checkpoint-args"""),
    *_block(no_effect("logging"), """
        --logging-level --tensorboard-log-interval --tensorboard-queue-size
        --no-log-loss-scale-to-tensorboard"""),
    *_block(no_effect("already"), """
        --log-validation-ppl-to-tensorboard --log-throughput --log-memory-interval
        --log-device-memory-used --verify-integrity --exit-signal-handler-for-training"""),
    *_block(no_effect("validation"), """
        --test-mode"""),
    *_block(no_effect("inference_engine"), """
        --inference-cuda-graph-scope --flash-decode --symmetric-ar-type
        --nccl-all-reduce-for-prefill --inference-fuse-tp-communication
        --inference-disable-triton-nvls-kernels --inference-grouped-gemm-backend
        --inference-moe-disable-fused-quant-kernels --inference-moe-token-dispatcher-type
        --moe-pad-experts-for-cuda-graph-inference --mlp-chunks-for-prefill --cache-mla-latents
        --inference-batch-times-seqlen-threshold --max-tokens-to-oom --use-legacy-static-engine
        --inference-max-requests --inference-max-seq-length --inference-dynamic-batching
        --inference-dynamic-batching-buffer-size-gb
        --inference-dynamic-batching-paused-buffer-size-gb
        --inference-dynamic-batching-mamba-memory-ratio --inference-dynamic-batching-block-size
        --inference-dynamic-batching-max-requests --inference-dynamic-batching-max-tokens
        --inference-dynamic-batching-num-cuda-graphs
        --inference-dynamic-batching-track-paused-request-events
        --inference-dynamic-batching-track-generated-token-events --decode-only-cuda-graphs
        --inference-cuda-graph-all-prefills --inference-cuda-graph-max-tokens
        --inference-dynamic-batching-unified-memory-level --enable-chunked-prefill
        --num-speculative-tokens --inference-dynamic-batching-prefix-caching
        --inference-dynamic-batching-prefix-caching-eviction-policy
        --inference-dynamic-batching-prefix-caching-coordinator-policy
        --inference-dynamic-batching-prefix-caching-routing-alpha
        --inference-dynamic-batching-prefix-caching-mamba-gb
        --inference-dynamic-batching-cuda-graph-mixed-prefill-count
        --inference-dynamic-batching-cuda-graph-sizing-distribution
        --inference-dynamic-batching-sampling-backend --use-same-sampling-seed-across-dp-ranks
        --inference-dynamic-batching-async-sched-mode --inference-dynamic-batching-logprobs-mode
        --inference-logging-step-interval --inference-text-gen-server-logging
        --inference-wandb-logging --inference-coordinator-port --mamba-inference-conv-states-dtype
        --mamba-inference-ssm-states-dtype --inference-use-synchronous-zmq-collectives
        --inference-disable-ep-consensus --inference-shards --inference-rng-tracker"""),
    *_block(no_effect("cluster"), """
        --local-rank --no-one-logger --one-logger-project --one-logger-run-name
        --one-logger-async --app-tag-run-name --app-tag-run-version --disable-msc"""),
    *_block(no_effect("deprecated"), """
        --use-mcore-models --use-dist-ckpt --dist-ckpt-format"""),
    *_block(no_effect("internal"), """
        --enable-experimental --spec --is-hybrid-model --config-logger-dir"""),
    *_block(no_effect("equivalent"), """
        --use-tp-pp-dp-mapping --num-distributed-optimizer-instances
        --outer-dp-sharding-strategy"""),
)
"""``(Megatron flag, row)`` of every flag accepted without effect."""

REFUSED_ROWS = (
    *_block(refused("rl"), """
        --perform-rl-step --rl-prompts-per-eval --grpo-prompts-per-step --grpo-group-size
        --rl-generation-lag --rl-max-inflight-requests --rl-submission-granularity
        --rl-consumption-granularity --rl-durable-rollout-bank --rl-rollout-bank-dir
        --rl-rollout-bank-max-bytes --grpo-iterations --grpo-clamp-eps-lower
        --grpo-clamp-eps-upper --grpo-kl-beta --grpo-entropy-term-weight
        --grpo-filter-groups-with-same-reward --langrl-env-config --rl-default-temperature
        --rl-default-top-p --rl-default-top-k --rl-offload-optimizer-during-inference
        --rl-kv-cache-management-mode --rl-persist-cuda-graphs --rl-partial-rollouts
        --rl-inference-logprobs-is-correction --rl-importance-sampling-truncation-coef
        --rl-use-sequence-packing --rl-sequence-packing-max-sequences-per-bin
        --rl-sequence-packing-algo --rl-training-cuda-graphs
        --rl-inference-tensor-model-parallel-size --rl-inference-pipeline-model-parallel-size
        --rl-inference-expert-model-parallel-size
        --rl-inference-expert-tensor-model-parallel-size
        --rl-inference-model-unified-memory-level --rl-offload-inference-model-weights-when-idle
        --refit-method --rl-verify-model-weights-swap --rl-skip-bos-token --rl-profile
        --rl-profile-dir --rl-inference-parsers --moe-enable-routing-replay"""),
    *_block(refused("vision"), """
        --num-classes --img-h --img-w --num-channels --patch-dim --classes-fraction
        --data-per-class-fraction --no-data-sharding --head-lr-mult --vision-pretraining
        --vision-pretraining-type --vision-backbone-type --swin-backbone-type --mask-type
        --mask-factor --iter-per-epoch --dino-local-img-size --dino-local-crops-number
        --dino-head-hidden-size --dino-bottleneck-size --dino-freeze-last-layer
        --dino-norm-last-layer --dino-warmup-teacher-temp --dino-teacher-temp
        --dino-warmup-teacher-temp-epochs --mrope-section"""),
    *_block(refused("retrieval"), """
        --ict-head-size --biencoder-projection-dim --biencoder-shared-query-context-model
        --ict-load --bert-load --titles-data-path --query-in-block-prob --use-one-sent-docs
        --evidence-data-path --retriever-report-topk-accuracies --retriever-score-scaling
        --block-data-path --embedding-path --indexer-batch-size --indexer-log-interval
        --output-bert-embeddings --bert-embedder-type"""),
    *_block(refused("t5"), """
        --encoder-num-layers --decoder-num-layers --encoder-seq-length --decoder-seq-length
        --relative-attention-num-buckets --relative-attention-max-distance --vocab-extra-ids"""),
    *_block(refused("distillation"), """
        --logits-save-top-k --logits-save-top-p --logits-save-top-p-min-k --logits-save-dir
        --logits-save-dtype --logits-load-dir --logits-load-decode-threads
        --logits-load-prefetch-factor --logits-load-msc-prefetch-depth --logits-load-kd-loss-alpha
        --logits-load-ignore-errors --export-kd-teacher-model-config
        --export-kd-teacher-ckpt-format"""),
    *_block(refused("modelopt"), """
        --export-model-type --export-legacy-megatron
        --export-default-te-spec --export-kv-cache-quant --export-real-quant-cfg
        --export-quant-cfg --finetune-hf-dataset --finetune-data-split --finetune-data-files
        --qad-train-target --freeze-base-for-mtp --export-qk-l2-norm
        --export-moe-apply-probs-on-input --export-offline-model --modelopt-enabled"""),
    *_block(refused("optimizers"), "--lion-beta1 --lion-beta2"),
    *_block(refused("linear_attention"), """
        --gdp-num-householder --gdp-cutedsl-kernel --gdp-num-chunk-states-to-recompute"""),
    *_block(refused("dsa"), """
        --dsa-indexer-topk-freq --dsa-indexer-skip-topk-offset --dsa-kernel-backend
        --dsa-indexer-rope-interleaved"""),
    *_block(refused("mhc"), """
        --enable-mhc-connections --mhc-num-residual-streams --mhc-sinkhorn-iterations
        --mhc-init-gating-factor --mhc-recompute-layer-num"""),
    *_block(refused("heterogeneous"), """
        --heterogeneous-layers-config-path --heterogeneous-layers-config-encoded-json"""),
    ("--chat-template", no_effect("tokenizer", note=(
        "Megatron hands it to its HuggingFace / SentencePiece / TikToken tokenizers' chat "
        "formatting (inference and RL endpoints); training data never reads it: pretraining "
        "text, and SFTTokenizer's template is --sft-tokenizer-prompt-format's"))),
    ("--mtp-standalone", _no("multi-token prediction on a pipeline stage of its own")),
    ("--mtp-use-repeated-layer", _no("multi-token prediction with one shared repeated layer")),
    ("--mtp-detach-heads", _no("multi-token prediction with detached heads")),
    ("--mtp-hsm", _no("multi-token prediction with a hierarchical softmax")),
    ("--mtp-hybrid-override-pattern", _no("hybrid multi-token-prediction layers")),
    ("--max-seqlen-per-dp-cp-rank", _no("dynamic context parallelism by sequence length")),
    ("--hybrid-context-parallel", _no("hybrid (dynamic) context parallelism")),
    ("--data-parallel-random-init", _no("different initial weights per data-parallel replica")),
    ("--moe-router-quantile-balancing-ema", _no("quantile load balancing")),
    ("--moe-expert-rank-capacity-factor", _no("a token capacity per expert-parallel rank")),
    ("--batch-invariant-mode", _no("batch-invariant kernels")),
    ("--batch-invariant-backend", _no("batch-invariant kernels")),

    ("--no-weight-decay-cond-type", _no("this deprecated spelling (Megatron's own help): give "
                                        "--apply-wd-to-qk-layernorm, its replacement")),
    ("--freeze-all-layers", refused("training_options", "frozen layers")),
    ("--gpu-sniff-test-interval", refused("extra_logs", "GPU sniff tests")),
    ("--sample-rate", refused("data_options", "dataset sub-sampling")),
    *_block(refused("resiliency"), """
        --inprocess-restart --inprocess-max-iterations --inprocess-monitor-thread-interval
        --inprocess-monitor-process-interval --inprocess-progress-watchdog-interval
        --inprocess-heartbeat-interval --inprocess-soft-timeout --inprocess-hard-timeout
        --inprocess-heartbeat-timeout --inprocess-barrier-timeout --inprocess-completion-timeout
        --inprocess-last-call-wait --inprocess-termination-grace-time --inprocess-granularity
        --inprocess-active-world-size --inprocess-empty-cuda-cache --enable-ft-package
        --calc-ft-timeouts --ft-num-warmup-iters --adlr-autoresume
        --adlr-autoresume-interval --run-workload-inspector-server"""),
    *_block(refused("fault_injection"), """
        --fault-injector-ranks --fault-injector-num-ranks --fault-injector-fault-types
        --fault-injector-fault-probabilities --fault-injector-fault-delay
        --fault-injector-delay-start-iteration --fault-injector-mtti-seconds
        --fault-injector-offset-seconds --fault-injector-seed"""),
    *_block(refused("nonpersistent"), """
        --non-persistent-local-ckpt-dir --non-persistent-local-ckpt-algo --replication --replication-jump --replication-factor"""),
    *_block(refused("ckpt_variants"), """
        --ckpt-convert-format --ckpt-convert-save --ckpt-convert-update-legacy-dist-opt-format
        --override-ckpt-iteration --use-mp-args-from-checkpoint-args"""),
    *_block(refused("dumps"), """
        --save-params-interval --save-activations-interval --save-tokens-per-expert-interval
        --save-wgrads-interval --save-dgrads-interval --dump-param-to-param-group-map
        --moe-routing-trace-path --moe-routing-trace-max-training-iters
        --moe-routing-trace-capture-logits --moe-routing-trace-capture-hidden-states
        --moe-routing-trace-dump-weights --nvtx-ranges"""),
    ("--pytorch-profiler-collect-chakra", refused("extra_logs", "Chakra execution traces "
                                                  "of the PyTorch profiler")),
    ("--record-shapes", refused("extra_logs", "NVTX tensor-shape records for nsys "
                                "(torch.autograd.profiler.emit_nvtx)")),
    ("--flight-recorder-dump-path", refused("extra_logs", "choice of the flight-recorder dump "
                                            "path (loom writes loom_nccl_trace_rankN.pkl "
                                            "beside its hang report)")),
    ("--log-energy", refused("extra_logs", "energy log (NVML)")),
    ("--otel-enabled", refused("extra_logs", "OpenTelemetry traces")),
    ("--otel-service-name", refused("extra_logs", "OpenTelemetry traces")),
    ("--otel-span-groups", refused("extra_logs", "OpenTelemetry traces")),
    ("--enable-msc", refused("data_options", "Multi-Storage Client object storage")),
    ("--fake-process-group", refused("training_options", "fake process groups (Megatron's "
                                     "single-GPU benchmarking)")),
    ("--yaml-cfg", refused("training_options", "Megatron YAML config: loom's --config "
                           "FILE.yaml takes flag names as keys")),
    # Megatron-LM v1's names, which its snapshot parses and refuses: their v1 meaning
    ("--batch-size", field("micro_batch_size", note=(
        "v1's per-GPU batch, --micro-batch-size (its snapshot refuses the flag)"))),
    ("--warmup", field("lr_warmup_fraction", note=(
        "v1's warm-up as a fraction of the decay iterations, --lr-warmup-fraction (a float "
        "there; its snapshot types it int and refuses it)"))),
    ("--model-parallel-size", field("tensor_model_parallel_size", note=(
        "v1's tensor-parallel size, --tensor-model-parallel-size (its snapshot refuses the "
        "flag)"))),
    ("--checkpoint-activations", field(note=(
        "Megatron-LM v1-v2's full recompute of every layer in chunks of --checkpoint-num-layers"
        " (= --recompute-granularity full --recompute-method uniform); its snapshot refuses "
        "the flag, naming --recompute-activations, which is selective"))),
)
"""``(Megatron flag, row)`` of every flag refused (unless given its default)."""
