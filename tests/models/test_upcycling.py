"""MoE upcycling (``--moe-use-upcycling``, loom/checkpoint/upcycling.py) against Megatron-Core's
own ``upcycle_state_dict`` (megatron-core 0.16.1, the same code as Megatron-LM d98e8a6): the
same dense GPTModel upcycled by both gives the same MoE tensors (every expert slice, scale and
the router's repeated rows), for plain and granular upcycling, with and without
``--moe-router-pre-softmax``, SwiGLU and GeLU MLPs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core")

from loom.checkpoint.upcycling import upcycle  # noqa: E402
from testkit import run_distributed  # noqa: E402
from testkit.config import tiny_config  # noqa: E402

BASE = dict(num_layers=2, hidden_size=16, num_attention_heads=4, seq_length=8, vocab_size=64,
            normalization="RMSNorm", position_embedding_type="rope", disable_bias_linear=True)


def compare(cases) -> dict:
    from testkit.megatron import (init_megatron_parallel, megatron_full, megatron_gpt,
                                  megatron_on_cpu)
    from megatron.core.transformer.moe.upcycling_utils import upcycle_state_dict
    worst = {}
    with megatron_on_cpu():
        for name, (kw, granularity) in cases.items():
            moe_cfg = tiny_config("gpt", BASE, kw).model
            dense_cfg = dataclasses.replace(moe_cfg, num_experts=None, moe_router_topk=2,
                                            ffn_hidden_size=moe_cfg.ffn_size * granularity,
                                            moe_ffn_hidden_size=None, moe_router_pre_softmax=False)
            init_megatron_parallel(seed=3)
            dense = megatron_gpt(dense_cfg)
            moe = megatron_gpt(moe_cfg)
            with torch.no_grad():
                for p in dense.parameters():  # away from the initial ones (norms at 1)
                    p.add_(torch.randn_like(p) * 0.1)
            dense_full = megatron_full(dense, dense_cfg, "param")
            moe_init = megatron_full(moe, moe_cfg, "param")
            theirs = upcycle_state_dict([moe], [dense])["model"]
            moe.load_state_dict(theirs, strict=True)
            want = megatron_full(moe, moe_cfg, "param")
            routers = {n: t for n, t in moe_init.items() if n.endswith("router.weight")}
            got = upcycle(dense_full, list(want), routers, moe_cfg, granularity)
            worst[name] = (max(float((got[n] - want[n]).abs().max()) for n in want),
                           sorted(want) == sorted(got),
                           sum("experts" in n for n in want))
    return worst


CASES = {
    "swiglu": (dict(swiglu=True, num_experts=4, moe_router_topk=2, ffn_hidden_size=24), 1),
    "swiglu-granular": (dict(swiglu=True, num_experts=8, moe_router_topk=2, ffn_hidden_size=12,
                             moe_ffn_hidden_size=12), 2),
    "gelu-pre-softmax-granular": (dict(num_experts=4, moe_router_topk=2, ffn_hidden_size=8,
                                       moe_ffn_hidden_size=8, moe_router_pre_softmax=True), 2),
}


def test_upcycling_is_megatron_cores():
    (worst,) = run_distributed(1, compare, CASES)
    for name, (err, same_names, experts) in worst.items():
        assert same_names and experts >= 2 * 4 * 2, (name, experts)
        assert err == 0.0, (name, err)


# --make-vocab-size-divisible-by 64: the same padded softmax columns at TP 1 and TP 2
ARGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "128",
        "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
        "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
        "--disable-bias-linear", "--ffn-hidden-size", "48", "--seed", "5", "--eval-iters", "0",
        "--no-progress-bar", "--log-interval", "1000", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--make-vocab-size-divisible-by", "64"]


def run_first_steps(argv: list, steps: int = 2) -> dict:
    """``loom train ARGV`` on this world: its first losses, the iteration it started at."""
    import argparse

    from loom.training.cli import add_arguments, prepare
    from loom.training.trainer import Trainer
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    trainer = Trainer(prepare(parser.parse_args(argv)))
    start = trainer.iteration
    return {"start": start, "losses": [trainer.train_step()["loss"] for _ in range(steps)],
            "experts": sum(".experts." in n for n, _ in trainer.model_chunks[0]
                           .named_parameters())}


def train_all(argv: list) -> int:
    """``loom train ARGV`` to its end (saving at the end, as loom train does); the iteration."""
    import argparse

    from loom.training.cli import add_arguments, prepare
    from loom.training.trainer import Trainer
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    trainer = Trainer(prepare(parser.parse_args(argv)))
    trainer.train()
    return trainer.iteration


def test_an_upcycled_run_starts_where_the_dense_model_is(tmp_path, monkeypatch):
    """A dense run's checkpoint (2 steps), then ``--moe-use-upcycling`` into 4 experts, top 2,
    granularity 1 (every expert the dense MLP, the normalized top-2 weights summing to 1): the
    upcycled model's first loss is the dense model's on the same first batch (``--finetune``
    from the same checkpoint), at one process and at EP 2 x TP 2 on 4 ranks; its checkpoint
    is written at iteration 1 and the run goes on from there (Megatron's); a second
    upcycling into the same --save is refused, as is granularity that does not divide."""
    from loom.errors import ConfigError
    dense, moe = tmp_path / "dense", tmp_path / "moe"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert run_distributed(1, train_all, ARGS + ["--train-iters", "2", "--save", str(dense)],
                           start_method="fork") == [2]
    (ref,) = run_distributed(1, run_first_steps, ARGS + [
        "--train-iters", "3", "--load", str(dense), "--finetune"], start_method="fork")
    upcycle_args = ARGS + ["--train-iters", "3", "--load", str(dense), "--num-experts", "4",
                           "--moe-router-topk", "2", "--moe-use-upcycling"]
    (one,) = run_distributed(1, run_first_steps, upcycle_args + ["--save", str(moe / "one")],
                             start_method="fork")
    four = run_distributed(4, run_first_steps, upcycle_args + [
        "--save", str(moe / "four"), "--tensor-model-parallel-size", "2",
        "--expert-model-parallel-size", "2"], start_method="fork")
    assert one["start"] == 1 and one["experts"] == 2 * 4 * 2
    assert (moe / "one" / "iter_0000001").is_dir() and (moe / "four" / "iter_0000001").is_dir()
    assert one["losses"][0] == pytest.approx(ref["losses"][0], rel=1e-5)
    for rank in four:
        assert rank["losses"][0] == pytest.approx(ref["losses"][0], rel=1e-5)
        assert rank["losses"][1] == pytest.approx(one["losses"][1], rel=1e-5)
    from loom.training.cli import add_arguments, prepare
    import argparse
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="upcycling is for the first run"):
        prepare(parser.parse_args(upcycle_args + ["--save", str(moe / "one")]))
    with pytest.raises(ConfigError, match="must split into experts"):
        prepare(parser.parse_args(upcycle_args + ["--save", str(moe / "x"),
                                                  "--moe-upcycling-granularity", "3"]))


def test_upcycling_rules_are_megatrons():
    """``--moe-use-upcycling`` needs an MoE model, --load and --save, no --finetune; it loads
    neither optimizer nor generator state (Megatron sets --no-load-optim / --no-load-rng);
    the dense width ``G x --ffn-hidden-size`` must split into experts whose count G divides,
    and with G > 1 every layer is MoE."""
    from loom.config.resilience import check_upcycling
    from loom.errors import ConfigError

    def cfg(**kw):
        base = dict(num_experts=4, moe_router_topk=2, ffn_hidden_size=16, load="d", save="s",
                    moe_use_upcycling=True)
        return tiny_config("llama", **{**base, **kw})
    ok = cfg(moe_upcycling_granularity=2)
    check_upcycling(ok)
    assert ok.checkpoint.no_load_optim and ok.checkpoint.no_load_rng
    assert ok.checkpoint.moe_use_upcycling and ok.checkpoint.moe_upcycling_granularity == 2
    for kw, needle in ((dict(num_experts=None), "--num-experts"),
                       (dict(save=None), "--save"), (dict(finetune=True), "--finetune"),
                       (dict(moe_upcycling_granularity=3), "must split"),
                       (dict(moe_upcycling_granularity=2, moe_layer_freq="[0, 1]",
                             num_layers=2), "every layer MoE")):
        with pytest.raises(ConfigError, match=needle):
            check_upcycling(cfg(**kw))
