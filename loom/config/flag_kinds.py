"""The kinds of row of the Megatron flag table (:mod:`loom.config.flag_rows`) and their reason
categories: every flag of Megatron-LM's ``parse_args()`` is, in loom, exactly one of

- **implemented** (:func:`field`): a loom config field (declared with ``opt()`` in the config
  sections) with Megatron's name, meaning and default (or, where the row says why, ``own``,
  loom's own default on purpose: ``--ckpt-format loom_dcp``); a few of Megatron's values may
  be refused with a reason (``refuse``);
- **accepted, no effect** (:func:`no_effect`): accepted with Megatron's type and choices and
  named once at start with its reason (:data:`NO_EFFECT`); not a config field, never stored in a
  checkpoint; some values may be refused (``refuse``);
- **refused** (:func:`refused`): any value other than Megatron's default (and the ``allow``
  values, which mean what loom does) is refused in one line naming the capability loom lacks
  (:data:`REFUSED`), or (``pending``) a capability not implemented yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field as dc_field
from types import MappingProxyType
from typing import Any, Mapping, Optional

IMPLEMENTED, NO_EFFECT_KIND, REFUSED_KIND = "implemented", "no effect", "refused"

NO_EFFECT = MappingProxyType({
    "kernel": "kernel choice or fusion (loom's PyTorch kernels compute the same values)",
    "te": "Transformer Engine, FP8 or FP4 (loom trains in fp32, bf16 or fp16 without "
          "Transformer Engine)",
    "precision": "lower-precision storage or communication (loom keeps these in fp32)",
    "runtime": "communication overlap, CUDA graphs, NCCL or CUDA runtime tuning (the same "
               "numbers, scheduled differently)",
    "memory": "GPU memory management: recomputation scope, offloading, allocator, garbage "
              "collection",
    "ckpt_io": "checkpoint I/O tuning (loom's torch.distributed.checkpoint saves and loads in "
               "parallel, resharding to any layout, with checksums)",
    "data_io": "data-loader and index-cache tuning (loom reads and indexes its datasets in the "
               "training process)",
    "tokenizer": "tokenizer construction (loom reads the tokenizer stored with the data by "
                 "`loom preprocess`)",
    "logging": "logging detail loom does not have (verbosity, TensorBoard interval and queue)",
    "already": "what loom does anyway (logs loss scale, memory, throughput and validation "
               "perplexity to stdout, TensorBoard and W&B; checks checkpoint checksums)",
    "validation": "Megatron's self-checks of its own implementation (loom checks every step's "
                  "gradient norm, skips and reports non-finite steps)",
    "inference_engine": "settings of Megatron's inference engine (request batching, KV-cache "
                        "memory, CUDA graphs, serving), which loom's training does not run and "
                        "its generation does not have",
    "cluster": "launcher and cluster services (torchrun gives the ranks; no telemetry is sent)",
    "deprecated": "deprecated in Megatron-LM",
    "internal": "Megatron's code-path switches (layer-spec modules, experimental features, "
                "JIT fuser)",
    "equivalent": "the same model in another parametrization, rank order or sharding",
})
"""``{category: reason}`` of the no-effect rows (the ``--help-all`` groups and the report)."""

REFUSED = MappingProxyType({
    "rl": "reinforcement learning (GRPO, Megatron's train_rl.py)",
    "vision": "vision and multimodal models",
    "retrieval": "retrieval (ICT, biencoder) models",
    "t5": "encoder-decoder (T5) models",
    "distillation": "knowledge distillation",
    "modelopt": "ModelOpt quantization, export and distillation",
    "optimizers": "optimizers other than Adam, SGD and Muon (loom trains with AdamW, SGD or "
                  "Muon: --optimizer adam|sgd|muon)",
    "linear_attention": "linear-attention layers (Gated DeltaNet, gated delta product)",
    "dsa": "DeepSeek sparse attention's cross-layer top-k sharing, fused kernels and "
           "interleaved indexer RoPE (loom's DSA computes the top-k in every layer, in "
           "PyTorch, with RoPE in halves)",
    "mhc": "manifold-constrained hyper-connections",
    "heterogeneous": "heterogeneous per-layer configurations",
    "architecture": "architecture variants",
    "resiliency": "NVIDIA's resiliency services (in-process restart, fault-tolerance package, "
                  "autoresume): loom restarts under torchrun "
                  "(--max-restarts) and resumes from --save",
    "fault_injection": "Megatron's fault injector (loom's drills: --inject-fault "
                       "RANK:ITERATION:KIND)",
    "nonpersistent": "node-local non-persistent checkpoints and their replication "
                     "(nvidia-resiliency-ext; loom writes --non-persistent-ckpt-type global)",
    "ckpt_variants": "checkpoint variants (converted at start, iteration overridden, "
                     "model-parallel sizes from the checkpoint's args): convert with "
                     "`loom checkpoint convert`",
    "dumps": "tensor dumps and traces (parameters, activations, gradients, routing, "
             "configs) every N iterations",
    "extra_logs": "extra logs and traces",
    "data_options": "data-pipeline options",
    "training_options": "training-loop options",
    "deprecated": "no longer accepted by Megatron-LM either",
    "inference": "options of Megatron's inference engine and servers",
    "pending": "not implemented in loom yet",
})
"""``{capability: reason}`` of the refused rows."""


@dataclass(frozen=True)
class Row:
    """One Megatron flag's disposition in loom (see the module docstring)."""

    kind: str
    category: Optional[str] = None
    field: Optional[str] = None
    allow: tuple = ()
    refuse: Mapping[Any, str] = dc_field(default_factory=dict)
    reason: str = ""
    note: str = ""
    default: Any = None
    spelled: bool = False
    own: str = ""
    required: Optional[str] = None
    pending: Optional[str] = None

    def why(self) -> str:
        """The one-line reason of a refused row ("loom has no CAPABILITY", "not implemented
        in loom yet: CAPABILITY", "deprecated in Megatron-LM: FIX"), or the category text of a
        no-effect one."""
        if self.kind != REFUSED_KIND:
            return NO_EFFECT.get(self.category, "")
        base = self.reason or REFUSED[self.category]
        if self.pending:
            return f"not implemented in loom yet: {base}"
        if self.category == "deprecated":
            return f"deprecated in Megatron-LM: {base}"
        return f"loom has no {base}"


