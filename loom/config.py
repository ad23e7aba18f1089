"""Configuration: dataclasses whose field names are Megatron-LM's flag names.

Every field ``foo_bar`` of the dataclasses below is the command-line flag ``--foo-bar`` and the
YAML key ``foo_bar`` (or ``foo-bar``) of ``--config FILE.yaml``; flags given on the command line
override the file. :func:`LoomConfig.validate` refuses impossible layouts with a
:class:`ConfigError` that names the flag and the fix, before any process group is created.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field, fields
from typing import Any, Optional, get_args, get_origin, get_type_hints

import yaml


class ConfigError(ValueError):
    """An impossible or inconsistent configuration; the message names the flag and the fix."""


MODEL_TYPES = ("gpt", "mamba")  # families in loom.models.FAMILY_MODULES


def flag(name: str) -> str:
    """``tensor_model_parallel_size`` -> ``--tensor-model-parallel-size``."""
    return "--" + name.replace("_", "-")


@dataclass
class ModelConfig:
    """Transformer shape and layout (symbols as in Shoeybi et al. 2019: L, h, a, V, s)."""

    model_type: str = "gpt"  # model family (loom.models.FAMILY_MODULES): gpt
    num_layers: int = 4  # L
    hidden_size: int = 256  # h
    num_attention_heads: int = 4  # a
    num_query_groups: Optional[int] = None  # g; None = a (multi-head attention)
    group_query_attention: bool = False
    ffn_hidden_size: Optional[int] = None  # None = 4h
    kv_channels: Optional[int] = None  # head dim; None = h / a
    seq_length: int = 256  # s
    max_position_embeddings: Optional[int] = None  # None = seq_length
    vocab_size: Optional[int] = None  # V; None = taken from the tokenizer / dataset
    make_vocab_size_divisible_by: int = 128
    normalization: str = "LayerNorm"  # LayerNorm | RMSNorm
    norm_epsilon: float = 1e-5
    position_embedding_type: str = "learned_absolute"  # learned_absolute | rope
    rotary_base: float = 10000.0
    swiglu: bool = False
    openai_gelu: bool = False  # tanh-approximated GeLU, as GPT-2 uses
    untie_embeddings_and_output_weights: bool = False
    disable_bias_linear: bool = False
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    # Mamba-2 / hybrid stacks (--model-type mamba; Dao & Gu 2024; Megatron-LM's names)
    hybrid_override_pattern: Optional[str] = None  # M Mamba, * attention, - MLP; None = all M
    mamba_state_dim: int = 128  # N: SSM state size per head
    mamba_head_dim: int = 64  # P: channels per SSM head
    mamba_num_groups: int = 8  # G: groups sharing B and C (like GQA groups)
    mamba_expand: int = 2  # d_inner = expand * h
    mamba_d_conv: int = 4  # causal depthwise conv kernel size
    mamba_chunk_size: int = 128  # SSD chunk length Q (exact for any value; a speed knob)

    @property
    def num_kv_groups(self) -> int:
        """g: key/value heads (``--num-query-groups``); equals a without GQA."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    def padded_vocab_size(self, tensor_model_parallel_size: int = 1) -> int:
        """V padded to a multiple of ``make_vocab_size_divisible_by * t`` (Megatron)."""
        if self.vocab_size is None:
            raise ConfigError("vocab size unknown: give --vocab-size or a --data-path with a tokenizer")
        mult = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return int(math.ceil(self.vocab_size / mult) * mult)

    @classmethod
    def gpt2(cls, **kw: Any) -> "ModelConfig":
        """GPT-2 layout: LayerNorm, learned positions, GeLU MLP with bias, tied embeddings."""
        return cls(**kw)

    @classmethod
    def llama(cls, **kw: Any) -> "ModelConfig":
        """LLaMA layout: RMSNorm, RoPE, SwiGLU, no biases, untied output layer."""
        base = dict(normalization="RMSNorm", position_embedding_type="rope", swiglu=True,
                    untie_embeddings_and_output_weights=True, disable_bias_linear=True,
                    norm_epsilon=1e-6)
        base.update(kw)
        return cls(**base)


