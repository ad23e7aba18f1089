"""Megatron's document masks (``--reset-position-ids``, ``--reset-attention-mask``,
``--dataloader-inter-document-masking``;
Megatron-LM d98e8a6's names and meaning: ``megatron/training/arguments.py`` ``_add_data_args``,
applied by ``megatron/core/datasets/gpt_dataset.py`` ``_get_ltor_masks_and_position_ids``), a
mixin of :class:`~loom.config.sections.DataConfig`, and their check
(:func:`check_document_masks`, part of the one validation pass). The samples' positions and
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
  loom always applies it (a boolean ``[b, 1, s, s]`` mask to
  ``scaled_dot_product_attention``).
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


def document_mask_refusals(cfg: Any, family_takes_them: bool = True) -> list[str]:
    """Why ``--reset-attention-mask`` / ``--reset-position-ids`` cannot run with the rest of
    ``cfg`` (a LoomConfig), one phrase each naming what to drop; empty when they can.
    ``family_takes_them``: the ``--model-type`` family's model reads them (the family's
    ``FamilyRules.document_masks``)."""
    d, m, p = cfg.data, cfg.model, cfg.parallel
    inter = d.dataloader_inter_document_masking
    flags = [f for f, on in (("--reset-attention-mask", d.reset_attention_mask),
                             ("--reset-position-ids", d.reset_position_ids),
                             ("--dataloader-inter-document-masking", inter)) if on]
    if not flags:
        return []
    out = []
    given = " / ".join(flags)
    if inter and (d.mock_data or d.fim_data):
        out.append("--dataloader-inter-document-masking with "
                   + ("--mock-data (random tokens hold no documents)" if d.mock_data else
                      "--fim-data (its samples are rearranged documents)"))
    if not family_takes_them:
        out.append(f"{given} with --model-type {m.model_type} (the GPT family's "
                   f"next-token samples only)")
    if d.sft:
        out.append(f"{given} with --sft (each sample is one conversation already)")
    if m.mtp_num_layers:
        out.append(f"{given} with --mtp-num-layers (the multi-token-prediction layers "
                   f"take the sequence positions)")
    if not (d.reset_attention_mask or inter):
        return out
    mask = "--dataloader-inter-document-masking" if inter else "--reset-attention-mask"
    special = [what for what, on in (
        ("--multi-latent-attention", m.multi_latent_attention),
        ("--window-size / --softmax-type (gpt-oss's attention)",
         m.window is not None or m.softmax_type != "vanilla"),
        ("DeepSeek sparse attention", m.dsa),
        ("Gated DeltaNet layers", m.gated_delta_net),
    ) if on]
    if special:
        out.append(f"{mask} with {', '.join(special)} (loom's document mask "
                   f"is in the standard dot-product attention)")
    if p.context_parallel_size > 1:
        out.append(f"{mask} with --context-parallel-size > 1 (the mask is "
                   f"not split over the CP ranks)")
    return out


def check_document_masks(cfg: Any, family_takes_them: bool = True) -> None:
    """Refuse ``--reset-attention-mask`` / ``--reset-position-ids`` where loom does not apply
    them (:func:`document_mask_refusals`). Raises ConfigError naming the flags and what to
    drop."""
    todo = document_mask_refusals(cfg, family_takes_them)
    if todo:
        raise ConfigError("not supported: " + "; ".join(todo) + ": drop one of them")


def document_resets(cfg: Any) -> list[str]:
    """The document flags given that change the samples: ``--dataloader-inter-document-masking``
    alone when given (it supersedes the others, as in Megatron, whose data loader then builds
    no attention mask and restarts the positions at each document), else
    ``--reset-attention-mask``, and ``--reset-position-ids`` unless it is inert
    (:func:`position_reset_is_inert`)."""
    d = cfg.data
    if d.dataloader_inter_document_masking:
        return ["--dataloader-inter-document-masking"]
    return [f for f, on in (("--reset-attention-mask", d.reset_attention_mask),
                            ("--reset-position-ids",
                             d.reset_position_ids and not position_reset_is_inert(cfg))) if on]


def position_reset_is_inert(cfg: Any) -> bool:
    """True when ``--reset-position-ids`` is given but changes nothing: the model has no learned
    absolute position embedding (RoPE and YaRN are computed from the sequence position, as in
    Megatron-Core)."""
    return cfg.data.reset_position_ids and \
        cfg.model.position_embedding_type != "learned_absolute"
