"""What ``loom plan`` does with every flag of ``loom train`` (loom/planner/cli_args.py): each
config field outside the model section is read by the planner, costs nothing in a step, or is
named on stderr as not in the prediction; so is every Megatron flag loom train takes without
effect. No flag given to loom plan changes nothing silently. Single process, ~2 s."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from loom.config import LoomConfig
from loom.planner.cli_args import (NO_STEP_COST, NO_STEP_COST_MODEL, NO_STEP_COST_SECTIONS,
                                   PLAN_READS, UNMODELLED, UNPRICED_MODEL, fixed_from_args)

SMALL = ["--num-layers", "8", "--hidden-size", "256", "--num-attention-heads", "8",
         "--seq-length", "512", "--vocab-size", "32000", "--gpu", "H100-80GB", "--num-gpus", "8",
         "--global-batch-size", "64"]

# a read field -> (flags giving it, the fixed dimension it sets), against SMALL + BASE
BASE = ["--pipeline-model-parallel-size", "2"]
FIXES = {
    "tensor_model_parallel_size": (["--tensor-model-parallel-size", "2"], "tp"),
    "pipeline_model_parallel_size": (["--pipeline-model-parallel-size", "4"], "pp"),
    "context_parallel_size": (["--context-parallel-size", "2"], "cp"),
    "data_parallel_size": (["--data-parallel-size", "2"], "dp"),
    "num_layers_per_virtual_pipeline_stage": (["--num-layers-per-virtual-pipeline-stage", "2"],
                                              "vp"),
    "num_virtual_stages_per_pipeline_rank": (["--num-virtual-stages-per-pipeline-rank", "2"],
                                             "vp"),
    "pipeline_schedule": (["--pipeline-schedule", "1f1b"], "vp"),
    "pipeline_model_parallel_layout": (["--pipeline-model-parallel-layout", "Et*3|t*5L"],
                                       "layout"),
    "microbatch_group_size_per_virtual_pipeline_stage": (
        ["--microbatch-group-size-per-virtual-pipeline-stage", "4"], "vpg"),
    "account_for_embedding_in_pipeline_split": (["--account-for-embedding-in-pipeline-split"],
                                                "account_embedding"),
    "account_for_loss_in_pipeline_split": (["--account-for-loss-in-pipeline-split"],
                                           "account_loss"),
    "decoder_first_pipeline_num_layers": (["--decoder-first-pipeline-num-layers", "3"],
                                          "first_layers"),
    "decoder_last_pipeline_num_layers": (["--decoder-last-pipeline-num-layers", "3"],
                                         "last_layers"),
    "sequence_parallel": (["--tensor-model-parallel-size", "2", "--sequence-parallel"], "sp"),
    "expert_model_parallel_size": (["--num-experts", "4", "--expert-model-parallel-size", "2"],
                                   "ep"),
    "expert_tensor_parallel_size": (["--num-experts", "4", "--tensor-model-parallel-size", "2",
                                     "--expert-tensor-parallel-size", "1"], "etp"),
    "micro_batch_size": (["--micro-batch-size", "2"], "mbs"),
    "use_distributed_optimizer": (["--use-distributed-optimizer"], "zero"),
    "zero_stage": (["--zero-stage", "2"], "zero"),
    "use_torch_fsdp2": (["--use-torch-fsdp2"], "zero"),
    "use_megatron_fsdp": (["--use-megatron-fsdp"], "zero"),
    "data_parallel_sharding_strategy": (["--use-megatron-fsdp",
                                         "--data-parallel-sharding-strategy", "optim"], "zero"),
    "recompute_granularity": (["--recompute-granularity", "selective"], "recompute"),
    "recompute_activations": (["--recompute-activations"], "recompute"),
    "checkpoint_activations": (["--checkpoint-activations"], "recompute"),
    "recompute_method": (["--recompute-granularity", "full", "--recompute-method", "block",
                          "--recompute-num-layers", "2"], "rcl"),
    "recompute_num_layers": (["--recompute-granularity", "full", "--recompute-method", "block",
                              "--recompute-num-layers", "2"], "rcl"),
}
# read elsewhere than the fixed dimensions: the CP type, DP overlap, buckets, the gradient
# buffer's dtype (a plan run shows them); and what the planner counts anyway (16-bit weights)
OTHER_READS = {"cp_comm_type", "hierarchical_context_parallel_sizes", "global_batch_size",
               "overlap_grad_reduce", "overlap_param_gather", "ddp_bucket_size",
               "accumulate_allreduce_grads_in_fp32", "grad_reduce_in_bf16",
               "use_precision_aware_optimizer", "main_grads_dtype", "main_params_dtype",
               "exp_avg_dtype", "exp_avg_sq_dtype", "optimizer", "muon_num_ns_steps",
               "muon_split_qkv", "muon_fp32_matmul_prec", "muon_tp_mode",
               "optimizer_offload_fraction"}
ASSUMED = {"bf16", "fp16", "sgd_momentum"}


def _args(argv: list) -> argparse.Namespace:
    from loom.planner.cli import add_arguments, plan_options
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    plan_options(args)
    return args


def _plan(argv, capsys) -> tuple[int, str, str]:
    from loom.cli import main
    with pytest.raises(SystemExit) as e:
        main(["plan", *argv])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def test_every_config_field_has_one_planner_class():
    """Every field of every section but the model is read, step-free or named as not in the
    prediction: exactly one of them, and no class lists a field the config lacks."""
    cfg = LoomConfig()
    sections = {f.name: [g.name for g in dataclasses.fields(getattr(cfg, f.name))]
                for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(getattr(cfg, f.name))}
    classes = (PLAN_READS, NO_STEP_COST, set(UNMODELLED))
    everything = set()
    for section, names in sections.items():
        if section == "model":
            continue
        for name in names:
            hits = sum(name in c for c in classes) + (section in NO_STEP_COST_SECTIONS)
            assert hits == 1, (section, name, hits)
        everything |= set(names)
    assert set().union(*classes) <= everything, set().union(*classes) - everything
    assert set(FIXES) | OTHER_READS | ASSUMED == PLAN_READS


@pytest.mark.parametrize("name", sorted(FIXES))
def test_each_read_layout_flag_fixes_its_dimension(name):
    from loom.planner.cli import _model_from_args
    argv, key = FIXES[name]
    args = _args(SMALL + BASE + argv)
    model = _model_from_args(args)[0]
    base = fixed_from_args(_args(SMALL + BASE), model)
    got = fixed_from_args(args, model)
    assert key in got and got.get(key) != base.get(key), (name, got)


def test_assumed_and_step_free_flags_change_nothing_and_unmodelled_ones_are_named(capsys):
    """``--bf16``, ``--lr``, ``--save`` ...: the same plan, no warning. ``--deterministic-mode``,
    ``--compile``, and a Megatron flag loom train takes without effect (``--fp8-format``,
    ``--tp-comm-overlap``, ``--distribute-saved-activations``): the same plan, one warning line
    each kind, naming every flag; ``--json`` stays parseable on stdout. (``--optimizer muon`` is
    priced: tests/planner/test_planner_muon.py.)"""
    runs = []
    for extra in ([], ["--bf16", "--accumulate-allreduce-grads-in-fp32", "--lr", "1e-4",
                       "--train-iters", "10", "--save", "/tmp/never-written", "--seed", "7",
                       "--log-interval", "5", "--optimizer", "adam"],
                  ["--deterministic-mode", "--compile", "--fp8-format", "hybrid",
                   "--tp-comm-overlap", "--distribute-saved-activations"]):
        code, out, err = _plan(SMALL + extra + ["--json", "--top", "3"], capsys)
        assert code == 0, err
        runs.append((json.loads(out)["layouts"], err))
    plain, step_free, named = runs
    assert step_free == plain and named[0] == plain[0] and plain[1] == ""
    lines = named[1].strip().splitlines()
    assert len(lines) == 2 and all(ln.startswith("loom plan: warning: ") for ln in lines)
    for flag in ("--deterministic-mode", "--compile", "--fp8-format hybrid", "--tp-comm-overlap",
                 "--distribute-saved-activations"):
        assert flag in named[1], flag


def test_the_no_spellings_fix_their_setting_off(capsys):
    """A switch given off is a choice, not "not given": ``--no-use-distributed-optimizer``
    plans ZeRO 0; ``--no-overlap-grad-reduce`` / ``--no-overlap-param-gather`` plan that
    collective exposed and leave its flag out of the command (both were searched or assumed
    on)."""
    from loom.planner.cli import _model_from_args
    args = _args(SMALL + ["--no-use-distributed-optimizer"])
    assert fixed_from_args(args, _model_from_args(args)[0])["zero"] == 0
    argv = ["llama3-8b", "--gpu", "H100-80GB", "--num-gpus", "64", "--global-batch-size", "256",
            "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
            "--context-parallel-size", "1", "--zero-stage", "1", "--micro-batch-size", "1",
            "--recompute-granularity", "full", "--json", "--top", "1"]  # many buckets
    rows = {}
    for extra in ([], ["--no-overlap-grad-reduce"], ["--no-overlap-param-gather"]):
        code, out, err = _plan(argv + extra, capsys)
        assert code == 0, err
        rows[" ".join(extra)] = json.loads(out)["layouts"][0]
    on, grad, param = rows[""], rows["--no-overlap-grad-reduce"], rows["--no-overlap-param-gather"]
    assert "--overlap-grad-reduce" in on["command"] and "--overlap-param-gather" in on["command"]
    assert "--overlap-grad-reduce" not in grad["command"]
    assert "--overlap-param-gather" not in param["command"]
    assert "--overlap-grad-reduce" in param["command"]
    for off in (grad, param):
        assert off["time_terms_s"]["dp_comm"] > on["time_terms_s"]["dp_comm"]


def test_sgd_is_priced_without_a_warning(capsys):
    """``--optimizer sgd``: SGD's states (8 bytes per parameter with the master copy, 4 without
    momentum) instead of Adam's 12, and no warning."""
    argv = SMALL + ["--zero-stage", "0", "--tensor-model-parallel-size", "1",
                    "--pipeline-model-parallel-size", "1", "--micro-batch-size", "1",
                    "--json", "--top", "1"]
    got = {}
    for extra in ([], ["--optimizer", "sgd"], ["--optimizer", "sgd", "--sgd-momentum", "0"]):
        code, out, err = _plan(argv + extra, capsys)
        assert code == 0 and err == "", err
        got[len(extra)] = json.loads(out)["layouts"][0]["memory_terms_gb"]["optimizer"]
    assert got[2] == pytest.approx(got[0] * 8 / 12) and got[4] == pytest.approx(got[0] * 4 / 12)


