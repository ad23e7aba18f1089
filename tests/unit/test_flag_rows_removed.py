"""Flags of Megatron-LM's earlier releases that d98e8a6 dropped (loom/config/flag_rows_removed.py,
loom/config/megatron_removed_flags.json): the snapshot is Megatron's, a renamed flag sets the
field of its later name, a no-effect flag is named at start, a refused one is refused in one line
naming the fix, and the hybrid shares allocate Megatron-Core's pattern."""

from __future__ import annotations


import pytest

from loom.config.flag_kinds import IMPLEMENTED, NO_EFFECT_KIND, REFUSED_KIND
from loom.config.flag_table import (by_spelling, field_of, megatron_flags, removed_snapshot,
                                    snapshot, table)
from loom.config.hybrid_pattern import allocate_pattern
from testkit.cli import TINY, prepared, refusal

BASE = TINY


def _prepare(argv, monkeypatch):
    return prepared(BASE + argv, monkeypatch)


def test_the_snapshot_is_the_earlier_releases_flags_d98e8a6_lacks():
    flags, releases = removed_snapshot()
    assert len(flags) == 94 and all(f.parser == "removed" for f in flags)
    current = {s for f in snapshot()[1] for s in f.flags}
    assert not {s for f in flags for s in f.flags} & current
    spell = by_spelling()
    assert spell["--DDP-impl"].choice_values == ("local", "torch")
    assert spell["--DDP-impl"].megatron_default == "local"
    assert spell["--layernorm-epsilon"].megatron_default == 1e-5
    assert spell["--use-legacy-models"].source.startswith("core_v0.17.1:megatron/training/")
    assert releases["--use-legacy-models"][1] == "core_v0.17.1"
    assert releases["--checkpoint-num-layers"] == ("v1.0", "v2.5")


def test_every_renamed_flag_is_the_field_of_its_later_name(monkeypatch):
    renamed = {f.name: field_of(f.name, table()[f.name]) for f in megatron_flags(("removed",))
               if table()[f.name].kind == IMPLEMENTED}
    assert renamed == {
        "--layernorm-epsilon": "norm_epsilon", "--min-scale": "min_loss_scale",
        "--use-checkpoint-lr-scheduler": "use_checkpoint_opt_param_scheduler",
        "--override-lr-scheduler": "override_opt_param_scheduler",
        "--use-custom-fsdp": "use_megatron_fsdp", "--muon-use-nesterov": "muon_nesterov",
        "--activations-checkpoint-method": "recompute_method",
        "--activations-checkpoint-num-layers": "recompute_num_layers",
        "--checkpoint-num-layers": "checkpoint_num_layers",
        "--hybrid-attention-ratio": "hybrid_attention_ratio",
        "--hybrid-mlp-ratio": "hybrid_mlp_ratio"}
    cfg = _prepare(["--layernorm-epsilon", "1e-6", "--fp16", "--min-scale", "4",
                    "--override-lr-scheduler"], monkeypatch)
    assert cfg.model.norm_epsilon == 1e-6 and cfg.training.min_loss_scale == 4.0
    assert cfg.checkpoint.override_opt_param_scheduler
    cfg = _prepare(["--recompute-granularity", "full", "--activations-checkpoint-method",
                    "block", "--activations-checkpoint-num-layers", "1"], monkeypatch)
    assert (cfg.training.recompute_method, cfg.training.recompute_num_layers) == ("block", 1)
    cfg = _prepare(["--optimizer", "muon", "--muon-use-nesterov"], monkeypatch)
    assert cfg.training.muon_nesterov


def test_no_effect_flags_are_accepted_and_named_at_start(monkeypatch):
    from loom.config.flag_table import no_effect_report
    argv = ["--use-legacy-models", "--DDP-impl", "torch", "--no-async-tensor-model-parallel-"
            "allreduce", "--data-impl", "mmap", "--local_rank", "0", "--legacy-tokenizer",
            "--use-contiguous-buffers-in-ddp", "--no-query-key-layer-scaling"]
    cfg = _prepare(argv, monkeypatch)
    report = no_effect_report(cfg.megatron_no_effect)
    for flag in ("--use-legacy-models", "--DDP-impl torch", "--data-impl mmap",
                 "--legacy-tokenizer", "--no-query-key-layer-scaling"):
        assert flag in report, (flag, report)
    kinds = {table()[f.name].kind for f in megatron_flags(("removed",))}
    assert kinds == {IMPLEMENTED, NO_EFFECT_KIND, REFUSED_KIND}


