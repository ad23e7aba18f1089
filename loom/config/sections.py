"""The configuration sections, filed by concern: model, parallel, training, data, logging;
checkpoint and fault tolerance live in :mod:`loom.config.resilience` (re-exported here).

Every field ``foo_bar`` is the flag ``--foo-bar`` (Megatron-LM's name and meaning) and the YAML
key ``foo_bar``. Each field carries its help text and its bounds in ``metadata``
(``help``, ``ge``: >=, ``gt``: >, ``lt``: <); string choices are ``Literal`` types. The one
generic check of types, choices and bounds is :func:`loom.config.validate.check_fields`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

from loom.config.document_masks import DocumentMaskFields
from loom.config.evaluation import EvaluationFields
from loom.config.fields import opt
from loom.config.model_bert import BertFields
from loom.config.model_dsa import DSAFields
from loom.config.model_gdn import GatedDeltaNetFields
from loom.config.model_qkclip import QKClipFields
from loom.config.model_gemma3 import Gemma3Fields
from loom.config.model_gptoss import GptOssFields
from loom.config.model_mamba import MambaFields
from loom.config.model_mla import MLAFields
from loom.config.model_moe import MoEFields
from loom.config.model_mup import MupFields
from loom.config.model_rope import RopeScalingFields
from loom.config.model_llama4 import Llama4AttentionFields
from loom.config.model_variants import LayerVariantFields
from loom.config.optimizer_muon import MuonFields
from loom.config.optimizer_precision import PrecisionAwareFields
from loom.config.parallel_cp import ContextParallelFields
from loom.config.resilience import CheckpointConfig, FaultToleranceConfig  # noqa: F401
from loom.config.schedule import ScheduleFields
from loom.config.script_fields import (DataScriptFields, LoggingScriptFields, ModelScriptFields,
                                       TrainingScriptFields)

Normalization = Literal["LayerNorm", "RMSNorm"]
PositionEmbedding = Literal["learned_absolute", "rope", "yarn", "none"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved", "zero-bubble", "zbv"]
DecayStyle = Literal["cosine", "linear", "constant", "inverse-square-root", "WSD"]
Recompute = Literal["selective", "full"]
Backend = Literal["nccl", "gloo"]
Device = Literal["cpu", "cuda"]
# --model-type names a family of loom.models.FAMILY_MODULES (or one registered on a registry):
# checked by the registry (loom.models.resolve_config), so a new family adds no line here
ModelType = str
RecomputeMethod = Literal["uniform", "block"]
TokenizerType = Literal["GPT2BPETokenizer", "HuggingFaceTokenizer", "ByteLevelBPETrained",
                        "BertWordPieceLowerCase", "BertWordPieceCase", "Llama2Tokenizer",
                        "GPTSentencePieceTokenizer", "SentencePieceTokenizer", "TikTokenizer",
                        "NullTokenizer", "SFTTokenizer"]


@dataclass
class ModelShapeFields:
    """The fields every model family has: the transformer's shape and layout; the first
    fields of :class:`ModelConfig`."""

    model_type: ModelType = opt("gpt", "model family, what Megatron's entry script chooses: "
                                       "gpt (pretrain_gpt.py: GPT-2 and LLaMA layouts, dense or "
                                       "mixture-of-experts), mamba (pretrain_hybrid.py, "
                                       "pretrain_mamba.py: Mamba-2 and hybrid "
                                       "Mamba/attention/MLP stacks), bert (pretrain_bert.py: "
                                       "bidirectional encoder, masked-LM pretraining) or gemma3 "
                                       "(Gemma 3 text)",
                                metavar="FAMILY")
    num_layers: Optional[int] = opt(None, "L: number of transformer layers (required; mamba: "
                                          "default the length of --hybrid-override-pattern)",
                                    ge=1)
    hidden_size: Optional[int] = opt(None, "h: transformer hidden size (width of the residual "
                                           "stream; required)", ge=1)
    num_attention_heads: Optional[int] = opt(None, "a: attention heads per layer; must divide h "
                                                   "(unless --kv-channels is set; required)", ge=1)
    num_query_groups: Optional[int] = opt(
        None, "g: key/value head groups for grouped-query attention; must divide a "
              "(default: 1 with --group-query-attention, else a: multi-head attention)", ge=1)
    group_query_attention: bool = opt(False, "use grouped-query attention (needs "
                                             "--num-query-groups)")
    ffn_hidden_size: Optional[int] = opt(None, "hidden size of the MLP (default: 4h)", ge=1)
    kv_channels: Optional[int] = opt(None, "per-head dimension of keys/values/queries "
                                           "(default: h / a)", ge=1)
    seq_length: Optional[int] = opt(None, "s: tokens per training sample (required)", ge=1)
    max_position_embeddings: Optional[int] = opt(
        None, "largest position the model can encode; must be >= --seq-length "
              "(default: --seq-length)", ge=1)
    vocab_size: Optional[int] = opt(
        None, "V: vocabulary size, token ids are 0..V-1 (default: from the dataset's "
              "PREFIX.meta.json or the checkpoint)", ge=1)
    make_vocab_size_divisible_by: int = opt(
        128, "pad V to a multiple of this times the tensor-parallel size", ge=1)
    exclude_padded_vocab: bool = opt(
        False, "loom's own: leave the padded vocabulary columns (ids >= V, from "
               "--make-vocab-size-divisible-by or --padded-vocab-size) out of the softmax of "
               "the loss and of evaluation, so the model's function does not depend on the "
               "padding (hence on t); default: in the softmax, as Megatron-Core's output "
               "layer has them")
    normalization: Normalization = opt("LayerNorm", "layer normalization: LayerNorm or RMSNorm")
    norm_epsilon: float = opt(1e-5, "epsilon added to the variance in the normalization", gt=0)
    apply_layernorm_1p: bool = opt(
        False, "zero-centred norm gains (Megatron's layernorm_zero_centered_gamma: gain 1 + w): "
               "loom's norms hold the gain itself, the same math; Megatron-format (torch_dist) "
               "checkpoints store gain - 1")
    position_embedding_type: PositionEmbedding = opt(
        "learned_absolute", "positions: learned_absolute embeddings, rope (rotary), yarn "
                            "(rotary with YaRN scaling: --rotary-scaling-factor, --yarn-*, "
                            "--mscale, --mscale-all-dim) or none")
    rotary_base: float = opt(10000.0, "RoPE base period (theta)", gt=0)
    swiglu: bool = opt(False, "SwiGLU MLP instead of GeLU")
    openai_gelu: bool = opt(False, "tanh-approximated GeLU, as GPT-2 uses")
    untie_embeddings_and_output_weights: bool = opt(
        False, "separate output layer instead of reusing the input embedding")
    disable_bias_linear: bool = opt(False, "no bias in the linear layers")
    hidden_dropout: float = opt(0.1, "dropout probability after attention and MLP, in [0, 1)",
                                ge=0, lt=1)
    attention_dropout: float = opt(0.1, "dropout probability of the attention weights, in [0, 1)",
                                   ge=0, lt=1)
    init_method_std: float = opt(0.02, "standard deviation of the normal weight initialization",
                                 gt=0)
    add_qkv_bias: bool = opt(False, "biases in the QKV projection only (Qwen2), even with "
                                    "--disable-bias-linear")


@dataclass
class ModelConfig(QKClipFields, Llama4AttentionFields, LayerVariantFields, DSAFields,
                  GatedDeltaNetFields, MupFields,
                  RopeScalingFields, ModelScriptFields, GptOssFields, MLAFields, MambaFields, Gemma3Fields,
                  BertFields, MoEFields, ModelShapeFields):
    """Transformer shape and layout (symbols as in Shoeybi et al. 2019: L, h, a, V, s).

    The fields every family has (:class:`ModelShapeFields`), then each family's own, in its own
    module: mixture of experts (:mod:`~loom.config.model_moe`), BERT
    (:mod:`~loom.config.model_bert`), Gemma 3 (:mod:`~loom.config.model_gemma3`), Mamba-2
    (:mod:`~loom.config.model_mamba`), multi-latent attention, YaRN and multi-token prediction
    (:mod:`~loom.config.model_mla`), muP (:mod:`~loom.config.model_mup`), the gated attention
    output and Gated DeltaNet layers (:mod:`~loom.config.model_gdn`), DeepSeek sparse attention
    (:mod:`~loom.config.model_dsa`), RoPE scaling and NoPE layers
    (:mod:`~loom.config.model_rope`), initialization and residual-stream variants
    (:mod:`~loom.config.model_variants`), QK-clip (:mod:`~loom.config.model_qkclip`), Llama 4's
    attention (:mod:`~loom.config.model_llama4`). One flat
    section all the same: ``cfg.model.<field>``, the flag ``--<field>`` and the YAML key, in this
    order.
    """

    @property
    def num_kv_groups(self) -> int:
        """g: key/value heads (``--num-query-groups``); equals a without GQA."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Per-head dimension: ``--kv-channels`` or h / a."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        """MLP hidden size: ``--ffn-hidden-size`` or 4h."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def softmax_vocab_size(self) -> Optional[int]:
        """Output columns the softmax of the loss and of evaluation spans: V with
        ``--exclude-padded-vocab``, else None: all Vp, the padded ones included (Megatron-Core's
        output layer and ``vocab_parallel_cross_entropy``). Generation never samples a padded
        id either way."""
        return self.vocab_size if self.exclude_padded_vocab else None

    @property
    def rotary(self) -> bool:
        """Whether standard attention rotates queries and keys: ``--position-embedding-type``
        rope or yarn."""
        return self.position_embedding_type in ("rope", "yarn")

    @property
    def max_positions(self) -> int:
        """``--max-position-embeddings`` or s."""
        return self.max_position_embeddings or self.seq_length

    @classmethod
    def gpt2(cls, **kw: Any) -> "ModelConfig":
        """GPT-2 layout: LayerNorm, learned positions, GeLU MLP with bias, tied embeddings."""
        return cls(**kw)

    @classmethod
    def mixtral(cls, **kw: Any) -> "ModelConfig":
        """Mixtral-style MoE: the LLaMA layout with every MLP a mixture of 8 SwiGLU experts,
        softmax top-2 router (Jiang et al. 2024)."""
        return cls.llama(**{**dict(num_experts=8, moe_router_topk=2, moe_aux_loss_coeff=0.01),
                            **kw})

    @classmethod
    def deepseek_moe(cls, **kw: Any) -> "ModelConfig":
        """DeepSeek-style MoE: fine-grained experts (64 of width h/2, top-6, sigmoid router with
        normalized weights) plus an always-on shared expert of width 2h (DeepSeek-V3 sec. 2.1)."""
        h = kw.get("hidden_size", 256)
        return cls.llama(**{**dict(num_experts=64, moe_router_topk=6,
                                   moe_router_score_function="sigmoid",
                                   moe_ffn_hidden_size=max(h // 2, 8),
                                   moe_shared_expert_intermediate_size=2 * h,
                                   moe_aux_loss_coeff=0.001), **kw})

    @classmethod
    def llama(cls, **kw: Any) -> "ModelConfig":
        """LLaMA layout: RMSNorm, RoPE, SwiGLU, no biases, untied output layer."""
        base = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                    untie_embeddings_and_output_weights=True, disable_bias_linear=True,
                    norm_epsilon=1e-6)
        base.update(kw)
        return cls(**base)


@dataclass
class ParallelConfig(ContextParallelFields):
    """Parallel sizes t, c, p (d is derived from the world size), their options and the device."""

    tensor_model_parallel_size: int = opt(1, "t: ranks splitting each layer's weights", ge=1)
    pipeline_model_parallel_size: int = opt(1, "p: pipeline stages (layers split across ranks)",
                                            ge=1)
    context_parallel_size: int = opt(1, "c: ranks splitting each sequence", ge=1)
    data_parallel_size: Optional[int] = opt(
        None, "d: model replicas; must equal world size / (t p c) (default: derived)", ge=1)
    num_layers_per_virtual_pipeline_stage: Optional[int] = opt(
        None, "layers per model chunk; giving it selects the interleaved 1F1B schedule "
              "(L / (p x N) chunks per stage)", ge=1)
    pipeline_schedule: Optional[PipelineSchedule] = opt(
        None, "pipeline schedule: gpipe, 1f1b, interleaved, zero-bubble (ZB-H1) or zbv (ZB-V: "
              "two chunks per stage in a V, L divisible by 2p); loom's own names for the last "
              "two, not Megatron values; default: interleaved when "
              "--num-layers-per-virtual-pipeline-stage is given, else 1f1b)")
    pipeline_model_parallel_layout: Optional[str] = opt(
        None, "Megatron's layout string: what every virtual stage holds, p x v stages split by "
              "'|' in pipeline order (E embedding, t layer, m MTP layer, L loss; X*n, (...)*n), "
              "e.g. 'Et*7|(t*8|)*14,t*7L'; v > 1 runs the interleaved schedule",
        metavar="LAYOUT")
    microbatch_group_size_per_virtual_pipeline_stage: Optional[int] = opt(
        None, "interleaved 1F1B: micro-batches N each stage runs through one model chunk before "
              "the next (Megatron-Core's schedule table; p <= N <= m, and the last group, m mod "
              "N, is 0 or at least p); default p", ge=1)
    num_virtual_stages_per_pipeline_rank: Optional[int] = opt(
        None, "model chunks per pipeline stage v (Megatron's other spelling: sets "
              "--num-layers-per-virtual-pipeline-stage L / (p v); 1: no interleaving)", ge=1)
    account_for_embedding_in_pipeline_split: bool = opt(
        False, "count the input embedding as a layer when splitting the layers over pipeline "
               "stages: the first stage holds one layer fewer ((L + 1) / p layers a stage)")
    account_for_loss_in_pipeline_split: bool = opt(
        False, "count the loss as a layer when splitting the layers over pipeline stages: the "
               "last stage holds one layer fewer")
    decoder_first_pipeline_num_layers: Optional[int] = opt(
        None, "layers on the first pipeline stage (the rest split evenly)", ge=1)
    decoder_last_pipeline_num_layers: Optional[int] = opt(
        None, "layers on the last pipeline stage (the rest split evenly)", ge=1)
    sequence_parallel: bool = opt(False, "shard norms and dropout over the sequence across the "
                                         "tensor-parallel ranks")
    expert_model_parallel_size: int = opt(1, "e: ranks the experts are split over, on "
                                             "Megatron's expert grid (TP, CP and DP ranks "
                                             "re-folded as expert TP x EP x expert DP)", ge=1)
    expert_tensor_parallel_size: Optional[int] = opt(
        None, "u: ranks each expert is sharded over, dividing --tensor-model-parallel-size "
              "(1: experts whole, the routed tokens split over the TP ranks; default: the TP "
              "size, experts sharded like the MLP)", ge=1)
    ddp_bucket_size: Optional[int] = opt(
        None, "gradient elements per data-parallel reduction bucket (default: "
              "clamp(ceil(P / 4), 250,000 x d, 40M) for P gradient elements and d DP ranks)",
        ge=1)
    overlap_grad_reduce: bool = opt(False, "launch each gradient bucket's reduction during "
                                           "backward, when its last gradient arrives (default: "
                                           "one pass after backward)")
    distributed_backend: Backend = opt(
        "nccl", "torch.distributed backend: nccl or gloo (--device cpu, which Megatron lacks, "
                "resolves the default to gloo)")
    device: Optional[Device] = opt(None, "cpu or cuda (default: cuda when available, else cpu)")


@dataclass
class TrainingConfig(TrainingScriptFields, MuonFields, PrecisionAwareFields, ScheduleFields):
    """Batch sizes, iterations, optimizer and learning-rate schedule."""

    micro_batch_size: Optional[int] = opt(None, "b: samples per micro-batch per data-parallel "
                                                "rank (required)", ge=1)
    global_batch_size: Optional[int] = opt(
        None, "B: samples per iteration over all ranks; a multiple of b x d (default: b x d)",
        ge=1)
    train_iters: Optional[int] = opt(None, "iterations (optimizer steps) to train for (this or "
                                           "--train-samples required)", ge=1)
    lr: Optional[float] = opt(None, "peak learning rate (required)", gt=0)
    min_lr: float = opt(0.0, "learning rate at the end of the decay; <= --lr", ge=0)
    lr_warmup_iters: int = opt(0, "iterations of linear warmup from 0 to --lr", ge=0)
    lr_decay_iters: Optional[int] = opt(None, "iterations over which the learning rate decays "
                                              "(default: --train-iters)", ge=1)
    lr_decay_style: DecayStyle = opt(
        "linear", "learning-rate decay after the warm-up, to --min-lr at --lr-decay-iters: "
                  "cosine, linear, constant, inverse-square-root (--lr x sqrt(warm-up / "
                  "iteration), at least --min-lr) or WSD (warmup-stable-decay: --lr until the "
                  "last --lr-wsd-decay-iters, then --lr-wsd-decay-style)")
    weight_decay: float = opt(0.01, "decoupled weight decay coefficient of the weights (not "
                                    "biases and norms; with --weight-decay-incr-style constant)",
                              ge=0)
    decoupled_weight_decay: bool = opt(
        True, "Adam's weight decay decoupled from the gradient (AdamW, Loshchilov & Hutter "
              "2019); --no-decoupled-weight-decay: the original Adam's L2 term added to the "
              "gradient (torch.optim.Adam; Megatron-Core's OptimizerConfig."
              "decoupled_weight_decay, which Megatron-LM's parser does not expose)")
    weight_decay_norms_and_biases: bool = opt(
        False, "decay biases and 1-D parameters (norms) too, as torchtitan's optimizer decays "
               "every parameter (loom's own flag; a torchtitan --config sets it; Megatron "
               "decays the weights only)")
    adam_beta1: float = opt(0.9, "AdamW first-moment decay, in [0, 1)", ge=0, lt=1)
    adam_beta2: float = opt(0.999, "AdamW second-moment decay, in [0, 1)", ge=0, lt=1)
    adam_eps: float = opt(1e-8, "AdamW denominator epsilon", gt=0)
    clip_grad: float = opt(1.0, "clip the global gradient L2 norm to this value (0: no clipping)",
                           ge=0)
    use_distributed_optimizer: bool = opt(
        False, "Megatron's distributed optimizer (ZeRO-1): gradients reduce-scattered over DP x "
               "CP, fp32 master weights and Adam states sharded, parameters all-gathered")
    zero_stage: int = opt(
        0, "ZeRO stage, 0-3: 1 = --use-distributed-optimizer; 2 = that with gradients kept "
           "sharded too; 3 = fully sharded data parallel (parameters, gradients and Adam states "
           "sharded over DP x CP with PyTorch's FSDP2, = --use-torch-fsdp2)", ge=0, lt=4)
    use_torch_fsdp2: bool = opt(
        False, "ZeRO-3 with PyTorch's FSDP2 (fully_shard per transformer layer and per model "
               "chunk, over DP x CP) = --zero-stage 3")
    overlap_param_gather: bool = opt(False, "distributed optimizer: all-gather the updated "
                                            "parameters asynchronously, waited for per bucket "
                                            "in the next forward")
    seed: int = opt(1234, "random seed of initialization, dropout and data order", ge=0)
    bf16: bool = opt(False, "bfloat16 parameters; fp32 main gradients and master weights")
    fp16: bool = opt(False, "float16 parameters, fp32 main gradients and master weights, "
                            "loss scaling")
    accumulate_allreduce_grads_in_fp32: bool = opt(
        False, "--fp16: accumulate and reduce gradients in fp32 main-gradient buffers (always "
               "on with --bf16 unless --grad-reduce-in-bf16)")
    grad_reduce_in_bf16: bool = opt(
        False, "--bf16: accumulate and reduce gradients in bf16 buffers instead of fp32 main "
               "gradients (half the gradient memory and data-parallel traffic, sums rounded to "
               "bf16; the optimizer still steps fp32 masters); no effect without --bf16, as in "
               "Megatron")
    loss_scale: Optional[float] = opt(None, "--fp16: static loss scale (default: dynamic)", gt=0)
    initial_loss_scale: float = opt(2.0 ** 32, "--fp16: initial dynamic loss scale", gt=0)
    min_loss_scale: float = opt(1.0, "--fp16: lowest dynamic loss scale", gt=0)
    loss_scale_window: int = opt(1000, "--fp16: steps without overflow before the scale "
                                       "doubles", ge=1)
    hysteresis: int = opt(2, "--fp16: overflows tolerated before the scale halves", ge=1)
    exit_on_nonfinite: Optional[int] = opt(
        None, "stop after N consecutive iterations with a non-finite gradient norm (each one "
              "is skipped and reported; default: never stop)", ge=1)
    recompute_granularity: Optional[Recompute] = opt(
        None, "activation recomputation: selective (attention core) or full (whole layers)")
    recompute_method: Optional[RecomputeMethod] = opt(
        None, "which layers --recompute-granularity full recomputes: uniform (groups of "
                   "--recompute-num-layers layers, only each group's input kept) or block (the "
                   "first --recompute-num-layers layers of each pipeline chunk; required with "
                   "--recompute-granularity full)")
    recompute_num_layers: Optional[int] = opt(None, "N of --recompute-method (required with "
                                                    "--recompute-granularity full)", ge=1)
    # -- Megatron's alternatives: by samples, warm-up as a fraction, evaluation only -------------
    train_samples: Optional[int] = opt(
        None, "samples to train on instead of --train-iters (iterations = samples / B)", ge=1)
    lr_warmup_fraction: Optional[float] = opt(
        None, "warm-up as a fraction of --lr-decay-iters, in [0, 1] (instead of "
              "--lr-warmup-iters)", ge=0)
    recompute_activations: bool = opt(False, "recompute the attention core in the backward "
                                             "pass (= --recompute-granularity selective)")
    skip_train: bool = opt(False, "do not train: evaluate the --load checkpoint on the "
                                  "validation and test sets, then exit")
    compile: bool = opt(False, "torch.compile each transformer layer (regional compilation; "
                               "fuses norms, activations, residual adds; the first steps pay "
                               "the compilation)")


@dataclass
class DataConfig(DataScriptFields, DocumentMaskFields):
    """Where the training tokens come from."""

    data_path: Optional[str] = opt(
        None, "dataset prefix (PREFIX.bin / .idx / .meta.json written by `loom preprocess`), "
              "or a blend: W1 PREFIX1 W2 PREFIX2 ... (weights; --split applies to each)")
    valid_data_path: Optional[str] = opt(
        None, "held-out dataset prefix or blend (W PREFIX ...) for evaluation (default: the "
              "--split share of --data-path)")
    # -- Megatron's separate sets: whole datasets, --split not applied ----------------------------
    train_data_path: Optional[str] = opt(
        None, "training dataset prefix or blend (W PREFIX ...) instead of --data-path")
    test_data_path: Optional[str] = opt(
        None, "test dataset prefix or blend (W PREFIX ...), evaluated with --skip-train")
    split: Optional[str] = opt(None, "train,valid,test weights of --data-path's documents "
                                     "(default: 969, 30, 1)")
    tokenizer_type: Optional[TokenizerType] = opt(
        None, "the tokenizer the data was prepared with (loom preprocess --tokenizer-type); "
              "checked against each dataset's PREFIX.meta.json, refused when they differ")
    mask_prob: float = opt(0.15, "BERT: share of the tokens (whole words when the tokenizer "
                                 "marks word pieces) to predict; each is replaced by [MASK] "
                                 "80%, a random token 10%, kept 10%", gt=0, lt=1)
    short_seq_prob: float = opt(0.1, "BERT: probability that a sample is shorter than "
                                     "--seq-length (a random length; the rest is [PAD])",
                                ge=0, lt=1)
    mock_data: bool = opt(False, "train on random tokens (needs --vocab-size; tests, "
                                 "benchmarks)")
    # -- fill-in-the-middle (Megatron's FIM GPT dataset: loom.data.fim) ---------------------------
    fim_data: bool = opt(False, "fill-in-the-middle: reorder documents of the samples into "
                                "prefix/suffix/middle (SPM or PSM) around the FIM tokens")
    fim_rate: float = opt(0.5, "--fim-data: probability that a document is transformed", ge=0)
    fim_spm_rate: float = opt(0.5, "--fim-data: probability that a transformed document is in "
                                   "SPM order (else PSM)", ge=0)
    fim_split_sample: Optional[str] = opt(
        None, "--fim-data: a token at which documents are cut into fragments, each transformed "
              "on its own (with --fim-fragment-rate)")
    fim_fragment_rate: Optional[float] = opt(
        None, "--fim-data with --fim-split-sample: probability that a fragment is transformed",
        ge=0)
    fim_no_prefix: Optional[str] = opt(
        None, "--fim-data: documents (fragments) whose text starts with this are kept as they are")
    fim_prefix_token: str = opt("<fim_prefix>", "--fim-data: the prefix sentinel token")
    fim_middle_token: str = opt("<fim_middle>", "--fim-data: the middle sentinel token")
    fim_suffix_token: str = opt("<fim_suffix>", "--fim-data: the suffix sentinel token")
    fim_pad_token: str = opt("<fim_pad>", "--fim-data: the token that pads a sample the "
                                          "transform shortened")
    fim_eod_token: str = opt("<|endoftext|>", "--fim-data: the end-of-document token at which "
                                              "samples are cut into documents")


@dataclass
class LoggingConfig(LoggingScriptFields, EvaluationFields):
    """What is reported, and how often."""

    log_interval: int = opt(100, "iterations between training-loss log lines", ge=1)
    eval_interval: Optional[int] = opt(None, "iterations between evaluations on the validation "
                                             "set (default: only one, at the end of training)",
                                       ge=1)
    eval_iters: int = opt(100, "evaluation iterations per evaluation, each of "
                               "--eval-global-batch-size samples (0: no evaluation)", ge=0)
    eval_global_batch_size: Optional[int] = opt(
        None, "samples per evaluation iteration (default: --global-batch-size; with "
              "--step-batch-size-schedule, --eval-micro-batch-size x data-parallel size, as "
              "Megatron); a multiple of --eval-micro-batch-size x data-parallel size", ge=1)
    eval_micro_batch_size: Optional[int] = opt(
        None, "samples per evaluation micro-batch (default: --micro-batch-size)", ge=1)
    log_json: Optional[str] = opt(None, "append every logged record as a JSON line to this file")
    tensorboard_dir: Optional[str] = opt(None, "write TensorBoard scalars to this directory")
    peak_tflops: Optional[float] = opt(
        None, "peak TFLOP/s per rank for MFU (default: from the device table)", gt=0)
    planner_cluster: Optional[str] = opt(
        None, "compare the step time with the planner's prediction for this layout on this "
              "cluster: a JSON file from `loom plan --calibrate` or a GPU name (H100-80GB)")
    timeline: Optional[str] = opt(None, "write a Chrome trace of the pipeline schedule here")
    no_progress_bar: bool = opt(False, "no progress bar on rank 0")


GROUPS = {"model": ModelConfig, "parallel": ParallelConfig, "training": TrainingConfig,
          "data": DataConfig, "logging": LoggingConfig, "checkpoint": CheckpointConfig,
          "fault_tolerance": FaultToleranceConfig}
