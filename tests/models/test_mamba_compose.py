"""Mamba / hybrid stacks compose with the rest of loom (CPU, gloo, fp32, no dropout):

- full recomputation (uniform at TP=2 + SP, block at TP=2), the distributed optimizer (ZeRO-1)
  at DP=2 and the interleaved 1F1B schedule at PP=2 (2 virtual stages of 1 layer) give the
  loss, grad norm and every gradient of the single-process run;
- a checkpoint written at TP=2 loads at TP=1 (weights resharded by the registry, Adam states
  by name): the next two losses equal those of the TP=2 run that kept going.

Helpers (tiny config, parity harness) are tests/models/mamba_helpers.py's.
"""

from __future__ import annotations

import math

import torch

from loom.parallel.mesh import ParallelMesh
from loom.parallel.registry import full_from_shards
from testkit import run_distributed
from mamba_helpers import check_parity, make_cfg, parity, tiny
from testkit.numerics import PARITY_RTOL


def world2(save_dir: str) -> dict:
    from loom.training.trainer import Trainer
    res = {"parity": parity(tiny("M*M-"), {"tp2sp-recompute-uniform": (2, 1, 1, True),
                                           "dp2-zero1": (1, 1, 2, False)},
                            overrides={"tp2sp-recompute-uniform": dict(
                                recompute_granularity="full", recompute_method="uniform",
                                recompute_num_layers=2),
                                "dp2-zero1": dict(use_distributed_optimizer=True)})}
    res["parity-block"] = parity(tiny(), {"tp2-recompute-block": (2, 1, 1, False)},
                                 overrides={"tp2-recompute-block": dict(
                                     recompute_granularity="full", recompute_method="block",
                                     recompute_num_layers=3)})
    res["parity-interleaved"] = parity(tiny("M*M-"), {"pp2-interleaved": (1, 2, 1, False)},
                                       overrides={"pp2-interleaved": dict(
                                           pipeline_schedule="interleaved",
                                           num_layers_per_virtual_pipeline_stage=1)})
    cfg = make_cfg(tiny("M*M-"), tp=2)
    tr = Trainer(cfg, mesh=ParallelMesh.build(tp=2))
    losses = []
    for step in range(4):
        if step == 2:
            tr.save(save_dir)
        losses.append(tr.global_loss(tr.forward_backward(tr.batches(tr.train_ds,
                                                                    tr.consumed_samples))))
        tr.optimizer_step()
        tr.consumed_samples += tr.global_batch
        tr.iteration += 1
    res["losses"] = losses
    return res


def test_recompute_zero1_and_checkpoint_resharding(tmp_path):
    from loom.training.trainer import Trainer
    results = run_distributed(2, world2, str(tmp_path))
    for r in results:
        cases = [c for k in ("parity", "parity-block", "parity-interleaved") for c in r[k].values()]
        for case in cases:
            assert case["compared"] > 10, case
            check_parity(case)
    # load the TP=2 checkpoint (after 2 steps) at TP=1 and continue
    tr = Trainer(make_cfg(tiny("M*M-")), mesh=ParallelMesh.single())
    assert tr.load(str(tmp_path)) and tr.iteration == 2
    want = results[0]["losses"]
    got = []
    for _ in range(2):
        got.append(tr.global_loss(tr.forward_backward(tr.batches(tr.train_ds,
                                                                 tr.consumed_samples))))
        tr.optimizer_step()
        tr.consumed_samples += tr.global_batch
    assert all(math.isclose(g, w, rel_tol=PARITY_RTOL) for g, w in zip(got, want[2:])), (got, want)
    # the match needs the loaded state: untrained weights on the same batch are far off
    fresh = Trainer(make_cfg(tiny("M*M-")), mesh=ParallelMesh.single())
    loss = fresh.global_loss(fresh.forward_backward(fresh.batches(fresh.train_ds,
                                                                  2 * fresh.global_batch)))
    assert abs(loss - want[2]) > 10 * PARITY_RTOL * abs(want[2]), (loss, want)


def test_full_from_shards_inverts_the_conv_segments():
    """The conv weight's (x, B, C) blocks are each split over TP; shards reassemble exactly."""
    full = torch.arange(12 * 3).view(12, 3)
    from loom.parallel.registry import ShardSpec, _shard
    spec = ShardSpec(0, (8, 2, 2))
    shards = [_shard(full, spec, r, 2) for r in range(2)]
    assert shards[0][:, 0].tolist() == [0, 3, 6, 9, 24, 30]
    assert torch.equal(full_from_shards(shards, spec), full)
