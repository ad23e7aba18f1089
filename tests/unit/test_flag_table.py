"""Megatron's whole flag surface, declared once (issue 42): every flag of Megatron-LM's
``parse_args()`` (the committed snapshot, loom/config/megatron_flags.json) has exactly one row
of loom's flag table; implemented rows are config fields with Megatron's default; no-effect rows
are not config fields and are named once at start; refused rows refuse in one line naming the
capability; ``--help`` / ``--help-all`` and docs/megatron-defaults.md come from the table."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import pytest

from loom.config import GROUPS, LoomConfig, add_config_arguments, config_from_args
from loom.config.flag_docs import expected_default, loom_defaults, render
from loom.config.flag_kinds import IMPLEMENTED, NO_EFFECT_KIND, REFUSED_KIND, field, refused
from loom.config.flag_rows import PENDING
from loom.config.flag_table import (ACCEPTED_PARSERS, ROW_PAIRS, TRAINING_PARSERS,
                                    MegatronFlag, by_spelling,
                                    coverage, field_of, megatron_flags, snapshot, table)
from loom.config.validate import choices_of
from loom.errors import ConfigError

DOC = Path(__file__).resolve().parents[2] / "docs" / "megatron-defaults.md"
FIELDS = {f.name for dc in GROUPS.values() for f in dataclasses.fields(dc)}


def test_snapshot_is_megatrons_parser():
    commit, flags = snapshot()
    assert commit.startswith("d98e8a6")
    pretrain = [f for f in flags if f.parser == "pretrain"]
    assert len(pretrain) == 838 and len(megatron_flags()) == 860  # + ModelOpt's 22
    assert all(f.source and ":" in f.source for f in flags)
    spell = by_spelling()
    assert spell["--num-layers"].source.startswith("megatron/core/transformer/")
    assert spell["--use-checkpoint-opt-param-scheduler"].name == \
        "--use-checkpoint-opt_param-scheduler"
    assert spell["--attention-backend"].megatron_default == "auto"  # an enum, by name


def test_every_megatron_flag_has_exactly_one_row():
    """d98e8a6's training flags and earlier releases' (loom/config/flag_rows_removed.py)."""
    problems = coverage(megatron_flags(ACCEPTED_PARSERS), ROW_PAIRS, FIELDS)
    assert problems == {"missing": [], "twice": [], "unknown": [], "no_field": []}, problems


def test_adding_a_flag_means_adding_one_row():
    """A new Megatron flag fails the table until it gets one row; two rows fail too, and so
    does a config field added for a flag the table accepts without effect or refuses (the
    field is then its declaration: the row goes)."""
    new = MegatronFlag(("--new-flag", "--new-flag-alias"), "new_flag", False, "storetrue",
                       None, 0, None, "g", "megatron/x.py:1", "pretrain")
    flags = megatron_flags(ACCEPTED_PARSERS) + (new,)
    assert coverage(flags, ROW_PAIRS, FIELDS)["missing"] == ["--new-flag"]
    one = ROW_PAIRS + (("--new-flag", refused("training_options", "a new thing")),)
    assert coverage(flags, one, FIELDS) == {"missing": [], "twice": [], "unknown": [],
                                            "no_field": []}
    two = one + (("--new-flag-alias", refused("training_options", "again")),)
    assert coverage(flags, two, FIELDS)["twice"] == ["--new-flag"]
    assert coverage(flags, one, FIELDS | {"new_flag"})["twice"] == ["--new-flag"]
    assert coverage(flags, ROW_PAIRS + (("--new-flag", field()),), FIELDS)["no_field"] == \
        ["--new-flag"]
    assert coverage(megatron_flags(ACCEPTED_PARSERS), ROW_PAIRS + (("--not-megatron", field()),),
                    FIELDS)["unknown"] == ["--not-megatron"]


def _same(loom_value, megatron_value) -> bool:
    numbers = (int, float)
    if isinstance(loom_value, numbers) and isinstance(megatron_value, numbers) and not \
            isinstance(loom_value, bool) and not isinstance(megatron_value, bool):
        return math.isclose(loom_value, megatron_value, rel_tol=1e-12)
    return loom_value == megatron_value and type(loom_value) is type(megatron_value)


IMPLEMENTED_NAMES = sorted(n for n, r in table().items() if r.kind == IMPLEMENTED and not r.field)


@pytest.mark.parametrize("name", IMPLEMENTED_NAMES)
def test_field_default_is_megatrons(name):
    megatron, want = expected_default(name)
    ours = loom_defaults()[field_of(name, table()[name])]
    assert _same(ours, want), f"{name}: loom {ours!r}, Megatron {megatron!r}"


def test_megatron_choices_are_taken_or_refused_with_a_reason():
    hints = {}
    for dc in GROUPS.values():
        hints.update(dc.__annotations__)
    from typing import get_type_hints
    for dc in GROUPS.values():
        hints.update(get_type_hints(dc))
    for name in IMPLEMENTED_NAMES:
        mf, row = by_spelling()[name], table()[name]
        loom = choices_of(hints[field_of(name, row)])
        if mf.choice_values is None or loom is None:
            continue
        for value in mf.choice_values:
            assert value in loom or value in row.refuse, (name, value)


def test_no_effect_flags_are_not_config_fields_and_outputs_are_never_silent():
    """A flag that asks for an output (a log, a trace, a dump, a profile) is implemented,
    refused, or (category ``already``) something loom writes anyway."""
    outputs = ("tensorboard", "profile", "trace", "dump", "log-", "record-", "save-",
               "snapshot", "output")
    for name, row in table().items():
        if row.kind == IMPLEMENTED:
            continue
        assert name[2:].replace("-", "_") not in FIELDS, name
        if row.kind == NO_EFFECT_KIND and any(w in name for w in outputs):
            assert row.category in ("already", "logging", "ckpt_io", "inference_engine",
                                    "precision", "kernel", "te", "memory", "runtime"), name
            assert not name.startswith(("--log-", "--profile", "--record")) or \
                row.category == "already", name


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loom train", exit_on_error=False)
    add_config_arguments(p)
    return p


REQUIRED = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters",
            "2", "--mock-data", "--vocab-size", "96"]


def _sample(mf: MegatronFlag) -> list[str]:
    """The flag with a value other than Megatron's default (and than an accepted one)."""
    if not mf.takes_value:
        return [mf.name]
    row = table()[mf.name]
    if mf.choice_values:
        value = next(v for v in mf.choice_values if v != mf.megatron_default and
                     v not in row.allow)
    else:
        value = {"int": 7, "float": 0.375}.get(mf.type, "x")
    return [mf.name] + [str(value)] * (1 if mf.nargs in (None, "+", "*", "?") else mf.nargs)


