"""In-process CLI refusals: run ``loom.cli.main(argv)`` as a single process and return its one
line (exit status 2, exactly one non-empty stderr line)."""

from __future__ import annotations

from typing import Optional

import pytest


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
