"""In-process CLI: a refusal (run ``loom.cli.main(argv)`` as a single process and return its one
line: exit status 2, exactly one non-empty stderr line), or the config ``loom train`` resolves
from a command line (:func:`prepared`)."""

from __future__ import annotations

from typing import Optional

import pytest


TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "1", "--lr", "1e-3", "--mock-data",
        "--vocab-size", "96", "--train-iters", "2"]
"""A tiny one-rank GPT on mock data: what the flag tests add their flags to."""


def prepared(argv: list, monkeypatch):
    """The :class:`loom.config.LoomConfig` ``loom train ARGV`` resolves on one rank, before
    any process group (:func:`loom.training.cli.prepare`); ConfigError as it raises it."""
    import argparse
    from loom.training.cli import add_arguments, prepare
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return prepare(parser.parse_args(argv))


def refusal(argv: list, monkeypatch, capsys, prog: Optional[str] = None) -> str:
    """The one stderr line ``loom`` prints when it refuses ``argv`` (exit status 2 asserted);
    ``prog`` (e.g. ``"loom evaluate"``): the line must start with ``"PROG: error: "``."""
    from loom.cli import main
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(err) == 1, err
    if prog is not None:
        assert err[0].startswith(f"{prog}: error: "), err
    return err[0]
