"""Checkpoints on torch.distributed.checkpoint (issue 9): resharding through DCP, ``--async-save``
and the crash-during-save drill.

- Resharding: one forked 8-rank world saves at (TP, PP, DP) = (2, 2, 2) after 4 iterations,
  goes on for 4 more (the uninterrupted reference), then resumes the checkpoint at (4, 1, 2),
  (1, 2, 4), (1, 4, 2) and (1, 1, 8) with the distributed optimizer (which saves again); a
  2-rank world resumes it at (2, 1, 1), this process both checkpoints at (1, 1, 1). Every loss equals the reference (fp32, rtol
  1e-5), and replicated entries were written once.
- ``--async-save``: the save call returns while a slowed-down writer is still writing; training
  goes on; the pointer moves only once the write completed; the checkpoint loads identically.
- Crash during save: ``--inject-fault 1:4:kill-in-save`` kills rank 1 after its files of
  iteration 4 are written, before the rename: the run dies, iteration 2 stays the latest and
  intact, and a rerun with ``--load`` (or torchrun's restart, with ``--async-save``) resumes with
  the losses of the straight run.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from loom.config import LoomConfig
from testkit import logged_losses, run_distributed, torchrun_train
from testkit.config import PRE_ISSUE_21, tiny_config
from testkit.numerics import PARITY_RTOL

SAVED_AT, MORE = 4, 4


def make_cfg(tp=1, pp=1, dp=1, zero=False, async_save=False) -> LoomConfig:
    return tiny_config("gpt", num_layers=4, vocab_size=128, make_vocab_size_divisible_by=8,
                       tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                       micro_batch_size=1, global_batch_size=8, train_iters=SAVED_AT + MORE,
                       lr_warmup_iters=2, adam_eps=1e-6, use_distributed_optimizer=zero,
                       adam_beta2=0.95, lr_decay_style="cosine",  # loom's old defaults
                       no_progress_bar=True, async_save=async_save, world=tp * pp * dp)


def _losses(tr, n: int) -> list[float]:
    return [tr.train_step()["loss"] for _ in range(n)]


def _reshard_world(root: str) -> dict:
    """8 ranks: save at (2, 2, 2), the reference, then resume at other 8-rank layouts."""
    import torch.distributed as dist

    from loom.checkpoint.reader import DcpIndex
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    out: dict = {"t": [time.time()]}
    tr = Trainer(make_cfg(2, 2, 2), mesh=ParallelMesh.build(tp=2, pp=2))
    out["first"] = _losses(tr, SAVED_AT)
    t0 = time.perf_counter()
    tr.save(os.path.join(root, "a"))
    out["save_s"] = time.perf_counter() - t0
    out["reference"] = _losses(tr, MORE)
    out["t"].append(time.time())
    for tp, pp, dp, zero in ((4, 1, 2, False), (1, 2, 4, False), (1, 4, 2, False),
                             (1, 1, 8, True)):
        t = Trainer(make_cfg(tp, pp, dp, zero), mesh=ParallelMesh.build(tp=tp, pp=pp))
        assert t.load(os.path.join(root, "a")) and t.iteration == SAVED_AT
        if zero:  # the distributed optimizer saves its DP shards of the Adam states
            t.save(os.path.join(root, "b"))
        out[f"{tp},{pp},{dp}{',zero' if zero else ''}"] = _losses(t, MORE)
        out["t"].append(time.time())
    if dist.get_rank() == 0:
        ckpt = os.path.join(root, "a", f"iter_{SAVED_AT:07d}")
        index = DcpIndex(ckpt)
        out["keys"] = sorted(index.md)
        out["indexed_bytes"] = sum(i.length for i in index.metadata.storage_data.values())
        out["file_bytes"] = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt)
                                if f.endswith(".distcp"))
    return out


def _resume_world(root: str, tp: int, pp: int, dp: int) -> list[float]:
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    t = Trainer(make_cfg(tp, pp, dp), mesh=ParallelMesh.build(tp=tp, pp=pp))
    assert t.load(os.path.join(root, "a")) and t.iteration == SAVED_AT
    return _losses(t, MORE)


def test_resharding_through_dcp(tmp_path):
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    t0 = time.perf_counter()
    # forked from this process (its imports done): 8 spawned ranks would spend ~25 s of CPU
    # importing torch before the first step
    res = run_distributed(8, _reshard_world, str(tmp_path), timeout=600, start_method="fork")[0]
    world_s = time.perf_counter() - t0
    ref = res["reference"]
    res["2,1,1"] = run_distributed(2, _resume_world, str(tmp_path), 2, 1, 1,
                                   start_method="fork")[0]
    for layout in ("4,1,2", "1,2,4", "1,4,2", "1,1,8,zero", "2,1,1"):
        assert res[layout] == pytest.approx(ref, rel=PARITY_RTOL), (layout, res[layout], ref)
    for ckpt in ("a", "b"):
        single = Trainer(make_cfg(), mesh=ParallelMesh.single())
        assert single.load(str(tmp_path / ckpt)) and single.iteration == SAVED_AT
        assert _losses(single, MORE) == pytest.approx(ref, rel=PARITY_RTOL), ckpt
        if ckpt == "a":  # the run's resume line says where the checkpoint came from
            from loom.training.story import resume_line
            assert resume_line(single.resumed).startswith(
                "loaded iter_0000004 (saved at TP2 x PP2 x DP2, resharded to TP1 x PP1 x DP1), "
                "32 samples consumed, optimizer restored; RNG fresh")
    # keys name what is stored, never who stored it: one key per TP shard of each parameter
    # (TP-replicated ones: 0of1), none per DP replica or pipeline copy; every byte written once
    keys, reg = res["keys"], single.model_chunks[0].registry
    want = {f"model.{n}/{r}of2" if meta.shard is not None else f"model.{n}/0of1"
            for n, meta in reg.items() for r in ((0, 1) if meta.shard is not None else (0,))}
    assert {k for k in keys if k.startswith("model.")} == want
    assert sum(k.startswith("rng.") for k in keys) == 8
    assert res["file_bytes"] == res["indexed_bytes"]
    print([round(b - a, 2) for a, b in zip(res["t"], res["t"][1:])])
    print(f"8-rank world {world_s:.1f} s, save at (2,2,2) {res['save_s']:.2f} s")


# -- --async-save -------------------------------------------------------------------------------

def _small_cfg(async_save: bool, world: int = 1) -> LoomConfig:
    return tiny_config("gpt", PRE_ISSUE_21, seq_length=8, vocab_size=64, train_iters=10,
                       micro_batch_size=4, async_save=async_save,
                       save="ck" if async_save else None,  # (the tests pass their directory)
                       world=world)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, no group
def test_async_save_returns_before_the_write_and_loads_identically(tmp_path, monkeypatch):
    import threading

    import loom.checkpoint.io as ckio
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    released = threading.Event()
    real = ckio._storage_writer

    class SlowWriter(ckio._Writer):
        def write_data(self, plan, planner):
            assert released.wait(60)  # the write stalls until the test lets it go
            return super().write_data(plan, planner)
    monkeypatch.setattr(ckio, "_storage_writer", lambda path, after=None: SlowWriter(path, after))
    tr = Trainer(_small_cfg(True), mesh=ParallelMesh.single())
    _losses(tr, 2)
    weights = {n: p.detach().clone() for n, p in tr.model_chunks[0].named_parameters()}
    final = tr.save(str(tmp_path))
    assert tr.saver.pending is not None and not os.path.exists(final)  # returned mid-write
    assert not (tmp_path / "latest_checkpointed_iteration.txt").exists()
    assert not os.path.exists(os.path.join(final + ".tmp", ".metadata"))
    after = _losses(tr, 2)  # training proceeds while the checkpoint is being written
    tr.saver.poll()
    assert tr.saver.pending is not None  # still writing: nothing moved
    released.set()
    said: list[str] = []
    tr.saver.finish(said.append)  # the next save / exit waits, then renames and points
    assert os.path.isdir(final) and not os.path.exists(final + ".tmp")
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert "--async-save: written in" in said[0] and "blocked" in said[0]
    monkeypatch.setattr(ckio, "_storage_writer", real)
    sync_dir = tmp_path / "sync"
    ref = Trainer(_small_cfg(False), mesh=ParallelMesh.single())
    _losses(ref, 2)
    ref.save(str(sync_dir))
    for root in (tmp_path, sync_dir):
        again = Trainer(_small_cfg(False), mesh=ParallelMesh.single())
        assert again.load(str(root)) and again.iteration == 2
        for n, p in again.model_chunks[0].named_parameters():
            assert torch.equal(p, weights[n]), n  # the state of iteration 2, not later
        assert _losses(again, 2) == after


# -- crash during save ----------------------------------------------------------------------------

MODEL = ["--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "1e-3", "--lr-warmup-iters", "2",
         "--log-interval", "1", "--no-progress-bar", "--train-iters", "6",
         "--tensor-model-parallel-size", "2",
         "--adam-beta2", "0.95", "--lr-decay-style", "cosine", "--eval-iters", "10"]  # (old
# loom defaults, pinned)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[int, float]:
    """The losses of the uninterrupted 6-iteration run (TP=2, 2 ranks)."""
    log = tmp_path_factory.mktemp("straight") / "straight.jsonl"
    r = torchrun_train(MODEL + ["--log-json", str(log)])
    assert r.returncode == 0, r.stderr[-2000:]
    return logged_losses(log)


def test_kill_during_save_keeps_the_previous_checkpoint_and_resumes(tmp_path, straight):
    from loom.checkpoint.safety import check_checkpoint_files
    ck = tmp_path / "ck"
    run = MODEL + ["--save", str(ck), "--load", str(ck), "--save-interval", "2"]
    drill = torchrun_train(run + ["--inject-fault", "1:4:kill-in-save",
                            "--log-json", str(tmp_path / "drill.jsonl")])
    assert drill.returncode != 0  # the run died in the save of iteration 4
    assert "kill-in-save fires on rank 1 (its checkpoint files written" in drill.stderr
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not (ck / "iter_0000004").exists()  # at most a partial iter_0000004.tmp
    check_checkpoint_files(str(ck / "iter_0000002"))
    again = torchrun_train(run + ["--log-json", str(tmp_path / "again.jsonl")])
    assert again.returncode == 0, again.stderr[-2000:]
    assert "starting at iteration 2" in again.stdout
    assert not (ck / "iter_0000004.tmp").exists()
    got = logged_losses(tmp_path / "again.jsonl")
    assert sorted(got) == [3, 4, 5, 6]
    for it in got:
        assert got[it] == pytest.approx(straight[it], rel=1e-5), (it, got[it], straight[it])


def test_kill_during_async_save_restarts_under_torchrun(tmp_path, straight):
    """The same drill with --async-save under torchrun --max-restarts 1: rank 1 dies in the
    background write of iteration 4 while training goes on; torchrun restarts the job and it
    resumes from iteration 2 with the straight run's losses."""
    ck = tmp_path / "ck"
    drill = torchrun_train(MODEL + ["--save", str(ck), "--load", str(ck), "--save-interval", "2",
                              "--async-save", "--inject-fault", "1:4:kill-in-save",
                              "--log-json", str(tmp_path / "async.jsonl")], restarts=1)
    assert drill.returncode == 0, drill.stderr[-3000:]
    assert "kill-in-save fires on rank 1" in drill.stderr
    assert re.search(r"\(exitcode: (-9|1)\)", drill.stderr), drill.stderr[-2000:]
    got = logged_losses(tmp_path / "async.jsonl")
    assert sorted(got) == list(range(1, 7))
    for it in got:
        assert got[it] == pytest.approx(straight[it], rel=1e-5), (it, got[it], straight[it])
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "6"


