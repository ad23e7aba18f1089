"""gpt-oss fields of :class:`~loom.config.sections.ModelConfig`: quick-GEGLU with a linear
offset and clamping, attention sinks (``--softmax-type``), sliding-window attention with full
layers every N-th (``--window-size``, ``--window-attn-skip-freq``), ``--padded-vocab-size``,
``--no-pad-vocab-size`` and ``--enable-gpt-oss`` (YaRN RoPE with gpt-oss's values).
Megatron-LM's names, meanings and defaults at d98e8a6 (``megatron/training/arguments.py``,
``TransformerConfig``, ``megatron/post_training/arguments.py``), and their checks
(:func:`check_gptoss`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional

from loom.config.fields import opt
from loom.config.model_moe import parse_moe_layer_freq
from loom.errors import ConfigError

SoftmaxType = Literal["vanilla", "off-by-one", "learnable"]

GPT_OSS_YARN = {"factor": 32.0, "original_max": 131072, "beta_fast": 32.0, "beta_slow": 1.0,
                "mscale": 1.0, "mscale_all_dim": 0.0}
"""The YaRN values ``--enable-gpt-oss`` sets (Megatron's ``megatron/post_training/
model_builder.py``; correction range not rounded to integers)."""


@dataclass
class GptOssFields:
    """gpt-oss's flags; a mixin of ModelConfig (all off by default: Megatron's defaults)."""

    quick_geglu: bool = opt(False, "gated MLP with quick GeLU: x sigmoid(1.702 x) of the gate "
                                   "times the linear half (Megatron's --quick-geglu)")
    glu_linear_offset: float = opt(0.0, "added to the linear half of a gated MLP before the "
                                        "product (gpt-oss: 1.0)")
    activation_func_clamp_value: Optional[float] = opt(
        None, "gated MLP: the gate clamped to <= this and the linear half to [-this, this] "
              "(default: no clamp)", gt=0)
    softmax_type: SoftmaxType = opt(
        "vanilla", "attention softmax: vanilla, off-by-one (1 added to the denominator) or "
                   "learnable (a learned per-head sink logit in the denominator)")
    window_size: Optional[str] = opt(
        None, "sliding-window attention 'LEFT,RIGHT': a query sees the LEFT keys before it "
              "(RIGHT must be 0 in a causal model; default: no window)")
    window_attn_skip_freq: Optional[str] = opt(
        None, "with --window-size: an int N (every N-th layer, 1-based, is full attention) or a "
              "list expression of 0/1 per layer (1 = sliding window; default: every layer)")
    padded_vocab_size: Optional[int] = opt(
        None, "the model's vocabulary rows exactly (default: V padded to "
              "--make-vocab-size-divisible-by x t)", ge=1)
    no_pad_vocab_size: bool = opt(
        False, "the model's vocabulary rows are V itself, not padded to "
               "--make-vocab-size-divisible-by x t (unless --padded-vocab-size gives them); "
               "V must then be divisible by --tensor-model-parallel-size")
    enable_gpt_oss: bool = opt(False, "gpt-oss's YaRN RoPE: factor 32, original context "
                                      "131072, beta fast 32, beta slow 1, mscale 1 (Megatron's "
                                      "ModelOpt flag)")

    @property
    def gated_linear_unit(self) -> bool:
        """Whether the MLP's FC1 holds a gate and a linear half (``--swiglu`` or
        ``--quick-geglu``; Megatron's ``gated_linear_unit``; a family's own gated MLP, e.g.
        Gemma's GeGLU, is its ``layer_shape`` hook's)."""
        return bool(self.swiglu or self.quick_geglu)

    @property
    def window(self) -> Optional[tuple[int, int]]:
        """``(left, right)`` of ``--window-size``, or None."""
        if self.window_size is None:
            return None
        parts = str(self.window_size).replace("(", "").replace(")", "").split(",")
        try:
            left, right = (int(p) for p in parts)
        except ValueError:
            raise ConfigError(f"--window-size {self.window_size!r}: give LEFT,RIGHT such as "
                              f"127,0") from None
        return left, right

    def is_window_layer(self, layer_number: int) -> bool:
        """Whether global layer ``layer_number`` (0-based) uses the sliding window (Megatron's
        ``is_layer_window_attention`` with its 1-based numbers: an int N skips layers whose
        number is a multiple of N; a list gives 1 for window layers)."""
        if self.window is None:
            return False
        freq = self.window_attn_skip_freq
        if freq is None:
            return True
        text = str(freq).strip()
        if "[" not in text:
            return (layer_number + 1) % int(text) != 0
        return bool(parse_moe_layer_freq(text, self.num_layers)[layer_number])

    def padded_vocab(self, tensor_model_parallel_size: int = 1) -> int:
        """The embedding's rows: ``--padded-vocab-size``, else V padded to a multiple of
        ``make_vocab_size_divisible_by * t`` (Megatron's ``calculate_padded_vocab_size``), V
        itself with ``--no-pad-vocab-size`` (Megatron's ``should_pad_vocab`` off).

        Raises ConfigError when V is unknown, or unpadded and not divisible by t."""
        if self.padded_vocab_size is not None:
            return self.padded_vocab_size
        if self.vocab_size is None:
            raise ConfigError("vocab size unknown: give --vocab-size or a --data-path with a "
                              "tokenizer")
        if self.no_pad_vocab_size:
            check_unpadded_vocab(self.vocab_size, tensor_model_parallel_size)
            return self.vocab_size
        mult = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return -(-self.vocab_size // mult) * mult


def check_unpadded_vocab(vocab_size: int, tp: int) -> None:
    """``--no-pad-vocab-size``: the vocabulary-parallel embedding and output layer split V rows
    over t ranks (Megatron's ``VocabUtility`` divides them evenly). Raises ConfigError when t
    does not divide V."""
    if vocab_size % tp:
        raise ConfigError(f"--no-pad-vocab-size keeps the vocabulary at {vocab_size} rows, which "
                          f"--tensor-model-parallel-size {tp} does not divide: drop "
                          f"--no-pad-vocab-size, give --padded-vocab-size (a multiple of {tp}) "
                          f"or a TP size dividing {vocab_size}")


def check_gptoss(m: Any, tp: int, cp: int) -> None:
    """Resolve ``--enable-gpt-oss`` (Megatron sets the YaRN position embedding: loom's RoPE
    with :data:`GPT_OSS_YARN`) and refuse gpt-oss flags that do not fit this model (``tp``,
    ``cp``: the parallel sizes; ``m`` is the copy being validated). Raises ConfigError naming
    the flag and a fix."""
    if m.enable_gpt_oss and m.position_embedding_type == "learned_absolute":
        m.position_embedding_type = "rope"
    if m.quick_geglu and m.swiglu:
        raise ConfigError("--quick-geglu and --swiglu pick different gated MLPs: give one")
    if (m.glu_linear_offset or m.activation_func_clamp_value is not None) \
            and not m.gated_linear_unit:
        raise ConfigError("--glu-linear-offset / --activation-func-clamp-value act on a gated "
                          "MLP: add --quick-geglu or --swiglu")
    if m.window_attn_skip_freq is not None:
        text = str(m.window_attn_skip_freq).strip()
        if "[" in text:
            try:  # the same list language as --moe-layer-freq (1 = sliding window here)
                parse_moe_layer_freq(text, m.num_layers)
            except ConfigError as e:
                raise ConfigError(str(e).replace("--moe-layer-freq", "--window-attn-skip-freq")
                                  ) from None
        elif not text.isdigit() or int(text) < 1:
            raise ConfigError(f"--window-attn-skip-freq {text!r}: an int N >= 1 or a list such "
                              f"as '[1,0]*{max(m.num_layers // 2, 1)}'")
    if m.window is not None:
        left, right = m.window
        if right != 0 or left < 0:
            raise ConfigError(f"--window-size {m.window_size}: a causal model sees no later "
                              f"key: give LEFT,0 with LEFT >= 0 (e.g. {max(left, 0)},0)")
    special = m.window is not None or m.softmax_type != "vanilla"
    if special and m.multi_latent_attention:  # another family: loom.models.gpt.config
        raise ConfigError("--window-size / --softmax-type apply to --model-type gpt's standard "
                          "attention: drop them (gemma3: --sliding-window)")
    if special and cp > 1:
        raise ConfigError("--window-size / --softmax-type with --context-parallel-size > 1 are "
                          "not supported yet: use --context-parallel-size 1")
    if m.no_pad_vocab_size and m.padded_vocab_size is None and m.vocab_size is not None:
        check_unpadded_vocab(m.vocab_size, tp)
    if m.padded_vocab_size is not None:
        if m.vocab_size is not None and m.padded_vocab_size < m.vocab_size:
            raise ConfigError(f"--padded-vocab-size {m.padded_vocab_size} is below the "
                              f"vocabulary ({m.vocab_size} tokens): give at least "
                              f"{m.vocab_size}")
        if m.padded_vocab_size % tp:
            raise ConfigError(f"--padded-vocab-size {m.padded_vocab_size} is not divisible by "
                              f"--tensor-model-parallel-size {tp}: give a multiple of {tp}")
    if m.enable_gpt_oss and (not m.rotary or m.multi_latent_attention):
        raise ConfigError("--enable-gpt-oss sets YaRN on RoPE: add --position-embedding-type "
                          "rope (without --multi-latent-attention)")
