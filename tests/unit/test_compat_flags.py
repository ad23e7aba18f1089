"""Megatron-LM's flags of its example scripts (issue 23, item 1): implementation switches
accepted and named once at start, never dropped silently; the real flags resolved with
Megatron's meaning (schedules in samples, position-embedding spellings, Megatron FSDP, batch
ramps, checkpoint formats), the ones loom does not train yet refused for training;
``--exit-duration-in-mins``, ``--pretrained-checkpoint`` and ``--use-checkpoint-args``
(item 4) with Megatron's semantics."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from loom.cli import main
from loom.errors import ConfigError
from testkit import run_distributed

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "1", "--lr", "1e-3", "--mock-data",
        "--vocab-size", "96"]
SWITCHES = [  # Megatron flags loom accepts without effect (the flag table), non-default values
    "--use-mcore-models", "--transformer-impl", "local", "--attention-backend", "flash",
    "--no-masked-softmax-fusion", "--no-rope-fusion", "--no-bias-swiglu-fusion",
    "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion",
    "--cross-entropy-loss-fusion", "--use-flash-attn", "--export-force-local-attention",
    "--cuda-graph-impl", "local",
    "--disable-gloo-process-groups", "--manual-gc", "--manual-gc-interval", "10",
    "--empty-unused-memory-level", "1", "--attention-softmax-in-fp32",
    "--apply-query-key-layer-scaling", "--chat-template", "{{ messages }}",
    "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
    "--fp8-param-gather", "--init-model-with-meta-device", "--use-nccl-ub",
    "--fsdp-double-buffer", "--fsdp-manual-registration", "--megatron-fsdp-grad-comm-dtype",
    "bf16", "--megatron-fsdp-main-grads-dtype", "bf16", "--moe-permute-fusion",
    "--moe-flex-dispatcher-backend", "hybridep", "--enable-experimental", "--spec",
    "megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec",
    "--recompute-modules", "mlp", "moe",
    "--log-validation-ppl-to-tensorboard", "--log-throughput", "--logging-level", "20",
    "--num-workers", "6", "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files",
    "--data-cache-path", "/tmp/cache", "--dataloader-type", "single",
    "--auto-detect-ckpt-format", "--dist-ckpt-strictness", "log_all"]


def _main(argv) -> int:
    try:
        return main(argv) or 0
    except SystemExit as e:
        return e.code or 0


def _parse(argv):
    from loom.training.cli import add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def _prepare(argv, monkeypatch, world=1):
    from loom.training.cli import prepare
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("RANK", raising=False)
    return prepare(_parse(argv))


def test_switches_are_accepted_and_named_once(capsys, monkeypatch):
    from loom.config import GROUPS
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert _main(["train", "--dry-run", "--world-size", "1", *BASE, "--train-iters", "2",
                 *SWITCHES]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "no effect in loom" in ln]
    assert len(lines) == 1
    given = [w for w in SWITCHES if w.startswith("--")]
    fields = {f.name for dc in GROUPS.values() for f in dataclasses.fields(dc)}
    for name in given:
        assert f"{name}" in lines[0], name
        assert name[2:].replace("-", "_") not in fields  # not a config field (issue 42)
    assert "--spec megatron.core.models.hybrid.hybrid_layer_specs hybrid_stack_spec" in lines[0]
    assert _main(["train", "--dry-run", "--world-size", "1", *BASE, "--train-iters", "2",
                  "--num-query-groups", "2"]) == 0  # loom keeps it; Megatron's rule is said
    assert "Megatron-LM would ignore it" in capsys.readouterr().out
    assert _main(["train", "--dry-run", "--world-size", "1", *BASE, "--train-iters", "2",
                  "--grad-reduce-in-bf16"]) == 0  # a field now, whose effect needs --bf16
    assert ("--grad-reduce-in-bf16 without --bf16: no effect (as in Megatron-LM, "
            "arguments.py:1213): gradients are reduced in fp32") in capsys.readouterr().out
    assert _main(["train", "--dry-run", "--world-size", "1", *BASE, "--train-iters", "2"]) == 0
    assert "no effect in loom" not in capsys.readouterr().out  # defaults say nothing


def test_megatron_spellings_resolve(monkeypatch):
    cfg = _prepare(BASE + ["--train-iters", "4", "--use-rotary-position-embeddings",
                           "--no-position-embedding", "--rotary-percent", "1.0",
                           "--num-query-groups", "2"], monkeypatch)
    assert cfg.model.position_embedding_type == "rope" and cfg.model.num_kv_groups == 2
    assert cfg.model.no_position_embedding and cfg.model.use_rotary_position_embeddings
    cfg = _prepare(BASE + ["--train-samples", "40", "--global-batch-size", "4",
                           "--lr-warmup-samples", "6", "--lr-decay-samples", "36"], monkeypatch)
    t = cfg.training
    assert (t.train_iters, t.lr_warmup_iters, t.lr_decay_iters) == (10, 2, 9)
    assert (t.lr_warmup_samples, t.lr_decay_samples) == (6, 36)
    cfg = _prepare(BASE + ["--train-iters", "2", "--step-batch-size-schedule", "0:4"],
                   monkeypatch)
    assert cfg.training.global_batch_size == 4
    from loom.config import config_from_args  # a ramp: validated (a dry run predicts its end)
    ramp = config_from_args(_parse(BASE + ["--train-iters", "2", "--step-batch-size-schedule",
                                           "0:2 1.5K:4"])).validate(1)
    assert ramp.derived.global_batch_size == 4
    cfg = _prepare(BASE + ["--model-type", "mamba", "--hybrid-layer-pattern", "M*",
                           "--train-iters", "2", "--mamba-num-groups", "1",
                           "--position-embedding-type", "none"], monkeypatch)
    assert cfg.model.hybrid_override_pattern == "M*" and cfg.model.num_layers == 2
    cfg = _prepare(BASE + ["--model-type", "mamba", "--hybrid-layer-pattern", "M*",
                           "--train-iters", "2", "--mamba-num-groups", "1", "--mamba-head-dim",
                           "16", "--mamba-num-heads", "6"], monkeypatch)
    assert cfg.model.mamba_d_inner == 96 and cfg.model.mamba_num_heads == 6  # 6 x 16
    cfg = _prepare(BASE + ["--model-type", "mamba", "--hybrid-layer-pattern", "M*",
                           "--train-iters", "2", "--mamba-num-groups", "1", "--mamba-head-dim",
                           "10", "--mamba-num-heads", "5"], monkeypatch)
    assert cfg.model.mamba_d_inner == 50  # not a multiple of h 32 (Nemotron-H's shapes)
    cfg = _prepare(BASE + ["--model-type", "bert", "--train-iters", "2", "--bert-binary-head",
                           "--bert-no-binary-head"], monkeypatch)
    assert cfg.model.bert_binary_head is False  # Megatron's --bert-no-binary-head
    for strategy, stage in (("no_shard", 0), ("optim", 1), ("optim_grads", 2),
                            ("optim_grads_params", 3)):
        cfg = _prepare(BASE + ["--train-iters", "2", "--use-megatron-fsdp",
                               "--data-parallel-sharding-strategy", strategy], monkeypatch, 2)
        assert cfg.training.zero_stage == stage and cfg.training.use_megatron_fsdp
    for fmt in ("torch_dist", "torch", "torch_dcp", "fsdp_dtensor"):
        assert _prepare(BASE + ["--train-iters", "2", "--ckpt-format", fmt],
                        monkeypatch).training.ckpt_format == fmt
    cfg = config_from_args(_parse(BASE + ["--train-samples", "200", "--moe-token-drop-policy",
                                          "probs", "--rampup-batch-size", "2", "2", "100",
                                          "--global-batch-size", "4"]))
    cfg = cfg.validate(1)
    assert cfg.model.moe_token_drop_policy == "probs"
    assert cfg.training.rampup_batch_size == "2 2 100"


@pytest.mark.parametrize("extra,match", [
    (["--train-iters", "2", "--no-position-embedding"], "--position-embedding-type"),
    (["--train-iters", "2", "--rotary-percent", "1.5"], "--rotary-percent 1.5"),
    (["--train-iters", "2", "--lr-warmup-samples", "4"], "--train-samples"),
    (["--train-samples", "8", "--lr-warmup-iters", "1", "--lr-decay-samples", "8"],
     "both set the schedule"),
    (["--train-iters", "2", "--global-batch-size", "2", "--step-batch-size-schedule",
      "0:1 1K:4"], "ends at 4"),
    (["--train-iters", "2", "--step-batch-size-schedule", "10:4"], "start at 0"),
    (["--train-iters", "2", "--rampup-batch-size", "2", "x", "9"], "three integers"),
    (["--train-iters", "2", "--model-type", "bert", "--ckpt-format", "torch_dist"],
     "written for the gpt and mamba families"),
    (["--train-iters", "2", "--dataloader-type", "cyclic"], "--dataloader-type single"),
    (["--train-iters", "2", "--decoupled-min-lr", "1e-5"], "--decoupled-lr"),
    (["--train-iters", "2", "--model-type", "mamba", "--mamba-num-heads", "3",
      "--mamba-head-dim", "48"],
     "--mamba-num-heads x --mamba-head-dim = 144 must split into heads of --mamba-head-dim 48, "
     "a multiple of --mamba-num-groups 8"),
    (["--train-iters", "2", "--num-experts", "2", "--moe-expert-capacity-factor", "1.0",
      "--moe-token-drop-policy", "position"], "--moe-token-drop-policy probs"),
])
def test_refused_with_the_fix(extra, match, monkeypatch):
    with pytest.raises(ConfigError, match=match):
        _prepare(BASE + extra, monkeypatch)


@pytest.mark.parametrize("extra,match", [
    (["--model-type", "bert", "--calculate-per-token-loss"], "--calculate-per-token-loss"),
])
def test_not_yet_trained_flags_are_refused_for_training_only(extra, match, monkeypatch,
                                                             capsys):
    argv = BASE + ["--train-iters", "2"] + extra
    with pytest.raises(ConfigError, match=f"not implemented in loom yet.*{match}"):
        _prepare(argv, monkeypatch)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert _main(["train", "--dry-run", "--world-size", "1", *argv]) == 0  # predicted


def _train(argv):
    from loom.training.cli import prepare
    from loom.training.trainer import Trainer
    trainer = Trainer(prepare(_parse(argv)))
    return [r["loss"] for r in trainer.train()], trainer.iteration


def test_exit_duration_pretrained_and_checkpoint_args(tmp_path, monkeypatch, capsys):
    """--exit-duration-in-mins stops (all ranks agreeing) and saves after the iteration that
    passed the limit; --pretrained-checkpoint fine-tunes from it when --load holds nothing;
    --use-checkpoint-args takes the architecture from the checkpoint over the flags."""
    save = tmp_path / "pre"
    argv = BASE + ["--train-iters", "50", "--exit-duration-in-mins", "1e-9", "--save",
                   str(save), "--eval-iters", "0", "--no-progress-bar"]
    losses, iteration = run_distributed(1, _train, argv, start_method="fork")[0]
    assert iteration == 1 and len(losses) == 1 and (save / "iter_0000001").is_dir()
    fresh = tmp_path / "fresh"
    cfg = _prepare(BASE + ["--train-iters", "2", "--load", str(fresh), "--save", str(fresh),
                           "--pretrained-checkpoint", str(save)], monkeypatch)
    assert cfg.checkpoint.load == str(save) and cfg.checkpoint.finetune
    assert "fine-tuning from --pretrained-checkpoint" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="--pretrained-checkpoint"):
        _prepare(BASE + ["--train-iters", "2", "--pretrained-checkpoint", str(fresh)],
                 monkeypatch)
    other_shape = [w for w in BASE if w not in ("--num-layers", "2")] + ["--swiglu"]
    with pytest.raises(ConfigError):  # without it: another architecture is refused
        _prepare(other_shape + ["--train-iters", "2", "--load", str(save), "--finetune"],
                 monkeypatch)
    cfg = _prepare(other_shape + ["--train-iters", "2", "--load", str(save), "--finetune",
                                  "--use-checkpoint-args"], monkeypatch)
    assert cfg.model.swiglu is False and cfg.model.num_layers == 2  # the checkpoint's
    assert cfg.training.use_checkpoint_args
    with pytest.raises(ConfigError, match="--use-checkpoint-args needs --load"):
        _prepare(BASE + ["--train-iters", "2", "--use-checkpoint-args"], monkeypatch)


def test_rotary_percent_rotates_the_first_channels(monkeypatch):
    """--rotary-percent p: RoPE (frequencies of dimension r = int(d p)) on the first r channels
    of each head, the rest passed through (Megatron-LM's _apply_rotary_pos_emb_bshd)."""
    import torch

    from loom.models.attention import apply_rope, rope_cos_sin
    cfg = _prepare(BASE + ["--train-iters", "2", "--position-embedding-type", "rope",
                           "--rotary-percent", "0.5"], monkeypatch)
    assert cfg.model.head_dim == 8 and cfg.model.rotary_dim == 4
    x = torch.randn(5, 2, 3, 8)
    pos = torch.arange(5)
    cos, sin = rope_cos_sin(pos, cfg.model.rotary_dim, 10000.0)
    out = apply_rope(x, cos, sin)
    assert torch.equal(out[..., 4:], x[..., 4:])
    inv = 1.0 / 10000.0 ** (torch.arange(0, 4, 2).float() / 4)  # Megatron's RotaryEmbedding
    ang = torch.outer(pos.float(), inv)[:, None, None, :]
    a, b = x[..., :2], x[..., 2:4]
    ref = torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], dim=-1)
    torch.testing.assert_close(out[..., :4], ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="even number"):
        _prepare(BASE + ["--train-iters", "2", "--position-embedding-type", "rope",
                         "--rotary-percent", "0.4"], monkeypatch)