def test_command_trains_in_the_precision_planned(capsys):
    """The planner prices 16-bit training; loom train (as Megatron) trains in fp32 without
    ``--bf16`` / ``--fp16``, so the printed command carries the one planned: ``--bf16`` by
    default, ``--fp16`` when given; none after ``--no-bf16``, which is named as not priced."""
    from loom.planner.command import command_config
    for extra, want in (([], "bf16"), (["--fp16"], "fp16")):
        code, out, _ = _plan(SMALL + extra + ["--json", "--top", "1"], capsys)
        cfg = command_config(json.loads(out)["layouts"][0]["command"], 8)
        assert code == 0 and getattr(cfg.training, want), (extra, want)
    # --no-bf16 asks for fp32: the command keeps it, the plan says it priced 16-bit
    code, out, err = _plan(SMALL + ["--no-bf16", "--json", "--top", "1"], capsys)
    cfg = command_config(json.loads(out)["layouts"][0]["command"], 8)
    assert not (cfg.training.bf16 or cfg.training.fp16) and "priced as 16-bit" in err


def test_gradient_dtype_is_priced_and_carried_to_the_command(capsys):
    """The gradient buffer's bytes follow Megatron's rule (``gradient_option``): bf16 keeps fp32
    main gradients unless ``--grad-reduce-in-bf16`` (half the G term, and the command carries
    the flag); ``--fp16`` reduces in fp16 unless ``--accumulate-allreduce-grads-in-fp32``
    (carried). Each printed command makes loom train keep the buffer that was priced."""
    from loom.planner.command import command_config
    argv = SMALL + ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                    "--zero-stage", "1", "--json", "--top", "1"]
    got = {}
    for name, extra, flag, in_fp32 in (
            ("bf16", [], None, True),
            ("bf16-grads", ["--bf16", "--grad-reduce-in-bf16"], "--grad-reduce-in-bf16", False),
            ("fp16", ["--fp16"], None, False),
            ("fp16-fp32", ["--fp16", "--accumulate-allreduce-grads-in-fp32"],
             "--accumulate-allreduce-grads-in-fp32", True)):
        code, out, err = _plan(argv + extra, capsys)
        rec = json.loads(out)["layouts"][0]
        got[name] = rec["memory_terms_gb"]["gradients"]
        assert code == 0 and (flag is None or flag in rec["command"]), (name, rec["command"])
        cfg = command_config(rec["command"], 8)
        assert cfg.training.accumulate_allreduce_grads_in_fp32 is in_fp32, name
    assert got["bf16-grads"] == pytest.approx(got["bf16"] / 2)
    assert got["fp16"] == pytest.approx(got["bf16"] / 2)
    assert got["fp16-fp32"] == pytest.approx(got["bf16"])


