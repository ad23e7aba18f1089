"""Multi-node launch (issue 23, item 6): two torchrun agents on this host, one process each,
meeting at a c10d rendezvous (``--nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT``,
the README's multi-node command) train as one job: the same losses as one agent running two
processes (here: two forked gloo ranks of one launcher, the same job in-process)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from testkit import logged_losses, run_distributed

REPO = Path(__file__).resolve().parents[2]
TRAIN = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
         "--train-iters", "3", "--lr", "1e-3", "--mock-data", "--vocab-size", "96",
         "--log-interval", "1", "--eval-iters", "0", "--no-progress-bar", "--device", "cpu",
         "--distributed-backend", "gloo"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(argv: list[str]) -> list[float]:
    import argparse

    from loom.training.cli import add_arguments, prepare
    from loom.training.trainer import Trainer
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return [r["loss"] for r in Trainer(prepare(parser.parse_args(argv))).train()]


def test_two_agents_train_as_one_job(tmp_path):
    one = dict(enumerate(run_distributed(2, _train, TRAIN, start_method="fork")[0], start=1))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    port, multi = _free_port(), tmp_path / "multi.jsonl"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    agents = [subprocess.Popen(
        [torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
         "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "t23",
         "-m", "loom", "train", *TRAIN, "--log-json", str(multi)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)]
    outs = [a.communicate(timeout=240) for a in agents]
    for a, (out, err) in zip(agents, outs):
        assert a.returncode == 0, err[-3000:]
    two = logged_losses(multi)
    assert sorted(one) == sorted(two) == [1, 2, 3]
    for it in one:
        assert abs(one[it] - two[it]) <= 1e-5 * abs(one[it]), (it, one[it], two[it])
    text = "".join(out for out, _ in outs)
    assert "'dp': 2" in text or "dp=2" in text or "2 DP" in text, text[-2000:]
