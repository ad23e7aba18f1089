"""``--eod-mask-loss`` (Megatron-LM's ``_get_ltor_masks_and_position_ids`` rule): no loss where
the input token is the end-of-document id. :class:`EodLossMask` adds the mask to a next-token
dataset's samples; :func:`end_of_document_id` finds the id (stored with the data, or the
tokenizer the flags name)."""

from __future__ import annotations

from typing import Optional

import torch

from loom.data.sampler import FieldsAdded
from loom.errors import ConfigError


class EodLossMask(FieldsAdded):
    """``--eod-mask-loss``: the samples of ``dataset`` with ``loss_mask [s]`` (fp32) added,
    0 where the input token is the end-of-document id ``eod`` (the prediction of the next
    document's first token from the end of the previous one), 1 elsewhere: Megatron's
    ``loss_mask[data == eod_token] = 0.0`` (``_get_ltor_masks_and_position_ids``, on the input
    tokens). Every other attribute is the dataset's."""

    def __init__(self, dataset, eod: int):
        self.dataset, self.eod = dataset, int(eod)

    def add(self, sample: dict[str, torch.Tensor], k: int) -> dict[str, torch.Tensor]:
        return {"loss_mask": (sample["tokens"] != self.eod).float()}


def end_of_document_id(data, vocab_size: Optional[int], flag: str = "--eod-mask-loss") -> int:
    """The end-of-document id ``--eod-mask-loss`` masks: the ``eod`` stored with the data
    (``PREFIX.meta.json``; all datasets of a blend must agree), else with ``--mock-data`` the
    tokenizer's the flags name (``NullTokenizer``: the id it adds after the ``--vocab-size``
    given, ``vocab_size`` - 1 of the resolved model). ``data``: a DataConfig. Raises
    ConfigError naming ``flag`` (the flag that needs the id: ``--eod-mask-loss``,
    ``--reset-attention-mask``, ``--reset-position-ids``) when no tokenizer says which id it is,
    or when two datasets disagree."""
    from loom.data.blended import data_prefixes
    from loom.data.preprocess import read_meta
    prefixes = [] if data.mock_data else data_prefixes(data)
    ids = {(flag, p): read_meta(p).get("eod") for flag, p in prefixes}
    found = {v for v in ids.values() if v is not None}
    if len(found) > 1:
        raise ConfigError(f"{flag}: the datasets end documents with different ids "
                          f"({ids}); blend datasets of one tokenizer")
    if found:
        return int(found.pop())
    if data.tokenizer_type == "NullTokenizer" and vocab_size:
        return int(vocab_size) - 1
    if data.tokenizer_type and (data.tokenizer_model or data.vocab_file):
        from loom.data.tokenizer import build_tokenizer
        return build_tokenizer(data.tokenizer_type, data.vocab_file, data.merge_file,
                               data.tokenizer_model,
                               tiktoken_pattern=data.tiktoken_pattern).eod
    raise ConfigError(f"{flag} needs the end-of-document id: give --data-path (loom "
                      "preprocess stores it), or with --mock-data a tokenizer "
                      "(--tokenizer-type NullTokenizer: its id --vocab-size)")