def test_precision_aware_optimizer_is_priced_and_carried_to_the_command(capsys):
    """``--use-precision-aware-optimizer``: the O term holds the stored bytes (bf16 moments and
    the 2-byte remainder of the fp32 master: 6 of 12 bytes per parameter; fp8 / fp16 moments
    and fp16 masters: 5), the search keeps to the distributed optimizer Megatron requires, and
    the printed command carries the flags; loom train's checks refuse what it refuses."""
    from loom.planner.command import command_config
    argv = SMALL + ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                    "--json", "--top", "3"]
    got = {}
    for name, extra in (("adam", ["--zero-stage", "1"]),
                        ("bf16", ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
                                  "--exp-avg-sq-dtype", "bf16"]),
                        ("low", ["--use-precision-aware-optimizer", "--exp-avg-dtype", "fp8",
                                 "--exp-avg-sq-dtype", "fp16", "--main-params-dtype", "fp16"])):
        code, out, err = _plan(argv + extra, capsys)
        recs = json.loads(out)["layouts"]
        assert code == 0 and err == "" and all(r["zero"] == 1 for r in recs), (name, err)
        got[name] = recs[0]["memory_terms_gb"]["optimizer"]
        cfg = command_config(recs[0]["command"], 8)
        t = cfg.training
        assert t.use_precision_aware_optimizer is (name != "adam") and \
            t.use_distributed_optimizer, recs[0]["command"]
        if name == "low":
            assert (t.exp_avg_dtype, t.exp_avg_sq_dtype, t.main_params_dtype) == \
                ("fp8", "fp16", "fp16")
    assert got["bf16"] == pytest.approx(got["adam"] * 6 / 12)
    assert got["low"] == pytest.approx(got["adam"] * 5 / 12)
    # --optimizer-cpu-offload: the offloaded share off the GPU, its host step named as unpriced
    code, out, err = _plan(argv + ["--use-precision-aware-optimizer", "--optimizer-cpu-offload",
                                   "--optimizer-offload-fraction", "0.75"], capsys)
    rec = json.loads(out)["layouts"][0]
    assert code == 0 and "--optimizer-cpu-offload" in err and "host step" in err, err
    assert rec["memory_terms_gb"]["optimizer"] == pytest.approx(got["adam"] * 10 / 12 / 4)
    assert "--optimizer-offload-fraction 0.75" in rec["command"]
    for extra, words in ((["--exp-avg-dtype", "bf16"], "needs --use-precision-aware-optimizer"),
                         (["--use-precision-aware-optimizer", "--optimizer", "sgd"],
                          "--optimizer adam"),
                         (["--use-precision-aware-optimizer", "--zero-stage", "0"],
                          "needs --use-distributed-optimizer")):
        code, out, err = _plan(argv + extra, capsys)
        assert code != 0 and words in err, (extra, err)


