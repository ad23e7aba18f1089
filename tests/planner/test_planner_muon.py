"""``--optimizer muon`` priced by the planner (:mod:`loom.planner.muon`): the Newton-Schulz FLOPs
against torch's FLOP counter on loom's own ``newton_schulz``; the optimizer bytes against what
loom's Muon holds after a step (fp32 and bf16, plain and distributed); ``loom plan`` and
``loom train --dry-run`` pricing it without a warning, the step's iterations in the optimizer
term and the command carrying the flags. In-process, ~5 s."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from loom.parallel.mesh import ParallelMesh
from loom.planner.layout import Options, make_layouts
from loom.planner.memory import memory_terms
from loom.planner.muon import kind_muon_params, kind_ns_seconds, layer_matrices, ns_flops
from loom.training.muon import newton_schulz
from loom.training.trainer import Trainer
from testkit.config import tiny_config
from testkit.numerics import held_optimizer_bytes


@pytest.mark.parametrize("shape", [(8, 32), (48, 16), (24, 24)])
def test_ns_flops_equal_torch_s_count_of_loom_s_iterations(shape):
    steps = 5
    with FlopCounterMode(display=False) as counter:
        newton_schulz(torch.randn(*shape), steps, bf16=False)
    assert counter.get_total_flops() == ns_flops(*shape, steps)


def _held(**flags) -> dict:
    """After one step of loom's Muon on the tiny llama: the bytes its optimizer holds beside the
    model's own parameters (states and masters, each storage once), the parameter count, the
    Muon-managed count (``param_groups.muon_managed``), and the config."""
    from loom.training.optimizer import decoupled_params
    from loom.config.optimizer_muon import muon_managed
    cfg = tiny_config("llama", optimizer="muon", **flags).validate(1)
    tr = Trainer(cfg, mesh=ParallelMesh.single(torch.device("cpu")))
    tr.train_step()
    chunks = list(tr.parts.model.chunks)
    dec = decoupled_params(chunks)
    named = [(n, p) for c in chunks for n, p in c.named_parameters()]
    return {"held": held_optimizer_bytes(tr), "n": sum(p.numel() for _, p in named), "cfg": cfg,
            "managed": sum(p.numel() for n, p in named
                           if muon_managed(n, p.ndim, id(p) in dec))}


@pytest.mark.parametrize("flags", [{}, {"bf16": True}, {"bf16": True,
                                                         "use_distributed_optimizer": True}],
                         ids=["fp32", "bf16", "bf16-zero1"])
def test_optimizer_bytes_equal_what_loom_s_muon_holds(flags):
    """Muon's momentum (4 bytes) on the layers' weights, AdamW's 8 on the embedding, output
    layer and norms, plus a 16-bit run's 4-byte master copy: loom's optimizer holds exactly
    that after a step, and the planner's optimizer term at t = p = d = 1 (which prices 16-bit
    training) counts the same weights, 4 bytes each less than AdamW's."""
    r = _held(**flags)
    bf16 = flags.get("bf16", False)
    n, managed = r["n"], r["managed"]
    assert 0 < managed < n
    assert r["held"] == managed * 4 + (n - managed) * 8 + (4 * n if bf16 else 0)
    m = r["cfg"].model
    L = make_layouts(dict(tp=1, pp=1, cp=1, dp=1, mbs=1, vp=1, recompute="none", sp=0,
                          zero=1 if flags.get("use_distributed_optimizer") else 0, zb=0))
    muon, adam = (memory_terms(m, L, 8, m.seq_length, o)
                  for o in (Options(muon_ns_steps=5), Options()))
    assert float(adam["params_per_gpu"][0]) == n
    assert m.num_layers * float(kind_muon_params(m, L)[0][0][0]) == managed
    assert float(muon["optimizer"][0]) == pytest.approx(managed * 4 + (n - managed) * 8 + 4 * n)
    assert float(muon["optimizer"][0]) == pytest.approx(float(adam["optimizer"][0]) - 4 * managed)


