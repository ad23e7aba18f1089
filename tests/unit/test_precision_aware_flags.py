"""Megatron's precision-aware optimizer flags through ``loom train``'s parser: Megatron's checks
(``OptimizerConfig.__post_init__``, arguments.py:1209-1216) refused before any process group
starts, each naming the flag and the fix; ``--main-grads-dtype bf16`` sets the bf16 gradient
rule; the dtypes without effect in a run are named at start. The optimizer itself:
tests/parallel/test_precision_aware_optimizer.py."""

from __future__ import annotations


import pytest

from loom.cli import main
from loom.errors import ConfigError
from testkit.cli import TINY, prepared

BASE = TINY
PA = ["--use-precision-aware-optimizer", "--use-distributed-optimizer"]


def _prepare(argv, monkeypatch):
    return prepared(BASE + argv, monkeypatch)


@pytest.mark.parametrize("argv,words", [
    (["--exp-avg-dtype", "bf16"], ["--exp-avg-dtype bf16", "needs --use-precision-aware"]),
    (["--main-params-dtype", "fp16", "--main-grads-dtype", "bf16"],
     ["--main-grads-dtype bf16", "--main-params-dtype fp16", "add it"]),
    (["--use-precision-aware-optimizer"], ["needs --use-distributed-optimizer"]),
    (PA + ["--optimizer", "sgd"], ["--optimizer sgd", "--optimizer adam"]),
    (["--use-precision-aware-optimizer", "--use-torch-fsdp2"], ["FSDP2", "ZeRO-1/2"]),
    (PA + ["--bf16", "--main-grads-dtype", "bf16", "--accumulate-allreduce-grads-in-fp32"],
     ["--main-grads-dtype bf16", "--accumulate-allreduce-grads-in-fp32", "drop one"]),
    (["--optimizer-cpu-offload", "--use-distributed-optimizer"],
     ["--optimizer-cpu-offload needs --use-precision-aware-optimizer"]),
    (PA + ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.5"],
     ["--optimizer-offload-fraction"]),
])
def test_megatron_s_checks_refuse_with_the_fix(argv, words, monkeypatch):
    with pytest.raises(ConfigError) as e:
        _prepare(argv, monkeypatch)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_accepted_settings_resolve(monkeypatch):
    cfg = _prepare(PA + ["--bf16", "--exp-avg-dtype", "fp8", "--exp-avg-sq-dtype", "bf16",
                         "--main-grads-dtype", "bf16"], monkeypatch)
    t = cfg.training
    assert (t.exp_avg_dtype, t.exp_avg_sq_dtype, t.main_grads_dtype) == ("fp8", "bf16", "bf16")
    assert t.accumulate_allreduce_grads_in_fp32 is False  # bf16 main gradients
    t = _prepare(PA + ["--bf16"], monkeypatch).training
    assert t.accumulate_allreduce_grads_in_fp32 is True  # Megatron's bf16 rule, unchanged
    t = _prepare(["--use-precision-aware-optimizer", "--zero-stage", "2"], monkeypatch).training
    assert t.use_distributed_optimizer  # ZeRO-2 is the distributed optimizer


def test_dtypes_without_effect_are_named_at_start(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = ["train", "--dry-run", "--world-size", "1", *BASE, *PA, "--main-grads-dtype",
            "bf16", "--main-params-dtype", "fp16"]
    try:
        assert (main(argv) or 0) == 0
    except SystemExit as e:
        assert not e.code
    out = capsys.readouterr().out
    assert "--main-grads-dtype bf16 without --bf16: no effect" in out, out
    assert "--main-params-dtype fp16 in an fp32 run: no effect" in out, out
