"""Nothing lost, round 4 (issue 44), the unclear and stuck cases: a restart after a kill in the
first save starts fresh; readers hold what they read while a run prunes; every command tears
down its process group; each failure is one line naming its cause (a full disk names the path
and the free bytes; over-long paths, a garbage ``config.json``, an edited ``.bin``). The dead
rank named by the survivor: ``test_fault_tolerance.py``'s kill drill."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import GPT
from loom.checkpoint.safety import LATEST, prune_checkpoints
from test_never_overwrite import TRAIN, cli, hashes, one_rank, refused  # noqa: F401
from testkit import run_distributed


def one_line(code, err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert code in (1, 2) and len(lines) == 1 and "Traceback" not in err, (code, err[-3000:])
    return lines[0]


def test_a_restart_after_a_kill_in_the_first_save_starts_fresh(tmp_path, one_rank, capsys,
                                                               monkeypatch):
    """The job dies in its first save (its files written, not yet renamed): only
    ``iter_N.tmp`` is left, and the same command was refused forever ("holds no checkpoint
    ... but other files")."""
    import loom.checkpoint.io as ckio

    def die(path):
        raise SystemExit("killed")
    monkeypatch.setattr(ckio, "write_manifest", die)
    ck = tmp_path / "ck"
    argv = TRAIN + ["--train-iters", "2", "--load", str(ck), "--save", str(ck)]
    assert cli(argv, capsys)[0] == "killed"
    assert sorted(os.listdir(ck)) == ["iter_0000002.tmp"]
    monkeypatch.undo()
    code, out, err = cli(argv, capsys)
    assert code == 0, err
    assert f"removed the partial checkpoint {ck / 'iter_0000002.tmp'}" in out, out
    assert "starting from iteration 0" in out, out
    assert (ck / LATEST).read_text() == "2"


def _another_job_prunes(root: Path) -> None:
    """What a run saving into ``root`` with ``--keep-last 1`` does: a new iteration 6, the
    pointer moved to it, the older ones pruned."""
    shutil.copytree(root / "iter_0000004", root / "iter_0000006")
    (root / LATEST).write_text("6")
    prune_checkpoints(str(root), 1)


@pytest.mark.parametrize("command", ["evaluate", "generate"])
def test_readers_hold_what_they_read_while_a_run_prunes(data_run, run_copy, one_rank, capsys,
                                                        monkeypatch, command):
    """``evaluate`` / ``generate`` failed with a FileNotFoundError traceback when a run's
    ``--keep-last`` pruned the checkpoint they were reading."""
    import loom.checkpoint.io as ckio
    import loom.evaluation.runner as runner
    module, name = (runner, "load_model") if command == "evaluate" else \
        (ckio, "load_model_weights")
    real = getattr(module, name)

    def pruned_meanwhile(*a, **k):
        _another_job_prunes(run_copy)
        return real(*a, **k)
    monkeypatch.setattr(module, name, pruned_meanwhile)
    argv = ["evaluate", "--task", "perplexity", "--eval-data", str(data_run["text"])] \
        if command == "evaluate" else ["generate", "--prompt", "alpha", "--max-new-tokens", "2"]
    code, out, err = cli(argv[:1] + ["--load", str(run_copy)] + argv[1:], capsys)
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert out.strip(), out
    # iteration 4 was kept while read (2 was pruned), and nothing of the reader is left behind
    assert sorted(os.listdir(run_copy)) == ["iter_0000004", "iter_0000006", LATEST]
    prune_checkpoints(str(run_copy), 1)
    assert sorted(os.listdir(run_copy)) == ["iter_0000006", LATEST]


def _commands_then_group_state(ck: str, text: str) -> dict:
    """Each command under a process group it starts itself (env://, as torchrun's, on an agent
    store as torchrun's: rank 0 serves a ``TCPStore`` on a port the OS gave it and the commands
    join it as clients, so no port is picked free and bound later, which another test's sockets
    could take meanwhile; each command a new ``TORCHELASTIC_RESTART_COUNT``, its own keys);
    after it, whether a group is still initialized."""
    import time

    import torch.distributed as dist
    from torch.distributed import TCPStore

    from loom.cli import main
    rank = dist.get_rank()
    store = TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False) if rank == 0 else None
    port = [store.port if store is not None else None]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()  # the harness's group: the commands start their own
    store = store or TCPStore("127.0.0.1", port[0], 2, False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port[0]),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    out = {}
    for attempt, argv in enumerate((
            ["evaluate", "--load", ck, "--task", "perplexity", "--eval-data", text,
             "--tensor-model-parallel-size", "2"],
            ["generate", "--load", ck, "--prompt", "alpha", "--max-new-tokens", "2",
             "--tensor-model-parallel-size", "2"])):
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                main(argv)
                code = None
            except SystemExit as e:
                code = e.code
        out[argv[0]] = (code, dist.is_initialized())
        if dist.is_initialized():
            dist.destroy_process_group()
    store.add("done", 1)  # rank 0's store serves until both ranks are through
    deadline = time.monotonic() + 60
    while rank == 0 and store.add("done", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return out


def test_commands_tear_down_their_process_group(data_run):
    """TP=2 ``evaluate`` (1 run in 10) and ``generate`` (1 in 3) printed their result, then
    died with ``terminate called without an active exception``, exit 1: the process group was
    left to the interpreter's exit."""
    for rank in run_distributed(2, _commands_then_group_state, str(data_run["ckpt"]),
                                str(data_run["text"]), timeout=240, start_method="fork"):
        assert rank == {"evaluate": (0, False), "generate": (0, False)}, rank


def test_a_full_disk_names_the_path_and_the_free_bytes(tmp_path, one_rank, capsys,
                                                       monkeypatch):
    """DCP's write failing on a full disk showed "CheckpointException ranks:dict_keys([0])"."""
    from torch.distributed.checkpoint import filesystem
    real = filesystem.FileSystem.create_stream

    class FullDisk(io.FileIO):
        """A file on a disk with 64 KiB left, as the kernel answers: a short write when the
        space runs out, then ENOSPC (inside ``torch.save`` of a tensor, which turns it into a
        RuntimeError of its own)."""
        room = [64 << 10]

        def write(self, data) -> int:
            if not self.room[0]:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            n = min(len(data), self.room[0])
            self.room[0] -= n
            return super().write(bytes(data)[:n])

    @contextlib.contextmanager
    def full_disk(self, path, mode):
        if str(path).endswith(".distcp") and "w" in mode:
            with FullDisk(str(path), "wb") as stream:
                yield stream
        else:
            with real(self, path, mode) as stream:
                yield stream
    monkeypatch.setattr(filesystem.FileSystem, "create_stream", full_disk)
    import loom.checkpoint.save_errors as save_errors
    monkeypatch.setattr(save_errors, "free_bytes", lambda path: 4096)  # left when it failed
    ck = tmp_path / "ck"
    wide = [a if a != "16" else "64" for a in TRAIN]  # tensors larger than a write buffer
    code, out, err = cli(wide + ["--train-iters", "1", "--save", str(ck)], capsys)
    line = one_line(code, err)
    assert "CheckpointException" not in line, line
    assert f"{ck / 'iter_0000001.tmp'}" in line and "4.0 KiB free on" in line, line
    assert "disk is full" in line, line


def test_bad_paths_and_files_are_one_line(data_run, tmp_path, one_rank, capsys):
    long = str(tmp_path / ("x" * 300))
    text = tmp_path / "t.txt"
    text.write_text("hello world\n" * 20)
    for argv in (TRAIN + ["--train-iters", "1", "--save", long],
                 TRAIN + ["--train-iters", "1", "--log-json", long],
                 TRAIN + ["--train-iters", "1", "--tensorboard-dir", long],
                 ["preprocess", "--input", str(text), "--output-prefix", long,
                  "--tokenizer-type", "ByteLevelBPETrained", "--vocab-size", "280"]):
        code, out, err = cli(argv, capsys)
        assert "File name too long" in one_line(code, err), err
    hf = tmp_path / "hf"
    hf.mkdir()
    for config, weights, words in (("{garbage", None, "config.json"),
                                   ('{"model_type": "gpt2"}', b"not safetensors",
                                    "model.safetensors"),
                                   ("[1, 2]", b"", "config.json")):
        (hf / "config.json").write_text(config)
        if weights is not None:
            (hf / "model.safetensors").write_bytes(weights)
        code, out, err = cli(["checkpoint", "convert", "--from-hf", str(hf),
                              str(tmp_path / "out")], capsys)
        line = one_line(code, err)
        assert f"--from-hf {hf}" in line and words in line, line


def test_evaluate_on_an_edited_bin_is_one_line(data_run, tmp_path, one_rank, capsys):
    """An IndexError traceback from the embedding before."""
    import numpy as np
    prefix = str(tmp_path / "a")
    for ext in (".bin", ".idx", ".meta.json", ".tokenizer.json"):
        shutil.copyfile(data_run["prefix"] + ext, prefix + ext)
    tokens = np.fromfile(prefix + ".bin", dtype=np.uint16)
    tokens[5] = 60000
    tokens.tofile(prefix + ".bin")
    line = refused(["evaluate", "--load", str(data_run["ckpt"]), "--task", "perplexity",
                    "--eval-data", prefix], capsys, tmp_path, f"{prefix}.bin")
    assert "changed since `loom preprocess` wrote it" in line, line
    assert json.loads(Path(prefix + ".meta.json").read_text())["files"]