def test_layer_matrices_are_the_managed_weights():
    """The shapes priced are loom's Muon-managed weights of one layer (fused QKV as one tensor
    here: its three parts sum to it)."""
    held = tiny_config("llama").validate(1)
    m = held.model
    kinds = layer_matrices(m, split_qkv=False)
    assert len(kinds) == 1
    shapes = sorted((r, c) for r, c, n, _ in kinds[0]["dense"] for _ in range(n))
    tr = Trainer(held, mesh=ParallelMesh.single(torch.device("cpu")))
    from loom.config.optimizer_muon import muon_managed
    from loom.training.optimizer import decoupled_params
    chunks = list(tr.parts.model.chunks)
    dec = decoupled_params(chunks)
    real = sorted(tuple(p.shape) for c in chunks for name, p in c.named_parameters()
                  if name.startswith("layers.0.") and muon_managed(name, p.ndim, id(p) in dec))
    assert shapes == real


def _plan(argv, capsys) -> tuple[int, dict, str]:
    from loom.cli import main
    with pytest.raises(SystemExit) as e:
        main(["plan", "llama3-8b", "--gpu", "H100-80GB", "--num-gpus", "8",
              "--global-batch-size", "32",
              "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
              "--micro-batch-size", "1", "--zero-stage", "1", "--json", "--top", "1", *argv])
    out = capsys.readouterr()
    return e.value.code, json.loads(out.out)["layouts"][0], out.err


def test_loom_plan_prices_muon_and_carries_its_flags(capsys):
    from loom.planner.constants import fitted_cluster
    from loom.planner.presets import PRESETS
    code, adam, err = _plan([], capsys)
    assert code == 0 and err == ""
    code, muon, err = _plan(["--optimizer", "muon"], capsys)
    assert code == 0 and err == "", err  # priced: no "not in the prediction" warning
    code, block, _ = _plan(["--optimizer", "muon", "--muon-tp-mode", "blockwise",
                            "--muon-num-ns-steps", "6"], capsys)
    assert muon["memory_terms_gb"]["optimizer"] < 0.75 * adam["memory_terms_gb"]["optimizer"]
    model = PRESETS["llama3-8b"]()
    L = make_layouts(dict(tp=2, pp=1, cp=1, dp=4, mbs=1, vp=1, recompute="none", sp=1, zero=1,
                          zb=0))
    cluster = fitted_cluster("H100-80GB", 8)
    ns = model.num_layers * float(kind_ns_seconds(model, L, cluster, 5)[0][0])
    added = muon["time_terms_s"]["optimizer"] - adam["time_terms_s"]["optimizer"]
    assert ns > 0 and added == pytest.approx(ns, rel=0.05), (added, ns)
    assert 0 < block["time_terms_s"]["optimizer"] < muon["time_terms_s"]["optimizer"]
    assert "--optimizer muon" in muon["command"]
    assert "--muon-tp-mode blockwise" in block["command"] and \
        "--muon-num-ns-steps 6" in block["command"]


def test_dry_run_prices_muon():
    from loom.planner.predict import predict_layout, run_options
    adam, muon = (tiny_config("llama", bf16=True, optimizer=o).validate(1)
                  for o in ("adam", "muon"))
    assert run_options(muon).muon_ns_steps == 5 and run_options(adam).muon_ns_steps == 0
    pa, pm = (predict_layout(c, 1, "H100-80GB") for c in (adam, muon))
    assert pm["memory_bytes"]["optimizer"] < pa["memory_bytes"]["optimizer"]


def test_loom_plan_keeps_muon_where_loom_train_runs_it(capsys):
    """Muon orthogonalizes whole matrices: the search never picks ZeRO-3 (FSDP) for it, and
    ``--zero-stage 3`` or ``--fp16`` with it are refused as loom train refuses them (the
    printed command must run: benchmarks/plan_sweep.py's Megatron corpus cases with Muon)."""
    from loom.cli import main
    base = ["plan", "llama3-8b", "--gpu", "H100-80GB", "--num-gpus", "8",
            "--global-batch-size", "8", "--json", "--top", "200", "--optimizer", "muon"]
    with pytest.raises(SystemExit) as e:
        main(base)
    recs = json.loads(capsys.readouterr().out)["layouts"]
    assert e.value.code == 0 and recs and all(r["zero"] < 3 for r in recs)
    for extra, words in ((["--zero-stage", "3"], "not FSDP shards"), (["--fp16"], "--bf16")):
        with pytest.raises(SystemExit) as e:
            main(base + extra)
        err = capsys.readouterr().err
        assert e.value.code == 2 and words in err, err
