"""Training that survives failures (issue 9, in part): the kill drill (a SIGKILLed rank under
``torchrun --max-restarts 1`` resumes from the last checkpoint and every iteration's loss equals
the uninterrupted run), the hang drill (the watchdog names the rank and iteration and the job
fails within 60 s), ``--exit-interval``, ``--keep-last``, and the learning-rate schedule of a
resumed run (refused when changed, unless overridden either way).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loom.cli import main

REPO = Path(__file__).resolve().parent.parent
MODEL = ["--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "1e-3", "--lr-warmup-iters", "2",
         "--log-interval", "1", "--no-progress-bar"]


def torchrun(args: list[str], timeout: float = 180, restarts: int = 0):
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    exe = Path(sys.executable).with_name("torchrun")
    return subprocess.run([str(exe), "--standalone", "--nproc-per-node", "2", "--max-restarts",
                           str(restarts), "--monitor-interval", "0.5", "-m", "loom", "train",
                           *args], env=env, capture_output=True, text=True, timeout=timeout)


def losses(log: Path) -> dict[int, float]:
    """The last logged loss of every iteration (a re-run iteration overwrites the first)."""
    out = {}
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "train":
            out[rec["iteration"]] = rec["loss"]
    return out


def test_kill_drill_resumes_and_matches_the_straight_run(tmp_path):
    common = MODEL + ["--train-iters", "10", "--tensor-model-parallel-size", "2"]
    straight = torchrun(common + ["--log-json", str(tmp_path / "straight.jsonl")])
    assert straight.returncode == 0, straight.stderr[-2000:]
    ck = tmp_path / "ck"
    drill = torchrun(common + ["--save", str(ck), "--load", str(ck), "--save-interval", "2",
                               "--inject-fault", "1:6:kill",
                               "--log-json", str(tmp_path / "drill.jsonl")], restarts=1)
    assert drill.returncode == 0, drill.stderr[-3000:]
    assert "exitcode: -9" in drill.stderr  # round 0 really lost rank 1
    want, got = losses(tmp_path / "straight.jsonl"), losses(tmp_path / "drill.jsonl")
    assert sorted(got) == list(range(1, 11))
    for it in range(1, 11):
        assert got[it] == pytest.approx(want[it], rel=1e-5), (it, got[it], want[it])


def test_hang_drill_names_rank_and_iteration(tmp_path):
    t0 = time.monotonic()
    r = torchrun(MODEL + ["--train-iters", "8", "--inject-fault", "1:4:hang",
                          "--hang-timeout-s", "20"], timeout=120)
    elapsed = time.monotonic() - t0
    assert r.returncode != 0
    assert elapsed < 60, elapsed
    assert "hang detected: rank 1 made no progress" in r.stderr, r.stderr[-2000:]
    assert "in iteration 4" in r.stderr


def run(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(["train", *argv])
    out = capsys.readouterr()
    return e.value.code, out.out + out.err


def test_exit_interval_and_keep_last(tmp_path, capsys):
    ck = tmp_path / "ck"
    code, out = run(MODEL + ["--train-iters", "20", "--save", str(ck), "--save-interval", "2",
                             "--keep-last", "2", "--exit-interval", "7"], capsys)
    assert code == 0, out
    assert "exiting after iteration 7" in out
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("iter_")) == \
        ["iter_0000006", "iter_0000007"]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "7"


def test_changed_schedule_refused_unless_overridden(tmp_path, capsys):
    ck = tmp_path / "ck"
    code, out = run(MODEL + ["--train-iters", "4", "--save", str(ck)], capsys)
    assert code == 0, out
    code, out = run(MODEL + ["--train-iters", "8", "--load", str(ck), "--save", str(ck)], capsys)
    assert code == 2 and "--lr-decay-iters 4 in the checkpoint, 8 here" in out, out
    assert "--override-opt-param-scheduler" in out
    code, out = run(MODEL + ["--train-iters", "6", "--load", str(ck), "--save", str(ck),
                             "--override-opt-param-scheduler"], capsys)
    assert code == 0 and "iteration      6" in out, out
    # the checkpoint's schedule (lr 1e-3, cosine to 0 at iteration 4) wins over --lr 5e-4
    code, out = run(MODEL + ["--train-iters", "8", "--lr", "5e-4", "--load", str(ck),
                             "--ckpt-step", "4", "--use-checkpoint-opt-param-scheduler"], capsys)
    line = next(ln for ln in out.splitlines() if "iteration      5 |" in ln)
    assert code == 0 and "lr 0.000e+00" in line, out


def test_resumed_lr_follows_the_new_schedule_from_the_first_step(tmp_path):
    """Override: the first resumed step already uses the new schedule (was: the checkpoint's
    learning rate for one step)."""
    from loom.config import LoomConfig, ModelConfig
    from loom.parallel.mesh import ParallelMesh
    from loom.training.optimizer import lr_at
    from loom.training.trainer import Trainer

    def cfg(iters: int) -> LoomConfig:
        c = LoomConfig(model=ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                                         seq_length=8, vocab_size=64))
        c.data.mock_data = True
        c.training.train_iters, c.training.lr = iters, 1e-3
        c.checkpoint.override_opt_param_scheduler = True
        return c.validate(1)
    tr = Trainer(cfg(4), mesh=ParallelMesh.single())
    for _ in range(2):
        tr.train_step()
    tr.save(str(tmp_path))
    again = Trainer(cfg(40), mesh=ParallelMesh.single())
    again.load(str(tmp_path))
    rec = again.train_step()
    assert rec["lr"] == pytest.approx(lr_at(2, again.cfg.training))
    assert rec["lr"] != pytest.approx(lr_at(2, tr.cfg.training))