def test_failed_dcp_write_names_the_error_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """A rank's DCP write that fails (here ENOSPC from inside DCP's writer, reported through
    its CheckpointException) is a CheckpointWriteError naming --save and the OS error; the
    partial .tmp is removed and the previous checkpoint and pointer are untouched."""
    import errno

    import loom.checkpoint.io as ckio
    from loom.errors import CheckpointWriteError
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer

    class FullDisk(ckio._Writer):
        def write_data(self, plan, planner):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
    tr = Trainer(_small_cfg(False), mesh=ParallelMesh.single())
    _losses(tr, 1)
    tr.save(str(tmp_path))
    monkeypatch.setattr(ckio, "_storage_writer", lambda path, after=None: FullDisk(path, after))
    _losses(tr, 1)
    with pytest.raises(CheckpointWriteError, match="No space left on device") as e:
        tr.save(str(tmp_path))
    assert str(tmp_path) in str(e.value) and "iter_0000002.tmp" in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "1"


def test_truncated_or_corrupt_dcp_files_are_refused_by_name(tmp_path, capsys):
    from loom.checkpoint.safety import check_checkpoint_files
    from loom.cli import main
    from loom.errors import ConfigError
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    tr = Trainer(_small_cfg(False), mesh=ParallelMesh.single())
    _losses(tr, 1)
    ckpt = Path(tr.save(str(tmp_path)))
    check_checkpoint_files(str(ckpt))
    shard = ckpt / "__0_0.distcp"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=r"__0_0\.distcp is truncated"):
        check_checkpoint_files(str(ckpt))
    shard.unlink()
    with pytest.raises(ConfigError, match=r"__0_0\.distcp is missing"):
        check_checkpoint_files(str(ckpt))
    shard.write_bytes(data)
    (ckpt / ".metadata").write_bytes(b"garbage")
    with pytest.raises(SystemExit) as e:  # the CLI: exit 2, one line naming the file
        main(["train",  # pinned: loom's defaults before Megatron's (issue 21)
              "--lr", "3e-4", "--micro-batch-size", "4", "--adam-beta2", "0.95",
              "--lr-decay-style", "cosine", "--log-interval", "10", "--eval-iters", "10",
              "--mock-data", "--vocab-size", "64", "--num-layers", "2",
              "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "8",
              "--train-iters", "2", "--load", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err  # its size differs from the manifest's
    assert f"checkpoint file {ckpt / '.metadata'} has 7 bytes" in err, err


def test_async_save_from_the_command_line_keep_last_and_exit(tmp_path, monkeypatch, capsys):
    """`loom train --async-save`: each save is finalized in the background (logged with how
    long the step loop was blocked), --keep-last prunes after each, and exit waits for the
    last write (--exit-interval): nothing half-written is left."""
    import torch.distributed as dist

    from loom.cli import main
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    ck = tmp_path / "ck"
    args = ["train",  # pinned: loom's defaults before Megatron's (issue 21)
            "--lr", "3e-4", "--adam-beta2", "0.95", "--lr-decay-style", "cosine",
            "--log-interval", "10", "--eval-iters", "10", "--mock-data", "--vocab-size", "64",
            "--num-layers", "2", "--hidden-size",
            "32", "--num-attention-heads", "4", "--seq-length", "8", "--micro-batch-size", "2",
            "--train-iters", "20", "--no-progress-bar", "--save", str(ck), "--save-interval", "2",
            "--keep-last", "2", "--exit-interval", "7", "--async-save"]
    try:
        with pytest.raises(SystemExit) as e:
            main(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    out = capsys.readouterr().out
    assert e.value.code == 0, out
    assert "saving checkpoint" in out and "--async-save: written in" in out, out
    assert "the step loop blocked" in out
    assert sorted(os.listdir(ck)) == ["iter_0000006", "iter_0000007",
                                      "latest_checkpointed_iteration.txt"]
    assert (ck / "latest_checkpointed_iteration.txt").read_text() == "7"


def _rank0_fails_world(root: str) -> str:
    """Rank 0's common.pt hits a full disk; every rank must hear of it (not wait forever)."""
    import torch.distributed as dist

    import loom.checkpoint.io as ckio
    from loom.errors import CheckpointWriteError
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    tr = Trainer(_small_cfg(False, world=2), mesh=ParallelMesh.build())
    _losses(tr, 1)
    if dist.get_rank() == 0:
        ckio._open_for_write = lambda path: open("/dev/full", "wb")
    try:
        tr.save(root)
    except CheckpointWriteError as e:
        return str(e)
    return "saved"


def test_a_failure_on_rank_0_reaches_every_rank(tmp_path):
    msgs = run_distributed(2, _rank0_fails_world, str(tmp_path), timeout=120,
                           start_method="fork")
    assert "No space left on device" in msgs[0], msgs
    assert "another rank failed to write the checkpoint" in msgs[1], msgs
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
