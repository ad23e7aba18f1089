"""Issue 21 items 3 and 5, issue 42: every loom flag named like Megatron-LM's takes Megatron-LM's
default (read from the snapshot of Megatron's parser, loom/config/megatron_flags.json, through the
flag table; rendered in docs/megatron-defaults.md: tests/unit/test_flag_table.py); Megatron's
required flags are refused when omitted."""

import argparse
import math

import pytest

from loom.config import LoomConfig, add_config_arguments, config_from_args
from loom.config.flag_docs import expected_default
from loom.config.flag_kinds import IMPLEMENTED
from loom.config.flag_table import field_of, table
from loom.errors import ConfigError

REQUIRED_GIVEN = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                  "--seq-length", "16", "--micro-batch-size", "2", "--lr", "1e-3",
                  "--train-iters", "5"]
IMPLEMENTED_ROWS = {name: row for name, row in table().items()
                    if row.kind == IMPLEMENTED and row.field is None}


def _resolved(argv: list, world: int = 1) -> LoomConfig:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(argv)).validate(world)


def _same(loom_value, megatron_value) -> bool:
    if isinstance(megatron_value, float) or isinstance(loom_value, float):
        return loom_value is not None and megatron_value is not None and \
            math.isclose(float(loom_value), float(megatron_value), rel_tol=1e-12)
    return loom_value == megatron_value and type(loom_value) is type(megatron_value) or \
        (loom_value is None and megatron_value is None)


RESOLVED = {"split": "969, 30, 1", "max_position_embeddings": 16,  # validation fills these in
            "eval_global_batch_size": 2, "eval_micro_batch_size": 2}  # Megatron's: b x d, b


def test_omitted_flags_resolve_to_megatrons_defaults():
    cfg = _resolved(REQUIRED_GIVEN + ["--mock-data", "--vocab-size", "100"])
    flat = cfg.to_flat()
    given = {a[2:].replace("-", "_") for a in REQUIRED_GIVEN + ["--vocab-size"]
             if a.startswith("--")}
    for name, row in IMPLEMENTED_ROWS.items():
        field = field_of(name, row)
        if field in given or field == "mock_data":
            continue
        want = RESOLVED.get(field, expected_default(name)[1])
        if field == "max_position_embeddings":  # inferred from --seq-length
            assert cfg.model.max_positions == want
            continue
        assert _same(flat[field], want), f"{name} resolves to {flat[field]!r}, want {want!r}"
    assert cfg.model.num_kv_groups == 4  # no --group-query-attention: a, as Megatron


def test_megatron_inferences():
    base = REQUIRED_GIVEN + ["--mock-data", "--vocab-size", "100"]
    assert _resolved(base + ["--group-query-attention"]).model.num_query_groups == 1
    assert _resolved(base + ["--bf16"]).training.accumulate_allreduce_grads_in_fp32 is True
    assert _resolved(base + ["--fp16"]).training.accumulate_allreduce_grads_in_fp32 is False
    # --grad-reduce-in-bf16 wins over fp32 accumulation under bf16 only (arguments.py:1213)
    for extra in ([], ["--accumulate-allreduce-grads-in-fp32"]):
        assert _resolved(base + ["--bf16", "--grad-reduce-in-bf16", *extra]) \
            .training.accumulate_allreduce_grads_in_fp32 is False
    assert _resolved(base + ["--fp16", "--grad-reduce-in-bf16"]) \
        .training.accumulate_allreduce_grads_in_fp32 is False
    assert _resolved(base + ["--fp16", "--grad-reduce-in-bf16",
                             "--accumulate-allreduce-grads-in-fp32"]) \
        .training.accumulate_allreduce_grads_in_fp32 is True
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
    # the pattern sets the depth; a different --num-layers is ignored, as Megatron ignores it
    assert _resolved(base + ["--hybrid-override-pattern", "M*M", "--num-layers", "4"]
                     ).model.num_layers == 3
    cfg = _resolved(base + ["--hybrid-override-pattern", "M*|MM|M-|*M",
                            "--pipeline-model-parallel-size", "2", "--global-batch-size", "4"],
                    world=2)  # | splits the stages
    assert cfg.model.hybrid_override_pattern == "M*MMM-*M"
    assert cfg.parallel.num_layers_per_virtual_pipeline_stage == 2  # 4 segments on 2 stages
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
