"""Issue 21 items 3 and 5: every loom flag named like Megatron-LM's takes Megatron-LM's default
(loom/config/megatron_defaults.py, rendered in docs/megatron-defaults.md); Megatron's required
flags are refused when omitted."""

import argparse
import math
from dataclasses import fields
from pathlib import Path

import pytest

from loom.config import GROUPS, LoomConfig, add_config_arguments, config_from_args
from loom.config.megatron_defaults import LOOM_OWN, MEGATRON_DEFAULTS, REQUIRED, SAME_MEANING
from loom.errors import ConfigError

REQUIRED_GIVEN = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                  "--seq-length", "16", "--micro-batch-size", "2", "--lr", "1e-3",
                  "--train-iters", "5"]
DOC = Path(__file__).resolve().parents[2] / "docs" / "megatron-defaults.md"


def _dataclass_defaults() -> dict:
    return {f.name: f.default for dc in GROUPS.values() for f in fields(dc)}


def _resolved(argv: list) -> LoomConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(argv)).validate(1)


def _same(loom_value, megatron_value) -> bool:
    if isinstance(megatron_value, float) or isinstance(loom_value, float):
        return loom_value is not None and megatron_value is not None and \
            math.isclose(float(loom_value), float(megatron_value), rel_tol=1e-12)
    return loom_value == megatron_value and type(loom_value) is type(megatron_value) or \
        (loom_value is None and megatron_value is None)


def _expected(name: str):
    """What loom must hold for the row: Megatron's value, or loom's spelling of it."""
    row = MEGATRON_DEFAULTS[name]
    if name in SAME_MEANING:
        return SAME_MEANING[name]
    if name in LOOM_OWN:  # loom's own on purpose, the run unchanged (the checkpoint format)
        return LOOM_OWN[name]
    return None if row.default is REQUIRED else row.default


def test_every_megatron_named_flag_is_in_the_table():
    loom = _dataclass_defaults()
    assert set(MEGATRON_DEFAULTS) <= set(loom)
    for must in ("adam_beta2", "lr_decay_style", "log_interval", "eval_iters", "num_layers",
                 "split", "accumulate_allreduce_grads_in_fp32", "recompute_method"):
        assert must in MEGATRON_DEFAULTS


@pytest.mark.parametrize("name", sorted(MEGATRON_DEFAULTS))
def test_dataclass_default_is_megatrons(name):
    assert _same(_dataclass_defaults()[name], _expected(name)), \
        f"--{name}: loom {_dataclass_defaults()[name]!r}, Megatron {MEGATRON_DEFAULTS[name]}"


RESOLVED = {"split": "969, 30, 1", "max_position_embeddings": 16}  # validation fills these in


def test_omitted_flags_resolve_to_megatrons_defaults():
    cfg = _resolved(REQUIRED_GIVEN + ["--mock-data", "--vocab-size", "100"])
    flat = cfg.to_flat()
    given = {a[2:].replace("-", "_") for a in REQUIRED_GIVEN + ["--vocab-size"]
             if a.startswith("--")}
    for name in MEGATRON_DEFAULTS:
        if name in given or name == "mock_data":
            continue
        want = RESOLVED.get(name, _expected(name))
        if name == "max_position_embeddings":  # inferred from --seq-length
            assert cfg.model.max_positions == want
            continue
        assert _same(flat[name], want), f"--{name} resolves to {flat[name]!r}, want {want!r}"
    assert cfg.model.num_kv_groups == 4  # no --group-query-attention: a, as Megatron


def test_megatron_inferences():
    base = REQUIRED_GIVEN + ["--mock-data", "--vocab-size", "100"]
    assert _resolved(base + ["--group-query-attention"]).model.num_query_groups == 1
    assert _resolved(base + ["--bf16"]).training.accumulate_allreduce_grads_in_fp32 is True
    assert _resolved(base + ["--fp16"]).training.accumulate_allreduce_grads_in_fp32 is False
    assert _resolved(base).training.adam_beta2 == pytest.approx(0.999)
    assert _resolved(base).training.lr_decay_style == "linear"


@pytest.mark.parametrize("flag", ["--num-layers", "--hidden-size", "--num-attention-heads",
                                  "--seq-length", "--micro-batch-size", "--lr", "--train-iters"])
def test_required_flags_are_refused_when_omitted(flag):
    i = REQUIRED_GIVEN.index(flag)
    argv = REQUIRED_GIVEN[:i] + REQUIRED_GIVEN[i + 2:] + ["--mock-data", "--vocab-size", "100"]
    with pytest.raises(ConfigError, match=flag + " is required"):
        _resolved(argv)


