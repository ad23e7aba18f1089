"""A command line that explains itself (issue 15, item 6): an unknown flag or command gets a
"did you mean" and the subcommand's usage in its one error line (exit 2); a boolean set in YAML
is turned off by ``--no-<flag>``; ``loom --version``. Every command's ``--help`` renders
(issue 21, item 1), discovered from ``loom.cli.SUBCOMMANDS``; a refusal points at the ``--help``
of the command that ran (item 2)."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loom import __version__
from loom.cli import SUBCOMMANDS, main
from loom.config import add_config_arguments, config_from_args
from testkit.cli import refusal

BASE = ["train",  # pinned: loom's defaults before Megatron's (issue 21)
         "--adam-beta2", "0.95", "--lr-decay-style", "cosine", "--log-interval", "10", "--eval-iters", "10", "--mock-data", "--vocab-size", "100", "--num-layers", "2", "--hidden-size",
         "32",
        "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
        "--train-iters", "1", "--no-progress-bar", "--lr", "1e-3"]
REPO = Path(__file__).resolve().parents[2]


_refusal = refusal


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


def _help_argvs() -> list[list[str]]:
    """``--help`` of ``loom``, of every subcommand, and of every sub-subcommand (a positional
    with choices, like ``loom checkpoint inspect``, or a nested subparser)."""
    argvs = [["--help"]]
    for name, (load, _) in SUBCOMMANDS.items():
        argvs.append([name, "--help"])
        p = argparse.ArgumentParser()
        load().add_arguments(p)
        for a in p._actions:
            if not a.option_strings and a.choices:
                argvs += [[name, str(c), "--help"] for c in a.choices]
    return argvs


HELP_ARGVS = _help_argvs()


def test_help_covers_every_command():
    assert {a[0] for a in HELP_ARGVS} == set(SUBCOMMANDS) | {"--help"}
    assert {"inspect", "convert"} <= {a[1] for a in HELP_ARGVS if a[0] == "checkpoint"}


@pytest.mark.parametrize("argv", HELP_ARGVS, ids=[" ".join(a) for a in HELP_ARGVS])
def test_help_renders(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 0, err
    prog = "loom" if argv == ["--help"] else f"loom {argv[0]}"
    assert out.startswith(f"usage: {prog}"), out[:200]
    assert "%%" not in out and "Traceback" not in err  # escaped once, where help is built
    assert len(out.splitlines()) > 3


@pytest.mark.parametrize("command", ["train", "plan"])
def test_help_shows_percent_signs(command, capsys):
    """Field help written plainly with ``%`` (BERT's masking "80%", MoE's "i % N") renders."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "80%" in out and "i % N" in out


def test_help_in_a_real_process():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "loom", "train", "--help"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: loom train") and "--mask-prob" in r.stdout
    assert r.stderr == ""


