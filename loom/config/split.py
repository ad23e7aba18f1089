"""Megatron's ``--split`` as a rule, torch-free: the train/valid/test weights it gives, so config
validation checks ``--split`` before anything starts (:mod:`loom.data.split` applies them to a
dataset's documents)."""

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
