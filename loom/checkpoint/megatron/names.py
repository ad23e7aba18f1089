"""loom's parameter names <-> Megatron-Core's checkpoint keys. Torch-free.

loom's modules carry Megatron-Core's names (``self_attention.linear_qkv``, ``mlp.linear_fc1``,
``input_layernorm``, ...), so a key differs from a loom name only in where it lives:

- the layers: loom ``layers.<i>.`` is ``decoder.layers.`` stacked on a leading layer dimension
  (``TransformerBlock``'s ``torch_dist`` keys: ``[L, ...]``, row i) or ``decoder.layers.<i>.``
  (the Mamba / hybrid stack, the ``torch`` format, ``mtp.layers.<k>.``);
- the layer norms under Transformer Engine's names: ``input_layernorm`` is
  ``self_attention.linear_qkv.layer_norm_weight`` (fused into the QKV GEMM; the Mamba layer's
  ``mixer.in_proj.layer_norm_weight``), ``pre_mlp_layernorm`` is
  ``mlp.linear_fc1.layer_norm_weight``, MLA's ``q_layernorm`` / ``kv_layernorm`` are
  ``linear_q_up_proj`` / ``linear_kv_up_proj.layer_norm_weight``; each also under its own name
  (the local spec's MoE and MLA layers, the Mamba layer's ``norm``);
- the experts: loom ``mlp.experts.<E>.`` is ``mlp.experts.experts.`` stacked on ``[L, E, ...]``
  (SequentialMLP / TEGroupedMLP / GroupedMLP all save this), ``mlp.experts.<E>.`` with
  ``singleton_local_shards``, ``mlp.experts.local_experts.<e>.`` in the ``torch`` format;
- the final norm: ``decoder.final_layernorm`` (``final_norm`` in the Mamba stack);
- a stack whose layers differ (Gated DeltaNet layers, Qwen3-Next; dense and MoE layers, a
  ``--moe-layer-freq`` list or int above 1) is not homogeneous, so Megatron keys each layer on
  its own (``decoder.layers.<i>.``, experts ``decoder.layers.<i>.mlp.experts.experts.`` on
  ``[E, ...]``: :func:`keyed_per_layer`); a Gated DeltaNet layer's norm is
  ``self_attention.in_proj.layer_norm_weight``, its ``in_proj`` and ``conv1d`` are stored in
  parts (``in_proj.weight.query/.key/.value/.z/.beta/.alpha``, ``conv1d.weight.query/.key/
  .value``) concatenated in loom's order.

Tensors that differ in layout (:data:`KINDS`): the fused QKV weight and bias (Megatron
interleaves them per query group, ``[g][a/g q heads, k, v][d]``; loom stores ``[Q; K; V]``), the
Mamba conv1d weight (``[C, 1, k]`` there, ``[C, k]`` here), and the Mamba in-projection and
conv, which ``torch_dist`` stores as parts (``in_proj.weight.z/.x/.B/.C/.dt``,
``conv1d.weight.x/.B/.C``) concatenated in loom's order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

KINDS = ("plain", "qkv", "conv")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(.+)$")
IN_PROJ_PARTS = ("z", "x", "B", "C", "dt")
CONV_PARTS = ("x", "B", "C")
GDN_IN_PROJ_PARTS = ("query", "key", "value", "z", "beta", "alpha")  # GatedDeltaNet's in_proj
GDN_CONV_PARTS = ("query", "key", "value")


@dataclass(frozen=True)
class Source:
    """Where one loom tensor lies in a Megatron checkpoint: ``key`` (a ``torch_dist`` key, or
    the per-layer name of the ``torch`` format), ``index`` (leading indices into a stacked key:
    ``(layer,)`` or ``(layer, expert)``; empty when not stacked), ``parts`` (suffixes whose
    tensors are concatenated on dim 0, e.g. ``.z`` ... ``.dt``)."""

    key: str
    index: tuple[int, ...] = ()
    parts: tuple[str, ...] = ()


def _norm_aliases(rest: str, attention: str) -> list[str]:
    """Megatron's names of loom's layer suffix ``rest`` (first: Transformer Engine's)."""
    m = re.match(r"^(input_layernorm|pre_mlp_layernorm)\.(weight|bias)$", rest)
    if m:
        which, w = m.groups()
        if which == "pre_mlp_layernorm":
            return [f"mlp.linear_fc1.layer_norm_{w}", rest]
        if attention == "ssm":
            return [f"mixer.in_proj.layer_norm_{w}", f"norm.{w}", rest]
        if attention == "gdn":  # fused into GatedDeltaNet's in_proj (TE's LayerNormLinear)
            return [f"self_attention.in_proj.layer_norm_{w}", rest]
        if attention == "mla":
            return [rest, f"self_attention.linear_qkv.layer_norm_{w}"]
        return [f"self_attention.linear_qkv.layer_norm_{w}", rest]
    m = re.match(r"^self_attention\.(q|kv)_layernorm\.(weight|bias)$", rest)
    if m and attention == "mla":
        return [f"self_attention.linear_{m[1]}_up_proj.layer_norm_{m[2]}", rest]
    return [rest]


def is_norm_gain(name: str) -> bool:
    """A norm's weight (its gain), which ``--apply-layernorm-1p`` stores zero-centred (every
    Transformer Engine norm; not the Mamba mixer's gated norm, which is mamba_ssm's)."""
    return name.endswith("norm.weight") and "mixer.norm" not in name


def kind_of(name: str) -> str:
    """How loom's tensor ``name`` differs in layout from Megatron's (:data:`KINDS`)."""
    if re.search(r"self_attention\.linear_qkv\.(weight|bias)$", name):
        return "qkv"
    if name.endswith("mixer.conv1d.weight"):
        return "conv"
    return "plain"


def _parts(rest: str) -> tuple[str, ...]:
    if rest == "mixer.in_proj.weight":
        return IN_PROJ_PARTS
    if rest in ("mixer.conv1d.weight", "mixer.conv1d.bias"):
        return CONV_PARTS
    if rest == "self_attention.in_proj.weight":
        return GDN_IN_PROJ_PARTS
    if rest in ("self_attention.conv1d.weight", "self_attention.conv1d.bias"):
        return GDN_CONV_PARTS
    return ()


def _layer_sources(prefix: str, i: int, rest: str, attention: str,
                   stacked: bool) -> list[Source]:
    """Candidates of ``<prefix>layers.<i>.<rest>``: stacked (``index (i,)``), then per layer."""
    out = []
    m = _EXPERT.match(rest)
    if m:
        e, sub = int(m[1]), m[2]
        if stacked:
            out.append(Source(f"{prefix}layers.mlp.experts.experts.{sub}", (i, e)))
            out.append(Source(f"{prefix}layers.mlp.experts.{e}.{sub}", (i,)))
            if sub.startswith("linear_fc1."):  # singleton_local_shards: GLU halves apart
                out.append(Source(f"{prefix}layers.mlp.experts.{e}.{sub}", (i,), ("_w", "_v")))
        out.append(Source(f"{prefix}layers.{i}.mlp.experts.experts.{sub}", (e,)))
        out.append(Source(f"{prefix}layers.{i}.mlp.experts.{e}.{sub}"))
        return out
    parts = _parts(rest)
    for alias in _norm_aliases(rest, attention):
        if stacked:
            out.append(Source(f"{prefix}layers.{alias}", (i,)))
            if parts:
                out.append(Source(f"{prefix}layers.{alias}", (i,), tuple("." + p for p in parts)))
        out.append(Source(f"{prefix}layers.{i}.{alias}"))
        if parts:
            out.append(Source(f"{prefix}layers.{i}.{alias}", (), tuple("." + p for p in parts)))
    return out


def sources(name: str, attention: str = "mha") -> list[Source]:
    """Where loom's parameter ``name`` may lie in a Megatron checkpoint, most likely first.
    ``attention``: ``mha`` (GPT layers), ``mla`` (multi-latent attention) or ``ssm`` (the
    layer is a Mamba layer: its norm is the in-projection's)."""
    m = _LAYER.match(name)
    if m:
        return _layer_sources("decoder.", int(m[1]), m[2], attention, stacked=True)
    m = _MTP.match(name)
    if m:
        k, rest = m.groups()
        for loom_sub, meg_sub in (("mtp_model_layer.", "transformer_layer."),):
            if rest.startswith(loom_sub):
                inner = rest[len(loom_sub):]
                return [Source(f"mtp.layers.{k}.{meg_sub}{alias}")
                        for alias in _norm_aliases(inner, attention)] + \
                    [Source(f"mtp.layers.{k}.{rest}")]
        return [Source(f"mtp.layers.{k}.{rest}")]
    m = re.match(r"^final_layernorm\.(weight|bias)$", name)
    if m:
        return [Source(f"decoder.final_layernorm.{m[1]}"), Source(f"decoder.final_norm.{m[1]}")]
    return [Source(name)]


def layer_pattern(cfg) -> Optional[str]:
    """The layer kinds the family of ``cfg`` (a ModelConfig) declares
    (``ModelFamily.layer_kinds``: the Mamba stack's hybrid pattern, ``M`` per Mamba layer), None
    for a stack of transformer layers."""
    from loom.models import get_family  # the family, not a model_type branch
    return get_family(cfg.model_type).layer_kinds(cfg)


def attention_kind(name: str, pattern: Optional[str], mla: bool,
                   gdn: Optional[Callable[[int], bool]] = None) -> str:
    """``ssm`` when ``name`` is a parameter of a Mamba layer of the hybrid ``pattern``
    (``--hybrid-override-pattern``), ``gdn`` of a Gated DeltaNet layer (``gdn(layer)``:
    ``ModelConfig.is_gdn_layer``), ``mla`` under multi-latent attention, else ``mha``."""
    m = _LAYER.match(name)
    if pattern and m and int(m[1]) < len(pattern) and pattern[int(m[1])] == "M":
        return "ssm"
    if gdn is not None and m and gdn(int(m[1])):
        return "gdn"
    return "mla" if mla else "mha"


def gdn_of(cfg) -> Optional[Callable[[int], bool]]:
    """``ModelConfig.is_gdn_layer`` of a model with Gated DeltaNet layers, else None."""
    return cfg.is_gdn_layer if getattr(cfg, "gated_delta_net", False) else None


def keyed_per_layer(cfg) -> bool:
    """Whether Megatron-Core's ``torch_dist`` keys each layer of the GPT stack of ``cfg`` on its
    own (``decoder.layers.<i>.``; experts ``decoder.layers.<i>.mlp.experts.experts.`` on
    ``[E, ...]``) instead of stacking them on ``[L, ...]``: ``TransformerBlock.
    sharded_state_dict``'s ``non_homogeneous_layers``, set when the layers differ: a
    ``--moe-layer-freq`` list or int above 1 (dense and MoE layers), Gated DeltaNet layers
    (``--linear-attention-freq``), a hybrid (Mamba) pattern."""
    if layer_pattern(cfg) is not None or gdn_of(cfg) is not None:
        return True
    if not getattr(cfg, "num_experts", None):
        return False
    text = str(cfg.moe_layer_freq).strip()
    return "[" in text or int(text) > 1


def primary_key(name: str, attention: str = "mha") -> Source:
    """The source a writer uses for ``name``: ``torch_dist``'s stacked key for the GPT stack
    (per-layer keys for Mamba / hybrid stacks: ``stacked`` False), Transformer Engine's names."""
    return sources(name, attention)[0]


def per_layer_key(name: str, attention: str = "mha") -> str:
    """The ``torch`` format's per-layer (global index) key of loom's ``name``."""
    for s in sources(name, attention):
        if not s.index and not s.parts and ".experts.experts." not in s.key:
            return s.key
    return sources(name, attention)[0].key


def write_sources(name: str, attention: str, stacked: bool, moe_layer: bool = False,
                  mamba_stack: Optional[bool] = None) -> list[Source]:
    """The keys a writer gives loom's ``name``: Megatron-Core's ``torch_dist`` spelling first
    (``stacked``: the GPT ``TransformerBlock``'s ``[L, ...]`` keys, experts ``[L, E, ...]``;
    else the Mamba stack's per-layer keys, its in-projection and conv in parts), then the other
    spec's spelling where the two differ: an MoE layer's pre-MLP norm (``moe_layer``: the
    Transformer Engine spec's ``pre_mlp_layernorm``, the local spec's fused-norm name) and
    MLA's latent norms, so either layer spec's ``GPTModel`` finds its key. ``mamba_stack``
    (default: not ``stacked``): the stack is Megatron's Mamba stack, whose final norm is
    ``final_norm`` (a GPT stack keyed per layer, with Gated DeltaNet layers, keeps
    ``final_layernorm``)."""
    m = _LAYER.match(name)
    cands = sources(name, attention)
    if mamba_stack is None:
        mamba_stack = not stacked
    if not m:  # the Mamba stack's final norm is ``final_norm``
        return cands[1:2] if name.startswith("final_layernorm.") and mamba_stack else cands[:1]
    per_layer = f"decoder.layers.{m[1]}."
    split = bool(_parts(m[2]))
    keep = [s for s in cands
            if s.key.startswith(per_layer) != stacked and bool(s.parts) == (split and not stacked)
            and (".experts." not in s.key or ".experts.experts." in s.key)]
    if (m[2].startswith("pre_mlp_layernorm.") and moe_layer) or (
            attention == "mla" and m[2].startswith(("self_attention.q_layernorm.",
                                                    "self_attention.kv_layernorm."))):
        return keep[:2]
    return keep[:1]
