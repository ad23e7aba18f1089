"""Per-rank Chrome-trace timeline (``--timeline PATH``): forward, backward, send, recv, idle and
optimizer spans; opens in Perfetto (https://ui.perfetto.dev) or ``chrome://tracing``.

Every rank records its own spans in memory (a no-op unless :func:`enable` was called), writes
``PATH.rank{N}.json`` at the end of training, and rank 0 merges all of them into ``PATH``
(one process row per rank, ``pid`` = global rank). Timestamps are wall-clock microseconds
(``time.time_ns``), so ranks on one machine line up.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import time
from typing import Optional

_events: Optional[list] = None
_rank = 0


def enable(rank: int) -> None:
    """Start recording spans for global rank ``rank`` (clears earlier events)."""
    global _events, _rank
    _events, _rank = [], rank


def disable() -> None:
    global _events
    _events = None


def enabled() -> bool:
    return _events is not None


def now_us() -> float:
    return time.time_ns() / 1000.0


def add(name: str, cat: str, start_us: float, end_us: float, **args) -> None:
    """Record a complete span (Chrome trace ``ph: X``)."""
    if _events is None:
        return
    ev = {"name": name, "cat": cat, "ph": "X", "ts": start_us, "dur": max(end_us - start_us, 0.0),
          "pid": _rank, "tid": 0}
    if args:
        ev["args"] = args
    _events.append(ev)


@contextlib.contextmanager
def span(name: str, cat: Optional[str] = None, **args):
    """``with span("optimizer"): ...`` records the block (no-op when disabled)."""
    if _events is None:
        yield
        return
    t0 = now_us()
    try:
        yield
    finally:
        add(name, cat or name, t0, now_us(), **args)


def events() -> list:
    return list(_events or [])


def write_rank(path: str, stage: Optional[int] = None) -> str:
    """Write this rank's events to ``PATH.rank{N}.json``; returns the file name."""
    out = f"{path}.rank{_rank}.json"
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    label = f"rank {_rank}" + (f" (pp stage {stage})" if stage is not None else "")
    meta = [{"name": "process_name", "ph": "M", "pid": _rank, "args": {"name": label}},
            {"name": "process_sort_index", "ph": "M", "pid": _rank, "args": {"sort_index": _rank}}]
    with open(out, "w") as fh:
        json.dump({"traceEvents": meta + (_events or [])}, fh)
    return out


def merge(path: str, world_size: Optional[int] = None) -> str:
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
