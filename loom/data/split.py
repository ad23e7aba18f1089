"""Megatron's ``--split``: train/valid/test document ranges of a dataset. The weights are parsed
by :func:`loom.config.split.parse_split` (re-exported here)."""

from __future__ import annotations

from loom.config.split import parse_split


def split_document_ranges(num_documents: int, split: str = "969, 30, 1") -> list[tuple[int, int]]:
    """Megatron's ``--split``: 3 consecutive ``(start, end)`` document ranges (train, valid, test).

    Weights are normalized; boundaries are ``round(cumulative weight * num_documents)``, shifted so
    that the last ends at ``num_documents``. Raises ConfigError naming ``--split`` for bad weights.
    """
    w = parse_split(split)
    total = sum(w)
    idx = [0]
    for x in w:
        idx.append(idx[-1] + int(round(x / total * float(num_documents))))
    diff = idx[-1] - num_documents
    for i in range(1, len(idx)):
        idx[i] -= diff
    idx = [min(max(i, 0), num_documents) for i in idx]
    return [(idx[i], idx[i + 1]) for i in range(3)]
