"""Activation recomputation changes nothing but memory: full (uniform and block, N = 1 and 2)
and selective recompute give the loss and every gradient of the run without recompute (fp32,
dropout 0.1 in attention and hidden states, so the masks must replay), on 1 rank and at TP=2
(with and without sequence parallelism); runs with and without recompute have the same
parameter names and initial weights and load each other's checkpoints.
"""

from __future__ import annotations

import copy
import os

import torch

from loom.config import LoomConfig, ModelConfig
from loom.testing import run_distributed

RTOL = 1e-5
VARIANTS = [("full", "uniform", 1), ("full", "uniform", 2), ("full", "block", 1),
            ("selective", "uniform", 1)]


def make_cfg(kind: str, tp: int, sp: bool = False) -> LoomConfig:
    common = dict(num_layers=3, hidden_size=64, num_attention_heads=4, seq_length=16,
                  vocab_size=300, hidden_dropout=0.1, attention_dropout=0.1)
    model = (ModelConfig.gpt2(**common) if kind == "gpt"
             else ModelConfig.llama(num_query_groups=2, ffn_hidden_size=96, **common))
    cfg = LoomConfig(model=model)
    cfg.parallel.tensor_model_parallel_size = tp
    cfg.parallel.sequence_parallel = sp
    cfg.training.micro_batch_size = 2
    cfg.training.global_batch_size = 4
    cfg.training.lr = 1e-3
    cfg.data.mock_data = True
    return cfg.validate(tp)


def run(cfg: LoomConfig, mesh, steps: int = 3) -> dict:
    from loom.training.trainer import Trainer
    tr = Trainer(cfg, mesh=mesh)
    init = {n: p.detach().clone() for n, p in tr.model_chunks[0].named_parameters()}
    losses, grads = [], []
    for _ in range(steps):
        losses.append(float(tr.forward_backward(tr.batches(tr.train_ds, tr.consumed_samples))))
        grads.append({n: p.grad.detach().clone() for n, p in tr.model_chunks[0].named_parameters()})
        tr.optimizer_step()
        tr.consumed_samples += tr.global_batch
    return {"trainer": tr, "init": init, "losses": losses, "grads": grads}


def compare(base: dict, other: dict) -> list[str]:
    errors = []
    if list(base["init"]) != list(other["init"]):
        errors.append("parameter names differ")
    for n, w in base["init"].items():
        if n in other["init"] and not torch.equal(w, other["init"][n]):
            errors.append(f"initial weight {n} differs")
    for step, (a, b) in enumerate(zip(base["losses"], other["losses"])):
        if abs(a - b) > RTOL * abs(a):
            errors.append(f"step {step}: loss {b} != {a}")
    for step, (ga, gb) in enumerate(zip(base["grads"], other["grads"])):
        for n, g in ga.items():
            err = float((gb[n] - g).abs().max() / g.abs().max().clamp_min(1e-12))
            if err > RTOL:
                errors.append(f"step {step}: grad {n} rel err {err:.2e}")
    return errors


def cases(tmp: str) -> dict:
    import torch.distributed as dist

    from loom.parallel.mesh import ParallelMesh
    world = dist.get_world_size()
    meshes = {1: ParallelMesh.single(), world: ParallelMesh.build(tp=world)}
    out = {}
    layouts = [("gpt", 1, False), ("llama", 1, False), ("gpt", world, False),
               ("llama", world, True)]
    for kind, tp, sp in layouts:
        base_cfg = make_cfg(kind, tp, sp)
        base = run(base_cfg, meshes[tp])
        for gran, method, n in VARIANTS:
            cfg = copy.deepcopy(base_cfg)
            cfg.training.recompute_granularity = gran
            cfg.training.recompute_method = method
            cfg.training.recompute_num_layers = n
            other = run(cfg, meshes[tp])
            key = f"{kind}-tp{tp}{'-sp' if sp else ''}-{gran}-{method}{n}"
            out[key] = compare(base, other)
            if gran == "full" and method == "uniform" and n == 2 and tp == world:
                # checkpoints are shared: save with recompute, load without, same weights
                save_dir = os.path.join(tmp, key)
                other["trainer"].save(save_dir)
                fresh = run(base_cfg, meshes[tp], steps=0)["trainer"]
                fresh.load(save_dir)
                saved = dict(other["trainer"].model_chunks[0].named_parameters())
                out[key + "-ckpt"] = [n_ for n_, p in fresh.model_chunks[0].named_parameters()
                                      if not torch.equal(p, saved[n_])]
        out[f"{kind}-tp{tp}-dropout-active"] = base["losses"][0] != run(
            _no_dropout(base_cfg), meshes[tp], steps=1)["losses"][0]
    return out


def _no_dropout(cfg: LoomConfig) -> LoomConfig:
    cfg = copy.deepcopy(cfg)
    cfg.model.hidden_dropout = cfg.model.attention_dropout = 0.0
    return cfg


def test_recompute_equals_no_recompute(tmp_path):
    results = run_distributed(2, cases, str(tmp_path), timeout=600)
    for rank, res in enumerate(results):
        assert len(res) == 4 * (len(VARIANTS) + 1) + 2  # + the two TP=2 checkpoint checks
        for key, errors in res.items():
            if key.endswith("dropout-active"):
                assert errors is True, f"rank {rank} {key}: dropout had no effect"
            else:
                assert not errors, f"rank {rank} {key}: " + "; ".join(errors[:5])


def test_recompute_comparison_can_fail():
    base = {"init": {"w": torch.ones(2)}, "losses": [1.0], "grads": [{"w": torch.ones(2)}]}
    other = {"init": {"w": torch.ones(2)}, "losses": [1.0],
             "grads": [{"w": torch.tensor([1.0, 1.001])}]}
    assert compare(base, other)
