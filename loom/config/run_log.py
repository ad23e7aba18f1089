"""Reading back a ``loom train --log-json`` file: one JSON record per line, each run starting
with its ``{"kind": "run", "config": {...}, "world_size": W, ...}`` header (a resume, or
another run appended to the same file, starts another), then its ``train`` and ``valid``
records. Read by ``loom plot`` (:mod:`loom.training.plot`) and ``loom plan --calibrate-from``
(:mod:`loom.planner.calibrate_runs`); written by :class:`loom.training.metrics.MetricsLogger`.
"""

from __future__ import annotations

from loom.errors import ConfigError
from loom.jsonl import json_lines


def read_run_log(path: str) -> list[dict]:
    """The runs of a ``--log-json`` file: ``[{"header": run record or {}, "train": [...],
    "valid": [...]}]`` in file order. Raises ConfigError for a missing file, a line that is
    not JSON, or a file without training records."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    runs: list[dict] = []
    for _n, rec in json_lines(enumerate(lines, 1), path,
                              "; give the file `loom train --log-json` wrote"):
        kind = rec.get("kind") if isinstance(rec, dict) else None
        if kind == "run" or not runs:
            runs.append({"header": rec if kind == "run" else {}, "train": [], "valid": []})
        if kind in ("train", "valid"):
            runs[-1][kind].append(rec)
    runs = [r for r in runs if r["train"] or r["valid"]]
    if not any(r["train"] for r in runs):
        raise ConfigError(f"{path}: no training records (kind \"train\"); give the file "
                          f"`loom train --log-json` wrote")
    return runs