REFUSED_NAMES = sorted(n for n, r in table().items() if r.kind == REFUSED_KIND)


def test_every_refused_flag_is_one_line_naming_what_loom_lacks():
    parser = _parser()
    for name in REFUSED_NAMES:
        mf = by_spelling()[name]
        with pytest.raises(ConfigError) as e:
            config_from_args(parser.parse_args(REQUIRED + _sample(mf)))
        text = str(e.value)
        assert "\n" not in text and text.startswith(mf.name), text
        assert ("loom has no " in text or "not implemented in loom yet: " in text
                or "deprecated in Megatron-LM: " in text), text
        if table()[name].pending:
            assert any(text.endswith(p[1]) for p in PENDING.values()), text


def test_every_no_effect_flag_parses_like_megatron_and_is_reported():
    parser = _parser()
    argv, names = list(REQUIRED), []
    for name, row in table().items():
        mf = by_spelling()[name]
        if row.kind != NO_EFFECT_KIND or mf.parser not in TRAINING_PARSERS:
            continue
        for spelling in mf.flags:
            assert spelling in parser._option_string_actions, spelling
        sample = _sample(mf)
        if len(sample) > 1 and sample[1] in row.refuse:
            continue
        argv += sample
        names.append(name)
    cfg = config_from_args(parser.parse_args(argv))
    assert set(cfg.megatron_no_effect) == set(names)
    from loom.config.flag_table import no_effect_report
    line = no_effect_report(cfg.megatron_no_effect)
    assert "\n" not in line and all(n in line for n in names)
    assert not set(cfg.to_flat()) & {n[2:].replace("-", "_") for n in names}  # never stored


