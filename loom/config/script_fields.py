"""Megatron-LM flags its example scripts use that change what loom trains, logs or loads: mixins
of the sections (Megatron's names, meanings and defaults; rows in
:mod:`loom.config.flag_rows`). Their resolution into loom's own fields is
:func:`loom.config.script_flags.resolve_script_flags`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from loom.config.fields import opt

CkptFormat = Literal["loom_dcp", "torch_dist", "torch", "torch_dcp", "fsdp_dtensor"]
OptimizerName = Literal["adam", "sgd", "muon", "dist_muon"]  # others: refused by the table
TimingLogOption = Literal["max", "minmax", "all"]
ShardingStrategy = Literal["no_shard", "optim", "optim_grads", "optim_grads_params"]
TiktokenPattern = Literal["v1", "v2"]


@dataclass
class ModelScriptFields:
    """Position-embedding flags of Megatron's scripts (a mixin of ModelConfig)."""

    rotary_percent: float = opt(1.0, "share of each head's channels RoPE rotates, in (0, 1]: "
                                     "the first int(d x p) rotate, the rest pass (GPT-NeoX)",
                                gt=0)
    rotary_interleaved: bool = opt(
        False, "RoPE rotates channel pairs (2i, 2i+1) instead of (i, i+r/2), the halves of "
               "each head's rotated channels (GPT-J's layout); with --rotary-percent within "
               "the rotated channels; not with YaRN or --multi-latent-attention (Megatron's "
               "rules)")
    use_rotary_position_embeddings: bool = opt(
        False, "= --position-embedding-type rope (Megatron's deprecated spelling)")
    no_position_embedding: bool = opt(
        False, "no learned position embeddings: with --position-embedding-type rope it "
               "changes nothing; otherwise refused, as Megatron refuses it (use "
               "--position-embedding-type)")

    squared_relu: bool = opt(False, "MLP and expert activation relu(x)^2 instead of GeLU (So "
                                    "et al. 2021, Primer; not with --swiglu)")
    moe_token_drop_policy: Literal["probs", "position"] = opt(
        "probs", "with --moe-expert-capacity-factor: drop the tokens of lowest router score "
                 "(probs, loom's) or the last ones (position: refused)")


    @property
    def rotary_dim(self) -> int:
        """r: channels of each head RoPE rotates, ``int(head_dim x --rotary-percent)``
        (Megatron's ``RotaryEmbedding``)."""
        return int(self.head_dim * self.rotary_percent)


