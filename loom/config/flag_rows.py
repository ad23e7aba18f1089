"""The Megatron flag table, part 1: the flags loom implements (each a config field declared with
``opt()`` in the config sections, with Megatron's name, meaning and default), the Megatron
values of those flags loom refuses, and the capabilities still pending. Part 2, the flags
accepted without effect and the ones refused: :mod:`loom.config.flag_rows_other`. The table
as a whole, and the one place a Megatron flag is declared: :mod:`loom.config.flag_table`.

Megatron's defaults and source lines are not repeated here: they are read from the snapshot
``loom/config/megatron_flags.json`` (``benchmarks/megatron_flag_snapshot.py``);
tests/unit/test_flag_table.py checks each field's default against it. A row's ``default=``
is loom's spelling of the same default (``None`` for "off" and the like), ``required=`` the
line where Megatron refuses to run without the flag.
"""

from __future__ import annotations

from loom.config.flag_kinds import field, refused, words

PENDING: dict = {  # capability key -> (branch, text): refused until that branch merges
    # (issue 42's modelcaps, traincaps, reliability and megackpt capabilities have all merged)
}


def pending(key: str, **kw) -> object:
    """A refused row naming a pending capability of :data:`PENDING`."""
    branch, text = PENDING[key]
    return refused("pending", text, pending=branch, **kw)


def pending_text(key: str) -> str:
    """The refusal reason of pending capability ``key`` (for a refused value of a field)."""
    return f"not implemented in loom yet: {PENDING[key][1]}"


