"""``--inject-fault RANK:ITERATION:KIND`` parsed (the drills themselves: loom/training/fault.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from loom.errors import ConfigError

FAULT_KINDS = ("kill", "hang", "exception", "kill-in-save", "stop")


@dataclass(frozen=True)
class FaultSpec:
    """Rank ``rank`` fails with ``kind`` when it starts iteration ``iteration`` (1-based);
    ``kill-in-save``: while writing the checkpoint of ``iteration``."""

    rank: int
    iteration: int
    kind: str


def parse_fault(text: Optional[str]) -> Optional[FaultSpec]:
    """``"1:6:kill"`` -> FaultSpec; None for None. Raises ConfigError naming the flag."""
    if text is None:
        return None
    parts = text.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or \
            parts[2] not in FAULT_KINDS or int(parts[1]) < 1:
        raise ConfigError(f"--inject-fault {text!r}: expected RANK:ITERATION:KIND with KIND one "
                          f"of {', '.join(FAULT_KINDS)} and ITERATION >= 1, e.g. 1:6:kill")
    return FaultSpec(int(parts[0]), int(parts[1]), parts[2])
