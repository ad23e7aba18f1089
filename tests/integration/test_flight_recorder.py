"""NCCL's flight recorder for hang reports: switched on before an NCCL process group starts
(unless the user configured it) and dumped by the hang watchdog where it exists; on CPU / gloo
there is none and the watchdog says nothing about it."""

from __future__ import annotations

import time

from loom.parallel.mesh import FLIGHT_RECORDER_ENTRIES, flight_recorder_env
from loom.training.fault import HangWatchdog, Progress, dump_flight_recorder


def test_flight_recorder_switched_on_unless_configured():
    env = {}
    added = flight_recorder_env(env)
    assert env == added == {"TORCH_NCCL_TRACE_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES),
                            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    mine = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}
    assert flight_recorder_env(mine) == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert mine["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50"  # the user's setting wins


def test_no_flight_recorder_on_cpu(tmp_path):
    assert dump_flight_recorder(0, str(tmp_path)) is None
    assert not list(tmp_path.iterdir())


def test_watchdog_report_without_recorder(monkeypatch, tmp_path):
    """The watchdog's report on CPU: rank, iteration, phase, stacks; no recorder line."""
    import loom.training.fault as fault
    exits = []
    monkeypatch.setattr(fault.os, "_exit", lambda code: exits.append(code))
    monkeypatch.setattr(fault, "HANG_GRACE_S", 0.0)
    progress = Progress()
    progress.mark(7, "forward")
    progress.stamp -= 10
    out = open(tmp_path / "report.txt", "w+")  # faulthandler needs a real file
    dog = HangWatchdog(progress, 0.2, rank=3, stream=out)
    dog.start()
    deadline = time.monotonic() + 5
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    dog.stop()
    # stop() waits for the poll in flight: no exit may come after the real os._exit is back
    # (CI's stop 49 died with status 3 from such a late exit, 80 s into the suite)
    assert not dog.is_alive()
    assert exits == [fault.HANG_EXIT_CODE]  # it fired once, then stopped polling
    out.seek(0)
    text = out.read()
    assert exits and exits[0] == fault.HANG_EXIT_CODE
    assert "rank 3" in text and "iteration 7" in text and "forward" in text
    assert "flight recorder" not in text