def test_dry_run_and_exact_count_price_the_precision_aware_states():
    """``loom train --dry-run`` with ``--use-precision-aware-optimizer --exp-avg-dtype bf16
    --exp-avg-sq-dtype bf16``: the prediction's options and the exact meta-device count hold 2
    (remainder) + 2 + 2 bytes per parameter of optimizer states, half of the 12 without it."""
    from loom.planner.meta_count import count_rank_states
    from loom.planner.predict import run_options
    from testkit.config import tiny_config
    flags = dict(use_precision_aware_optimizer=True, exp_avg_dtype="bf16",
                 exp_avg_sq_dtype="bf16")
    plain, aware = (tiny_config("llama", bf16=True, use_distributed_optimizer=True,
                                **kw).validate(1) for kw in ({}, flags))
    o = run_options(aware)
    assert (o.master_bytes, o.optimizer_state_bytes) == (2.0, 4.0)
    assert (run_options(plain).master_bytes, run_options(plain).optimizer_state_bytes) == (4.0, 8.0)
    a, b = count_rank_states(plain, 1), count_rank_states(aware, 1)
    assert a["optimizer_bytes"] == 12 * a["params"] and b["optimizer_bytes"] == 6 * b["params"]


def test_dry_run_and_exact_count_use_the_run_s_gradient_dtype():
    """``loom train --dry-run``: the planner's prediction (``run_options``) and the exact
    meta-device count both price a ``--grad-reduce-in-bf16`` run's gradients at 2 bytes."""
    from loom.planner.meta_count import count_rank_states
    from loom.planner.predict import predict_layout, run_options
    from testkit.config import tiny_config
    fp32, bf16 = (tiny_config("llama", bf16=True, grad_reduce_in_bf16=g).validate(1)
                  for g in (False, True))
    assert (run_options(fp32).grad_bytes, run_options(bf16).grad_bytes) == (4, 2)
    a, b = count_rank_states(fp32, 1), count_rank_states(bf16, 1)
    assert a["gradients_bytes"] == 4 * a["params"] and b["gradients_bytes"] == 2 * b["params"]
    ga, gb = (predict_layout(c, 1, "H100-80GB")["memory_bytes"]["gradients"] for c in (fp32, bf16))
    assert gb == pytest.approx(ga / 2, rel=1e-12)


