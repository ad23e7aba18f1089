"""Per-rank Chrome-trace timeline (``--timeline PATH``): forward, backward, send, recv, idle and
optimizer spans; opens in Perfetto (https://ui.perfetto.dev) or ``chrome://tracing``.

A :class:`Timeline` is a recorder object owned by the trainer and passed to the schedule; a
disabled one (the default) records nothing. Every rank writes ``PATH.rank{N}.json`` at the end
of training and rank 0 merges them into ``PATH`` (one process row per rank, ``pid`` = global
rank). Timestamps are wall-clock microseconds (``time.time_ns``), so ranks on one machine line
up.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import time
from typing import Optional


def now_us() -> float:
    return time.time_ns() / 1000.0


class Timeline:
    """Spans of one rank; ``enabled=False`` makes every call a no-op."""

    def __init__(self, rank: int = 0, enabled: bool = False):
        self.rank, self.enabled = rank, enabled
        self.events: list[dict] = []

    now_us = staticmethod(now_us)

    def add(self, name: str, cat: str, start_us: float, end_us: float, **args) -> None:
        """Record a complete span (Chrome trace ``ph: X``)."""
        if not self.enabled:
            return
        ev = {"name": name, "cat": cat, "ph": "X", "ts": start_us,
              "dur": max(end_us - start_us, 0.0), "pid": self.rank, "tid": 0}
        if args:
            ev["args"] = args
        self.events.append(ev)

    @contextlib.contextmanager
    def span(self, name: str, cat: Optional[str] = None, **args):
        """``with timeline.span("optimizer"): ...`` records the block."""
        if not self.enabled:
            yield
            return
        t0 = now_us()
        try:
            yield
        finally:
            self.add(name, cat or name, t0, now_us(), **args)

    def write_rank(self, path: str, stage: Optional[int] = None) -> str:
        """Write this rank's events to ``PATH.rank{N}.json``; returns the file name."""
        out = f"{path}.rank{self.rank}.json"
        os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
        label = f"rank {self.rank}" + (f" (pp stage {stage})" if stage is not None else "")
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": label}},
                {"name": "process_sort_index", "ph": "M", "pid": self.rank,
                 "args": {"sort_index": self.rank}}]
        with open(out, "w") as fh:
            json.dump({"traceEvents": meta + self.events}, fh)
        return out

    def write(self, path: str, stage: Optional[int] = None, barrier=None) -> None:
        """Every rank writes its file (:meth:`write_rank`), waits at ``barrier`` (a callable,
        e.g. ``dist.barrier``; None on one rank), then rank 0 merges them into ``PATH``
        (:func:`merge`)."""
        self.write_rank(path, stage)
        if barrier is not None:
            barrier()
        if self.rank == 0:
            merge(path)


def merge(path: str) -> str:
    """Merge ``PATH.rank*.json`` into one trace ``PATH`` (and remove the per-rank files)."""
    files = sorted(glob.glob(f"{glob.escape(path)}.rank*.json"))
    merged: list = []
    for f in files:
        with open(f) as fh:
            merged.extend(json.load(fh)["traceEvents"])
    with open(path, "w") as fh:
        json.dump({"traceEvents": merged, "displayTimeUnit": "ms"}, fh)
    for f in files:
        os.unlink(f)
    return path