@pytest.mark.parametrize("argv, words", [
    (["--moe-extended-tp"], "use --expert-tensor-parallel-size"),
    (["--renormalize-blend-weights"], "later releases (and loom) blend with the given weights"),
    (["--retro-add-retriever"], "loom has no retrieval"),
    (["--standalone-embedding-stage"], "--pipeline-model-parallel-layout 'E|...'"),
    # values of flags d98e8a6 keeps that earlier releases took (its choices lack them)
    (["--ckpt-format", "zarr"], "use torch_dist"),
    (["--lr-decay-style", "exponential"], "use cosine, linear"),
    (["--tokenizer-type", "Llama3Tokenizer"], "use HuggingFaceTokenizer"),
    (["--num-experts", "2", "--moe-token-dispatcher-type", "alltoall_seq"], "use alltoall"),
])
def test_refused_flags_name_the_fix_in_one_line(argv, words, monkeypatch, capsys):
    line = refusal(["train", *BASE, *argv], monkeypatch, capsys, prog="loom train")
    assert " ".join(argv[-2:] if argv[-1][0] != "-" else argv[-1:]) in line, line
    assert words in line, line


def test_the_hybrid_shares_allocate_megatron_cores_pattern(monkeypatch, capsys):
    pytest.importorskip("megatron.core")
    from megatron.core.ssm.mamba_hybrid_layer_allocation import allocate_layers
    for L in range(1, 41):
        for ra in (0.0, 0.08, 0.1, 0.125, 0.25, 1 / 3, 0.5, 1.0):
            for rm in (0.0, 0.1, 0.25, 0.5):
                if ra + rm <= 1.0:
                    assert allocate_pattern(L, ra, rm) == "".join(allocate_layers(L, ra, rm)), \
                        (L, ra, rm)
    mamba = ["--model-type", "mamba", "--mamba-num-groups", "2", "--mamba-head-dim", "16"]
    cfg = _prepare([*mamba, "--num-layers", "8", "--hybrid-attention-ratio", "0.25",
                    "--hybrid-mlp-ratio", "0.25"], monkeypatch)
    assert cfg.model.hybrid_override_pattern == "".join(allocate_layers(8, 0.25, 0.25))
    line = refusal(["train", *BASE, *mamba, "--hybrid-attention-ratio", "0.25",
                    "--hybrid-override-pattern", "MMMMMMM*"], monkeypatch, capsys)
    assert "Megatron requires them equal" in line, line
    line = refusal(["train", *BASE, "--hybrid-attention-ratio", "0.5"], monkeypatch, capsys)
    assert "--hybrid-attention-ratio is a share of the layer kinds of a Mamba hybrid stack, " \
           "which --model-type gpt does not have" in line, line


def test_every_value_earlier_releases_offered_is_answered(monkeypatch, capsys):
    """A value an earlier release offered that d98e8a6's choices lack (``removed_values``): an
    implemented flag refuses it naming the replacement; a no-effect or refused flag parses it
    as any other value (never argparse's 'invalid choice')."""
    from loom.config.flag_table import removed_values
    assert removed_values()["--ckpt-format"] == ("zarr",)
    hints = {}
    from typing import get_type_hints
    from loom.config import GROUPS
    from loom.config.validate import choices_of
    for dc in GROUPS.values():
        hints.update(get_type_hints(dc))
    for name, values in removed_values().items():
        row = table()[name]
        for value in values:
            if row.kind == IMPLEMENTED:
                assert value in row.refuse or value in (
                    choices_of(hints[field_of(name, row)]) or ()), (name, value)
                continue
            line = refusal(["train", *BASE, name, value, "--dry-run", "--foo"], monkeypatch,
                           capsys)  # parsed, so the unknown --foo is what is refused
            assert "invalid choice" not in line and "--foo" in line, line