@dataclass
class TrainingScriptFields:
    """Schedules by samples, batch-size ramps, decoupled learning rates, time limits, Megatron
    FSDP and checkpoint formats (a mixin of TrainingConfig)."""

    checkpoint_activations: bool = opt(
        False, "Megatron-LM v1-v2's activation checkpointing: every layer recomputed in chunks "
               "of --checkpoint-num-layers (= --recompute-granularity full --recompute-method "
               "uniform --recompute-num-layers N; Megatron-LM refuses it since 22.04)")
    checkpoint_num_layers: int = opt(1, "the chunk of --checkpoint-activations, in layers "
                                        "(Megatron-LM v1-v2)", ge=1)
    lr_warmup_samples: int = opt(0, "warm-up length in samples (with --train-samples; "
                                    "converted to iterations of B samples, rounded up)", ge=0)
    lr_decay_samples: Optional[int] = opt(
        None, "decay length in samples (with --train-samples; default: --train-samples)", ge=1)
    lr_warmup_init: float = opt(0.0, "learning rate the linear warm-up starts from (to --lr, "
                                     "or --decoupled-lr in its group)", ge=0)
    decoupled_lr: Optional[float] = opt(
        None, "peak learning rate of the input word embedding and output layer weights (their "
              "own parameter group, same schedule shape)", gt=0)
    decoupled_min_lr: Optional[float] = opt(None, "minimum learning rate of the "
                                                  "--decoupled-lr group (default: --min-lr)",
                                            ge=0)
    exit_duration_in_mins: Optional[float] = opt(
        None, "stop training after this many minutes of training (all ranks agree), saving a "
              "checkpoint first with --save", gt=0)
    calculate_per_token_loss: bool = opt(
        False, "average the loss over all loss tokens of the global batch instead of per "
               "micro-batch; accepted where every micro-batch has the same number of loss "
               "tokens (next-token families: identical), refused otherwise")
    rampup_batch_size: Optional[str] = opt(
        None, "START INCREMENT SAMPLES: the global batch size starts at START and grows by "
              "INCREMENT at equal intervals over the first SAMPLES samples up to "
              "--global-batch-size (Megatron-Core <= 0.16's ramp; needs --train-samples; the "
              "planner and a dry run take the final size)",
        words=True)
    decrease_batch_size_if_needed: bool = opt(
        False, "train each iteration on the largest multiple of --micro-batch-size x "
               "data-parallel size that is at most --global-batch-size (instead of refusing a "
               "global batch they do not divide): a restart on fewer data-parallel ranks goes "
               "on; the samples left out are counted as skipped (Megatron-Core's "
               "ConstantNumMicroBatchesCalculator); not with a batch-size ramp")
    step_batch_size_schedule: Optional[str] = opt(
        None, "'TOKENS:B ...' the global batch size B from each number of consumed tokens on "
              "(thresholds / --seq-length samples; K/M/B/T suffixes; Megatron-Core's step "
              "schedule; the planner and a dry run take the last B)")
    log_num_zeros_in_grad: bool = opt(False, "log the number of zero gradient entries each "
                                             "iteration (each element once over the "
                                             "model-parallel ranks)")
    log_params_norm: bool = opt(False, "log the L2 norm of the parameters each iteration "
                                       "(each element once over the model-parallel ranks)")
    use_megatron_fsdp: bool = opt(False, "Megatron FSDP: data-parallel sharding by "
                                         "--data-parallel-sharding-strategy (loom: ZeRO stage "
                                         "0-3, FSDP2 for stage 3)")
    data_parallel_sharding_strategy: ShardingStrategy = opt(
        "optim_grads_params", "with --use-megatron-fsdp: no_shard (ZeRO 0), optim (1), "
                              "optim_grads (2), optim_grads_params (3)")
    ckpt_format: CkptFormat = opt(
        "loom_dcp", "what --save writes: loom_dcp (loom's own; Megatron's default is torch_dist: "
                    "the run trains the same) or torch_dist (Megatron's, which Megatron-LM "
                    "--load reads: weights, Adam states, iteration, saved synchronously, no RNG "
                    "state); torch, torch_dcp and fsdp_dtensor write loom_dcp (said at start); "
                    "--load reads every format, Megatron's torch and torch_dist included "
                    "(detected)")
    pretrained_checkpoint: Optional[str] = opt(
        None, "fine-tuning: when --load holds no checkpoint, load only the weights of this one "
              "and start at iteration 0 (Megatron's semantics)")
    use_checkpoint_args: bool = opt(
        False, "take the model's architecture from the --load (else --pretrained-checkpoint) "
               "checkpoint, overriding the flags")
    optimizer: OptimizerName = opt(
        "adam", "adam: AdamW, decoupled weight decay (Megatron's adam); sgd: torch.optim.SGD "
                "with --sgd-momentum and --weight-decay as L2 added to the gradient (Megatron's "
                "sgd); both with the plain or distributed optimizer (ZeRO-1/2), FSDP2 (ZeRO-3), "
                "fp32 master weights for --bf16/--fp16, states saved by parameter name; muon: "
                "Megatron's Muon (momentum, Newton-Schulz orthogonalized updates of the 2-D "
                "weights, AdamW for the rest; --muon-*), plain or distributed (ZeRO-1/2); "
                "dist_muon: muon with --use-distributed-optimizer (Megatron's old spelling)")
    sgd_momentum: float = opt(0.9, "--optimizer sgd: momentum factor (0: plain SGD, no state)",
                              ge=0)
    deterministic_mode: bool = opt(
        False, "bitwise-reproducible runs (what torch offers): "
               "torch.use_deterministic_algorithms(True) (an op without a deterministic kernel "
               "raises, naming itself), CUBLAS_WORKSPACE_CONFIG=:4096:8 and NCCL_ALGO=Ring "
               "unless set (Megatron's values; nondeterministic values refused), "
               "cudnn.benchmark off. loom's own reductions (gradient buckets, norms, "
               "pipeline, loss) already run in a fixed order, with or without overlap")
    export_kd_teacher_load: Optional[str] = opt(
        None, "knowledge distillation: the teacher's checkpoint directory (loom or Megatron; "
              "its shape from its saved config, the vocabulary and sequence length this "
              "run's); the teacher runs frozen in forward on every micro-batch and the loss "
              "is --export-kd-cfg's (loom.training.distill); GPT, one pipeline stage")
    export_kd_cfg: Optional[str] = opt(
        None, "distillation YAML: skip_lm_loss (default true: the KD loss alone; false: LM "
              "loss + kd_loss_scale x KD loss), kd_loss_scale (1.0), logit_kl_temperature "
              "(1.0), logit_layers [output_layer, output_layer]; intermediate_layer_pairs "
              "refused. Without it: logits KL only at temperature 1")
    iterations_to_skip: Optional[str] = opt(
        None, "iterations (1-based) that take no step: their global batch is consumed (the "
              "next iteration reads the batch after it), no forward, backward, optimizer or "
              "LR-schedule step, no log, evaluation or save at them (Megatron's)", words=True)


