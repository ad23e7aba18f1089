"""What a model family supplies to loom: the plain model, its parallel plan, its initializers
and its forward step. Schedules, the trainer, checkpoints and interop know only this interface.

A family is written once as plain math (``nn.Linear``, norms, an attention or mixer core) and
parallelized after construction by its plan (:mod:`loom.parallel.plan`). The forward-step types
and :class:`StageSpec` live beside the schedules that drive them
(:mod:`loom.parallel.interface`) and are re-exported here: ``forward_step(chunk, batch,
hidden_states) -> (output, loss_fn)``; on the last pipeline stage ``loss_fn(output) -> (loss,
metrics)`` gives the scalar to backpropagate and a dict of named, detached scalars (e.g.
``lm loss``, an auxiliary loss).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from loom.errors import ConfigError

REEXPORTED = ("ForwardStep", "LossFn", "StageSpec")  # of loom.parallel.interface


def __getattr__(name: str):
    """The forward-step types and :class:`StageSpec` of :mod:`loom.parallel.interface`,
    re-exported when asked: this module stays torch-free, so a family's declarations and config
    rules (``loom/models/<family>/config.py``, read by validation and the planner) import no
    torch."""
    if name in REEXPORTED:
        from loom.parallel import interface
        return getattr(interface, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class Generation:
    """How a family generates text (``loom generate``): the model provides
    ``allocate_cache(batch, length)`` (a KV cache, or a recurrent state for Mamba layers) and
    ``model(input_ids=[b, s], cache=...) -> logits [b, s, Vp/t]``; ``bos_token``: the token put
    before every prompt (Gemma's ``<bos>``), None for none."""

    bos_token: Optional[str] = None


@dataclass(frozen=True)
class HFConversion:
    """A family's Hugging Face mapping (``loom checkpoint convert``), the generic reading,
    resharding and writing staying in :mod:`loom.checkpoint.convert`:

    * ``model_types``: the ``config.json`` ``model_type`` values this family imports;
    * ``to_loom(hf_config: dict, hf_state: dict, where: str) -> (ModelConfig, full)``: full loom
      tensors by loom name (vocabulary padded as loom's layout expects); raises ConfigError
      naming ``where`` for a config it cannot express;
    * ``export_config(model_cfg) -> config.json dict`` of the matching ``transformers`` class;
      None when the family does not export; raises ConfigError for a layout no
      ``transformers`` class expresses (checked before any weight is read);
    * ``from_loom(full, model_cfg) -> HF state dict``: the inverse of ``to_loom``, vocabulary
      padding dropped;
    * ``read_config(hf_config: dict, where: str) -> ModelConfig``: the model alone, no weights
      (``loom plan --from-hf``; ``to_loom`` builds the same config); raises ConfigError naming
      ``where``; None: the family's config needs its weights;
    * ``gguf_architectures``: GGUF ``general.architecture`` values it imports (via
      ``transformers``' GGUF reader into the ``to_loom`` path);
    * ``title``: the layout's name in messages (e.g. "Gemma 3")."""

    model_types: tuple = ()
    to_loom: Optional[Callable] = None
    export_config: Optional[Callable] = None
    from_loom: Optional[Callable] = None
    gguf_architectures: tuple = ()
    title: str = ""
    read_config: Optional[Callable] = None


def next_token_windows(cfg) -> tuple:
    """The default ``datasets``: GPT-style next-token windows of ``cfg`` (a LoomConfig)."""
    from loom.data.for_model import next_token_datasets
    return next_token_datasets(cfg)


def no_metrics(model_cfg) -> tuple:
    """The default ``logged_metrics``: no family-specific ``loss_fn`` metric is logged."""
    return ()


def no_differences(saved: dict, model_cfg) -> list:
    """The default ``checkpoint_differences``: nothing beyond the architecture flags."""
    return []


def no_checks(cfg, world_size: int) -> None:
    """The default ``check``: no rule beyond the config's own (:mod:`loom.config.validate`)."""


def no_own_flags(model_cfg) -> None:
    """The default ``refuse_own_flags``: the family reads no flag another family lacks."""


def transformer_layers(model_cfg) -> None:
    """The default ``layer_kinds``: None, every layer a transformer layer (attention, or MLA
    with ``--multi-latent-attention``; an MLP, or MoE on ``--moe-layer-freq``'s layers)."""
    return None


@dataclass(frozen=True)
class LayerShape:
    """What the planner prices of a transformer layer beyond the shape fields: whether its MLP
    is gated (FC1 ``2f`` wide), its norms of width h, and whether each query and key head has a
    learned norm of width d."""
    gated_mlp: bool
    norms: int = 2
    qk_norms: bool = False


def transformer_layer_shape(model_cfg) -> LayerShape:
    """The default ``layer_shape``: a gated MLP with ``--swiglu`` / ``--quick-geglu``, the input
    and pre-MLP norms, Q/K norms with ``--qk-layernorm``."""
    return LayerShape(bool(model_cfg.gated_linear_unit), 2, bool(model_cfg.qk_layernorm))


def other_family_flag(name: str, what: str, model_type: str) -> ConfigError:
    """``--NAME is WHAT, which --model-type MODEL_TYPE does not have: drop --NAME``: a family's
    own flag in another family's config (``refuse_own_flags``); the fix keeps the user's family
    (never "use --model-type X", which would make another model)."""
    f = "--" + name.replace("_", "-")
    return ConfigError(f"{f} is {what}, which --model-type {model_type} does not have: drop {f}")


@dataclass(frozen=True)
class ModelFamily:
    """``build(model_cfg, stage) -> nn.Module`` (plain math, built on the meta device by loom);
    ``plan(model_cfg, stage, ctx) -> {module-name pattern: ParallelStyle}``;
    ``init(model_cfg) -> (name -> InitFn)``; ``forward_step`` as in the module docstring.

    Optional hooks, each with a default, so that code outside ``loom/models/<family>`` asks the
    family instead of branching on ``--model-type``:

    * ``datasets(cfg) -> (train, valid, test)`` (None for a set without data): the samples it
      trains on; default next-token windows (mock tokens, or ``--data-path``);
    * ``logged_metrics(model_cfg) -> names``: ``loss_fn`` metrics a training record carries;
    * ``generation``: a :class:`Generation`, or None for a family that does not generate text;
    * ``evaluation_tasks``: the ``loom evaluate --task`` names it supports
      (:mod:`loom.evaluation.registry`);
    * ``hf``: a :class:`HFConversion`, or None for a family without a Hugging Face layout;
    * ``checkpoint_differences(saved: dict, model_cfg) -> [message]``: shape facts a checkpoint
      must share beyond the architecture flags (e.g. the size of learned position tables);
    * ``wordpiece_data``: whether it trains on WordPiece-tokenized data (BERT's [CLS], [SEP],
      [MASK]); a family without it refuses such data;
    * ``megatron_checkpoints``: whether its names are Megatron-Core's ``GPTModel`` /
      ``MambaModel``'s, so Megatron checkpoints are read and written for it
      (:mod:`loom.checkpoint.megatron`);
    * ``check(cfg, world_size)``: its own config rules, run inside the one validation pass on
      the copy being resolved (after the shape rules, :func:`loom.config.validate.validate_config`;
      reached through :func:`loom.models.resolve_config`, before any process group): raises a
      one-line ConfigError naming the flag and a fix that keeps the family, and may write the
      values its layout fixes into ``cfg`` (Gemma 3's RMSNorm, RoPE, no biases);
    * ``refuse_own_flags(model_cfg)``: raises ConfigError ("drop it") when a config of *another*
      family sets a flag only this family reads (the flags themselves are declared once, in
      :mod:`loom.config`, as Megatron's are);
    * ``replicates_kv_heads``: its plan replicates K/V heads when TP exceeds the query groups
      (Gemma 3's ``ReplicatedKV``), so TP need not divide ``--num-query-groups``;
    * ``layer_kinds(model_cfg) -> str | None``: what the planner prices, one character per
      layer: ``M`` a Mamba-2 mixer, ``*`` attention, ``-`` an MLP (:mod:`loom.planner.mamba`);
      None (the default): every layer a transformer layer (attention or MLA + MLP or MoE);
    * ``layer_shape(model_cfg) -> LayerShape``: a transformer layer's gated MLP, norms and Q/K
      norms as the planner counts them (default :func:`transformer_layer_shape`);
    * ``records_attention_logits``: its standard attention layers are
      :class:`~loom.models.attention.SelfAttention`, whose cores record the maximum logits of
      ``--qk-clip`` / ``--log-max-attention-logit`` (:mod:`loom.training.qk_clip`).

    :attr:`takes_documents`: whether its model reads the document starts and reset positions
    of ``--reset-attention-mask`` / ``--reset-position-ids`` (``document_starts`` among the
    built class's ``extra_inputs``)."""

    name: str
    build: Callable
    plan: Callable
    init: Callable
    forward_step: "ForwardStep"
    datasets: Callable = next_token_windows
    logged_metrics: Callable = no_metrics
    generation: Optional[Generation] = None
    evaluation_tasks: tuple = ()
    hf: Optional[HFConversion] = None
    checkpoint_differences: Callable = no_differences
    wordpiece_data: bool = False
    megatron_checkpoints: bool = False
    check: Callable = no_checks
    refuse_own_flags: Callable = no_own_flags
    replicates_kv_heads: bool = False
    layer_kinds: Callable = transformer_layers
    layer_shape: Callable = transformer_layer_shape
    records_attention_logits: bool = False

    @property
    def takes_documents(self) -> bool:
        return "document_starts" in getattr(self.build, "extra_inputs", ())