def test_a_yaml_config_takes_megatrons_other_spellings(tmp_path, monkeypatch):
    """``--config FILE.yaml`` keys are flag names: a renamed flag's earlier name
    (``layernorm_epsilon``) sets its field, a ``--no-x`` spelling (``bert_no_binary_head``)
    turns the field off, a no-effect one (``use_legacy_models``) is named at start."""
    from loom.config.flag_table import no_effect_report
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("layernorm_epsilon: 1.0e-6\nuse_legacy_models: true\n")
    cfg = _prepare(["--config", str(cfg_file)], monkeypatch)
    assert cfg.model.norm_epsilon == 1e-6
    assert "--use-legacy-models" in no_effect_report(cfg.megatron_no_effect)
    bert = tmp_path / "b.yaml"
    bert.write_text("model_type: bert\nbert_no_binary_head: true\n")
    assert _prepare(["--config", str(bert)], monkeypatch).model.bert_binary_head is False
    bert.write_text("model_type: bert\nbert_no_binary_head: false\n")
    assert _prepare(["--config", str(bert)], monkeypatch).model.bert_binary_head is True


def test_megatron_v2_full_recompute_and_its_gpt3_script(monkeypatch, capsys):
    """Megatron-LM v1-v2's --checkpoint-activations (with its --checkpoint-num-layers chunk) is
    the full recompute it was there, --recompute-granularity full --recompute-method uniform,
    said at start; with a --recompute-* flag it is refused; and v2.0's own GPT-3 175B script
    (examples/pretrain_gpt3_175B.sh: that recompute, the batch-size ramp by samples, the
    schedule in samples) dry-runs on its 128 x 8 GPUs (TP 8, PP 16)."""
    from loom.training.script_checks import start_notes
    cfg = _prepare(["--checkpoint-activations"], monkeypatch)
    t = cfg.training
    assert (t.recompute_granularity, t.recompute_method, t.recompute_num_layers) == \
        ("full", "uniform", 1)
    assert any("--checkpoint-activations (Megatron-LM v1-v2" in n
               for n in start_notes(cfg, {"checkpoint_activations": True}))
    t = _prepare(["--checkpoint-activations", "--checkpoint-num-layers", "2"],
                 monkeypatch).training
    assert t.recompute_num_layers == 2
    quiet = _prepare(["--checkpoint-num-layers", "2"], monkeypatch)
    assert quiet.training.recompute_granularity is None
    assert any("--checkpoint-num-layers without --checkpoint-activations: no effect" in n
               for n in start_notes(quiet, {"checkpoint_num_layers": 2}))
    line = refusal(["train", *BASE, "--checkpoint-activations", "--recompute-activations"],
                   monkeypatch, capsys, prog="loom train")
    assert "drop it or the --recompute-* flags" in line, line
    from loom.cli import main
    gpt3 = ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
            "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
            "--seq-length", "2048", "--max-position-embeddings", "2048",
            "--micro-batch-size", "1", "--global-batch-size", "1536",
            "--rampup-batch-size", "16", "16", "5859375", "--train-samples", "146484375",
            "--lr-decay-samples", "126953125", "--lr-warmup-samples", "183105",
            "--lr", "6.0e-5", "--min-lr", "6.0e-6", "--lr-decay-style", "cosine",
            "--log-interval", "10", "--eval-iters", "40", "--eval-interval", "1000",
            "--mock-data", "--vocab-size", "50257", "--save-interval", "1000",
            "--split", "98,2,0", "--clip-grad", "1.0", "--weight-decay", "0.1",
            "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--fp16", "--checkpoint-activations"]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as done:
        main(["train", "--dry-run", "--world-size", "1024", *gpt3])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--checkpoint-activations (Megatron-LM v1-v2" in out and "16 -> 1536" in out, out


def test_megatron_v1_names_keep_their_v1_meaning(monkeypatch):
    """Megatron-LM v1.0's --batch-size (per-GPU batch), --model-parallel-size (tensor
    parallelism) and --warmup (a float: the warm-up's share of the decay iterations), which its
    snapshot parses and refuses, are --micro-batch-size, --tensor-model-parallel-size and
    --lr-warmup-fraction (v1.0's examples/pretrain_bert*.sh dry-run:
    benchmarks/megatron_examples.py)."""
    from loom.config import config_from_args
    from loom.training.cli import add_arguments
    import argparse
    i = BASE.index("--micro-batch-size")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(BASE[:i] + BASE[i + 2:] + [
        "--batch-size", "4", "--model-parallel-size", "2", "--warmup", ".01",
        "--lr-decay-iters", "200"])
    cfg = config_from_args(args).validate(4)  # TP 2 x DP 2
    assert cfg.training.micro_batch_size == 4 and cfg.training.lr_warmup_fraction == 0.01
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.derived.global_batch_size == 8
