"""``--check-weight-hash-across-dp-replicas-interval`` (Megatron's flag;
loom/training/weight_hash.py): on 2 gloo ranks (DP 2, the distributed optimizer with overlapped
parameter all-gathers) the replicas match before training and after steps; one element changed
on one rank is named, with that rank, on every rank, and the run stops. Through ``loom train``
(one process): the check runs before the first iteration and every N-th, and is said; ZeRO-3
refuses it."""

from __future__ import annotations

import pytest
import torch

from loom.parallel.mesh import ParallelMesh
from testkit import run_distributed
from testkit.config import tiny_config


def world() -> dict:
    from loom.training.trainer import Trainer
    from loom.errors import WeightHashMismatch
    cfg = tiny_config("llama", mock_data=True, zero_stage=1, overlap_param_gather=True,
                      overlap_grad_reduce=True, global_batch_size=4, world=2,
                      check_weight_hash_across_dp_replicas_interval=2)
    tr = Trainer(cfg, mesh=ParallelMesh.build())
    said: list[str] = []
    faults = tr.parts.faults
    faults.check_weights(0, said.append, first=True)
    for _ in range(3):
        tr.train_step()
        faults.check_weights(tr.iteration, said.append)  # due at 2 only
    name, p = next((n, q) for n, q in tr.model_chunks[0].named_parameters() if q.dim() == 2)
    from loom.training.step import finish_param_gather
    finish_param_gather(tr.optimizer)  # else the step's in-flight all-gather may land after the
    if tr.mesh.dp_rank == 1:            # change below and undo it (a race under a loaded CPU)
        with torch.no_grad():
            p.view(-1)[3] += 1e-3
    try:
        faults.check_weights(4, said.append)
        error = None
    except WeightHashMismatch as e:
        error = str(e)
    return {"said": said, "error": error, "name": name, "rank": tr.mesh.rank}


@pytest.fixture(scope="module")
def results():
    return run_distributed(2, world, timeout=300)


def test_replicas_match_before_and_after_steps(results):
    for r in results:
        assert [s.split()[-1] for s in r["said"]] == ["0", "2"], r["said"]
        assert all("weight hashes match" in s for s in r["said"])


def test_a_changed_element_is_named_with_its_rank_on_every_rank(results):
    for r in results:
        assert r["error"] is not None, r
        assert r["name"] in r["error"] and "global ranks 1 differ from rank 0" in r["error"]
        assert "at iteration 4" in r["error"]


def test_loom_train_checks_before_and_every_interval(monkeypatch, capsys):
    from loom.cli import main
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["train", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
              "4", "--seq-length", "16", "--micro-batch-size", "1", "--lr", "1e-3",
              "--mock-data", "--vocab-size", "96", "--train-iters", "4",
              "--check-weight-hash-across-dp-replicas-interval", "2"])
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    said = [ln for ln in out.splitlines() if "weight hashes match" in ln]
    assert [ln.split()[-1] for ln in said] == ["0", "2", "4"], out


def test_zero3_is_refused():
    from loom.errors import ConfigError
    with pytest.raises(ConfigError, match="no replicas to compare"):
        tiny_config("llama", zero_stage=3, world=2,
                    check_weight_hash_across_dp_replicas_interval=1)


def test_digest_sees_one_bit():
    from loom.training.weight_hash import digest
    x = torch.randn(64)
    y = x.clone()
    y.view(torch.int32)[5] ^= 1  # the lowest mantissa bit
    assert torch.equal(digest(x), digest(x.clone())) and not torch.equal(digest(x), digest(y))


def test_a_mismatch_in_loom_train_is_one_line_and_status_1(monkeypatch, capsys):
    from loom.cli import main
    from loom.training import weight_hash
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(weight_hash, "mismatches",
                        lambda chunks, mesh: ["layers.0.mlp.linear_fc1.weight (global ranks 1 "
                                              "differ from rank 0)"])
    with pytest.raises(SystemExit) as e:
        main(["train", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
              "4", "--seq-length", "16", "--micro-batch-size", "1", "--lr", "1e-3",
              "--mock-data", "--vocab-size", "96", "--train-iters", "2",
              "--check-weight-hash-across-dp-replicas-interval", "1"])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 1 and len(err) == 1, err
    assert "weights differ across data-parallel replicas at iteration 0" in err[0]
    assert "layers.0.mlp.linear_fc1.weight" in err[0]
