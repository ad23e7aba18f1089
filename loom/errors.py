"""loom's user-facing errors; imports nothing from loom, so every layer may raise them.

A :class:`ConfigError` is bad input: ``loom`` prints its message once (rank 0) without a
traceback and exits with status 2 (an :class:`UnknownOptionError`, a YAML key loom does not
know, also points at the command's ``--help``). :func:`closest` picks the one flag an unknown
flag is a typo of, if any. A :class:`CheckpointWriteError` is a checkpoint the
filesystem refused; ``loom`` prints its message (naming the directory and the OS error) and
exits with status 1. A :class:`NonFiniteError` stops training that keeps producing NaN/inf
(status 1). A :class:`RerunExit` ends a run after Megatron's rerun state machine attributed a
rejected result (status 16 or 17, Megatron's codes).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An impossible or inconsistent input; the message names the flag, key or file and the fix."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the message names the directory and the OS error."""


class NonFiniteError(RuntimeError):
    """``--exit-on-nonfinite N`` consecutive iterations had a non-finite loss or gradient norm;
    the message names the iterations. ``loom`` prints it and exits with status 1."""


class WeightHashMismatch(RuntimeError):
    """``--check-weight-hash-across-dp-replicas-interval``: replicas of some weights differ
    across data-parallel ranks (loom/training/weight_hash.py); the message names the weights,
    the ranks and the iteration. Raised on every rank; ``loom`` prints it and exits with
    status 1."""


class RerunExit(RuntimeError):
    """``--rerun-mode validate_results`` stops the run after rerunning an iteration whose loss
    was rejected (loom/training/rerun.py): ``code`` 16 (reproduced: the iteration's starting
    state checkpointed, resume on other hardware) or 17 (not reproduced: a transient fault);
    ``checkpoint``: whether that state is to be saved first. ``loom`` prints the message and
    exits with ``code``."""

    def __init__(self, message: str, code: int, checkpoint: bool = False):
        super().__init__(message)
        self.code, self.checkpoint = code, checkpoint


class UnknownOptionError(ConfigError):
    """A flag or YAML key loom does not know. ``loom`` appends "see `loom COMMAND --help`",
    naming the command that ran (``loom plan`` and ``loom train`` read the same YAML keys)."""


def edit_distance(a: str, b: str) -> int:
    """Damerau-Levenshtein distance (optimal string alignment) between ``a`` and ``b``: the
    fewest single-character insertions, deletions, substitutions and adjacent swaps."""
    prev2, prev = [], list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        cur = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                cur[j] = min(cur[j], prev2[j - 2] + 1)
        prev2, prev = prev, cur
    return prev[-1]


def _words(name: str) -> list[str]:
    return name.lstrip("-").replace("_", "-").split("-")


def closest(word: str, options) -> str | None:
    """The one option of ``options`` that ``word`` is a typo of, or None.

    The rule (a suggestion must mean "you mistyped X", never "use a different feature"),
    comparing names without their leading dashes, ``_`` and ``-`` alike:

    * a typo: Damerau-Levenshtein distance at most 1 for names under 12 characters, at most 2
      for longer ones (``--hiden-size`` -> ``--hidden-size``, ``--seq-lenght`` ->
      ``--seq-length``; not ``--vocab-file`` -> ``--vocab-size``, distance 2 in 10 characters);
    * or one inner word left out (``--tensor-parallel-size`` ->
      ``--tensor-model-parallel-size``); a word missing at either end is not a typo
      (``--init-method`` is not ``--init-method-std``);
    * or an abbreviation: a prefix ending inside a word and at least half the name
      (``--save-int`` -> ``--save-interval``; not ``--max-new``, which ends at a word).

    Only the nearest candidates count, and a tie between two of them gives None (at most one
    suggestion, and never a guess between two).
    """
    name = "-".join(_words(word))
    if not name:
        return None
    limit = 1 if len(name) < 12 else 2
    scored = []
    for option in set(options):
        other = "-".join(_words(option))
        d = edit_distance(name, other)
        if d <= limit:
            scored.append((d, option))
            continue
        ws, wo = name.split("-"), other.split("-")
        inner_word = len(wo) == len(ws) + 1 and any(wo[:i] + wo[i + 1:] == ws
                                                     for i in range(1, len(ws)))
        abbreviation = other.startswith(name) and other[len(name)] != "-" \
            and 2 * len(name) >= len(other)
        if inner_word or abbreviation:
            scored.append((limit + 1, option))
    if not scored:
        return None
    best = min(d for d, _ in scored)
    tied = [o for d, o in scored if d == best]
    return tied[0] if len(tied) == 1 else None


def did_you_mean(word: str, options) -> str:
    """``"; did you mean X?"`` naming :func:`closest` of ``options`` to ``word``, or ``""``."""
    close = closest(word, options)
    return f"; did you mean {close}?" if close else ""