def test_value_refusals_of_implemented_and_no_effect_flags():
    parser = _parser()
    for argv, words in (
            (["--position-embedding-type", "mrope"], "loom has no multimodal RoPE"),
            (["--position-embedding-type", "relative"], "loom has no relative position"),
            (["--moe-router-load-balancing-type", "quantile_balancing"], "quantile"),
            (["--transformer-impl", "inference_optimized"], "inference-only"),
            (["--dataloader-type", "cyclic"], "--dataloader-type single"),
            (["--optimizer", "soap"], r"--optimizer soap: loom has no SOAP optimizer: use "
                                      r"--optimizer adam \(AdamW\), sgd or muon"),
            (["--muon-scalar-optimizer", "lion"], "loom has no Lion optimizer"),
            (["--record-shapes"], "loom has no NVTX tensor-shape records"),
            (["--experimental-attention-variant", "gdn2"], "loom has no Gated DeltaNet-2"),
            (["--dsa-indexer-topk-freq", "2"], "cross-layer top-k sharing")):
        with pytest.raises(ConfigError, match=words):
            config_from_args(parser.parse_args(REQUIRED + argv))
    for ok in (["--optimizer", "adam"], ["--timing-log-level", "0"], ["--rerun-mode",
               "validate_results"], ["--exit-signal", "SIGINT"],  # what loom does
               # capabilities the other branches of issue 42 added (rows, no longer pending)
               ["--optimizer", "sgd"], ["--timing-log-level", "2"],
               ["--position-embedding-type", "yarn"], ["--ckpt-format", "torch"],
               ["--moe-router-load-balancing-type", "sinkhorn"], ["--deterministic-mode"],
               ["--save-retain-interval", "4"], ["--no-yarn-correction-range-round-to-int"]):
        assert config_from_args(parser.parse_args(REQUIRED + ok)).megatron_no_effect == {}