_IMPLEMENTED = words("""
--num-layers --hidden-size --num-attention-heads --num-query-groups --group-query-attention
--ffn-hidden-size --kv-channels --seq-length --max-position-embeddings --vocab-size
--make-vocab-size-divisible-by --normalization --norm-epsilon --position-embedding-type
--rotary-base --swiglu --openai-gelu --untie-embeddings-and-output-weights --disable-bias-linear
--hidden-dropout --attention-dropout --init-method-std --add-qkv-bias --num-experts
--moe-router-topk --moe-ffn-hidden-size --moe-shared-expert-intermediate-size --moe-layer-freq
--moe-router-score-function --moe-router-pre-softmax --moe-aux-loss-coeff --moe-z-loss-coeff
--moe-expert-capacity-factor --moe-shared-expert-gate --moe-router-load-balancing-type
--moe-router-enable-expert-bias --moe-router-bias-update-rate --moe-router-num-groups
--moe-router-group-topk --moe-router-topk-scaling-factor --moe-router-dtype
--moe-token-dispatcher-type --moe-grouped-gemm --moe-shared-expert-overlap
--moe-router-force-load-balancing --moe-router-force-biased --moe-input-jitter-eps
--moe-apply-probs-on-input --moe-latent-size --qk-layernorm --rotary-scaling-factor
--hybrid-override-pattern
--mamba-state-dim --mamba-head-dim --mamba-num-groups --multi-latent-attention --q-lora-rank
--kv-lora-rank --qk-head-dim --qk-pos-emb-head-dim --v-head-dim --rope-type --mscale
--mscale-all-dim --yarn-original-max-position-embeddings --yarn-beta-fast --yarn-beta-slow
--mtp-num-layers --mtp-loss-scaling-factor --quick-geglu --glu-linear-offset
--activation-func-clamp-value --softmax-type --window-size --window-attn-skip-freq
--padded-vocab-size --enable-gpt-oss --rotary-percent --use-rotary-position-embeddings
--no-position-embedding --mamba-num-heads --squared-relu --moe-token-drop-policy --cp-comm-type
--hierarchical-context-parallel-sizes --tensor-model-parallel-size --pipeline-model-parallel-size
--context-parallel-size --num-layers-per-virtual-pipeline-stage
--microbatch-group-size-per-virtual-pipeline-stage --pipeline-model-parallel-layout
--decoder-first-pipeline-num-layers --decoder-last-pipeline-num-layers --sequence-parallel
--expert-model-parallel-size --expert-tensor-parallel-size --ddp-bucket-size --overlap-grad-reduce
--distributed-backend --lr-warmup-samples --lr-decay-samples --lr-warmup-init --decoupled-lr
--decoupled-min-lr --exit-duration-in-mins --calculate-per-token-loss --rampup-batch-size
--step-batch-size-schedule --decrease-batch-size-if-needed --phase-transition-iterations
--log-num-zeros-in-grad --log-params-norm --use-megatron-fsdp
--data-parallel-sharding-strategy --ckpt-format --pretrained-checkpoint --use-checkpoint-args
--micro-batch-size --global-batch-size --train-iters --lr --min-lr --lr-warmup-iters
--lr-decay-iters --lr-decay-style --weight-decay --adam-beta1 --adam-beta2 --adam-eps --clip-grad
--use-distributed-optimizer --use-torch-fsdp2 --overlap-param-gather --seed --bf16 --fp16
--accumulate-allreduce-grads-in-fp32 --grad-reduce-in-bf16 --use-precision-aware-optimizer
--main-grads-dtype --main-params-dtype --exp-avg-dtype --exp-avg-sq-dtype --optimizer-cpu-offload
--optimizer-offload-fraction --loss-scale --initial-loss-scale --min-loss-scale
--loss-scale-window --hysteresis --recompute-granularity --recompute-method --recompute-num-layers
--train-samples --lr-warmup-fraction --recompute-activations --skip-train --tokenizer-model
--vocab-file --merge-file --tiktoken-pattern --eod-mask-loss --reset-position-ids
--reset-attention-mask --dataloader-inter-document-masking --data-args-path
--per-split-data-args-path --data-path --valid-data-path
--train-data-path --test-data-path --split --tokenizer-type --mask-prob --short-seq-prob
--mock-data --wandb-project --wandb-exp-name --wandb-save-dir --wandb-entity --log-interval
--eval-interval --eval-iters --tensorboard-dir --save --load --save-interval --ckpt-step
--finetune --no-load-optim --no-load-rng --exit-interval --async-save
--moe-use-upcycling --moe-upcycling-granularity
--distributed-timeout-minutes --exit-signal-handler --check-weight-hash-across-dp-replicas-interval
--num-virtual-stages-per-pipeline-rank
--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split
--moe-per-layer-logging --timing-log-level --timing-log-option --log-timers-to-tensorboard
--no-barrier-with-level-1-timing --log-memory-to-tensorboard --deterministic-mode --sgd-momentum
--profile --profile-step-start --profile-step-end --use-pytorch-profiler
--pytorch-profiler-collect-shapes --pytorch-profiler-collect-callstack --record-memory-history
--memory-snapshot-path --save-retain-interval --optimizer --profile-ranks --sft
--sft-tokenizer-prompt-format
--yarn-correction-range-round-to-int --rotary-interleaved --use-mup --mup-base-hidden-size
--mup-embedding-mult --mup-output-mult --mup-base-head-dim --mup-attn-scale-power --muon-momentum
--muon-nesterov --muon-scale-mode --muon-fp32-matmul-prec --muon-coefficient-type
--muon-num-ns-steps --muon-tp-mode --muon-extra-scale-factor --muon-scalar-optimizer
--eval-global-batch-size --eval-micro-batch-size --attention-output-gate --linear-attention-freq
--linear-conv-kernel-dim --linear-key-head-dim --linear-value-head-dim --linear-num-key-heads
--linear-num-value-heads --apply-wd-to-qk-layernorm --dsa-indexer-n-heads --dsa-indexer-head-dim
--dsa-indexer-topk --dsa-indexer-loss-coeff --dsa-indexer-use-sparse-loss
--no-dsa-indexer-rotate-activation --no-dsa-indexer-scoring-relu --dsa-indexer-k-norm-epsilon
--dsa-indexer-k-norm-fp32 --qk-clip --qk-clip-alpha --qk-clip-threshold --log-max-attention-logit
--fim-data --fim-rate --fim-spm-rate --fim-split-sample --fim-fragment-rate --fim-no-prefix
--fim-prefix-token --fim-middle-token --fim-suffix-token --fim-pad-token --fim-eod-token
--rerun-mode --error-injection-rate --error-injection-type --result-rejected-tracker-filename
--check-for-spiky-loss --no-check-for-nan-in-loss-and-grad --check-for-large-grads
--export-kd-teacher-load --export-kd-cfg
--no-save-optim --no-save-rng --exit-on-missing-checkpoint --exit-signal --log-progress
--log-world-size-to-tensorboard
--use-rope-scaling --rope-scaling-factor --rotary-seq-len-interpolation-factor --no-rope-freq
--log-straggler --straggler-minmax-count --disable-straggler-on-startup --straggler-ctrlr-port
--non-persistent-save-interval --non-persistent-ckpt-type --non-persistent-global-ckpt-dir
--lr-wsd-decay-style --lr-wsd-decay-iters --lr-wsd-decay-samples --start-weight-decay
--end-weight-decay --weight-decay-incr-style
--embedding-init-method-std --init-method-xavier-uniform --apply-residual-connection-post-layernorm
--fp32-residual-connection --qk-l2-norm
--start-eval-at-iter --full-validation --multiple-validation-sets --validation-set-names
--iterations-to-skip --no-pad-vocab-size
""")
"""Flags implemented by the loom field of the same name, Megatron's default and meaning."""

