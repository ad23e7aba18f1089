"""Megatron's document masks (``--reset-position-ids``, ``--reset-attention-mask``,
``--dataloader-inter-document-masking``;
Megatron-LM d98e8a6's names and meaning: ``megatron/training/arguments.py`` ``_add_data_args``,
applied by ``megatron/core/datasets/gpt_dataset.py`` ``_get_ltor_masks_and_position_ids``), a
mixin of :class:`~loom.config.sections.DataConfig`, what they change in a run
(:func:`document_plan`), the start notes where they change nothing (:func:`document_notes`)
and their check (:func:`check_document_masks`, part of the one validation pass). The samples' positions and
document starts: :mod:`loom.data.document_masks`; the mask: :mod:`loom.models.attention`.

What each does, as in Megatron-Core (an EOD token at index i of a sample ends a document; the
next document starts at i + 1):

- ``--reset-position-ids``: the position ids restart at 0 after each EOD. Megatron-Core feeds
  position ids to the learned absolute position embedding only (its RoPE is computed from the
  sequence length, ``GPTModel.forward``), so loom does too: under RoPE or YaRN the flag changes
  nothing, which loom names once at start.
- ``--reset-attention-mask``: a token attends only to the earlier tokens of its own document
  (a block-diagonal causal mask). Megatron builds this mask in its data loader; its unfused
  attention applies it, while Transformer Engine's and the fused causal softmax ignore it.
  loom applies it wherever its GPT family runs standard attention (a boolean
  ``[b, 1, s, s]`` mask to ``scaled_dot_product_attention``); elsewhere (other families, CP,
  MLA, gpt-oss, DSA, Gated DeltaNet) the run trains without it, as Megatron's Transformer
  Engine attention does, and says so at start.
- ``--dataloader-inter-document-masking``: the same mask and position reset at the dataset's own
  document boundaries (Megatron passes them as ``cu_seqlens`` to packed-sequence attention, whose
  RoPE restarts at each document: the same attention, RoPE being relative); it supersedes the
  two above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loom.config.fields import opt
from loom.errors import ConfigError


@dataclass
class DocumentMaskFields:
    """End-of-document resets of the GPT dataset's samples."""

    reset_position_ids: bool = opt(
        False, "restart the position ids at 0 after each end-of-document token (the learned "
               "absolute position embedding reads them; RoPE, as in Megatron-Core, does not)")
    reset_attention_mask: bool = opt(
        False, "each token attends only to the earlier tokens of its own document (documents "
               "end at the end-of-document token): a block-diagonal causal mask")
    dataloader_inter_document_masking: bool = opt(
        False, "each token attends only to the earlier tokens of its own document, and the "
               "position ids restart at each document, at the dataset's own document "
               "boundaries (Megatron's cu_seqlens; instead of the end-of-document resets)")


@dataclass(frozen=True)
class DocumentPlan:
    """What the given document flags change in a run (:func:`document_plan`): the attention
    mask (``attention``), the learned positions (``positions``), at the dataset's own
    boundaries (``own_documents``) or at end-of-document tokens."""

    attention: bool = False
    positions: bool = False
    own_documents: bool = False

    @property
    def active(self) -> bool:
        return self.attention or self.positions


def _mask_not_applied(cfg: Any, family_takes_them: bool) -> list[str]:
    """Why loom's document mask cannot be applied to this run (phrases; empty when it can)."""
    d, m, p = cfg.data, cfg.model, cfg.parallel
    return [what for what, on in (
        (f"--model-type {m.model_type}", not family_takes_them),
        ("--sft (each sample is one conversation)", d.sft),
        ("--multi-latent-attention", m.multi_latent_attention),
        ("gpt-oss's attention (--window-size / --softmax-type)",
         m.window is not None or m.softmax_type != "vanilla"),
        ("DeepSeek sparse attention", m.dsa),
        ("Gated DeltaNet layers", m.gated_delta_net),
        ("--context-parallel-size > 1", p.context_parallel_size > 1),
        ("--mock-data (random tokens hold no documents)",
         d.dataloader_inter_document_masking and d.mock_data),
    ) if on]


def document_plan(cfg: Any, family_takes_them: bool = True) -> DocumentPlan:
    """What ``--reset-attention-mask``, ``--reset-position-ids`` and
    ``--dataloader-inter-document-masking`` change in ``cfg`` (a LoomConfig).
    ``--dataloader-inter-document-masking`` supersedes the other two, as in Megatron, whose data
    loader then builds no attention mask and restarts the positions at each document. The mask
    is applied where loom's standard attention runs (:func:`_mask_not_applied`); the positions
    reach the learned absolute position embedding only, as in Megatron-Core.
    ``family_takes_them``: the ``--model-type`` family's model reads them (the family's
    ``FamilyRules.document_masks``)."""
    d, m = cfg.data, cfg.model
    learned = m.position_embedding_type == "learned_absolute"
    family_ok = family_takes_them and not d.sft
    mask_ok = not _mask_not_applied(cfg, family_takes_them)
    if d.dataloader_inter_document_masking:
        return DocumentPlan(attention=mask_ok, positions=mask_ok and learned,
                            own_documents=mask_ok)
    return DocumentPlan(attention=d.reset_attention_mask and mask_ok,
                        positions=d.reset_position_ids and learned and family_ok)


def document_notes(cfg: Any, family_takes_them: bool = True) -> list[str]:
    """The start notes of the document flags given that change nothing in this run (each
    naming why: as with Megatron's Transformer Engine attention, which ignores the mask, the run
    trains without it)."""
    d = cfg.data
    plan = document_plan(cfg, family_takes_them)
    why = ", ".join(_mask_not_applied(cfg, family_takes_them))
    out = []
    mask = "--dataloader-inter-document-masking" if d.dataloader_inter_document_masking else \
        "--reset-attention-mask" if d.reset_attention_mask else None
    if mask and not plan.attention:
        out.append(f"{mask} with {why}: no document mask (loom applies it in the standard "
                   f"attention of the GPT family; Megatron's Transformer Engine attention "
                   f"ignores it everywhere)")
    if d.reset_position_ids and not d.dataloader_inter_document_masking and \
            not plan.positions:
        out.append(f"--reset-position-ids with --position-embedding-type "
                   f"{cfg.model.position_embedding_type}: no effect (as in Megatron-Core, whose "
                   f"RoPE ignores the position ids); only a learned absolute position "
                   f"embedding reads them" if cfg.model.position_embedding_type !=
                   "learned_absolute" else f"--reset-position-ids with {why}: no effect")
    return out


def check_document_masks(cfg: Any, family_takes_them: bool = True) -> None:
    """Refuse the document flags where loom would apply them to part of the model only
    (multi-token prediction's layers take the sequence positions) or where they contradict
    the data (``--fim-data`` rearranges the documents). Raises ConfigError naming the flags and
    what to drop."""
    d = cfg.data
    if d.dataloader_inter_document_masking and d.fim_data:
        raise ConfigError("--dataloader-inter-document-masking with --fim-data: its samples are "
                          "rearranged documents; drop one of them")
    if cfg.model.mtp_num_layers and document_plan(cfg, family_takes_them).active:
        given = " / ".join(f for f, on in (
            ("--reset-attention-mask", d.reset_attention_mask),
            ("--reset-position-ids", d.reset_position_ids),
            ("--dataloader-inter-document-masking", d.dataloader_inter_document_masking)) if on)
        raise ConfigError(f"{given} with --mtp-num-layers: the multi-token-prediction layers "
                          f"take the sequence positions, not the documents; drop one of them")