def test_python_api_refuses_missing_shape():
    with pytest.raises(ConfigError, match="--hidden-size is required"):
        LoomConfig.from_flat(dict(num_layers=2, num_attention_heads=4, seq_length=8,
                                  micro_batch_size=1, lr=1e-3, train_iters=1)).validate(1)


def test_train_samples_stands_for_train_iters():
    argv = REQUIRED_GIVEN[:12] + ["--train-samples", "8", "--mock-data", "--vocab-size", "100"]
    assert _resolved(argv).training.train_iters == 4  # 8 samples / B = 2


def test_mamba_depth_from_the_hybrid_pattern():
    base = REQUIRED_GIVEN[2:] + ["--mock-data", "--vocab-size", "100", "--model-type", "mamba",
                                 "--mamba-head-dim", "16", "--mamba-num-groups", "1"]
    cfg = _resolved(base + ["--hybrid-override-pattern", "M*M-M"])
    assert cfg.model.num_layers == 5
    with pytest.raises(ConfigError, match="--hybrid-override-pattern 'M\\*M' has 3 layers"):
        _resolved(base + ["--hybrid-override-pattern", "M*M", "--num-layers", "4"])
    with pytest.raises(ConfigError, match="--num-layers is required.*--hybrid-override-pattern"):
        _resolved(base)


def test_full_recompute_needs_method_and_count():
    base = REQUIRED_GIVEN + ["--mock-data", "--vocab-size", "100",
                             "--recompute-granularity", "full"]
    with pytest.raises(ConfigError, match="--recompute-method"):
        _resolved(base + ["--recompute-num-layers", "1"])
    with pytest.raises(ConfigError, match="--recompute-num-layers"):
        _resolved(base + ["--recompute-method", "uniform"])
    cfg = _resolved(base + ["--recompute-method", "block", "--recompute-num-layers", "1"])
    assert cfg.training.recompute_method == "block"


def test_doc_lists_every_row():
    text = DOC.read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip().strip("`"): line for line in text.splitlines()
            if line.startswith("| `--")}
    for name, row in MEGATRON_DEFAULTS.items():
        flag = "--" + name.replace("_", "-")
        assert flag in rows, f"docs/megatron-defaults.md lacks {flag}"
        assert row.source in rows[flag]
        shown = "required" if row.default is REQUIRED else f"`{row.default!r}`"
        assert shown in rows[flag], f"{flag}: the doc does not show Megatron's {shown}"


def test_skip_train_needs_no_lr_or_train_iters():
    """Megatron's --lr / --train-iters are about training: an evaluation-only run
    (--skip-train) needs neither; its optimizer and schedule, built but never stepped, get
    placeholders, and given values are kept. Without --skip-train both stay required."""
    shape = REQUIRED_GIVEN[:10]  # the model shape and --micro-batch-size only
    cfg = _resolved(shape + ["--skip-train"])
    assert cfg.training.lr > 0 and cfg.training.train_iters == 1
    assert _resolved(shape + ["--skip-train", "--min-lr", "1e-5"]).training.lr == 1e-5
    given = _resolved(shape + ["--skip-train", "--lr", "2e-3", "--train-iters", "7"]).training
    assert (given.lr, given.train_iters) == (2e-3, 7)
    with pytest.raises(ConfigError, match="--lr is required"):
        _resolved(shape)
    with pytest.raises(ConfigError, match="--train-iters is required"):
        _resolved(shape + ["--lr", "1e-3"])


def test_distributed_backend_is_megatrons_nccl_and_cpu_uses_gloo(monkeypatch):
    """``--distributed-backend`` defaults to Megatron's nccl; a CPU run can only use gloo, so
    the mesh is built with gloo on CPU whatever the flag says, and with the flag on CUDA."""
    from loom.config import LoomConfig
    from loom.training import builder
    assert LoomConfig().parallel.distributed_backend == "nccl"
    seen = []
    monkeypatch.setattr(builder, "init_distributed",
                        lambda dev, backend, timeout: seen.append((dev, backend)) or dev)
    monkeypatch.setattr(builder.ParallelMesh, "build", staticmethod(lambda **kw: kw))
    for device, backend in (("cpu", "nccl"), ("cuda", "nccl"), ("cuda", "gloo")):
        cfg = LoomConfig()
        cfg.parallel.device, cfg.parallel.distributed_backend = device, backend
        builder.build_mesh(cfg)
    assert seen == [("cpu", "gloo"), ("cuda", "nccl"), ("cuda", "gloo")]