def test_yaml_takes_megatron_only_keys(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("num_layers: 2\ntransformer_impl: local\nno_rope_fusion: true\n")
    cfg = config_from_args(_parser().parse_args(["--config", str(y)]))
    # a switch stores what Megatron's dest gets: --no-rope-fusion sets apply_rope_fusion False
    assert cfg.megatron_no_effect == {"--transformer-impl": "local", "--no-rope-fusion": False}
    y.write_text("num_layers: 2\nposition_embedding_type: mrope\n")
    with pytest.raises(ConfigError, match="c.yaml:2: --position-embedding-type mrope"):
        config_from_args(_parser().parse_args(["--config", str(y)]))
    y.write_text("num_layers: 2\nperform_rl_step: true\n")
    with pytest.raises(ConfigError, match="--perform-rl-step: loom has no reinforcement"):
        config_from_args(_parser().parse_args(["--config", str(y)]))


def test_megatron_spellings_of_fields():
    args = _parser().parse_args(["--use-checkpoint-opt_param-scheduler", "--bert-no-binary-head",
                                 "--hybrid-layer-pattern", "M*", "--persistent-save-interval",
                                 "5", "--override-opt-param-scheduler"])
    assert args.use_checkpoint_opt_param_scheduler is True and args.bert_binary_head is False
    assert args.hybrid_override_pattern == "M*" and args.save_interval == 5
    assert args.override_opt_param_scheduler is True


def test_old_checkpoint_configs_with_switches_still_load():
    old = {**LoomConfig().to_flat(), "transformer_impl": "local", "num_workers": 2,
           "profile": True, "dry_run": False, "apply_query_key_layer_scaling": True}
    with pytest.raises(ConfigError, match="--transformer-impl"):
        LoomConfig.from_flat(old)
    cfg = LoomConfig.from_flat(old, ignore_retired=True)
    assert "transformer_impl" not in cfg.to_flat()
    assert "apply_query_key_layer_scaling" not in cfg.to_flat()  # a switch of modelcaps' time
    assert cfg.logging.profile  # a switch once, a field again since traincaps: kept


def test_help_lists_common_flags_first_and_hides_the_rest(capsys):
    from loom.cli import main
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    common = out.index("common flags:")
    assert common < out.index("model:") and out.index("--num-layers", common) < out.index("model:")
    assert "--no-persist-layer-norm" not in out and "--help-all" in out
    with pytest.raises(SystemExit) as e:
        main(["train", "--help-all"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--no-persist-layer-norm" in out and "no effect in loom: kernel" in out
    assert "--perform-rl-step" in out and "refused: rl" in out


def test_doc_is_rendered_from_the_table():
    assert DOC.read_text(encoding="utf-8") == render(), \
        "docs/megatron-defaults.md is stale: python -m loom.config.flag_docs " \
        "docs/megatron-defaults.md"


def test_every_inference_flag_has_one_row_in_generate():
    """The inference scripts' own flags (the snapshot's ``inference`` parser): each a
    ``loom generate`` option (one of its spellings) or a row of loom.inference.options."""
    from loom.config.fields import flag
    from loom.inference.options import INFERENCE_ROWS, GenerateOptions
    options = {s for f in dataclasses.fields(GenerateOptions)
               for s in (flag(f.name), *f.metadata.get("spellings", ()))}
    rows = [name for name, _ in INFERENCE_ROWS]
    for mf in megatron_flags(("inference",)):
        declared = [s for s in mf.flags if s in options] + [s for s in mf.flags if s in rows]
        assert len(declared) == 1, (mf.flags, declared)
    assert all(by_spelling()[r].parser == "inference" for r in rows)


def test_commands_take_their_flags_from_the_declarations():
    """``loom evaluate``, ``generate``, ``plan``, ``checkpoint`` and ``plot`` write no flag by
    hand: their options are dataclass fields declared with ``opt()`` and the config fields they
    share come from the one declaration (``--seed``: one default, 1234, Megatron's)."""
    import inspect as inspect_module
    from loom.cli import SUBCOMMANDS
    from loom.config.args import field_defaults
    from loom.config.flag_table import by_spelling as spell
    for name in ("evaluate", "generate", "plan", "checkpoint", "plot"):
        module = SUBCOMMANDS[name].load()
        assert 'add_argument("--' not in inspect_module.getsource(module), name
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        train = _parser()
        for option, action in parser._option_string_actions.items():
            if option in train._option_string_actions and option in ("--seed", "--load",
                                                                      "--ckpt-step"):
                shown = getattr(action, "loom_help", action.help)  # (--help-all's, if hidden)
                assert shown == train._option_string_actions[option].help, option
    args = argparse.Namespace(seed=None)
    field_defaults(args, ("seed",))
    assert args.seed == 1234 == spell()["--seed"].megatron_default


def test_readme_counts_are_the_tables():
    """README.md's counts of implemented, no-effect and refused flags are the table's, for
    d98e8a6's flags and for the earlier releases' ones."""
    import re
    from collections import Counter
    text = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    count = Counter(table()[f.name].kind for f in megatron_flags())
    said = [int(n) for n in re.findall(
        r"implemented with Megatron's meaning \((\d+)\), accepted and named once at start "
        r"because it only picks a kernel, a launcher or an I/O detail \((\d+):.*?refused in one "
        r"line naming what loom lacks \((\d+):", text)[0]]
    assert said == [count[IMPLEMENTED], count[NO_EFFECT_KIND], count[REFUSED_KIND]]
    removed = megatron_flags(("removed",))
    count = Counter(table()[f.name].kind for f in removed)
    said = [int(n) for n in re.findall(
        r"So has each of the (\d+) flags .*? implemented under their later names \((\d+)\b.*? "
        r"accepted without effect \((\d+)\b.*? refused \((\d+)\b", text)[0]]
    assert said == [len(removed), count[IMPLEMENTED], count[NO_EFFECT_KIND],
                    count[REFUSED_KIND]]