def field(name: Optional[str] = None, *, note: str = "", refuse: Optional[dict] = None,
          required: Optional[str] = None, own: str = "", **spelled: Any) -> Row:
    """Implemented by loom config field ``name`` (default: the flag's name). ``default=X``:
    loom spells Megatron's default as X (same meaning, e.g. ``None`` for "off"), or, with
    ``own`` (the reason), loom's default differs from Megatron's on purpose without changing
    what the run computes (``--ckpt-format loom_dcp``); ``required``: Megatron refuses to run
    without the flag (its ``file:line``); ``refuse``: ``{Megatron value: reason}`` loom
    refuses."""
    assert not own or "default" in spelled, "own: loom's default is given as default="
    return Row(IMPLEMENTED, field=name, note=note, refuse=MappingProxyType(refuse or {}),
               required=required, default=spelled.get("default"), spelled="default" in spelled,
               own=own)


def no_effect(category: str, *, note: str = "", refuse: Optional[dict] = None) -> Row:
    """Accepted and named at start with the reason ``NO_EFFECT[category]``; ``refuse``:
    ``{value: reason}`` refused."""
    assert category in NO_EFFECT, category
    return Row(NO_EFFECT_KIND, category=category, note=note,
               refuse=MappingProxyType(refuse or {}))


def refused(category: str, reason: str = "", *, allow: tuple = (),
            pending: Optional[str] = None, note: str = "",
            refuse: Optional[dict] = None) -> Row:
    """Refused unless given Megatron's default or an ``allow`` value (what loom does);
    ``reason`` (default ``REFUSED[category]``) names the capability; ``refuse``: ``{value:
    reason}`` where a value has its own; ``pending``: the branch implementing it (shown in the
    docs, not to the user)."""
    assert category in REFUSED, category
    return Row(REFUSED_KIND, category=category, reason=reason, allow=tuple(allow),
               pending=pending, note=note, refuse=MappingProxyType(refuse or {}))


def words(text: str) -> tuple[str, ...]:
    """The flags of a whitespace-separated block."""
    return tuple(text.split())
