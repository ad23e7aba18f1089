"""GPT-style next-token windows, the samples a causal model family trains on (the default
``datasets`` hook of :class:`loom.models.family.ModelFamily`; BERT's masked-LM samples are
:mod:`loom.data.bert_dataset`, chosen by its family)."""

from __future__ import annotations

from typing import Any


def next_token_datasets(cfg: Any) -> tuple[Any, Any, Any]:
    """(train, valid, test) next-token datasets of a LoomConfig (None for a set without data):
    mock tokens with ``--mock-data`` or no data path, else the indexed datasets named by
    ``--data-path`` and friends (blends, ``--split``)."""
    d, m, seed = cfg.data, cfg.model, cfg.training.seed
    if d.mock_data or not (d.data_path or d.train_data_path or d.valid_data_path
                           or d.test_data_path):
        from loom.data.gpt_dataset import MockGPTDataset
        return (MockGPTDataset(m.vocab_size, m.seq_length, seed),
                MockGPTDataset(m.vocab_size, m.seq_length, seed + 1), None)
    from loom.data.blended import build_datasets
    sets = build_datasets(d, m.seq_length, seed,  # blends: loom.data.blended
                          separate_valid=cfg.logging.multiple_validation_sets)
    return with_fim(d, sets, seed) if d.fim_data else sets


def with_fim(data: Any, sets: tuple, seed: int) -> tuple:
    """``--fim-data``: each set of ``sets`` wrapped in :class:`loom.data.fim.FimDataset` with
    the tokenizer stored beside the (first) dataset of ``data``."""
    from loom.data.blended import blend_prefixes, map_sets
    from loom.data.fim import FimDataset, fim_transform
    from loom.data.preprocess import load_tokenizer_for
    prefix = blend_prefixes(data.data_path or data.train_data_path or data.valid_data_path
                            or data.test_data_path)[0]
    transform = fim_transform(data, load_tokenizer_for(prefix), prefix)
    return map_sets(lambda s: FimDataset(s, transform, seed), sets)
