"""A command line that explains itself (issue 15, item 6): an unknown flag or command gets a
"did you mean" and the subcommand's usage in its one error line (exit 2); a boolean set in YAML
is turned off by ``--no-<flag>``; ``loom --version``."""

from __future__ import annotations

import argparse

import pytest

from loom import __version__
from loom.cli import main
from loom.config import add_config_arguments, config_from_args

BASE = ["train", "--mock-data", "--vocab-size", "100", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--train-iters", "1", "--no-progress-bar"]


def _refusal(argv, monkeypatch, capsys) -> str:
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(err) == 1, err
    return err[0]


@pytest.mark.parametrize("argv,prog,suggestion", [
    (BASE + ["--tensor-parallel-size", "2"], "loom train", "did you mean --tensor-model-parallel-size?"),
    (BASE + ["--train-iter", "3"], "loom train", "did you mean --train-iters?"),
    (BASE + ["--seq-lenght", "3"], "loom train", "did you mean --seq-length?"),
    (["plan", "--num-gpu", "8"], "loom plan", "did you mean --num-gpus?"),
    (["preprocess", "--input", "x.txt", "--output-prefx", "y"], "loom preprocess",
     "did you mean --output-prefix?"),
    (["trian"], "loom", "did you mean train?"),
])
def test_unknown_flag_suggests_and_shows_usage(monkeypatch, capsys, argv, prog, suggestion):
    line = _refusal(argv, monkeypatch, capsys)
    assert line.startswith(f"{prog}: error:") and suggestion in line, line
    assert f"usage: {prog} " in line and f"`{prog} --help`" in line, line


def test_nothing_close_no_suggestion(monkeypatch, capsys):
    line = _refusal(BASE + ["--zzqx"], monkeypatch, capsys)
    assert "--zzqx" in line and "did you mean" not in line


def test_yaml_unknown_key_suggests(tmp_path, monkeypatch, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("num_layers: 2\nhiden_size: 32\n")
    line = _refusal(BASE + ["--config", str(cfg)], monkeypatch, capsys)
    assert "c.yaml:2" in line and "did you mean hidden_size?" in line, line


def _parse(argv):
    p = argparse.ArgumentParser()
    add_config_arguments(p)
    return config_from_args(p.parse_args(argv))


def test_no_flag_turns_off_yaml_boolean(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("model:\n  swiglu: true\nparallel:\n  sequence_parallel: true\n"
                 "training:\n  bf16: true\n")
    on = _parse(["--config", str(y)])
    assert on.model.swiglu and on.parallel.sequence_parallel and on.training.bf16
    off = _parse(["--config", str(y), "--no-swiglu", "--no-sequence-parallel"])
    assert not off.model.swiglu and not off.parallel.sequence_parallel and off.training.bf16
    assert _parse(["--swiglu"]).model.swiglu is True
    assert _parse([]).model.swiglu is False  # the default, not "given"


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"loom {__version__}"