_ARGS = "megatron/training/arguments.py"
_SPECIAL = {  # implemented flags with a note, a spelled default, a requirement or refusals
    "--num-layers": field(required=f"{_ARGS}:1314", note="a hybrid stack's depth is the "
                          "length of --hybrid-override-pattern"),
    "--hidden-size": field(required=f"{_ARGS}:1314"),
    "--num-attention-heads": field(required=f"{_ARGS}:1314"),
    "--seq-length": field(required=f"{_ARGS}:1350"),
    "--micro-batch-size": field(required=f"{_ARGS}:693"),
    "--train-iters": field(required="megatron/training/training.py:2174",
                           note="this or --train-samples; not needed with --skip-train"),
    "--lr": field(required=f"{_ARGS}:2984", note="default None, which the LR scheduler cannot "
                  "use (megatron/training/training.py:2591); not needed with --skip-train"),
    "--max-position-embeddings": field(required=f"{_ARGS}:1314", default=None,
                                       note="loom infers --seq-length when omitted (every "
                                            "Megatron command line gives it)"),
    "--num-query-groups": field(default=None, note="used only with --group-query-attention "
                                "(then 1 by default); without it a "
                                "(megatron/training/argument_utils.py:330)"),
    "--rotary-base": field(note="an int in Megatron"),
    "--disable-bias-linear": field(note="Megatron's dest add_bias_linear defaults to True: "
                                        "the flag is off"),
    "--moe-layer-freq": field(default="1", note="loom holds the text (an int, or a list "
                                                "expression such as ([0]*3+[1]*58))"),
    "--moe-z-loss-coeff": field(default=0.0, note="Megatron None: no z-loss"),
    "--moe-router-load-balancing-type": field(
        note="one type (Megatron also takes a list); sinkhorn: balanced picks in training, "
             "top-k of the scores in evaluation, no aux loss (Megatron's)",
        refuse={"quantile_balancing": "loom has no quantile load balancing: use aux_loss, "
                                      "seq_aux_loss, global_aux_loss or sinkhorn"}),
    "--moe-router-score-function": field(note="sqrtsoftplus: sqrt(softplus(logits)), routed "
                                               "as sigmoid scores are (Megatron-LM d98e8a6)"),
    "--moe-router-dtype": field(note="Megatron None routes in the input dtype, loom None in "
                                     "fp32 (the same under fp32 training)"),
    "--moe-token-dispatcher-type": field(note="flex (DeepEP / HybridEP kernels) runs as "
                                              "alltoall (the same numbers)", refuse={
        "alltoall_seq": "Megatron-LM's sequence-parallel all-to-all, dropped after core_v0.12 "
                        "for alltoall, which dispatches the same tokens: use alltoall"}),
    "--lr-decay-style": field(refuse={
        "exponential": "Megatron-LM v1.0's halving every --lr-decay-iters, dropped since v2.0: "
                       "use cosine, linear, inverse-square-root or WSD"}),
    "--moe-router-force-load-balancing": field(note="benchmarks only"),
    "--moe-router-force-biased": field(note="benchmarks only; the bias is drawn from the "
                                            "default generator (the same on every TP and DP "
                                            "rank of a pipeline stage)"),
    "--moe-input-jitter-eps": field(note="as in Megatron, also in evaluation forwards"),
    "--rotary-scaling-factor": field(default=None, note="Megatron 1.0: no scaling (YaRN's "
                                     "factor; Gemma 3's linear scaling)"),
    "--rope-type": field(note="None: yarn with MLA (MLATransformerConfig), rope otherwise"),
    "--yarn-original-max-position-embeddings": field(note="None: 4096"),
    "--yarn-beta-fast": field(note="None: 32"),
    "--yarn-beta-slow": field(note="None: 1"),
    "--position-embedding-type": field(note="yarn: RoPE with YaRN scaling "
                                       "(--rotary-scaling-factor, --yarn-*, --mscale*)", refuse={
        "mrope": "loom has no multimodal RoPE (vision-language models)",
        "relative": "loom has no relative position buckets (T5)"}),
    "--cp-comm-type": field(default="p2p", note="a list (one value or one per layer); loom "
                                                "stores the words joined by spaces"),
    "--hierarchical-context-parallel-sizes": field(note="a list [A, B]; loom stores \"A B\""),
    "--distributed-backend": field(note="loom's --device cpu (which Megatron lacks) uses gloo"),
    "--accumulate-allreduce-grads-in-fp32": field(note="forced on with --bf16 unless "
                                                       "--grad-reduce-in-bf16 "
                                                       "(arguments.py:1213-1216)"),
    "--initial-loss-scale": field(note="2**32"),
    "--split": field(note="None: the legacy '969, 30, 1' with --data-path (so in loom)"),
    "--eval-global-batch-size": field(note="None: --global-batch-size (b x d with "
                                           "--step-batch-size-schedule, Megatron's); a "
                                           "multiple of --eval-micro-batch-size x d"),
    "--eval-micro-batch-size": field(note="None: --micro-batch-size"),
    "--fim-data": field(note="Megatron's FIM GPT dataset (loom/data/fim.py; the same draws in "
                             "the same order), sample k drawn from its own stream seeded "
                             "(--seed, k) instead of one stream per dataset in reading order"),
    "--eval-interval": field(note="no periodic evaluation (megatron/training/training.py:4915)"
                                  "; one at the end"),
    "--no-load-optim": field(default=False, note="store_true with default None: off"),
    "--no-load-rng": field(default=False, note="store_true with default None: off"),
    "--exit-signal-handler": field(note="SIGTERM: finish the iteration, save (with --save), "
                                        "exit; loom also takes SIGINT"),
    "--exit-signal": field(note="an enum, by name; SIGTERM or SIGINT: loom catches both",
                           refuse={**{v: f"{v} never reaches a handler: choose a catchable "
                                         f"signal (SIGTERM, SIGUSR1, ...)"
                                      for v in ("SIGKILL", "SIGSTOP")},
                                   **{v: f"{v} is a hardware-fault signal (a handler cannot "
                                         f"return from a real fault): choose SIGTERM, SIGUSR1, "
                                         f"..." for v in ("SIGSEGV", "SIGBUS", "SIGFPE",
                                                          "SIGILL")}}),
    "--no-save-optim": field(default=False, note="store_true with default None: off; no "
                                                 "optimizer and no LR-schedule state"),
    "--no-save-rng": field(default=False, note="store_true with default None: off"),
    "--exit-on-missing-checkpoint": field(note="a one-line error, status 2 (Megatron exits "
                                               "0)"),
    "--log-progress": field(note="needs --save (progress.txt lies there); FLOPs are loom's "
                                 "model FLOPs (KOR eq. 7)"),
    "--start-eval-at-iter": field(note="periodic evaluations from this iteration on; the one "
                                       "after the last iteration always"),
    "--full-validation": field(note="every sample once (Megatron cycles short DP ranks); the "
                                    "test set keeps --eval-iters; not --mock-data, no "
                                    "weighted blend"),
    "--multiple-validation-sets": field(note="one set per --valid-data-path dataset, weights "
                                             "refused; also without --full-validation (each "
                                             "set's first --eval-iters batches)"),
    "--validation-set-names": field(note="a list; loom holds the words (validation-NAME in "
                                         "the logs)"),
    "--iterations-to-skip": field(default=None, note="[] in Megatron: none; loom holds the "
                                                     "words. Data consumed, LR held"),
    "--no-pad-vocab-size": field(note="dest pad_vocab_size=True; V rows (t must divide V) "
                                      "unless --padded-vocab-size"),
    "--rotary-percent": field(note="the first int(d x p) channels of each head rotate"),
    "--qk-clip": field(note="per query group of standard attention (gpt, mamba), fp32 masters "
                            "too (loom/training/qk_clip.py); refused with MLA, context "
                            "parallelism and FSDP"),
    "--log-max-attention-logit": field(note="TensorBoard train/max_attention_logit, the "
                                            "maximum over layers, heads and ranks"),
    "--rotary-interleaved": field(note="pairs (2i, 2i+1) rotate (Megatron's _rotate_half with "
                                       "rotary_interleaved); refused with YaRN and MLA, as "
                                       "Megatron refuses them"),
    "--use-rotary-position-embeddings": field(note="= --position-embedding-type rope"),
    "--no-position-embedding": field(note="dest add_position_embedding=True"),
    "--squared-relu": field(note="not with --swiglu (as Megatron); the experts too"),
    "--decoupled-lr": field(note="word embedding and output layer weights"),
    "--decoupled-min-lr": field(note="None: --min-lr"),
    "--exit-duration-in-mins": field(note="an int in Megatron"),
    "--rampup-batch-size": field(note="nargs 3; Megatron-Core <= 0.16's ramp (ignored since "
                                      "532ad926)"),
    "--step-batch-size-schedule": field(note="thresholds in tokens, as Megatron's training "
                                             "reads them"),
    "--use-megatron-fsdp": field(note="loom: --zero-stage from the sharding strategy"),
    "--ckpt-format": field(default="loom_dcp", own=(
        "loom's own format keeps the generators, the data identities, checksums and async "
        "saves; the run trains the same, only the files differ"),
        note="torch_dist writes Megatron's format (Megatron-LM's --load reads it); torch, "
             "torch_dcp and fsdp_dtensor write loom_dcp (said at start); --load reads every "
             "format, detected", refuse={
                 "zarr": "the zarr backend of Megatron's distributed checkpoints, dropped after "
                         "core_v0.15: use torch_dist (or loom_dcp)"}),
    "--eod-mask-loss": field(note="GPT-style families; input tokens == eod"),
    "--reset-position-ids": field(note="read by the learned absolute position embedding only, "
                                       "as in Megatron-Core (under RoPE: named inert at start)"),
    "--reset-attention-mask": field(note="applied by the GPT family's standard attention at CP "
                                         "1 (Megatron's Transformer Engine and fused-softmax "
                                         "paths ignore its mask; elsewhere loom says so at "
                                         "start)"),
    "--dataloader-inter-document-masking": field(note="the same mask and position reset at the "
                                                      "dataset's own document boundaries; not "
                                                      "with --fim-data"),
    "--data-args-path": field(note="read when the config is resolved, before the data"),
    "--non-persistent-ckpt-type": field(refuse={
        "local": "loom has no node-local checkpoints (nvidia-resiliency-ext): use "
                 "--non-persistent-ckpt-type global",
        "in_memory": "loom has no in-memory checkpoints (in-process restart): use "
                     "--non-persistent-ckpt-type global"},
        note="global: loom's own format, the newest kept (loom.training.non_persistent)"),
    "--sft": field(note="loom.data.sft: one conversation per JSONL line (a line of "
                        "several is refused: loom has no per-conversation attention)"),
    "--sft-tokenizer-prompt-format": field(note="a str in Megatron; its four formats"),
    "--moe-token-drop-policy": field(note="position refused"),
    "--mamba-num-heads": field(note="d_inner = heads x --mamba-head-dim, any h"),
    "--window-size": field(note="loom holds the text 'LEFT,RIGHT'"),
    "--window-attn-skip-freq": field(note="loom holds the text (an int or a list)"),
    "--use-rope-scaling": field(note="Llama 3.1's scaling with low/high frequency factors 1 "
                                     "and 4 and original context 8192, fixed as in "
                                     "Megatron-Core; RoPE of standard attention (not YaRN, "
                                     "MLA or a hybrid model, which Megatron builds without it)"),
    "--rope-scaling-factor": field(note="Megatron-LM d98e8a6's pretrain_gpt.py does not pass "
                                        "it on (its GPTModelConfig keeps 8.0 whatever the "
                                        "flag); loom scales by the flag's value, as its help "
                                        "and Megatron's HF config check mean it"),
    "--rotary-seq-len-interpolation-factor": field(note="an int in Megatron; positions times "
                                                        "1/factor (RotaryEmbedding's "
                                                        "seq_len_interpolation_factor); not "
                                                        "with YaRN or MLA, which ignore it"),
    "--no-rope-freq": field(note="loom holds the text (an int or a list); also YaRN's layers, "
                                 "not MLA's (Megatron's MLA ignores it)"),
    "--enable-gpt-oss": field(note="ModelOpt's flag: YaRN RoPE with gpt-oss's values"),
    "--tokenizer-type": field(refuse={
        "MultimodalTokenizer": "loom has no multimodal tokenizer (vision-language models)",
        "NullMultimodalTokenizer": "loom has no multimodal tokenizer (vision-language models)",
        "Llama3Tokenizer": "Megatron-LM core_v0.8's tiktoken wrapper of Llama 3's tokenizer, "
                           "dropped since: use HuggingFaceTokenizer with the model's tokenizer",
        "MistralTokenizer": "Megatron-LM core_v0.8's mistral_common wrapper, dropped since: use "
                            "HuggingFaceTokenizer with the model's tokenizer"},
        note="SFTTokenizer: with --sft (loom.data.sft)"),
    "--num-virtual-stages-per-pipeline-rank": field(
        note="sets --num-layers-per-virtual-pipeline-stage L / (p v)"),
    "--yarn-correction-range-round-to-int": field(default=True, note=(
        "None: True (megatron/training/argument_utils.py:413); MLA always rounds")),
    "--rerun-mode": field(note="loom/training/rerun.py: the in-place rerun, exit 16 / 17; a "
                          "restarted job does not rerun the step a second time", refuse={
        "report_stats": "Megatron-LM d98e8a6 itself cannot start with it (its RerunMode has no "
                        "value 'report_stats'): use validate_results or disabled"}),
    "--no-check-for-nan-in-loss-and-grad": field(note="dest check_for_nan_in_loss_and_grad="
                                                      "True; the loss check (gradients: "
                                                      "the non-finite norm skips the step)"),
    "--experimental-attention-variant": field(
        note="gated_delta_net is Megatron's deprecated spelling of gdn", refuse={
            "gdn2": "loom has no Gated DeltaNet-2 (channel-wise decay): use gdn"}),
    "--linear-attention-freq": field(note="loom holds the text (an int N, or a list such as "
                                          "([1]*3+[0])*2)"),
    "--apply-layernorm-1p": field(note="Megatron's norms hold w, gain 1 + w; loom's hold the gain "
                                      "g = 1 + w itself (the same function and, as no norm "
                                      "weight is decayed, the same training); a torch_dist "
                                      "checkpoint stores g - 1 under it and reads w + 1"),
    "--apply-wd-to-qk-layernorm": field(note="the query / key norms' parameters decayed too; "
                                             "refused with --apply-layernorm-1p (loom's norms "
                                             "hold the gain 1 + w, whose decay is not w's)"),
    "--optimizer": field(note="adam: AdamW (decoupled weight decay); sgd: torch SGD; muon: "
                              "Megatron's Muon with AdamW for the rest; dist_muon: muon with "
                              "--use-distributed-optimizer", refuse={
        v: f"loom has no {name} optimizer: use --optimizer adam (AdamW), sgd or muon"
        for v, name in (("lion", "Lion"), ("soap", "SOAP"), ("adaptive_muon", "adaptive Muon"))}),
    "--use-mup": field(note="muP for --model-type gpt: width-scaled init, attention scale, "
                            "embedding and logit multipliers, per-group LR and Adam epsilon"),
    "--mup-base-hidden-size": field(note="None: --hidden-size (width multiplier 1)"),
    "--init-method-xavier-uniform": field(
        note="output projections Xavier too (Megatron-LM d98e8a6 passes scaled_init_method, no "
             "TransformerConfig field, and stops); fans of the full matrix, as "
             "--use-cpu-initialization (Megatron's GPU init uses the TP shard's)"),
    "--embedding-init-method-std": field(
        note="init only: Megatron's optimizer skips no embedding weight decay at d98e8a6 "
             "either"),
    "--apply-residual-connection-post-layernorm": field(
        note="gpt family: residual = LN(x), legacy Megatron's and BLOOM's layer; "
             "Megatron-Core's TransformerLayer ignores the field"),
    "--fp32-residual-connection": field(note="gpt family; needs --bf16 / --fp16, as in Megatron"),
    "--qk-l2-norm": field(note="gpt family, standard attention; not with --qk-layernorm (which "
                               "Megatron's spec then drops)"),
    "--mup-output-mult": field(note="1.0 means 1 / width multiplier (Megatron's automatic "
                                    "value)"),
    "--muon-fp32-matmul-prec": field(note="medium: Newton-Schulz in bf16; high: fp32 (TF32 on "
                                          "CUDA); low: fp32 (torch ignores 'low')"),
    "--muon-coefficient-type": field(note="a str in Megatron, validated against "
                                          "emerging_optimizers 0.3.0's sets (custom needs "
                                          "coefficients Megatron never passes)"),
    "--muon-tp-mode": field(note="distributed computes duplicated's function (loom gathers)"),
    "--muon-scalar-optimizer": field(refuse={
        "lion": "loom has no Lion optimizer: use --muon-scalar-optimizer adam"}),
    "--muon-no-split-qkv": field("muon_split_qkv"),
    "--profile": field(note="Megatron's field use_nsys_profiler: nsys capture range unless "
                            "--use-pytorch-profiler"),
    "--profile-ranks": field(default=None, note="[] in Megatron: every rank; loom holds the "
                                                "words"),
    "--record-memory-history": field(note="needs CUDA (on CPU one line says so)"),
    "--log-memory-to-tensorboard": field(note="CUDA allocator statistics"),
    "--timing-log-level": field(note="an int 0-2 (bounds, not choices)"),
    "--save-retain-interval": field(note="checkpoints at its multiples are kept when older ones "
                                         "are deleted (megatron/training/checkpointing.py:1108)"),
    "--moe-per-layer-logging": field(note="moe/<loss>_layer_<i> to the JSON log, TensorBoard "
                                          "and W&B"),
    "--export-kd-teacher-load": field(note="ModelOpt's flag: logits KD from a frozen teacher "
                                      "(loom.training.distill); its existence is checked "
                                      "in a real run, not at --dry-run"),
    "--export-kd-cfg": field(note="ModelOpt's YAML; intermediate_layer_pairs refused"),
    # -- another spelling of a loom field (a Megatron flag of its own, or an alias)
    "--no-yarn-correction-range-round-to-int": field("yarn_correction_range_round_to_int"),
    "--hybrid-layer-pattern": field("hybrid_override_pattern",
                                    note="Megatron's current name of --hybrid-override-pattern"),
    "--bert-no-binary-head": field("bert_binary_head", note="turns BERT's sentence-order head "
                                   "off (loom's BERT has none unless --bert-binary-head)"),
    "--use-checkpoint-opt_param-scheduler": field("use_checkpoint_opt_param_scheduler"),
    "--override-opt_param-scheduler": field("override_opt_param_scheduler"),
}

IMPLEMENTED_ROWS = tuple((flag, _SPECIAL.get(flag) or field()) for flag in _IMPLEMENTED) + \
    tuple((flag, row) for flag, row in _SPECIAL.items() if flag not in _IMPLEMENTED)
"""``(Megatron flag, row)`` of every flag loom implements."""

PENDING_ROWS: tuple = ()  # Megatron-only flags whose capability another branch adds