def _norms(argv):
    import torch

    from loom.training.cli import prepare
    from loom.training.trainer import Trainer
    trainer = Trainer(prepare(_parse(argv)))
    history = trainer.train()
    direct = torch.sqrt(sum((p.detach().double() ** 2).sum()
                            for c in trainer.model_chunks for p in c.parameters()))
    return [r["params_norm"] for r in history], float(direct)


def test_log_params_norm_counts_each_weight_once():
    """--log-params-norm: on 1 rank the plain L2 norm of every parameter after the step; at
    TP 2 and at PP 2 (2 ranks; a learning rate of 1e-9 keeps the weights at their
    layout-independent initial values) the same norm as on 1 rank: each weight counted once."""
    argv = BASE + ["--train-iters", "2", "--log-params-norm", "--eval-iters", "0",
                   "--no-progress-bar", "--position-embedding-type", "rope",
                   "--untie-embeddings-and-output-weights", "--num-query-groups", "2",
                   "--group-query-attention"]
    trained, direct = run_distributed(1, _norms, argv, start_method="fork")[0]
    assert trained[-1] == pytest.approx(direct, rel=1e-6)
    still = [w if w != "1e-3" else "1e-9" for w in argv]
    one = run_distributed(1, _norms, still, start_method="fork")[0][0]
    for layout in (["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]):
        two = run_distributed(2, _norms, still + layout, start_method="fork")[0][0]
        assert two == pytest.approx(one, rel=1e-6), layout


def test_wandb_flags_reach_wandb_init(tmp_path, monkeypatch):
    """--wandb-project / --wandb-exp-name / --wandb-save-dir / --wandb-entity as wandb.init's
    project / name / dir / entity (the real offline run: test_megatron_scripts.py's Mixtral
    copy); records logged as {kind}/{key} at step = iteration; nothing without a project."""
    import wandb

    from loom.training.wandb_writer import open_wandb, wandb_dir
    calls = {}

    class Run:
        dir = str(tmp_path)

        def log(self, values, step):
            calls.setdefault("log", []).append((values, step))

        def finish(self):
            calls["finished"] = True
    monkeypatch.setattr(wandb, "init", lambda **kw: calls.update(init=kw) or Run())
    assert open_wandb({"wandb_project": None}) is None and open_wandb(None) is None
    flat = {"wandb_project": "p", "wandb_exp_name": "n", "wandb_entity": "e",
            "wandb_save_dir": str(tmp_path / "w"), "save": str(tmp_path / "ck")}
    writer = open_wandb(flat)
    writer.log({"iteration": 3, "loss": 1.5, "flag": True}, "train")
    writer.close()
    init = calls["init"]
    assert (init["project"], init["name"], init["entity"], init["dir"]) == \
        ("p", "n", "e", str(tmp_path / "w"))
    assert calls["log"] == [({"train/loss": 1.5}, 3)] and calls["finished"]
    assert wandb_dir({"save": "/ck"}) == "/ck/wandb" and wandb_dir({}) == "wandb"


def test_rotary_scaling_factor_without_yarn_is_megatrons_no_effect(monkeypatch, capsys):
    """Scripts that train Llama 3.x give ``--use-rope-scaling --rotary-scaling-factor 32``
    (slime's llama3.2-3B); Megatron-LM reads --rotary-scaling-factor for YaRN and MLA only,
    so the run is Llama 3's scaling by --rope-scaling-factor (8): accepted, said once, the
    same model as without it. With YaRN it stays YaRN's factor."""
    rope = BASE + ["--train-iters", "2", "--position-embedding-type", "rope",
                   "--use-rope-scaling"]
    given = _prepare(rope + ["--rotary-scaling-factor", "32"], monkeypatch)
    assert given.model == _prepare(rope, monkeypatch).model
    assert given.model.rope_scaling_factor == 8.0 and given.model.rotary_scaling_factor is None
    assert _main(["train", "--dry-run", "--world-size", "1", *rope,
                  "--rotary-scaling-factor", "32"]) == 0
    assert ("--rotary-scaling-factor 32: no effect without YaRN or multi-latent attention (as "
            "in Megatron-LM); Llama 3's RoPE scaling (--use-rope-scaling) takes "
            "--rope-scaling-factor, 8 here") in capsys.readouterr().out
    yarn = _prepare(BASE + ["--train-iters", "2", "--position-embedding-type", "yarn",
                            "--rotary-scaling-factor", "32"], monkeypatch)
    assert yarn.model.rotary_scaling_factor == 32.0


def test_zero_turns_off_what_megatron_reads_as_off(monkeypatch, tmp_path):
    """Megatron tests these intervals and depths for truth (``if args.exit_interval and
    iteration % args.exit_interval == 0``, ``if args.mtp_num_layers:``): 0 is the feature off
    (HabanaAI's 175B script passes ``--exit-interval 0``), stored as None; below 0 is refused
    naming the flag; ``--save-interval 0`` with ``--save`` stays refused (Megatron asserts
    ``save_interval > 0`` there)."""
    from loom.config import config_from_args
    from loom.config.args import GROUPS
    marked = {f.name for dc in GROUPS.values() for f in dataclasses.fields(dc)
              if f.metadata.get("zero_is_off")}
    assert marked == {"exit_interval", "non_persistent_save_interval", "mtp_num_layers"}
    cfg = _prepare(BASE + ["--train-iters", "3", "--exit-interval", "0",
                           "--non-persistent-save-interval", "0", "--mtp-num-layers", "0"],
                   monkeypatch)
    assert cfg.checkpoint.exit_interval is None and cfg.model.mtp_num_layers is None
    assert cfg.checkpoint.non_persistent_save_interval is None
    with pytest.raises(ConfigError, match=r"--exit-interval must be >= 1 \(or 0: off\), got -1"):
        config_from_args(_parse(BASE + ["--train-iters", "3", "--exit-interval", "-1"])
                         ).validate(1)
    with pytest.raises(ConfigError, match="--save-interval must be >= 1, got 0"):
        config_from_args(_parse(BASE + ["--train-iters", "3", "--save", str(tmp_path),
                                        "--save-interval", "0"])).validate(1)
    # loom plan checks loom train's bounds on the same flags: 0 is off there too
    from loom.planner.cli import check_train_bounds
    check_train_bounds(argparse.Namespace(mtp_num_layers=0, exit_interval=0))
    # the run itself: 3 iterations, no exit at any (an interval 0 would divide by zero)
    assert _main(["train", *BASE, "--train-iters", "3", "--exit-interval", "0",
                  "--save", str(tmp_path / "ck"), "--log-interval", "1"]) == 0
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_megatron_llms_underscore_spelling_reads_as_megatron_lms_flag(monkeypatch, capsys):
    """epfLLM's Megatron-LLM spells Megatron-LM's flags with underscores (its
    examples/pretrain_bert_distributed_with_mp.sh, shortened): each unknown ``--a_b`` whose
    ``--a-b`` is loom's flag is read as it, named once at start; the configuration equals the
    hyphenated command line's; a misspelling is still refused with its suggestion, and loom's
    own underscore spelling is kept."""
    from loom.cli import hyphenated
    from loom.config import config_from_args
    llm = ["--tensor_model_parallel_size", "2", "--pipeline_model_parallel_size", "2",
           "--num_layers", "4", "--hidden_size", "32", "--num_attention_heads", "4",
           "--micro_batch_size", "2", "--global_batch_size", "16", "--seq_length=16",
           "--max_position_embeddings", "16", "--train_iters", "10", "--lr", "0.0001",
           "--lr_decay_style", "linear", "--min_lr", "1.0e-5", "--lr_decay_iters", "9",
           "--weight_decay", "1e-2", "--clip_grad", "1.0", "--lr_warmup_fraction", ".01",
           "--log_interval", "100", "--eval_interval", "1000", "--eval_iters", "10",
           "--split", "949,50,1", "--mock-data", "--vocab-size", "96", "--model-type", "bert"]
    dashed = [w.replace("_", "-") if w.startswith("--") else w for w in llm]
    from loom.training.cli import add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    known = parser._option_string_actions
    argv, spelled = hyphenated(["train", *llm], known)
    assert argv[1:] == dashed and "--seq_length as --seq-length" in spelled
    assert config_from_args(_parse(argv[1:])).to_flat() == \
        config_from_args(_parse(dashed)).to_flat()
    kept = ["train", "--use-checkpoint-opt_param-scheduler", "--hidden_sizee", "3", "--",
            "--hidden_size"]
    assert hyphenated(kept, known) == (kept, [])
    assert _main(["train", "--dry-run", "--world-size", "4", *llm]) == 0
    out = capsys.readouterr()
    assert out.out.count("Megatron-LLM's underscore spelling") == 1
    assert _main(["train", "--dry-run", *BASE, "--hidden_sizee", "3"]) == 2
    assert "--hidden_sizee: did you mean --hidden-size?" in capsys.readouterr().err