@dataclass
class ParallelConfig:
    """Parallel sizes t, c, p (d is derived from the world size) and their options."""

    tensor_model_parallel_size: int = 1  # t
    pipeline_model_parallel_size: int = 1  # p
    context_parallel_size: int = 1  # c
    data_parallel_size: Optional[int] = None  # d; None = world / (t p c)
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    pipeline_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    sequence_parallel: bool = False
    ddp_bucket_size: int = 40_000_000  # elements per gradient bucket
    distributed_backend: Optional[str] = None  # None = nccl on CUDA, gloo on CPU


@dataclass
class TrainingConfig:
    micro_batch_size: int = 4  # b
    global_batch_size: Optional[int] = None  # B; None = b * d
    train_iters: int = 100
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_iters: Optional[int] = None  # None = train_iters
    lr_decay_style: str = "cosine"  # cosine | linear | constant
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False  # ZeRO-1: Adam states sharded over data parallel
    seed: int = 1234
    bf16: bool = False
    recompute_granularity: Optional[str] = None  # None | selective | full
    recompute_method: str = "uniform"  # uniform (groups of N layers) | block (first N layers)
    recompute_num_layers: int = 1  # N of --recompute-method
    device: Optional[str] = None  # None = cuda when available, else cpu
    dry_run: bool = False


@dataclass
class DataConfig:
    data_path: Optional[str] = None  # prefix of PREFIX.bin / PREFIX.idx
    valid_data_path: Optional[str] = None  # held-out prefix; None = the --split share of data_path
    split: str = "969,30,1"
    mock_data: bool = False  # random tokens (tests, benchmarks)
    num_workers: int = 0


@dataclass
class LoggingConfig:
    log_interval: int = 10
    eval_interval: Optional[int] = None
    eval_iters: int = 10
    log_json: Optional[str] = None
    tensorboard_dir: Optional[str] = None
    peak_tflops: Optional[float] = None  # per rank, for MFU; None = from the device table
    planner_cluster: Optional[str] = None  # cluster JSON (`loom plan --calibrate`) for predictions
    timeline: Optional[str] = None
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_progress_bar: bool = False


GROUPS = {"model": ModelConfig, "parallel": ParallelConfig, "training": TrainingConfig,
          "data": DataConfig, "logging": LoggingConfig}


