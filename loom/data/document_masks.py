"""``--reset-position-ids`` and ``--reset-attention-mask`` on a next-token dataset's samples
(Megatron-Core's ``_get_ltor_masks_and_position_ids`` rule, ``megatron/core/datasets/
gpt_dataset.py``): an end-of-document (EOD) input token at index i ends a document, and the next
one starts at i + 1; ``--dataloader-inter-document-masking``: the dataset's own document
boundaries. The flags' meaning and checks: :mod:`loom.config.document_masks`.

:func:`document_starts` gives, for each token, the index where its document starts;
:class:`DocumentResets` adds to each sample what the model reads:

- ``document_position_ids [s]`` (``--reset-position-ids``): ``j - start(j)``, the position
  within the document, read by the learned absolute position embedding;
- ``document_starts [s]`` (``--reset-attention-mask``): ``start(j)``; the query at j sees the
  keys ``start(j) <= k <= j`` (:func:`loom.models.attention.document_causal_mask`).
"""

from __future__ import annotations

import torch

from loom.data.sampler import FieldsAdded


def document_starts(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """``tokens [..., s]`` (int) -> ``[..., s]`` (int64): for each token the index at which its
    document starts, one past the last EOD before it (0 before the first EOD; an EOD itself
    ends its own document, so it belongs to the one before)."""
    s = tokens.shape[-1]
    after = torch.arange(1, s + 1, device=tokens.device).expand_as(tokens)
    ends = torch.where(tokens == eod, after, torch.zeros_like(after))  # i + 1 at each EOD i
    starts = torch.cummax(ends, dim=-1).values
    return torch.cat([torch.zeros_like(starts[..., :1]), starts[..., :-1]], dim=-1)


class DocumentResets(FieldsAdded):
    """The samples of ``dataset`` with ``document_position_ids [s]`` (``positions``) and
    ``document_starts [s]`` (``attention``) added. Documents end at the end-of-document id
    ``eod`` (None: not at tokens) and, with ``own_documents``
    (``--dataloader-inter-document-masking``), at the dataset's own document boundaries
    (its ``document_starts(k)``); a token's start is the later of the two. Every other
    attribute is the dataset's (:class:`FieldsAdded`)."""

    def __init__(self, dataset, eod, positions: bool, attention: bool,
                 own_documents: bool = False):
        self.dataset, self.eod = dataset, None if eod is None else int(eod)
        self.positions, self.attention, self.own_documents = positions, attention, own_documents

    def add(self, sample: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
        tokens = sample["tokens"]
        starts = torch.zeros_like(tokens) if self.eod is None else \
            document_starts(tokens, self.eod)
        if self.own_documents:
            starts = torch.maximum(starts, self.dataset.document_starts(k).to(starts.dtype))
        out = {}
        if self.positions:
            out["document_position_ids"] = torch.arange(starts.shape[-1]) - starts
        if self.attention:
            out["document_starts"] = starts
        return out
