"""Megatron's ``--split``: train/valid/test weights over a dataset's documents. Torch-free, so
config validation can check ``--split`` before anything starts."""

from __future__ import annotations

from loom.errors import ConfigError


def parse_split(split: str) -> list[float]:
    """Three non-negative weights (train, valid, test) from ``"969,30,1"`` (or ``969/30/1``,
    ``969, 30, 1``, or one pair of matching quotes around it, as Megatron's bash scripts pass
    ``--split "'99,1,0'"``); missing ones are 0. Raises ConfigError naming ``--split``."""
    s = "969, 30, 1" if split is None else str(split).strip()  # None: Megatron's default
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        s = s[1:-1]
    s = s.replace("/", ",")
    try:
        w = [float(x) for x in s.split(",") if x.strip() != ""]
    except ValueError:
        raise ConfigError(f"--split {split!r}: give comma-separated weights such as 969,30,1") from None
    if not 1 <= len(w) <= 3 or any(not x >= 0 for x in w) or not sum(w) > 0 or sum(w) == float("inf"):
        raise ConfigError(f"--split {split!r}: give 1 to 3 non-negative weights with a positive sum, e.g. 969,30,1")
    return w + [0.0] * (3 - len(w))


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
