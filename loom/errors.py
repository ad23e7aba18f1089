"""loom's user-facing errors; imports nothing from loom, so every layer may raise them.

A :class:`ConfigError` is bad input: ``loom`` prints its message once (rank 0) without a
traceback and exits with status 2. A :class:`CheckpointWriteError` is a checkpoint the
filesystem refused; ``loom`` prints its message (naming the directory and the OS error) and
exits with status 1. A :class:`NonFiniteError` stops training that keeps producing NaN/inf
(status 1).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An impossible or inconsistent input; the message names the flag, key or file and the fix."""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the message names the directory and the OS error."""


class NonFiniteError(RuntimeError):
    """``--exit-on-nonfinite N`` consecutive iterations had a non-finite loss or gradient norm;
    the message names the iterations. ``loom`` prints it and exits with status 1."""


def did_you_mean(word: str, options) -> str:
    """``"; did you mean --x?"`` naming the closest of ``options`` to ``word`` (difflib, cutoff
    0.6; a prefix of exactly one option wins first), or ``""`` when none is close."""
    import difflib
    options = sorted(set(options))
    prefixed = [o for o in options if o.startswith(word)] if len(word) > 3 else []
    close = prefixed if len(prefixed) == 1 else difflib.get_close_matches(word, options, n=1,
                                                                           cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""