def test_bucket_size_is_planned_and_carried_to_the_command(capsys):
    """``--ddp-bucket-size`` was accepted and ignored: the plan now times the given buckets and
    its command carries them."""
    argv = SMALL + ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
                    "--zero-stage", "1", "--json", "--top", "1"]
    _, out, _ = _plan(argv, capsys)
    _, small, _ = _plan(argv + ["--ddp-bucket-size", "100000"], capsys)
    a, b = json.loads(out)["layouts"][0], json.loads(small)["layouts"][0]
    assert "--ddp-bucket-size 100000" in b["command"] and "--ddp-bucket-size 100000" \
        not in a["command"]
    assert b["time_terms_s"]["dp_comm"] > a["time_terms_s"]["dp_comm"]


def test_every_model_field_is_priced_free_or_named():
    """Every ModelConfig field is in one of: named as not priced (:data:`UNPRICED_MODEL`), free
    in a step (:data:`NO_STEP_COST_MODEL`), or read by the planner's code (its name appears in
    loom/planner outside the table itself): a new model field the planner ignores fails here
    until it is priced or classed. A free field may be set by a preset (a model's definition),
    not read elsewhere."""
    import pathlib
    import re
    import loom.planner as planner
    from loom.config import ModelConfig
    src = "".join(p.read_text() for p in pathlib.Path(planner.__file__).parent.glob("*.py")
                  if p.name != "cli_args.py")
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(UNPRICED_MODEL) <= names and NO_STEP_COST_MODEL <= names
    assert not set(UNPRICED_MODEL) & NO_STEP_COST_MODEL
    for name in names - set(UNPRICED_MODEL) - NO_STEP_COST_MODEL:
        assert re.search(rf"\b{name}\b", src), f"{name}: not read by the planner; class it"
    read = "".join(p.read_text() for p in pathlib.Path(planner.__file__).parent.glob("*.py")
                   if p.name not in ("cli_args.py", "presets.py"))
    for name in NO_STEP_COST_MODEL:  # a free field the planner does read belongs to neither
        assert not re.search(rf"\b{name}\b", read), name


