"""The model configurations of THUDM/slime (``scripts/models/*.sh``: 39 models' ``MODEL_ARGS``,
Megatron-LM flags, transcribed with their default environment in slime_model_args.json) through
``loom train --dry-run`` at 8 ranks with a training tail (sequence, batch, learning rate, mock
data): data loom was not fitted on, of the models slime's users train (Qwen2.5 / 3 / 3.5,
Qwen3-Next, Llama 3, DeepSeek-V3, Kimi K2, GLM-4 / 4.5 / 4.7 / 5, MiniMax-M2, Moonlight, MiMo).

Each is accepted, or refused in one line for a flag of slime's own Megatron patch, named with
loom's fix (loom/config/foreign_flags.py); where the fix is a loom flag of the same meaning
(``--use-gated-attention`` -> ``--attention-output-gate``), the fixed line is accepted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from testkit.megatron_corpus import dry_run

MODELS = json.loads((Path(__file__).with_name("slime_model_args.json")).read_text())["models"]
TAIL = ["--seq-length", "4096", "--max-position-embeddings", "131072", "--micro-batch-size",
        "1", "--global-batch-size", "64", "--lr", "1e-5", "--train-iters", "10", "--mock-data"]
# model -> (slime's flag, the fix loom names; the replacement that makes it loom's, or None)
REFUSED = {
    **{m: ("--post-mlp-layernorm", "GLM-4's norm after the attention / MLP output", None)
       for m in ("glm4-9B", "glm4-32B")},
    **{m: ("--allgather-cp", "--cp-comm-type allgather", None)
       for m in ("glm5-744B-A40B", "glm5.2-744B-A40B")},
    **{m: ("--use-gated-attention", "--attention-output-gate", "--attention-output-gate")
       for m in ("qwen3-next-80B-A3B", "qwen3.5-0.8B", "qwen3.5-4B", "qwen3.5-9B",
                 "qwen3.5-27B", "qwen3.5-35B-A3B", "qwen3.5-35B-A3B-vl")},
}


def _argv(args: list[str]) -> list[str]:
    return args + TAIL + ([] if "--vocab-size" in args else ["--vocab-size", "151936"])


def _accept(argv: list[str], monkeypatch) -> None:
    """What ``loom train --dry-run`` checks before it prints (parsing, every rule at 8 ranks),
    without the exact per-rank count of the built model on the meta device, which takes 20-40 s
    for the 100B+ MoE models here (``benchmarks``-sized, not a test's)."""
    import argparse
    from loom.training.cli import add_arguments, prepare
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with monkeypatch.context() as m:
        m.setenv("WORLD_SIZE", "8")
        prepare(parser.parse_args(argv))  # ConfigError / SystemExit when refused


# models the test also runs whole through ``loom train --dry-run`` (seconds each)
WHOLE = ("qwen3-8B", "llama3.1-8B-Instruct", "deepseek-v3-5layer", "moonlight",
         "qwen3.5-4B")


def test_slime_models_are_accepted_or_refused_with_the_fix(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert len(MODELS) == 39 and set(REFUSED) <= set(MODELS)
    accepted = []
    for name, args in MODELS.items():
        if name not in REFUSED:
            _accept(_argv(args), monkeypatch)
            if name in WHOLE:
                code, err = dry_run(_argv(args), 8)
                assert code == 0, (name, err.splitlines()[-1:])
            accepted.append(name)
            continue
        code, err = dry_run(_argv(args), 8)
        flag, fix, same = REFUSED[name]
        assert code == 2 and f"{flag}: slime's flag; " in err and fix in err, (name, err)
        if same:
            fixed = _argv([same if a == flag else a for a in args])
            _accept(fixed, monkeypatch)
            if name in WHOLE:
                code, err = dry_run(fixed, 8)
                assert code == 0, (name, err.splitlines()[-1:])
            accepted.append(name)
    assert len(accepted) == 35  # of 39: GLM-4's sandwich norms and slime's GLM-5 CP refused
