"""The configuration filed by concern (issue 7 item 5): sections, typed choices checked in one
place, a help text per flag, Megatron's interleaving semantics, YAML coercion, no import cycles;
checkpoint-pointer resolution and the single-process process group (issue 16)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
from pathlib import Path
from typing import get_type_hints

import pytest
import torch
import torch.distributed as dist

from loom.config.flag_table import refused_values
from loom.config import (GROUPS, CheckpointConfig, ConfigError, LoggingConfig, LoomConfig,
                         ModelConfig, ParallelConfig, TrainingConfig, add_config_arguments,
                         config_from_args)
from loom.config.validate import choices_of, coerce
from testkit.config import MEGATRON_DROPOUT, tiny_config

REPO = Path(__file__).resolve().parents[2]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_config_arguments(p)
    return p


def _names(dc) -> set[str]:
    return {f.name for f in dataclasses.fields(dc)}


def test_sections_by_concern():
    assert {"save", "load", "save_interval", "ckpt_step", "overwrite_checkpoints"} <= \
        _names(CheckpointConfig)
    assert not {"save", "load", "save_interval"} & _names(LoggingConfig)
    assert "device" in _names(ParallelConfig) and "device" not in _names(TrainingConfig)
    every = set().union(*(_names(dc) for dc in GROUPS.values()))
    assert "dry_run" not in every
    assert "num_workers" not in every  # a no-effect row of the flag table (issue 42)
    assert list(GROUPS) == ["model", "parallel", "training", "data", "logging", "checkpoint",
                            "fault_tolerance"]


def test_every_flag_has_a_help_text_in_words():
    actions = [a for a in _parser()._actions if a.option_strings and a.dest != "help"]
    assert len(actions) > 50
    for a in actions:
        text = getattr(a, "loom_help", a.help)  # a Megatron-only flag: shown by --help-all
        assert text and not text.startswith("(default"), a.option_strings
        assert len(text.split()) >= 3, (a.option_strings, text)


def test_literal_choices_are_argparse_choices_and_validated():
    by_dest = {a.dest: a for a in _parser()._actions}
    literal = 0
    for dc in GROUPS.values():
        for name, hint in get_type_hints(dc).items():
            choices = choices_of(hint)
            if choices is not None:
                literal += 1
                # and Megatron's values loom refuses with a reason (the flag table)
                assert tuple(by_dest[name].choices) == choices + tuple(
                    v for v in refused_values(name) if v not in choices), name
    assert literal >= 6
    cfg = LoomConfig(model=ModelConfig(vocab_size=100, normalization="BatchNorm"))
    with pytest.raises(ConfigError, match="--normalization"):
        cfg.validate(1)  # the same check for configs built in code


def test_coerce_to_the_field_type():
    assert coerce("1e-3", float, "lr") == pytest.approx(1e-3)  # PyYAML reads 1e-3 as a string
    assert coerce("8", int, "n") == 8 and coerce("1e3", int, "n") == 1000
    assert coerce(2, float, "lr") == 2.0 and isinstance(coerce(2, float, "lr"), float)
    for value, hint in ((True, int), ("yes", bool), (2.5, int), ("inf", float), ([1], str)):
        with pytest.raises(ConfigError, match="what"):
            coerce(value, hint, "what")


def test_virtual_stage_size_alone_selects_interleaving():
    def cfg(**par):
        return tiny_config("gpt", MEGATRON_DROPOUT, num_layers=4, mock_data=False,
                           pipeline_model_parallel_size=2, **par, micro_batch_size=1,
                           global_batch_size=4, train_iters=1, world=2)
    assert cfg(num_layers_per_virtual_pipeline_stage=1).parallel.pipeline_schedule == "interleaved"
    assert cfg().parallel.pipeline_schedule == "1f1b"
    assert cfg(pipeline_schedule="gpipe").parallel.pipeline_schedule == "gpipe"


def test_yaml_flat_and_grouped_give_the_same_config(tmp_path):
    flat = tmp_path / "flat.yaml"
    flat.write_text("num_layers: 3\nlr: 1e-3\nsave: ck\ndevice: cpu\nsplit: 100\n")
    grouped = tmp_path / "grouped.yaml"
    grouped.write_text("model:\n  num_layers: 3\ntraining:\n  lr: 1e-3\ncheckpoint:\n  save: ck\n"
                       "parallel:\n  device: cpu\ndata:\n  split: 100\n")
    a = config_from_args(_parser().parse_args(["--config", str(flat)]))
    b = config_from_args(_parser().parse_args(["--config", str(grouped)]))
    assert a.to_flat() == b.to_flat()
    assert a.training.lr == 1e-3 and a.checkpoint.save == "ck" and a.data.split == "100"


def test_demo_yaml_still_loads_and_validates():
    cfg = config_from_args(_parser().parse_args(["--config", str(REPO / "configs/demo.yaml"),
                                                 "--vocab-size", "8192"]))
    assert cfg.validate(4).parallel.tensor_model_parallel_size == 2


def test_hybrid_demo_yaml_loads_and_validates():
    cfg = config_from_args(_parser().parse_args(
        ["--config", str(REPO / "configs/demo_hybrid.yaml"), "--vocab-size", "8192"]))
    assert cfg.validate(4).model.model_type == "mamba"


def test_old_checkpoint_configs_still_load():
    old = LoomConfig(model=ModelConfig(vocab_size=10)).to_flat()
    old.update(dry_run=False, num_workers=0)  # fields of the pre-section config
    assert LoomConfig.from_flat(old, ignore_retired=True).model.vocab_size == 10
    with pytest.raises(ConfigError, match="--dry-run"):
        LoomConfig.from_flat(old)


def _imports(path: Path, module: str, known: set[str]) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n and n != module:
                out.add(n)
    return out


def test_no_import_cycles_through_config_data_or_layout():
    files = {}
    for path in (REPO / "loom").rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    graph = {m: _imports(p, m, set(files)) for m, p in files.items()}

    def reaches(src: str, dst: str) -> bool:
        seen, todo = set(), [src]
        while todo:
            m = todo.pop()
            for n in graph.get(m, ()):
                if n == dst:
                    return True
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return False
    mine = [m for m in files if m.startswith(("loom.config", "loom.data", "loom.errors"))] + \
        ["loom.parallel.pipeline.placement", "loom.checkpoint.safety"]
    for m in mine:
        assert not reaches(m, m), f"{m} imports itself through a cycle"
    assert not reaches("loom.parallel.pipeline.placement", "loom.config")
    assert not reaches("loom.data.tokenizer", "loom.data.preprocess")


def test_checkpoint_pointer_resolution(tmp_path):
    from loom.checkpoint.safety import resolve_checkpoint
    assert resolve_checkpoint(str(tmp_path / "absent")) is None  # a fresh start
    for it in (2, 4):
        d = tmp_path / f"iter_{it:07d}"
        d.mkdir()
        (d / "metadata.json").write_text(json.dumps({}))
        (d / "common.pt").write_bytes(b"")
    pointer = tmp_path / "latest_checkpointed_iteration.txt"
    pointer.write_text("4\n")
    assert resolve_checkpoint(str(tmp_path)).endswith("iter_0000004")
    pointer.write_text("garbage")
    with pytest.raises(ConfigError, match="latest_checkpointed_iteration.txt"):
        resolve_checkpoint(str(tmp_path))
    assert resolve_checkpoint(str(tmp_path), step=2).endswith("iter_0000002")  # explicit
    pointer.write_text("6")
    with pytest.raises(ConfigError, match="iter_0000006"):
        resolve_checkpoint(str(tmp_path))


def test_single_process_group_needs_no_port(monkeypatch):
    from loom.parallel.mesh import init_distributed
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)
    assert not dist.is_initialized()
    try:
        assert init_distributed("cpu", "gloo").type == "cpu"
        t = torch.ones(2)
        dist.all_reduce(t)
        assert dist.get_world_size() == 1 and t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


def _tiny(**kw) -> LoomConfig:
    return tiny_config("gpt", MEGATRON_DROPOUT, dict(micro_batch_size=1, train_iters=1), kw)


def test_megatron_forms_accepted():
    """Issue 21 item 5: --eval-iters 0 (no evaluation), --save-interval without --save (no
    saves), --split with one pair of quotes or spaces, as Megatron's scripts pass them."""
    assert _tiny(eval_iters=0).validate(1).logging.eval_iters == 0
    assert _tiny(save_interval=10).validate(1).checkpoint.save is None
    from loom.data.split import parse_split, split_document_ranges
    for text in ("'99,1,0'", '"99,1,0"', "99, 1, 0", " 99,1,0 "):
        assert parse_split(_tiny(split=text).validate(1).data.split) == [99.0, 1.0, 0.0]
    assert split_document_ranges(1000, "'969, 30, 1'") == [(0, 969), (969, 999), (999, 1000)]
    for bad in ("'99,1,0", "\"99,1,0'", "''"):
        with pytest.raises(ConfigError, match="--split"):
            _tiny(split=bad).validate(1)


def test_validate_returns_a_new_resolved_config_and_leaves_its_input():
    """Issue 22 item 4: one resolution, returning a new object with the derived sizes."""
    cfg = _tiny(global_batch_size=8, train_samples=40, use_distributed_optimizer=True)
    before = dataclasses.asdict(cfg.training), cfg.parallel.pipeline_schedule
    resolved = cfg.validate(2)
    assert resolved is not cfg and cfg.derived is None
    assert (dataclasses.asdict(cfg.training), cfg.parallel.pipeline_schedule) == before
    d = resolved.derived
    assert (d.world_size, d.data_parallel_size, d.global_batch_size) == (2, 2, 8)
    assert d.num_microbatches == 8 // (resolved.training.micro_batch_size * 2)
    assert d.pipeline_schedule == resolved.parallel.pipeline_schedule == "1f1b"
    assert resolved.training.train_iters == 5 and resolved.training.zero_stage == 1
    with pytest.raises(ConfigError, match="never resolved"):
        cfg.require_derived()
