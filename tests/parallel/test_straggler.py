"""``--log-straggler`` (loom.training.straggler, Megatron's straggler detector): the detector
names the slow rank, lists the N lowest / highest with ``--straggler-minmax-count``, and its
HTTP controller toggles it (``--disable-straggler-on-startup``, ``--straggler-ctrlr-port``)."""

from __future__ import annotations

import json
import socket
import time
import urllib.request

import pytest
import torch

from testkit import run_distributed
from testkit.config import tiny_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def test_the_controller_toggles_the_detector():
    """Off at startup: no report; one HTTP request to the port turns it on at the next report,
    which then reports the timed forward (ms) and its estimated TFLOP/s (flops / 3 / time)."""
    from loom.training.straggler import StragglerDetector
    port = _free_port()
    det = StragglerDetector(0, 1, torch.device("cpu"), enabled=False, port=port)
    said: list[str] = []
    try:
        assert det.report(1, said.append) is None and not said
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as r:
            assert r.status == 200 and b"ON" in r.read()
        assert det.report(1, said.append) is None and said == ["straggler detector toggled ON"]
        det.flops_per_iter = 3e12
        step = det.wrap(lambda: time.sleep(0.05))
        step()
        table = det.report(1, said.append)
        assert 45 < table["forward_ms"][0] < 500
        assert table["tflops"][0] == pytest.approx(1e3 / table["forward_ms"][0], rel=1e-6)
        assert said[-1].startswith("straggler | MnRtt/Rnk: ") and "TF/0" in said[-1]
    finally:
        det.close()
    busy = StragglerDetector(0, 1, torch.device("cpu"), port=port)  # a port in use: named
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        taken = StragglerDetector(0, 1, torch.device("cpu"), port=s.getsockname()[1])
    busy.close()
    assert taken.server is None and "cannot listen" in taken.notes[0]


def test_minmax_lines_list_the_ranks_by_throughput():
    from loom.training.straggler import StragglerDetector
    det = StragglerDetector(0, 4, torch.device("cpu"), count=2)
    lines = det.lines({"forward_ms": [10.0, 40.0, 20.0, 30.0], "batch_ms": [1.0, 1.0, 2.0, 1.5],
                       "tflops": [4.0, 1.0, 2.0, 3.0]})
    assert "MxRtt/Rnk: 40.0ms/1" in lines[0] and "MnEtpt/Rnk: 1.00TF/1" in lines[0]
    assert "MxDRtt/Rnk: 2.0ms/2" in lines[0]
    assert lines[1].endswith("1.00TF/1, 2.00TF/2") and lines[2].endswith("4.00TF/0, 3.00TF/3")


def _slow_rank(log_path):
    from loom.training.trainer import Trainer
    cfg = tiny_config("gpt", global_batch_size=4, train_iters=4, log_interval=2, eval_iters=0,
                      no_progress_bar=True, log_straggler=True, straggler_ctrlr_port=0,
                      log_json=log_path).validate(2)
    tr = Trainer(cfg)
    if torch.distributed.get_rank() == 1:  # inside the timed forward: rank 1 is the straggler
        tr.model_chunks[0].register_forward_pre_hook(lambda *a: time.sleep(0.03))
    tr.train()
    return tr.parts.debug.straggler.on


def test_the_slow_rank_is_named(tmp_path):
    """DP = 2 (one micro-batch per rank), rank 1's forward 30 ms slower: every report names rank 1 as
    the slowest and lowest-throughput rank, and rank 0 as the fastest."""
    log = tmp_path / "log.jsonl"
    assert run_distributed(2, _slow_rank, str(log), start_method="fork") == [True, True]
    reports = [r for r in map(json.loads, log.read_text().splitlines())
               if r.get("kind") == "straggler"]
    assert [r["iteration"] for r in reports] == [2, 4]
    for r in reports:
        assert r["forward_ms"][1] > r["forward_ms"][0] + 20  # one micro-batch x 30 ms
        assert r["tflops"][1] < r["tflops"][0]