@dataclass
class LoomConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    # -- flat (Megatron-style) access -------------------------------------------------------
    def to_flat(self) -> dict:
        out = {}
        for g in GROUPS:
            out.update(dataclasses.asdict(getattr(self, g)))
        return out

    @classmethod
    def from_flat(cls, values: dict) -> "LoomConfig":
        """Build from a flat ``{flag_name: value}`` dict; unknown keys raise ConfigError."""
        values = {k.replace("-", "_"): v for k, v in values.items()}
        known = {f.name: g for g, dc in GROUPS.items() for f in fields(dc)}
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"unknown option(s): {', '.join(flag(u) for u in unknown)}; "
                              f"see `loom train --help` for the accepted flags")
        parts = {g: {} for g in GROUPS}
        for k, v in values.items():
            parts[known[k]][k] = v
        return cls(**{g: GROUPS[g](**parts[g]) for g in GROUPS})

    # -- derived sizes -------------------------------------------------------------------------
    def data_parallel_size(self, world_size: int) -> int:
        p = self.parallel
        return world_size // (p.tensor_model_parallel_size * p.context_parallel_size
                              * p.pipeline_model_parallel_size)

    def global_batch_size(self, world_size: int) -> int:
        return self.training.global_batch_size or (
            self.training.micro_batch_size * self.data_parallel_size(world_size))

    def num_microbatches(self, world_size: int) -> int:
        """m = B / (b d)."""
        return self.global_batch_size(world_size) // (
            self.training.micro_batch_size * self.data_parallel_size(world_size))

    # -- validation ----------------------------------------------------------------------------
    def validate(self, world_size: int) -> "LoomConfig":
        """Refuse impossible layouts; raises :class:`ConfigError` naming the flag and the fix."""
        m, p, t = self.model, self.parallel, self.training
        tp, pp, cp = (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                      p.context_parallel_size)
        flat = self.to_flat()
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "context_parallel_size", "micro_batch_size", "num_layers", "hidden_size",
                     "num_attention_heads", "seq_length"):
            value = flat[name]
            if value is None or value < 1:
                raise ConfigError(f"{flag(name)} must be a positive integer, got {value}")
        if m.group_query_attention and m.num_query_groups is None:
            raise ConfigError("--group-query-attention needs --num-query-groups G")
        if m.num_attention_heads % m.num_kv_groups:
            raise ConfigError(
                f"--num-attention-heads {m.num_attention_heads} is not divisible by "
                f"--num-query-groups {m.num_kv_groups}: choose G dividing the head count")
        if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
            raise ConfigError(
                f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
                f"{m.num_attention_heads}: choose a head count dividing h (or set --kv-channels)")
        if m.num_attention_heads % tp:
            raise ConfigError(
                f"--num-attention-heads {m.num_attention_heads} is not divisible by "
                f"--tensor-model-parallel-size {tp}: choose a TP size dividing the head count")
        if m.num_kv_groups % tp:
            raise ConfigError(
                f"--num-query-groups {m.num_kv_groups} is not divisible by "
                f"--tensor-model-parallel-size {tp}: use a TP size that divides the query groups")
        if m.ffn_size % tp:
            raise ConfigError(f"--ffn-hidden-size {m.ffn_size} is not divisible by "
                              f"--tensor-model-parallel-size {tp}")
        if m.seq_length > m.max_positions:
            raise ConfigError(
                f"--seq-length {m.seq_length} exceeds --max-position-embeddings "
                f"{m.max_positions}: raise --max-position-embeddings or shorten --seq-length")
        if m.model_type not in MODEL_TYPES:
            raise ConfigError(f"--model-type must be one of {', '.join(MODEL_TYPES)}, got "
                              f"{m.model_type}")
        if m.normalization not in ("LayerNorm", "RMSNorm"):
            raise ConfigError(f"--normalization must be LayerNorm or RMSNorm, got {m.normalization}")
        if m.position_embedding_type not in ("learned_absolute", "rope"):
            raise ConfigError("--position-embedding-type must be learned_absolute or rope, "
                              f"got {m.position_embedding_type}")
        if m.position_embedding_type == "rope" and m.head_dim % 2:
            raise ConfigError(f"RoPE needs an even head dimension, got {m.head_dim}")
        if m.hybrid_override_pattern is not None and m.model_type != "mamba":
            raise ConfigError("--hybrid-override-pattern needs --model-type mamba")
        if m.model_type == "mamba":
            pat = m.hybrid_override_pattern or "M" * m.num_layers
            d_inner, hd, ng = m.mamba_expand * m.hidden_size, m.mamba_head_dim, m.mamba_num_groups
            if len(pat) != m.num_layers or set(pat) - set("M*-"):
                raise ConfigError(f"--hybrid-override-pattern {pat!r} must have --num-layers "
                                  f"{m.num_layers} characters of M (Mamba), * (attention), - (MLP)")
            sizes = (hd, ng, m.mamba_state_dim, m.mamba_expand, m.mamba_d_conv, m.mamba_chunk_size)
            if min(sizes) < 1 or d_inner % hd or (d_inner // hd) % ng:
                raise ConfigError(f"Mamba: --mamba-expand x --hidden-size = {d_inner} must split "
                                  f"into heads of --mamba-head-dim {hd}, a multiple of "
                                  f"--mamba-num-groups {ng} (all Mamba sizes >= 1)")
            if "M" in pat and (d_inner // hd) % tp:
                raise ConfigError(f"{d_inner // hd} Mamba heads (--mamba-expand x --hidden-size / "
                                  f"--mamba-head-dim) not divisible by "
                                  f"--tensor-model-parallel-size {tp}")
            if "M" in pat and ng % tp:
                raise ConfigError(f"--mamba-num-groups {ng} is not divisible by "
                                  f"--tensor-model-parallel-size {tp}: choose G a multiple of t")
            if "M" in pat and cp > 1:
                raise ConfigError("--context-parallel-size > 1 is not supported with Mamba layers "
                                  "(the scan would need the state passed between CP ranks): use 1")
        if world_size % (tp * pp * cp):
            raise ConfigError(
                f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                f"--pipeline-model-parallel-size {pp} x --context-parallel-size {cp} = "
                f"{tp * pp * cp}: launch a multiple of {tp * pp * cp} ranks or change the sizes")
        dp = self.data_parallel_size(world_size)
        if p.data_parallel_size is not None and p.data_parallel_size != dp:
            raise ConfigError(f"--data-parallel-size {p.data_parallel_size} disagrees with the "
                              f"world size {world_size} / (t p c) = {dp}")
        if m.num_layers % pp and p.decoder_first_pipeline_num_layers is None and \
                p.decoder_last_pipeline_num_layers is None:
            raise ConfigError(
                f"--num-layers {m.num_layers} is not divisible by --pipeline-model-parallel-size "
                f"{pp}: choose a PP size dividing L, or set --decoder-first-pipeline-num-layers")
        if m.seq_length % (2 * cp) and cp > 1:
            raise ConfigError(f"--seq-length {m.seq_length} must be divisible by 2 x "
                              f"--context-parallel-size {cp} for causal load balancing")
        if p.sequence_parallel and m.seq_length % (tp * cp):
            raise ConfigError(f"--sequence-parallel needs --seq-length {m.seq_length} divisible by "
                              f"--tensor-model-parallel-size {tp} x --context-parallel-size {cp}")
        gbs = self.global_batch_size(world_size)
        if gbs % (t.micro_batch_size * dp):
            raise ConfigError(
                f"--global-batch-size {gbs} is not divisible by --micro-batch-size "
                f"{t.micro_batch_size} x data-parallel size {dp} = {t.micro_batch_size * dp}: "
                f"use a multiple of {t.micro_batch_size * dp}")
        if t.lr_decay_style not in ("cosine", "linear", "constant"):
            raise ConfigError(f"--lr-decay-style must be cosine, linear or constant, got "
                              f"{t.lr_decay_style}")
        if t.recompute_granularity not in (None, "selective", "full"):
            raise ConfigError("--recompute-granularity must be selective or full")
        if t.recompute_method not in ("uniform", "block"):
            raise ConfigError("--recompute-method must be uniform or block")
        if t.recompute_num_layers < 1:
            raise ConfigError(f"--recompute-num-layers must be >= 1, got {t.recompute_num_layers}")
        if not 0.0 <= m.hidden_dropout < 1.0 or not 0.0 <= m.attention_dropout < 1.0:
            raise ConfigError("--hidden-dropout and --attention-dropout must lie in [0, 1)")
        if self.logging.save_interval and not self.logging.save:
            raise ConfigError("--save-interval needs --save DIR")
        if pp > 1 or p.num_layers_per_virtual_pipeline_stage is not None or \
                p.pipeline_schedule != "1f1b":
            from loom.parallel.pipeline.layout import validate_pipeline  # torch-free
            validate_pipeline(self, world_size)
        return self


# -- command line ---------------------------------------------------------------------------------

def _arg_type(tp: Any):
    if get_origin(tp) is not None:  # Optional[X]
        tp = [a for a in get_args(tp) if a is not type(None)][0]
    return tp


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one ``--flag`` per config field (default None = "not given"), plus ``--config``."""
    parser.add_argument("--config", default=None, help="YAML file of the same keys; flags override")
    for gname, dc in GROUPS.items():
        grp = parser.add_argument_group(gname)
        hints = get_type_hints(dc)
        for f in fields(dc):
            tp = _arg_type(hints[f.name])
            if tp is bool:
                grp.add_argument(flag(f.name), dest=f.name, action="store_const", const=True,
                                 default=None, help=f"(default {f.default})")
            else:
                grp.add_argument(flag(f.name), dest=f.name, type=tp, default=None,
                                 help=f"(default {f.default})")


def config_from_args(args: argparse.Namespace) -> LoomConfig:
    """YAML (``--config``) first, then every flag given on the command line."""
    values: dict = {}
    if getattr(args, "config", None):
        try:
            with open(args.config) as fh:
                loaded = yaml.safe_load(fh) or {}
        except OSError as e:
            raise ConfigError(f"--config {args.config}: {e.strerror}") from e
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {args.config} must hold a mapping of flag names")
        for k, v in loaded.items():
            if isinstance(v, dict) and k in GROUPS:  # grouped YAML is accepted too
                values.update(v)
            else:
                values[k] = v
    known = {f.name for dc in GROUPS.values() for f in fields(dc)}
    for k, v in vars(args).items():
        if k in known and v is not None:
            values[k] = v
    return LoomConfig.from_flat(values)
