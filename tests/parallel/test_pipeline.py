"""Pipeline parallelism: parity with the single-process run (loss and every gradient, 3 steps)
for GPipe / 1F1B / interleaved at PP=2, PP=4 and TP=2 x PP=2 x DP=2, GPT-2 and LLaMA layouts;
layer splits; the in-flight memory bound; config validation; an end-to-end Trainer run.

Each ``run_distributed`` call costs a few seconds of process start-up, so every spawned world
runs a list of cases and reports failures back; the assertions happen in the parent.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from loom.config import ConfigError, LoomConfig, ParallelConfig
from loom.parallel.pipeline.placement import chunk_layers, stage_layer_counts, validate_pipeline
from loom.parallel.pipeline.schedules import gpipe_ops, interleaved_ops, one_f_one_b_ops
from testkit import run_distributed
from testkit.numerics import PARITY_RTOL
from testkit.config import PARITY_ADAM_EPS, tiny_config

ATOL = 1e-7  # added to PARITY_RTOL x max|want| (a gradient that is all ~0)
STEPS = 3


def make_cfg(layout="gpt2", layers=4, tp=1, pp=1, dp=1, m=1, schedule="1f1b", lpv=None,
             first=None, last=None, b=2, iters=3, cp=1, sp=False, group=None) -> LoomConfig:
    return tiny_config(
        "gpt" if layout == "gpt2" else "llama", num_layers=layers, vocab_size=300,
        make_vocab_size_divisible_by=8, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_schedule=schedule,
        num_layers_per_virtual_pipeline_stage=lpv, decoder_first_pipeline_num_layers=first,
        decoder_last_pipeline_num_layers=last, context_parallel_size=cp, sequence_parallel=sp,
        microbatch_group_size_per_virtual_pipeline_stage=group, micro_batch_size=b,
        global_batch_size=b * m * dp, train_iters=iters, lr_decay_style="constant", seed=1234,
        adam_eps=PARITY_ADAM_EPS,  # eps 1e-8: Adam amplifies 1e-9 TP reordering noise in
        # near-zero grads to ~lr sign flips (also seen at TP=2 without pipelining); 1e-6 still
        # let it reach 1.5e-5 of a gradient by step 3 once the padded vocabulary columns train
        # (issue 42; as tests/parallel/test_parallel_parity.py, eps 1e-4)
        no_progress_bar=True, log_interval=1)


def reference_cfg(cfg: LoomConfig) -> LoomConfig:
    import copy
    ref = copy.deepcopy(cfg)
    ref.parallel = ParallelConfig()
    ref.training.global_batch_size = cfg.training.global_batch_size
    return ref.validate(1)  # resolved for its one rank


# -- spawned workers ---------------------------------------------------------------------------------

_REF_CACHE: dict = {}


def _reference(cfg: LoomConfig, device: str = "cpu") -> dict:
    """Single-process run of the same model and global batch on ``device`` (cached per process:
    the reference does not depend on the parallel layout or schedule)."""
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    rcfg = reference_cfg(cfg)
    key = (repr(rcfg), device)
    if key not in _REF_CACHE:
        from loom.training.step import grad_getter
        ref = Trainer(rcfg, mesh=ParallelMesh.single(device))
        params = dict(ref.model_chunks[0].named_parameters())
        grad_of = grad_getter(ref.reducers)  # main gradients (e.g. ZeRO-1/2 flags at d = 1)
        steps = []
        for _ in range(STEPS):
            loss = ref.global_loss(ref.forward_backward(ref.batches(ref.train_ds,
                                                                    ref.consumed_samples)))
            grads = {n: grad_of(p).detach().reshape(p.shape).clone() for n, p in params.items()}
            steps.append((loss, grads, ref.optimizer_step()))
            ref.consumed_samples += ref.global_batch
        _REF_CACHE[key] = {"steps": steps, "eval": ref.evaluate(iters=1)["valid_loss"]}
    return _REF_CACHE[key]


def _parity_cases(cases: list[dict], device: str = "cpu") -> list[dict]:
    """Run every case (a make_cfg kwargs dict) on this world; compare with the reference (on
    ``device``: tests/cuda runs these cases with two ranks on one GPU)."""
    import torch.distributed as dist

    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.registry import local_shard
    from loom.training.step import grad_getter
    from loom.training.trainer import Trainer

    world = dist.get_world_size()
    out = []
    meshes = {}
    for case in cases:
        case = dict(case)
        case.setdefault("dp", world // (case.get("tp", 1) * case.get("pp", 1) * case.get("cp", 1)))
        extra = case.get("extra", {})  # {"section.field": value}: e.g. recompute, ZeRO, MoE
        cfg = make_cfg(**{k: v for k, v in case.items() if k != "extra"})
        for key, val in extra.items():
            section, name = key.split(".")
            setattr(getattr(cfg, section), name, val)
        cfg = cfg.validate(world)
        key = (case.get("tp", 1), case.get("pp", 1), case.get("cp", 1))
        if key not in meshes:
            meshes[key] = ParallelMesh.build(tp=key[0], pp=key[1], cp=key[2],
                                             device=torch.device(device))
        mesh = meshes[key]
        tr = Trainer(cfg, mesh=mesh)
        ref = _reference(cfg, device)
        errors, n_compared, peaks, bubbles = [], 0, [], []
        grad_of = grad_getter(tr.reducers)  # main-gradient shards under ZeRO-1/2
        for step in range(STEPS):
            loss = tr.global_loss(tr.forward_backward(tr.batches(tr.train_ds, tr.consumed_samples)))
            peaks.append(tr.last_stats.peak_in_flight)
            bubbles.append(tr.last_stats.bubble_fraction)
            ref_loss, ref_grads, ref_norm = ref["steps"][step]
            if not math.isclose(loss, ref_loss, rel_tol=PARITY_RTOL, abs_tol=1e-6):
                errors.append(f"step {step}: loss {loss} != reference {ref_loss}")
            for chunk in tr.model_chunks:
                for name, p in chunk.named_parameters():
                    rg = ref_grads[name]
                    want = local_shard(rg, tr.registry[name], mesh.tp_rank, mesh.tp_size)
                    got = grad_of(p)
                    if got.numel() != want.numel():  # this rank's reduced range of p
                        lo, hi = next(r for b in tr.reducers for r in getattr(b, "reducers", [b])
                                      if any(q is p for q in r.params)).shard_range(p)
                        want = want.reshape(-1)[lo:hi]
                    got = got.reshape(want.shape)
                    n_compared += 1
                    if not want.numel():
                        continue
                    # atol: a small fraction of the tensor's scale (TP's reordered reductions
                    # differ from the reference by ~1e-9 absolute, with or without pipelining)
                    atol = ATOL + PARITY_RTOL * want.abs().max().item()
                    if not torch.allclose(got, want, rtol=PARITY_RTOL, atol=atol):
                        err = (got - want).abs().max().item()
                        errors.append(f"step {step}: grad {name} max err {err:.3e}")
            tr_norm = tr.optimizer_step()
            if not math.isclose(tr_norm, ref_norm, rel_tol=1e-5):
                errors.append(f"step {step}: grad norm {tr_norm} != reference {ref_norm}")
            tr.consumed_samples += tr.global_batch
        # evaluation (forward_only) matches the reference too
        ev = tr.evaluate(iters=1)
        if not math.isclose(ev["valid_loss"], ref["eval"], rel_tol=PARITY_RTOL):
            errors.append(f"eval loss {ev['valid_loss']} != reference {ref['eval']}")
        layers = sorted({int(n.split(".")[1]) for c in tr.model_chunks
                         for n, _ in c.named_parameters() if n.startswith("layers.")})
        out.append({"case": case, "errors": errors, "compared": n_compared, "peak": max(peaks),
                    "pp_rank": mesh.pp_rank, "layers": layers, "bubble": bubbles[-1],
                    "ops": tr.last_stats.op_counts,
                    "chunks": [sorted({int(n.split(".")[1]) for n, _ in c.named_parameters()
                                       if n.startswith("layers.")}) for c in tr.model_chunks]})
    return out


def _trainer_e2e(tmpdir: str) -> dict:
    """Full Trainer.train() at PP=2 with --timeline and JSON logs."""
    import torch.distributed as dist

    from loom.training.trainer import Trainer
    cfg = make_cfg("gpt2", layers=4, pp=2, m=4, schedule="1f1b", iters=4)
    cfg.logging.timeline = os.path.join(tmpdir, "trace.json")
    cfg.logging.log_json = os.path.join(tmpdir, "log.jsonl")
    cfg.logging.eval_interval = 2
    cfg.logging.eval_iters = 1
    cfg = cfg.validate(dist.get_world_size())
    tr = Trainer(cfg)
    hist = tr.train()
    return {"history": hist, "rank": dist.get_rank()}


# -- tests -----------------------------------------------------------------------------------------

def _check(results, expect_cases):
    assert len(results[0]) == expect_cases
    for rank, per_rank in enumerate(results):
        for r in per_rank:
            assert r["compared"] > 0
            assert not r["errors"], f"rank {rank} {r['case']}: " + "; ".join(r["errors"][:5])


def _pp2_cases():
    cases = []
    for layout in ("gpt2", "llama"):
        for sched in ("gpipe", "1f1b"):
            for m in (1, 2, 5):
                cases.append(dict(layout=layout, pp=2, m=m, schedule=sched))
        cases.append(dict(layout=layout, pp=2, m=2, schedule="interleaved", lpv=1))
        cases.append(dict(layout=layout, pp=2, m=4, schedule="interleaved", lpv=1))
    # m = 5 not a multiple of p: Megatron-Core's micro-batch groups of N = 3 (then 2)
    cases.append(dict(layout="gpt2", pp=2, m=5, schedule="interleaved", lpv=1,
                      extra={"parallel.microbatch_group_size_per_virtual_pipeline_stage": 3}))
    # Megatron's --pipeline-model-parallel-layout: uneven virtual stages, and virtual stages
    # holding only the embedding or only the loss (--account-for-*-in-pipeline-split's split)
    lay = "parallel.pipeline_model_parallel_layout"
    cases.append(dict(layout="llama", layers=6, pp=2, m=2, schedule="interleaved",
                      extra={lay: "Et|tt|t|ttL"}))
    cases.append(dict(layout="gpt2", layers=2, pp=2, m=2, schedule="interleaved",
                      extra={lay: "E|t|t|L"}))
    # uneven split: 6 layers as 1 + 5, and 4 + 2
    cases.append(dict(layout="gpt2", layers=6, pp=2, m=3, schedule="1f1b", first=1))
    cases.append(dict(layout="llama", layers=6, pp=2, m=3, schedule="1f1b", last=2))
    return cases


def test_parity_pp2():
    cases = _pp2_cases()
    results = run_distributed(2, _parity_cases, cases)
    _check(results, len(cases))
    for r0, r1 in zip(*results):
        if r0["case"].get("first") == 1:
            assert r0["layers"] == [0] and r1["layers"] == [1, 2, 3, 4, 5]
        if r0["case"].get("last") == 2:
            assert r0["layers"] == [0, 1, 2, 3] and r1["layers"] == [4, 5]
        lay = r0["case"].get("extra", {}).get("parallel.pipeline_model_parallel_layout")
        if lay == "Et|tt|t|ttL":
            assert r0["chunks"] == [[0], [3]] and r1["chunks"] == [[1, 2], [4, 5]]
        elif lay == "E|t|t|L":  # the first chunk only embeds, the last only has the loss
            assert r0["chunks"] == [[], [1]] and r1["chunks"] == [[0], []]
        elif r0["case"]["schedule"] == "interleaved":
            assert r0["chunks"] == [[0], [2]] and r1["chunks"] == [[1], [3]]


def _pp4_cases():
    cases = []
    for layout in ("gpt2", "llama"):
        for sched in ("gpipe", "1f1b"):
            for m in (1, 4, 9):
                cases.append(dict(layout=layout, pp=4, m=m, schedule=sched))
        cases.append(dict(layout=layout, layers=8, pp=4, m=4, schedule="interleaved", lpv=1))
    cases.append(dict(layout="gpt2", layers=8, pp=4, m=8, schedule="interleaved", lpv=1))
    cases.append(dict(layout="llama", layers=8, pp=4, m=5, schedule="interleaved", lpv=1,
                      extra={"parallel.microbatch_group_size_per_virtual_pipeline_stage": 5}))  # m = 5 in one group of N = 5 (Megatron's --micro...)
    cases.append(dict(layout="gpt2", layers=8, pp=4, m=5, schedule="1f1b", first=1, last=3))
    # PP=2 x DP=2 and TP=2 x PP=2 on the same 4 ranks
    cases.append(dict(layout="gpt2", pp=2, m=3, schedule="1f1b"))
    cases.append(dict(layout="llama", pp=2, m=2, schedule="interleaved", lpv=1))
    cases.append(dict(layout="gpt2", tp=2, pp=2, m=3, schedule="1f1b"))
    cases.append(dict(layout="llama", tp=2, pp=2, m=2, schedule="gpipe"))
    return cases


def test_parity_pp4_and_memory():
    cases = _pp4_cases()
    results = run_distributed(4, _parity_cases, cases)
    _check(results, len(cases))
    for i, case in enumerate(cases):
        stage0 = results[0][i]
        if case.get("pp") == 4 and case["schedule"] == "gpipe":
            assert stage0["peak"] == case["m"], (case, stage0["peak"])
        if case.get("pp") == 4 and case["schedule"] == "1f1b":
            assert stage0["peak"] <= 4, (case, stage0["peak"])
            if case["m"] >= 4:
                assert stage0["peak"] == 4
            assert results[3][i]["peak"] == 1  # the last stage holds one micro-batch
        if case.get("first") == 1:
            assert [results[r][i]["layers"] for r in range(4)] == [[0], [1, 2], [3, 4], [5, 6, 7]]


def test_parity_tp2_pp2_dp2():
    cases = [dict(layout="gpt2", tp=2, pp=2, m=3, schedule="1f1b"),
             dict(layout="llama", tp=2, pp=2, m=3, schedule="1f1b"),
             dict(layout="gpt2", tp=2, pp=2, m=2, schedule="interleaved", lpv=1),
             dict(layout="llama", tp=2, pp=2, m=1, schedule="gpipe"),
             # pipeline composed with sequence and context parallelism: activations of
             # [s/(c t), b, h] cross the stage boundary
             dict(layout="llama", tp=2, pp=2, m=3, schedule="1f1b", sp=True),
             dict(layout="gpt2", tp=2, pp=2, cp=2, m=2, schedule="1f1b", sp=True)]
    results = run_distributed(8, _parity_cases, cases)
    _check(results, len(cases))


def test_trainer_end_to_end(tmp_path):
    results = run_distributed(2, _trainer_e2e, str(tmp_path))
    hist = results[0]["history"]
    assert len(hist) == 4
    assert all(math.isfinite(h["loss"]) for h in hist) and hist[0]["loss"] > 0
    assert all(0.0 <= h["bubble_fraction"] <= 1.0 for h in hist)
    assert [h["loss"] for h in results[1]["history"]] == [h["loss"] for h in hist]
    trace = json.load(open(tmp_path / "trace.json"))["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    cats = {e["cat"] for e in spans}
    assert {"forward", "backward", "send", "recv", "idle", "optimizer"} <= cats
    assert not list(tmp_path.glob("trace.json.rank*"))
    logs = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    assert any("bubble_fraction" in rec for rec in logs)


# -- single-process checks ---------------------------------------------------------------------------

def test_layer_split():
    assert stage_layer_counts(8, 4) == [2, 2, 2, 2]
    assert stage_layer_counts(8, 4, first=1, last=3) == [1, 2, 2, 3]
    assert stage_layer_counts(7, 4, first=1) == [1, 2, 2, 2]
    assert stage_layer_counts(6, 2, last=2) == [4, 2]
    assert chunk_layers(8, 2, 0, layers_per_virtual_stage=2) == [[0, 1], [4, 5]]
    assert chunk_layers(8, 2, 1, layers_per_virtual_stage=2) == [[2, 3], [6, 7]]
    assert chunk_layers(8, 4, 3, layers_per_virtual_stage=1) == [[3], [7]]


def test_op_lists_cover_every_microbatch():
    for p in (2, 4):
        for r in range(p):
            for m in (1, p, 2 * p + 1):
                for ops in (gpipe_ops(m, p, r), one_f_one_b_ops(m, p, r)):
                    assert sorted(ops) == sorted([("F", 0, j) for j in range(m)]
                                                 + [("B", 0, j) for j in range(m)])
                    done = set()
                    for kind, c, j in ops:  # backward after its own forward
                        assert kind == "F" or ("F", c, j) in done
                        done.add((kind, c, j))
            for m in (p, 2 * p, 3 * p):
                ops = interleaved_ops(m, p, r, 2)
                assert sorted(ops) == sorted([(k, c, j) for k in "FB" for c in range(2)
                                              for j in range(m)])
    for m, p, v, n in ((5, 2, 2, 3), (10, 4, 3, 5), (7, 2, 2, 7)):  # groups of N, m % p != 0
        for r in range(p):
            ops = interleaved_ops(m, p, r, v, n)
            assert sorted(ops) == sorted([(k, c, j) for k in "FB" for c in range(v)
                                          for j in range(m)])
    # Megatron-Core's schedule table: each group of N through chunk 0, then chunk 1
    assert [op for op in interleaved_ops(5, 2, 0, 2, 3) if op[0] == "F"] == [
        ("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("F", 1, 0), ("F", 1, 1), ("F", 1, 2),
        ("F", 0, 3), ("F", 0, 4), ("F", 1, 3), ("F", 1, 4)]
    assert one_f_one_b_ops(4, 4, 0)[:4] == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("F", 0, 3)]
    for m, n in ((3, None), (5, 2), (5, 6), (4, 1)):  # m mod N < p; N > m; N < p
        with pytest.raises(ValueError):
            interleaved_ops(m, 2, 0, 2, n)


@pytest.mark.parametrize("kw, world, words", [
    (dict(pp=2, schedule="zigzag"), 2, ["--pipeline-schedule", "gpipe"]),
    (dict(pp=1, schedule="interleaved", lpv=1), 1, ["--pipeline-model-parallel-size"]),
    (dict(pp=1, lpv=2), 1, ["--pipeline-model-parallel-size"]),
    (dict(pp=2, schedule="interleaved"), 2, ["--num-layers-per-virtual-pipeline-stage"]),
    (dict(pp=2, lpv=1), 2, ["--pipeline-schedule interleaved"]),
    (dict(pp=2, m=3, schedule="interleaved", lpv=1), 2, ["micro-batches", "--global-batch-size"]),
    (dict(pp=2, m=5, schedule="interleaved", lpv=1, group=2), 2,
     ["m mod N = 5 mod 2 = 1", "--microbatch-group-size-per-virtual-pipeline-stage"]),
    (dict(pp=2, m=4, schedule="interleaved", lpv=1, group=6), 2, ["[p = 2, m = 4]"]),
    (dict(pp=2, layers=6, schedule="interleaved", lpv=2), 2,
     ["--num-layers-per-virtual-pipeline-stage", "divisible"]),
    (dict(pp=2, layers=5), 2, ["--num-layers", "--decoder-first-pipeline-num-layers"]),
    (dict(pp=4, layers=8, first=2, last=3), 4, ["--decoder-first-pipeline-num-layers", "3"]),
    (dict(pp=2, layers=4, first=4), 2, ["leaves 0 layers"]),
    (dict(pp=2, layers=4, first=0), 2, ["--decoder-first-pipeline-num-layers", ">= 1"]),
    (dict(pp=4, layers=3), 4, ["--num-layers"]),
    (dict(pp=2, layers=4, schedule="interleaved", lpv=1, first=1), 2, ["not supported"]),
])
def test_refused_configs(kw, world, words):
    cfg = make_cfg(**kw)
    with pytest.raises(ConfigError) as e:
        cfg.validate(world)  # before any process group exists
    for w in words:
        assert w in str(e.value), str(e.value)


def test_valid_configs_pass():
    for kw, world in [(dict(pp=2, m=4, schedule="interleaved", lpv=1), 2),
                      (dict(pp=4, layers=8, first=1, last=3), 4),
                      (dict(pp=2, layers=6, first=1, dp=2), 4),
                      (dict(pp=2, m=5, schedule="gpipe"), 2),
                      (dict(pp=2, m=5, schedule="interleaved", lpv=1, group=3), 2)]:
        make_cfg(**kw).validate(world)
    import subprocess
    import sys
    code = ("import sys; import loom.parallel.pipeline.placement; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0  # torch-free
