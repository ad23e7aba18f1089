"""Which samples a model family trains on: GPT-style next-token windows, or BERT's masked-LM
samples (:mod:`loom.data.bert_dataset`) for ``--model-type bert``."""

from __future__ import annotations

from typing import Any


def build_for_model(cfg: Any) -> tuple[Any, Any, Any]:
    """(train, valid, test) datasets of a LoomConfig for its ``--model-type`` (None for a set
    without data): mock tokens with ``--mock-data`` or no data path, else the indexed datasets
    named by ``--data-path`` and friends (blends, ``--split``)."""
    d, m, seed = cfg.data, cfg.model, cfg.training.seed
    if m.model_type == "bert":
        from loom.data.bert_dataset import build_bert_datasets
        return build_bert_datasets(cfg)
    if d.mock_data or not (d.data_path or d.train_data_path or d.valid_data_path
                           or d.test_data_path):
        from loom.data.gpt_dataset import MockGPTDataset
        return (MockGPTDataset(m.vocab_size, m.seq_length, seed),
                MockGPTDataset(m.vocab_size, m.seq_length, seed + 1), None)
    from loom.data.blended import build_datasets
    return build_datasets(d, m.seq_length, seed)  # blends: loom.data.blended
