"""Interleaved RoPE (``--rotary-interleaved``) and muP (``--use-mup``) against the single-process
run, one spawned 2-rank world: loss, gradient norm and every gradient within rtol 1e-5 for 3
steps (fp32, no dropout, Adam with its per-group learning rates), each row asserting its feature
ran.

* ``interleaved``: --rotary-interleaved with --rotary-percent 0.5 (pairs (2i, 2i+1) within the
  rotated half of each head); at TP=2, PP=2 and CP=2 (the positions of the load-balanced CP
  chunks).
* ``mup``: --use-mup with width multiplier 4 (--mup-base-hidden-size 8), --mup-embedding-mult
  2, the attention scale 1/d, logits x 1/4, and Adam's hidden matrices at lr / 4 and eps / 4
  (their own parameter group); at TP=2 and PP=2.

Muon's parity (TP2 x PP2 x DP2, 8 ranks): tests/parallel/test_optimizer_muon.py."""

from __future__ import annotations

import pytest
import torch

from loom.config import LoomConfig
from testkit import run_distributed

from parity_helpers import step_mismatches, trainer_steps
from testkit.numerics import PARITY_RTOL
from testkit.config import PARITY_ADAM_EPS, tiny_config

STEPS = 3


def make_cfg(kind: str, tp=1, pp=1, cp=1) -> LoomConfig:
    extra = dict(rotary_interleaved=True, rotary_percent=0.5) if kind == "interleaved" else \
        dict(use_mup=True, mup_base_hidden_size=8, mup_embedding_mult=2.0)
    return tiny_config("llama", extra, num_layers=4, num_query_groups=None,
                       make_vocab_size_divisible_by=32,  # Vp 128 at t = 1 and 2
                       ffn_hidden_size=48, tensor_model_parallel_size=tp,
                       pipeline_model_parallel_size=pp, context_parallel_size=cp,
                       global_batch_size=4, adam_eps=PARITY_ADAM_EPS)


def run_steps(cfg, mesh):
    from loom.training.trainer import Trainer
    tr = Trainer(cfg, mesh=mesh)
    return tr, trainer_steps(tr, STEPS)


def features(tr, kind: str) -> dict:
    from loom.models.attention import DotProductAttention
    from loom.training.optimizer import local_optimizer
    chunk, mods = tr.model_chunks[0], [m for c in tr.model_chunks for m in c.modules()]
    if kind == "interleaved":
        rope = chunk.layer_inputs(torch.arange(16), None, {})[0]
        return {"interleaved": len(rope) == 3 and rope[2], "rotated": rope[0].shape[-1]}
    groups = local_optimizer(tr.optimizer).param_groups
    return {"scales": sorted({m.scale for m in mods if isinstance(m, DotProductAttention)}),
            "mup_groups": sorted((g["max_lr"], g.get("eps")) for g in groups
                                 if any(p.numel() for p in g["params"]))}


def world2(cases) -> list[dict]:
    from loom.parallel.mesh import ParallelMesh
    refs, results = {}, []
    for kind, layout in cases:
        if kind not in refs:
            refs[kind] = run_steps(make_cfg(kind).validate(1), ParallelMesh.single())[1]
        cfg = make_cfg(kind, **layout).validate(2)
        p = cfg.parallel
        mesh = ParallelMesh.build(tp=p.tensor_model_parallel_size,
                                  pp=p.pipeline_model_parallel_size, cp=p.context_parallel_size)
        tr, par = run_steps(cfg, mesh)
        results.append({"case": (kind, layout), "errors": step_mismatches(par, refs[kind], mesh,
                                                                          PARITY_RTOL),
                        "compared": sum(len(s[1]) for s in par), "features": features(tr, kind)})
    return results


CASES = [("interleaved", dict(tp=2)), ("interleaved", dict(pp=2)), ("interleaved", dict(cp=2)),
         ("mup", dict(tp=2)), ("mup", dict(pp=2))]


@pytest.fixture(scope="module")
def results():
    return run_distributed(2, world2, CASES, timeout=900, start_method="fork")


@pytest.mark.parametrize("i", range(len(CASES)))
def test_math_capability_parity(results, i):
    kind, layout = CASES[i]
    for rank in results:
        r = rank[i]
        assert r["case"] == (kind, layout)
        assert not r["errors"], r["errors"][:5]
        assert r["compared"] > 20, r
        f = r["features"]
        if kind == "interleaved":
            assert f == {"interleaved": True, "rotated": 4}, f
        else:
            assert f["scales"] == [1 / 8], f  # 1/d with d = 8
            # hidden matrices at lr / 4 and eps / 4, the rest at lr and Adam's eps
            assert (1e-3 / 4, 1e-4 / 4) in f["mup_groups"], f
            assert any(lr == 1e-3 for lr, _ in f["mup_groups"]), f