@dataclass
class DataScriptFields:
    """Tokenizer files of Megatron's scripts and the end-of-document loss mask (a mixin of
    DataConfig)."""

    tokenizer_model: Optional[str] = opt(
        None, "tokenizer file or directory: SentencePiece .model (Llama2Tokenizer, "
              "GPTSentencePieceTokenizer), tiktoken BPE file (TikTokenizer), Hugging Face "
              "tokenizer directory or tokenizer.json (HuggingFaceTokenizer)")
    vocab_file: Optional[str] = opt(None, "GPT-2 vocab.json (GPT2BPETokenizer) or BERT "
                                          "vocab.txt (BertWordPiece*)")
    merge_file: Optional[str] = opt(None, "GPT-2 merges.txt (GPT2BPETokenizer)")
    tiktoken_pattern: Optional[TiktokenPattern] = opt(
        None, "TikTokenizer: the pre-tokenizer regex, v1 or v2")
    data_args_path: Optional[str] = opt(
        None, "a file holding --data-path's words (a blend too long for a command line)")
    per_split_data_args_path: Optional[str] = opt(
        None, "a JSON file {\"train\": ..., \"valid\": ..., \"test\": ...} holding "
              "--train-data-path, --valid-data-path and --test-data-path (each a blend: a "
              "list or a string of words)")
    phase_transition_iterations: Optional[str] = opt(
        None, "ITER,ITER,...: data phases (Megatron-LM's): at each of these iterations save "
              "(with --save) and exit; the run resumed there may train on other data (the "
              "checkpoint's data is not required) and reads the training data from its first "
              "sample, as each later phase does; needs a constant global batch (no ramp, no "
              "--decrease-batch-size-if-needed), the same on resume")
    eod_mask_loss: bool = opt(False, "no loss where the input token is the end-of-document id "
                                     "(Megatron's rule; each micro-batch averages over the "
                                     "rest); GPT-style families")
    sft: bool = opt(False, "supervised fine-tuning: --data-path is a JSONL file of conversations "
                           "({\"messages\": [{\"role\", \"content\"}]}, one per line), "
                           "tokenized by --tokenizer-type SFTTokenizer; the loss covers the "
                           "assistant turns only (loom.data.sft)")
    sft_tokenizer_prompt_format: str = opt(
        "nemotron-h-aligned", "SFTTokenizer's chat template: nemotron-h-aligned, "
                              "nemotron-nano-v2, identity, or default (the tokenizer's own, "
                              "every token in the loss)", metavar="FORMAT")


