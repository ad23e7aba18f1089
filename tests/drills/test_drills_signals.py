"""Every rank ends when one stops (issue 27, item 5): the collective timeout reaches every
process group loom makes; the watchdog names the stopped rank (heartbeats through the store),
at 2 and 4 ranks; SIGTERM saves with ``--exit-signal-handler`` and is one line without it;
the ranks exit when the torchrun agent is killed."""

from __future__ import annotations

import datetime
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loom.training.fault import Heartbeats, HangWatchdog, Progress, find_laggards
from testkit import run_distributed, torchrun_train

REPO = Path(__file__).resolve().parents[2]
MODEL = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16",
         "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "1",
         "--lr", "1e-3", "--lr-decay-style", "constant", "--log-interval", "1",
         "--eval-iters", "1", "--no-progress-bar"]


def _dp_group_times_out():
    """Rank 1 stays away; rank 0's all-reduce on the mesh's DP group (made by ``new_group``)
    must fail after the mesh's timeout, not torch's 30 minutes."""
    from loom.parallel.mesh import ParallelMesh
    mesh = ParallelMesh.build(timeout=datetime.timedelta(seconds=2))
    if dist.get_rank() == 1:
        time.sleep(5)
        return None
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):
        dist.all_reduce(torch.ones(1), group=mesh.groups["dp"])
    return time.monotonic() - t0


def test_the_collective_timeout_reaches_the_mesh_groups():
    waited = run_distributed(2, _dp_group_times_out, timeout=60, start_method="fork")[0]
    assert waited < 4.5, waited


@pytest.mark.parametrize("world,stopped", [(2, 1), (4, 2)])
def test_the_report_names_the_stopped_rank_not_the_waiters(world, stopped):
    store = dist.HashStore()
    now = time.time()
    for r in range(world):  # the stopped rank's last heartbeat is 30 s old
        beat = {"iteration": 4, "phase": "forward-backward", "mark": now - 30,
                "sent": now - (30 if r == stopped else 0.2), "host": "elsewhere", "pid": 1}
        store.set(f"rank{r}", json.dumps(beat))
    assert find_laggards({r: json.loads(store.get(f"rank{r}")) for r in range(world)}, world,
                         now, 2.0) == [stopped]
    for waiter in (r for r in range(world) if r != stopped):
        out = io.StringIO()
        dog = HangWatchdog(Progress(), 4.0, waiter, stream=out,
                           heartbeats=Heartbeats(waiter, world, store))
        lag, _ = dog.report(31.0)
        assert lag == [stopped]
        named = re.findall(r"rank (\d+) \(last heartbeat", out.getvalue())
        assert named == [str(stopped)], out.getvalue()
        assert "Python stacks" not in out.getvalue()  # a waiter: one line, no stack dump


def test_sigstop_drill_names_the_stopped_rank_and_ends_the_job(tmp_path):
    t0 = time.monotonic()
    r = torchrun_train(MODEL + ["--train-iters", "40", "--inject-fault", "1:3:stop",
                                "--hang-timeout-s", "2"], timeout=120)
    elapsed = time.monotonic() - t0
    assert r.returncode != 0
    reports = re.findall(r"hang detected: rank (\d+) \(last heartbeat", r.stderr)
    assert reports == ["1"], r.stderr[-3000:]
    assert "ending rank 1" in r.stderr  # SIGKILLed at once, not after torchrun's 30 s
    assert elapsed < 60, elapsed
    print(f"SIGSTOP drill (2 ranks, --hang-timeout-s 2): job ended in {elapsed:.1f} s")


def _loom(args, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.Popen([sys.executable, "-m", "loom", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def _wait_for_training(proc: subprocess.Popen) -> str:
    """Read the log until iteration 2 (training runs); kills ``proc`` if it never comes."""
    seen = ""
    for line in proc.stdout:
        seen += line
        if re.search(r"iteration\s+2 \|", line):
            return seen
        if len(seen) > 200_000:
            break
    proc.kill()
    raise AssertionError(seen[-2000:])


def test_sigterm_saves_with_the_exit_signal_handler_and_is_one_line(tmp_path):
    """Both at once (one with ``--exit-signal-handler``, one without), to halve the wait."""
    procs = {g: _loom(["train", *MODEL, "--train-iters", "3000", "--save", str(tmp_path / str(g)),
                       *(["--exit-signal-handler"] if g else [])]) for g in (True, False)}
    for p in procs.values():
        _wait_for_training(p)
    t0 = time.monotonic()
    for p in procs.values():
        p.send_signal(signal.SIGTERM)
    (out, err), (out2, err2) = (p.communicate(timeout=60) for p in procs.values())
    elapsed = time.monotonic() - t0
    assert "Traceback" not in err + err2, err + err2
    m = re.search(r"SIGTERM received \(--exit-signal-handler\): exiting after iteration "
                  r"(\d+)", out)
    assert procs[True].returncode == 0 and m, (out[-2000:], err)
    assert (tmp_path / "True" / "latest_checkpointed_iteration.txt").read_text().strip() == \
        m.group(1)
    assert procs[False].returncode == 128 + signal.SIGTERM, err2
    assert err2.strip().splitlines()[-1] == \
        "loom: rank 0 received SIGTERM: exiting without a checkpoint " \
        "(--exit-signal-handler saves one first)"
    assert not (tmp_path / "False" / "latest_checkpointed_iteration.txt").exists()
    print(f"SIGTERM: both exited within {elapsed:.1f} s")


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def test_ranks_exit_when_the_torchrun_agent_is_killed(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    exe = Path(sys.executable).with_name("torchrun")
    agent = subprocess.Popen([str(exe), "--standalone", "--nproc-per-node", "2", "-m", "loom",
                              "train", *MODEL, "--train-iters", "3000", "--save",
                              str(tmp_path / "ck")], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    _wait_for_training(agent)
    ranks = _children(agent.pid)
    assert len(ranks) == 2, ranks
    t0 = time.monotonic()
    agent.kill()
    agent.wait()
    while any(os.path.exists(f"/proc/{r}") and _state(r) != "Z" for r in ranks):
        assert time.monotonic() - t0 < 30, "orphaned ranks still running"
        time.sleep(0.2)
    print(f"agent killed: both ranks gone in {time.monotonic() - t0:.1f} s")


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
