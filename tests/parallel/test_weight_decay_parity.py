"""Parity of the weight-decay flags (loom/training/param_groups.py, optimizer.py): with
``--no-decoupled-weight-decay`` (the original Adam: L2 added to the gradient),
``--weight-decay-norms-and-biases`` (torchtitan's: every parameter decayed) and
``--apply-wd-to-qk-layernorm``, DP 2 with the distributed optimizer (ZeRO-1: each rank steps
its shard of the fp32 masters, in groups of its own) trains as 1 rank does: the same losses and
weights after 3 steps (fp32, no dropout). Active: the inner optimizer is ``torch.optim.Adam``, every group
decays, and the weights differ from a run with decoupled decay."""

from __future__ import annotations

import argparse

import pytest
import torch

from loom.parallel.registry import ShardSpec, full_from_shards
from testkit import run_distributed

ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--mock-data", "--vocab-size", "128", "--make-vocab-size-divisible-by", "64",
        "--eval-iters", "0", "--no-progress-bar", "--position-embedding-type", "rope",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "3",
        "--lr", "1e-2", "--min-lr", "1e-3", "--lr-warmup-iters", "1", "--weight-decay", "0.5",
        "--qk-layernorm", "--apply-wd-to-qk-layernorm", "--weight-decay-norms-and-biases"]
COUPLED = ["--no-decoupled-weight-decay"]


def _train(argv):
    from loom.training.cli import add_arguments, prepare
    from loom.training.trainer import Trainer
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    trainer = Trainer(prepare(parser.parse_args(argv)))
    history = trainer.train()
    inner = getattr(trainer.optimizer, "optim", trainer.optimizer)
    groups = [g for g in inner.param_groups if g["params"][0].numel()]
    weights = {name: (p.detach().numpy().copy(), meta.shard.to_dict() if meta.shard else None)
               for c in trainer.model_chunks for name, p in c.named_parameters()
               for meta in [c.registry[name]]}
    return ([r["loss"] for r in history], type(inner).__name__,
            all(g["weight_decay"] > 0 for g in groups), trainer.mesh.tp_rank, weights)


def _full(results) -> dict:
    by_name: dict = {}
    for *_, tp_rank, weights in results:
        for name, (w, spec) in weights.items():
            by_name.setdefault(name, {})[tp_rank] = (w, spec)
    return {name: full_from_shards([torch.from_numpy(shards[r][0]) for r in sorted(shards)],
                                   ShardSpec.from_dict(shards[0][1]))
            for name, shards in by_name.items()}


def test_coupled_decay_of_every_parameter_matches_one_rank():
    one = run_distributed(1, _train, ARGV + COUPLED, start_method="fork")
    losses, kind, all_decay = one[0][:3]
    assert kind == "Adam" and all_decay
    ref = _full(one)
    decoupled = _full(run_distributed(1, _train, ARGV, start_method="fork"))
    assert any(not torch.allclose(decoupled[n], w, rtol=1e-4, atol=1e-6) for n, w in ref.items())
    for world, layout in ((2, ["--use-distributed-optimizer"]),):
        got = run_distributed(world, _train, ARGV + COUPLED + layout, start_method="fork")
        assert got[0][1] == "Adam" and got[0][2], layout
        assert got[-1][0] == pytest.approx(losses, rel=1e-5), layout
        full = _full(got)
        for name, w in ref.items():
            torch.testing.assert_close(full[name], w, rtol=1e-5, atol=1e-6,
                                       msg=f"{layout} {name}")