def test_unpriced_model_fields_are_named(capsys):
    """``--attention-output-gate``, ``--window-size``, Gated DeltaNet layers: planned as the
    layers the planner prices, and said so on stderr (and under the dry-run's prediction)."""
    from loom.planner.predict import format_prediction, predict_layout
    from testkit.config import tiny_config
    for extra, flag in ((["--attention-output-gate"], "--attention-output-gate"),
                        (["--window-size", "128,0"], "--window-size 128,0")):
        code, out, err = _plan(SMALL + extra + ["--json", "--top", "1"], capsys)
        assert code == 0 and json.loads(out)["layouts"], err
        assert err.startswith("loom plan: warning: not in the prediction: " + flag), err
    pred = predict_layout(tiny_config("llama", attention_output_gate=True).validate(1), 1,
                          "H100-80GB")
    assert "--attention-output-gate (the attention output gate's saved activations" in \
        format_prediction(pred)


def test_dry_run_prediction_names_what_it_does_not_price():
    """``loom train --dry-run``'s planner prediction says the same of the run's own config."""
    from loom.planner.predict import format_prediction, predict_layout
    from testkit.config import tiny_config
    plain = predict_layout(tiny_config("llama", bf16=True).validate(1), 1, "H100-80GB")
    assert plain["unpriced"] is None
    fp32 = predict_layout(tiny_config("llama").validate(1), 1, "H100-80GB")  # the planner's
    assert "fp32, no --bf16 / --fp16 (priced as 16-bit training)" in fp32["unpriced"]  # bytes
    pred = predict_layout(tiny_config("llama", bf16=True, compile=True).validate(1), 1,
                          "H100-80GB")
    assert "--compile (priced as eager PyTorch kernels)" in format_prediction(pred)


@pytest.mark.parametrize("extra,words", [
    (["--use-precision-aware-optimizer", "--optimizer-cpu-offload",
      "--optimizer-offload-fraction", "1.5"], "--optimizer-offload-fraction must be <= 1"),
    (["--micro-batch-size", "-3"], "--micro-batch-size must be >= 1"),
    (["--muon-num-ns-steps", "0", "--optimizer", "muon"], "--muon-num-ns-steps must be >= 1"),
])
def test_loom_train_s_bounds_are_refused_before_the_search(extra, words, capsys):
    """A value loom train refuses by its field's bounds is refused by loom plan too, in one
    line naming the flag (it was planned, and the printed command then failed)."""
    code, out, err = _plan(SMALL + extra + ["--json"], capsys)
    assert code == 2 and out == "" and words in err and len(err.strip().splitlines()) == 1, err
