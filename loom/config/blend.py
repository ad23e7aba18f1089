"""Megatron's blend syntax of ``--data-path`` (and ``--train/valid/test-data-path``):
``PREFIX``, ``W1 PREFIX1 W2 PREFIX2 ...`` or ``PREFIX1 PREFIX2 ...``, parsed once here, torch-
and numpy-free, for the config checks (:mod:`loom.config.evaluation`) and the datasets
(:mod:`loom.data.blended`, which builds them)."""

from __future__ import annotations

import math
import os
from typing import Optional

from loom.errors import ConfigError


def is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def parse_blend(text: Optional[str], flag: str = "--data-path") -> Optional[list[tuple[float, str]]]:
    """``[(weight, prefix)]`` of a ``--data-path`` value: ``PREFIX`` (weight 1), ``W1 P1 W2 P2
    ...`` (weights, normalized) or ``P1 P2 ...`` (weights proportional to each dataset's size:
    ``None`` weights, resolved by :func:`build_blend`). None for None.

    Words are separated by whitespace; a value that names an existing ``PREFIX.idx`` as a whole
    is one prefix even if it contains spaces. Raises ConfigError naming ``flag`` for an odd
    number of words in a weighted blend, a missing weight, or weights that are negative or sum
    to zero.
    """
    if text is None:
        return None
    text = str(text).strip()
    words = text.split()
    if not words:
        raise ConfigError(f"{flag}: give a dataset prefix or a blend W1 PREFIX1 W2 PREFIX2 ...")
    if len(words) == 1 or os.path.exists(text + ".idx"):
        return [(1.0, text)]
    if not is_number(words[0]):
        if any(is_number(w) for w in words):
            raise ConfigError(f"{flag} {text}: mix of weights and prefixes; give W1 PREFIX1 W2 "
                              f"PREFIX2 ... (a weight before every prefix) or only prefixes")
        return [(None, w) for w in words]  # type: ignore[misc] - sizes decide, see build_blend
    if len(words) % 2 or not all(is_number(w) for w in words[::2]):
        raise ConfigError(f"{flag} {text}: a blend is W1 PREFIX1 W2 PREFIX2 ...: a weight "
                          f"before every prefix")
    weights = [float(w) for w in words[::2]]
    if any(not (w >= 0 and math.isfinite(w)) for w in weights) or not sum(weights) > 0:
        raise ConfigError(f"{flag} {text}: blend weights must be finite, >= 0, with a positive "
                          f"sum")
    total = sum(weights)
    return [(w / total, p) for w, p in zip(weights, words[1::2])]
