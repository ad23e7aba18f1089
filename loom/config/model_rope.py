"""RoPE scaling and NoPE-layer fields of :class:`~loom.config.sections.ModelConfig`: Llama 3.1's
frequency scaling (``--use-rope-scaling``, ``--rope-scaling-factor``), linear position
interpolation (``--rotary-seq-len-interpolation-factor``) and layers without RoPE (Llama 4's
``--no-rope-freq``). Megatron-LM's names, meanings and defaults at d98e8a6
(``megatron/training/arguments.py`` ``_add_network_size_args``; Megatron-Core's
``RotaryEmbedding`` and ``TransformerConfig.no_rope_freq``), and their checks
(:func:`check_rope`, part of the one validation pass)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from loom.config.fields import opt
from loom.config.model_moe import parse_moe_layer_freq
from loom.errors import ConfigError

LLAMA3_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max": 8192}
"""The constants of Llama 3.1's RoPE scaling besides its factor, as Megatron-Core's
``RotaryEmbedding._apply_scaling`` fixes them (no flag sets them)."""


@dataclass
class RopeScalingFields:
    """RoPE scaling and NoPE-layer flags; a mixin of ModelConfig (off by default)."""

    use_rope_scaling: bool = opt(
        False, "Llama 3.1's RoPE frequency scaling: wavelengths above 8192 positions divided "
               "by --rope-scaling-factor, below 2048 kept, smoothly blended between "
               "(low/high frequency factors 1 and 4, original context 8192, as Megatron fixes "
               "them); --position-embedding-type rope, standard attention")
    rope_scaling_factor: float = opt(8.0, "with --use-rope-scaling: the factor the low "
                                          "frequencies are divided by (Llama 3.1: 8, "
                                          "Llama 3.2: 32)", gt=0)
    # loom's own (Megatron fixes them): Llama 4's scaling has high_freq_factor 1
    rope_scaling_low_freq_factor: float = opt(
        LLAMA3_SCALING["low_freq_factor"], "with --use-rope-scaling: wavelengths above the "
        "original context / this factor are divided by --rope-scaling-factor (Llama 3.1 and "
        "4: 1; Megatron fixes it)", gt=0)
    rope_scaling_high_freq_factor: float = opt(
        LLAMA3_SCALING["high_freq_factor"], "with --use-rope-scaling: wavelengths below the "
        "original context / this factor are kept, those between blended (Llama 3.1: 4; Llama "
        "4: 1, no blend; Megatron fixes it at 4)", gt=0)
    rope_scaling_original_max_position_embeddings: int = opt(
        LLAMA3_SCALING["original_max"], "with --use-rope-scaling: the original context in "
        "positions (Llama 3.1 and 4: 8192; Megatron fixes it)", ge=1)
    rotary_seq_len_interpolation_factor: Optional[int] = opt(
        None, "linear position interpolation: RoPE positions divided by this factor (Chen et "
              "al. 2023; HF's linear rope_scaling); --position-embedding-type rope, standard "
              "attention", ge=1)
    no_rope_freq: Optional[str] = opt(
        None, "layers without RoPE (Llama 4's NoPE layers): an int N (every N-th layer, "
              "1-based, skips RoPE; N divides --num-layers) or a list expression of 0/1 per "
              "layer (1 = no RoPE), e.g. '([0]*3+[1])*2' (default: RoPE in every layer)")

    def rope_scaling_args(self) -> dict:
        """The scaling keywords of :func:`loom.models.attention.rope_cos_sin` these flags give:
        ``interpolation`` (``--rotary-seq-len-interpolation-factor``, or None) and
        ``llama3_factor`` (``--rope-scaling-factor`` under ``--use-rope-scaling``, or None)
        with ``llama3_bands`` (:meth:`llama3_bands`)."""
        return dict(interpolation=self.rotary_seq_len_interpolation_factor,
                    llama3_factor=self.rope_scaling_factor if self.use_rope_scaling else None,
                    llama3_bands=self.llama3_bands())

    def llama3_bands(self) -> tuple[float, float, int]:
        """(low frequency factor, high frequency factor, original context) of
        ``--use-rope-scaling`` (:func:`loom.models.rope_scaling.llama3_inv_freq`)."""
        return (self.rope_scaling_low_freq_factor, self.rope_scaling_high_freq_factor,
                self.rope_scaling_original_max_position_embeddings)

    def is_no_rope_layer(self, layer_number: int) -> bool:
        """Whether global layer ``layer_number`` (0-based) skips RoPE (Megatron's
        ``no_rope_freq[layer_number - 1]`` with its 1-based numbers: an int N marks the layers
        whose number is a multiple of N; 0, Megatron's falsy value, marks none)."""
        if self.no_rope_freq is None:
            return False
        text = str(self.no_rope_freq).strip()
        if "[" not in text:
            n = int(text)
            return n > 0 and (layer_number + 1) % n == 0
        return bool(parse_moe_layer_freq(text, self.num_layers,
                                         "--no-rope-freq")[layer_number])


def check_rope(m: Any) -> None:
    """Refuse the scaling and NoPE flags where Megatron would ignore them or fail: the scalings
    act on the model-level RoPE of standard attention (Megatron-Core's ``RotaryEmbedding`` of
    GPTModel; YaRN, gpt-oss's included, builds its own rotary embedding, which takes neither),
    ``--no-rope-freq`` on that RoPE or YaRN (Megatron's ``Attention.forward`` drops either);
    multi-latent attention applies its own RoPE, which takes none of them.
    ``--rope-scaling-factor`` only under ``--use-rope-scaling``; ``--no-rope-freq`` an int
    dividing the depth or a pattern of ``--num-layers`` entries, not with multi-token
    prediction (whose layers Megatron numbers past the pattern). Raises ConfigError naming the
    flag and a fix."""
    scaling = [f for f, on in (("--use-rope-scaling", m.use_rope_scaling),
                               ("--rotary-seq-len-interpolation-factor",
                                m.rotary_seq_len_interpolation_factor is not None)) if on]
    given = scaling + (["--no-rope-freq"] if m.no_rope_freq is not None else [])
    if m.rope_scaling_factor != 8.0 and not m.use_rope_scaling:
        raise ConfigError(f"--rope-scaling-factor {m.rope_scaling_factor:g} scales RoPE under "
                          f"--use-rope-scaling only: add --use-rope-scaling or drop it")
    bands = m.llama3_bands()
    defaults = (LLAMA3_SCALING["low_freq_factor"], LLAMA3_SCALING["high_freq_factor"],
                LLAMA3_SCALING["original_max"])
    if bands != defaults and not m.use_rope_scaling:
        raise ConfigError("--rope-scaling-low/high-freq-factor and --rope-scaling-original-max-"
                          "position-embeddings shape --use-rope-scaling: add it or drop them")
    if bands[0] > bands[1]:
        raise ConfigError(f"--rope-scaling-low-freq-factor {bands[0]:g} exceeds "
                          f"--rope-scaling-high-freq-factor {bands[1]:g}: the kept band must "
                          f"start above the divided one (Llama 3.1: 1 and 4; Llama 4: 1 and 1)")
    if not given:
        return
    if m.multi_latent_attention:
        raise ConfigError(f"{given[0]} with --multi-latent-attention: MLA's own RoPE "
                          f"(--rope-type) takes no such option (Megatron's ignores it): drop "
                          f"{given[0]}")
    if scaling and (m.position_embedding_type == "yarn" or m.enable_gpt_oss):
        raise ConfigError(f"{scaling[0]} with YaRN (--position-embedding-type yarn / "
                          f"--enable-gpt-oss): Megatron's YarnRotaryEmbedding takes no such "
                          f"option: drop {scaling[0]}")
    if not m.rotary:
        raise ConfigError(f"{given[0]} acts on RoPE: add --position-embedding-type rope or "
                          f"drop {given[0]}")
    if m.no_rope_freq is not None:
        _check_no_rope_freq(m)


def _check_no_rope_freq(m: Any) -> None:
    text = str(m.no_rope_freq).strip()
    if "[" in text:
        parse_moe_layer_freq(text, m.num_layers, "--no-rope-freq")
    elif not text.isdigit():
        raise ConfigError(f"--no-rope-freq {text!r}: give an int N (every N-th layer skips "
                          f"RoPE) or a list such as '([0]*3+[1])*{max(m.num_layers // 4, 1)}'")
    elif int(text) and m.num_layers % int(text):
        raise ConfigError(f"--no-rope-freq {text}: --num-layers {m.num_layers} must be a "
                          f"multiple of it (Megatron's rule): give a divisor of "
                          f"{m.num_layers} or a list of {m.num_layers} entries")
    if m.mtp_num_layers:
        raise ConfigError("--no-rope-freq with --mtp-num-layers: Megatron numbers the "
                          "multi-token prediction layers past --no-rope-freq's pattern (it "
                          "fails); drop one of them")


def rope_theta(hf_config) -> float:
    """The RoPE base of a config (``rope_theta``, or transformers 5's ``rope_parameters``)."""
    theta = getattr(hf_config, "rope_theta", None)
    return theta or (getattr(hf_config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)


def rope_fields(hf_config, title: Optional[str] = None) -> dict:
    """loom's RoPE flags of a LLaMA-like config: ``--rotary-base`` (:func:`rope_theta`) and
    its ``rope_scaling`` (transformers 5: ``rope_parameters``): ``default``; ``linear``
    (positions / factor) as ``--rotary-seq-len-interpolation-factor`` (an int, Megatron's
    type); ``llama3`` as ``--use-rope-scaling --rope-scaling-factor F`` with its frequency
    bands (``--rope-scaling-low/high-freq-factor``, ``--rope-scaling-original-max-position-
    embeddings``, given when not Llama 3.1's 1, 4 and 8192, which Megatron fixes: Llama 4's
    high factor is 1). Raises ConfigError for any other scaling, naming ``title`` (default:
    the config's ``model_type``)."""
    title = title or getattr(hf_config, "model_type", None) or "LLaMA"
    params = dict(getattr(hf_config, "rope_parameters", None) or
                  getattr(hf_config, "rope_scaling", None) or {})
    kind = params.get("rope_type", params.get("type", "default"))
    out = dict(rotary_base=rope_theta(hf_config))
    factor = params.get("factor")
    if kind == "default":
        return out
    if kind == "linear" and factor is not None and float(factor).is_integer() and factor >= 1:
        return dict(out, rotary_seq_len_interpolation_factor=int(factor))
    if kind == "linear":
        raise ConfigError(f"{title} rope_scaling linear with factor {factor}: loom's "
                          f"--rotary-seq-len-interpolation-factor is an int >= 1 (Megatron's "
                          f"type)")
    bands = (params.get("low_freq_factor", LLAMA3_SCALING["low_freq_factor"]),
             params.get("high_freq_factor", LLAMA3_SCALING["high_freq_factor"]),
             params.get("original_max_position_embeddings", LLAMA3_SCALING["original_max"]))
    if kind == "llama3" and factor is not None:
        low, high, original = bands
        if not (0 < low <= high) or int(original) != original or original < 1:
            raise ConfigError(f"{title} rope_scaling llama3 with low_freq_factor {low}, "
                              f"high_freq_factor {high}, original_max_position_embeddings "
                              f"{original}: need 0 < low <= high and a whole context")
        out.update(use_rope_scaling=True, rope_scaling_factor=float(factor))
        for key, value, default in (
                ("rope_scaling_low_freq_factor", float(low), LLAMA3_SCALING["low_freq_factor"]),
                ("rope_scaling_high_freq_factor", float(high),
                 LLAMA3_SCALING["high_freq_factor"]),
                ("rope_scaling_original_max_position_embeddings", int(original),
                 LLAMA3_SCALING["original_max"])):
            if value != default:
                out[key] = value
        return out
    raise ConfigError(f"{title} rope_scaling type {kind!r}: loom reads default, linear "
                      f"(--rotary-seq-len-interpolation-factor) and llama3 "
                      f"(--use-rope-scaling) RoPE only")