def test_plan_yaml_refusal_points_at_plan_help(tmp_path, monkeypatch, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("num_layers: 2\nmoe_router_quantile_balancing_ema: 0.5\n")
    line = _refusal(["plan", "--config", str(cfg)], monkeypatch, capsys)
    assert line.startswith("loom plan: error:") and "bad.yaml:2" in line, line
    assert "see `loom plan --help`" in line and "loom train" not in line, line
    assert "--moe-router-quantile-balancing-ema" in line and "not supported by loom" in line, line
    assert "did you mean" not in line, line


def test_checkpoint_config_unknown_key_names_no_command():
    """``LoomConfig.from_flat`` (a checkpoint's config, read by generate/evaluate/convert)
    names the key but no command's --help (it is not a flag the user gave)."""
    from loom.config import ConfigError, LoomConfig
    with pytest.raises(ConfigError) as e:
        LoomConfig.from_flat({"num_layers": 2, "moe_router_quantile_balancing_ema": 0.5})
    assert str(e.value) == "unknown option(s): --moe-router-quantile-balancing-ema"


# -- suggestions only for typos; family flags refused with a fix that keeps the family (issue 21)

def test_did_you_mean_rule():
    from loom.errors import closest
    flags = ["--num-layers", "--hidden-size", "--post-layernorm", "--no-swiglu", "--swiglu",
             "--vocab-size", "--init-method-std", "--global-batch-size", "--micro-batch-size",
             "--tensor-model-parallel-size"]
    assert closest("--seq-lenght", ["--seq-length"]) == "--seq-length"  # a swap is one edit
    assert closest("--hiden-size", flags) == "--hidden-size"
    assert closest("--tensor-parallel-size", flags) == "--tensor-model-parallel-size"
    for far in ("--qk-layernorm", "--no-bias-swiglu-fusion", "--vocab-file", "--init-method",
                "--batch-size"):  # another feature, a word added at an end, or a tie
        assert closest(far, flags) is None, far
    assert closest("trian", ["train", "plan"]) == "train"
    assert closest("--save-int", ["--save-interval", "--save"]) == "--save-interval"
    assert closest("--max-new", ["--max-new-tokens"]) is None  # ends at a word: not a typo
    assert closest("--hidden-sie", ["--hidden-size", "--hidden-sig"]) is None  # a tie


# -- family flags: refused with a fix that keeps the user's --model-type (issue 21, item 4) -----

@pytest.mark.parametrize("extra,words", [
    (["--multi-latent-attention", "--rope-type", "rope", "--rotary-scaling-factor", "8"],
     ["--rotary-scaling-factor", "Gemma 3's linear RoPE", "YaRN", "not supported yet",
      "drop --rotary-scaling-factor"]),  # (without MLA or YaRN: Megatron's no effect)
    (["--sliding-window", "4"], ["--model-type gpt does not have: drop --sliding-window"]),
    (["--final-logit-softcapping", "30"], ["drop --final-logit-softcapping"]),
    (["--hybrid-override-pattern", "MM"], ["drop --hybrid-override-pattern"]),
    (["--post-layernorm"], ["drop --post-layernorm"]),
    (["--bert-binary-head"], ["drop --bert-binary-head"]),
])
def test_family_flag_refusal_keeps_the_family(monkeypatch, capsys, extra, words):
    line = _refusal(BASE + extra, monkeypatch, capsys)
    for w in words:
        assert w in line, (w, line)
    for other in ("gemma3", "mamba", "bert"):
        assert f"--model-type {other}" not in line, line


def test_mamba_tp_refusal_changes_the_layout_not_the_model():
    from loom.config import ConfigError, ModelConfig
    from loom.models.mamba.config import check_heads as check_mamba
    m = ModelConfig(model_type="mamba", num_layers=2, hidden_size=64, num_attention_heads=4,
                    vocab_size=100, seq_length=16, mamba_head_dim=16, mamba_num_groups=2)
    check_mamba(m, 2, 1)
    with pytest.raises(ConfigError) as e:
        check_mamba(m, 4, 1)
    assert str(e.value) == ("--mamba-num-groups 2 is not divisible by "
                            "--tensor-model-parallel-size 4: use a --tensor-model-parallel-size "
                            "dividing --mamba-num-groups 2 (1, 2)")


def test_bert_refusals_name_the_fix():
    from loom.config import ConfigError, ModelConfig
    from loom.config import LoomConfig
    from loom.models.bert.config import check
    base = dict(model_type="bert", num_layers=2, hidden_size=32, num_attention_heads=4,
                vocab_size=100, seq_length=16)
    for changes, fix in ((dict(num_experts=4), "drop --num-experts"),
                         (dict(position_embedding_type="rope"), "drop --position-embedding-type"),
                         (dict(seq_length=2), "use --seq-length 3 or more")):
        with pytest.raises(ConfigError) as e:
            check(LoomConfig(model=ModelConfig(**{**base, **changes})), 1)
        assert str(e.value).endswith(fix), str(e.value)