@dataclass
class DebugScriptFields:
    """Megatron's timers, profiler and memory snapshots (docs/debugging.md); a mixin of
    LoggingConfig through :class:`LoggingScriptFields`."""

    timing_log_level: int = opt(
        0, "timers, 0-2: 0 the iteration time only (no extra synchronization); 1 adds "
           "forward-backward, the gradient reductions, the optimizer's phases, the parameter "
           "all-gather (once per iteration each; a CUDA sync at each start and stop); 2 adds "
           "batch-generator, forward/backward compute and pipeline send/recv (per micro-batch)",
        ge=0, lt=3)
    timing_log_option: TimingLogOption = opt(
        "minmax", "timers over ranks: max, minmax (min and max) or all (every rank)")
    log_timers_to_tensorboard: bool = opt(
        False, "write each timer's max over ranks (NAME-time, ms per iteration) and "
               "iteration-time (s) to --tensorboard-dir")
    no_barrier_with_level_1_timing: bool = opt(
        False, "no barrier before the level-1 timers forward-backward, all-grads-sync, "
               "optimizer and params-all-gather (Megatron's default has one, so their times "
               "exclude waiting for slower ranks)")
    log_memory_to_tensorboard: bool = opt(
        False, "CUDA: mem-reserved-bytes, mem-allocated-bytes, mem-max-allocated-bytes and "
               "mem-allocated-count (torch.cuda.memory_stats) to --tensorboard-dir at each "
               "--log-interval; CPU: one line says so (peak resident memory is always logged)")
    profile: bool = opt(
        False, "profile iterations --profile-step-start..--profile-step-end on --profile-ranks: "
               "with --use-pytorch-profiler a torch.profiler Chrome trace "
               "(DIR/../torch_profile/rank-N.json.gz beside --tensorboard-dir DIR, else "
               "./torch_profile/); without, Megatron's nsys capture range "
               "(cudaProfilerStart/Stop, for nsys profile --capture-range=cudaProfilerApi; "
               "needs CUDA, on CPU one line says nothing is captured)")
    use_pytorch_profiler: bool = opt(False, "--profile with torch.profiler instead of nsys")
    profile_step_start: int = opt(10, "--profile: first profiled iteration", ge=0)
    profile_step_end: int = opt(12, "--profile: torch.profiler records iterations up to this "
                                    "one, excluded; nsys stops after it", ge=0)
    profile_ranks: Optional[str] = opt(None, "global ranks --profile and "
                                             "--record-memory-history apply to (default: all)",
                                       words=True)
    pytorch_profiler_collect_shapes: bool = opt(False, "--use-pytorch-profiler: record tensor "
                                                       "shapes")
    pytorch_profiler_collect_callstack: bool = opt(False, "--use-pytorch-profiler: record "
                                                          "Python call stacks")
    record_memory_history: bool = opt(
        False, "CUDA: record allocator history from the model build on (--profile-ranks) and "
               "dump a snapshot (torch.cuda.memory._dump_snapshot, for pytorch.org/memory_viz) "
               "to --memory-snapshot-path as BASE_RANK.EXT at every --log-interval, and "
               "BASE_oom_rank_RANK.EXT on out-of-memory; CPU: one line says it needs CUDA")
    memory_snapshot_path: str = opt("snapshot.pickle", "--record-memory-history: the "
                                                       "snapshot file (the rank is appended)")


@dataclass
class LoggingScriptFields(DebugScriptFields):
    """Weights & Biases, per-layer MoE losses, and Megatron's debugging flags (a mixin of
    LoggingConfig)."""

    moe_per_layer_logging: bool = opt(
        False, "log each MoE layer's load-balancing and z losses every iteration (Megatron's "
               "moe/<loss>_layer_<i>: without the coefficient, mean over the micro-batches "
               "and data-parallel ranks) to the JSON log, TensorBoard and W&B")
    log_progress: bool = opt(
        False, "append to --save's progress.txt one line when the job starts and one at each "
               "checkpoint: iteration, this job's and the cumulative TFLOP/s per GPU, the "
               "floating-point operations and tokens trained so far (Megatron's format)")
    log_world_size_to_tensorboard: bool = opt(
        False, "write the world size (world-size, and world-size vs samples) to "
               "--tensorboard-dir at every --log-interval")
    log_straggler: bool = opt(
        False, "at every --log-interval, the fastest and slowest rank's forward time, batch "
               "time and estimated TFLOP/s (Megatron's straggler detector; loom.training."
               "straggler)")
    straggler_minmax_count: int = opt(
        1, "--log-straggler: also list this many ranks of lowest and of highest estimated "
           "throughput (when 1 < N < world size)", ge=1)
    disable_straggler_on_startup: bool = opt(
        False, "--log-straggler: start with the detector off (an HTTP request to "
               "--straggler-ctrlr-port on rank 0 toggles it)")
    straggler_ctrlr_port: int = opt(
        65535, "--log-straggler: the TCP port on rank 0 whose HTTP requests toggle the "
               "detector (curl localhost:PORT)", ge=0, le=65535)
    log_max_attention_logit: bool = opt(
        False, "log max_attention_logit: the largest scaled attention logit (q k^T times the "
               "softmax scale) of the step over every attention layer and head, each "
               "iteration (also with --qk-clip: the value before the clip)")
    wandb_project: Optional[str] = opt(None, "Weights & Biases project; logs every record "
                                             "there too (WANDB_MODE=offline works offline)")
    wandb_exp_name: Optional[str] = opt(None, "Weights & Biases run name")
    wandb_save_dir: Optional[str] = opt(None, "directory of the local Weights & Biases files "
                                              "(default: --save/wandb, else ./wandb)")
    wandb_entity: Optional[str] = opt(None, "Weights & Biases entity (team or user)")
