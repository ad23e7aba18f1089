"""The distributed optimizer (Megatron's design, ZeRO-1) and ZeRO-2 against the single-process
reference (CPU, gloo, fp32, no dropout).

For 3 optimizer steps the loss, every gradient's owned shard (the reduce-scattered range of the
bucket, :meth:`GradBuffer.shard_range`), the clipped global norm and the parameters after
the steps match the single-process AdamW run (rtol 1e-5; parameters 1e-4, see
test_parallel_parity): DP=2 and DP=4, with and without ``--overlap-grad-reduce`` and
``--overlap-param-gather``; TP=2 x DP=2; PP=2 x DP=2 (tied embedding in a bucket of its own);
gradient accumulation (m = 3); ZeRO-2; EP=2 MoE. Communication is counted exactly over 2 steps
of 1 to 3 micro-batches, with and without overlap (:func:`expected_comm`): ZeRO-1 one
reduce-scatter and one all-gather per bucket per step and no gradient all-reduce; ZeRO-2 a
reduce-scatter per bucket per micro-batch; without the distributed optimizer one all-reduce
per bucket; with ``--overlap-grad-reduce`` every reduction launched inside backward. Memory per rank in bf16 equals 6 + 12/d bytes per
parameter (ZeRO-2: 2 + 16/d; plain: 18) within 1% for d in {1, 2, 4}. A checkpoint saved with
the distributed optimizer at DP=2 resumes without it at DP=1 with the losses of an
uninterrupted run.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist

from loom.config import LoomConfig
from loom.parallel.mesh import ParallelMesh
from loom.parallel.registry import local_shard
from testkit import run_distributed
from testkit.numerics import PARAM_RTOL, PARITY_RTOL, rel_err
from testkit.config import PARITY_ADAM_EPS, PARITY_SHAPE, tiny_config, tiny_model


def make_cfg(world: int, tp=1, pp=1, ep=1, zero=1, og=False, opg=False, m=None, moe=False,
             bf16=False, layers=2, **flags) -> LoomConfig:
    if moe:
        model = tiny_model("llama", PARITY_SHAPE, num_layers=layers, num_experts=4,
                           moe_router_topk=2, moe_ffn_hidden_size=48, moe_layer_freq=1,
                           moe_aux_loss_coeff=0.01)
    else:
        model = tiny_model("gpt", PARITY_SHAPE, num_layers=layers)
    dp = world // (tp * pp)
    return tiny_config(
        model=model, mock_data=True, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, expert_model_parallel_size=ep, overlap_grad_reduce=og,
        ddp_bucket_size=20_000,  # several buckets
        zero_stage=zero or 0, overlap_param_gather=opg, bf16=bf16,
        global_batch_size=2 * dp * (m or 1), adam_eps=PARITY_ADAM_EPS, clip_grad=0.5,
        log_interval=10**9, world=world, **flags)


def parity_case(**kw) -> dict:
    """3 steps of the layout ``kw`` beside the single-process fp32 AdamW reference."""
    from loom.parallel.grad_buffer import flat_buffers
    from loom.training.step import finish_param_gather, grad_getter
    from loom.training.trainer import Trainer
    world = dist.get_world_size()
    cfg = make_cfg(world, **kw)
    p = cfg.parallel
    mesh = ParallelMesh.build(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                              ep=p.expert_model_parallel_size)
    par = Trainer(cfg, mesh=mesh)
    ref_cfg = copy.deepcopy(cfg)
    rp, rt = ref_cfg.parallel, ref_cfg.training
    rp.tensor_model_parallel_size = rp.pipeline_model_parallel_size = 1
    rp.expert_model_parallel_size, rp.overlap_grad_reduce = 1, False
    rt.use_distributed_optimizer, rt.zero_stage, rt.overlap_param_gather = False, 0, False
    ref = Trainer(ref_cfg.validate(1), mesh=ParallelMesh.single())
    owner = {id(q): r for r in flat_buffers(par.reducers) for q in r.params}
    grad_of = grad_getter(par.reducers)
    out = {"loss": 0.0, "grad": 0.0, "norm": 0.0, "param": 0.0, "compared": 0, "owned": 0,
           "kind": type(par.optimizer).__name__}
    for _ in range(3):
        lp = par.global_loss(par.forward_backward(par.batches(par.train_ds, par.consumed_samples)))
        lr_ = float(ref.forward_backward(ref.batches(ref.train_ds, ref.consumed_samples)))
        out["loss"] = max(out["loss"], abs(lp - lr_) / abs(lr_))
        ref_params = dict(ref.model_chunks[0].named_parameters())
        for chunk in par.model_chunks:
            for name, q in chunk.named_parameters():
                want = local_shard(ref_params[name].grad, par.registry[name], mesh.tp_rank,
                                   mesh.tp_size)
                lo, hi = owner[id(q)].shard_range(q)
                got = grad_of(q)
                assert got.numel() == hi - lo
                out["grad"] = max(out["grad"], rel_err(got, want.reshape(-1)[lo:hi], want))
                out["compared"] += 1
                out["owned"] += hi - lo
        np_, nr = par.optimizer_step(), ref.optimizer_step()
        out["norm"] = max(out["norm"], abs(np_ - nr) / nr)
        par.consumed_samples += par.global_batch
        ref.consumed_samples += ref.global_batch
    finish_param_gather(par.optimizer)
    ref_params = dict(ref.model_chunks[0].named_parameters())
    for chunk in par.model_chunks:
        for name, q in chunk.named_parameters():
            want = local_shard(ref_params[name].detach(), par.registry[name], mesh.tp_rank,
                               mesh.tp_size)
            out["param"] = max(out["param"], rel_err(q.detach(), want, want))
    out["total"] = sum(q.numel() for c in par.model_chunks for q in c.parameters())
    return out


def comm_case(world: int, zero: int, og: bool = False, opg: bool = False, m: int = 1,
              steps: int = 2) -> dict:
    """The collectives on the DP group during ``steps`` optimizer steps of ``m`` micro-batches
    (:func:`testkit.count_collectives`: ``group`` by keyword or position): per op the
    calls, their elements and the calls made inside backward (overlapped); all-reduces of
    more than one element only (gradients; the norm's scalar is not one). With the buckets'
    count and elements, from which the calls are derived exactly."""
    from loom.parallel.grad_buffer import flat_buffers
    from loom.training.step import finish_param_gather
    from loom.training.trainer import Trainer
    from testkit import count_collectives
    cfg = make_cfg(world, zero=zero, og=og, opg=opg, m=m)
    tr = Trainer(cfg, mesh=ParallelMesh.build())
    group = tr.mesh.groups["dp_cp"]
    with count_collectives() as records:
        for _ in range(steps):
            tr.forward_backward(tr.batches(tr.train_ds, tr.consumed_samples))
            tr.optimizer_step()
            tr.consumed_samples += tr.global_batch
        finish_param_gather(tr.optimizer)
    out = {"steps": steps, "m": m, "zero": zero, "og": og,
           "kind": type(tr.optimizer).__name__}
    for op in ("reduce_scatter", "all_gather", "all_reduce"):
        mine = [r for r in records if r["op"] == op and r["group"] is group and r["numel"] > 1]
        out[op] = len(mine)
        out[op + "_numel"] = sum(r["numel"] for r in mine)
        out[op + "_in_backward"] = sum(r["backward"] for r in mine)
    buckets = [b for r in flat_buffers(tr.reducers) for b in r.buckets]
    out["buckets"], out["bucket_numel"] = len(buckets), sum(b.buffer.numel() for b in buckets)
    return out


def expected_comm(c: dict) -> dict:
    """Megatron's DDP / distributed optimizer, per step: plain DP one all-reduce per bucket;
    ZeRO-1 one reduce-scatter per bucket (of the whole padded bucket) and one all-gather per
    bucket (the updated parameters); ZeRO-2 one reduce-scatter per bucket per micro-batch
    (into the kept 1/d shard) and one all-gather per bucket. With --overlap-grad-reduce the
    last micro-batch's reductions (ZeRO-2: every micro-batch's) are launched inside backward."""
    s, n, numel = c["steps"], c["buckets"], c["bucket_numel"]
    rs = {0: 0, 1: 1, 2: c["m"]}[c["zero"]] * s
    want = {"reduce_scatter": rs * n, "reduce_scatter_numel": rs * numel,
            "all_gather": s * n if c["zero"] else 0,
            "all_gather_numel": s * numel if c["zero"] else 0,
            "all_reduce": 0 if c["zero"] else s * n,
            "all_reduce_numel": 0 if c["zero"] else s * numel}
    overlapped = s * n if c["og"] else 0  # ZeRO-2: every micro-batch's, in its backward
    want["reduce_scatter_in_backward"] = {0: 0, 1: overlapped, 2: overlapped * c["m"]}[c["zero"]]
    want["all_reduce_in_backward"] = overlapped if c["zero"] == 0 else 0
    want["all_gather_in_backward"] = 0
    return want


COMM2 = {"comm-plain": dict(zero=0), "comm-plain-og-m3": dict(zero=0, og=True, m=3),
         "comm-zero1": dict(zero=1), "comm-zero1-m3": dict(zero=1, m=3),
         "comm-zero1-og-opg-m3": dict(zero=1, og=True, opg=True, m=3),
         "comm-zero2-m3": dict(zero=2, m=3), "comm-zero2-og-m2": dict(zero=2, og=True, m=2)}
COMM4 = {"comm-zero1-og-m2": dict(zero=1, og=True, m=2), "comm-zero2-m2": dict(zero=2, m=2)}


def memory_case(world: int, zero: int, bf16: bool = True, **flags) -> dict:
    """Bytes of params + main grads + fp32 masters + Adam states on this rank after one step,
    per parameter of the model."""
    from loom.training.distributed_optimizer import param_bytes
    from loom.training.trainer import Trainer
    cfg = make_cfg(world, zero=zero, bf16=bf16, layers=4, **flags)
    cfg.parallel.ddp_bucket_size = None
    mesh = ParallelMesh.build() if world > 1 else ParallelMesh.single()
    tr = Trainer(cfg, mesh=mesh)
    tr.forward_backward(tr.batches(tr.train_ds, 0))
    tr.optimizer_step()
    n = sum(p.numel() for p in tr.params)
    b = param_bytes(tr.optimizer)
    return {"per_param": sum(b.values()) / n, "bytes": b, "n": n}


def bf16_grads_case() -> dict:
    """``--bf16 --grad-reduce-in-bf16`` at DP 2 with the distributed optimizer, beside the same
    run with fp32 main gradients, 3 steps: the bucket dtypes, the loss, and each owned gradient
    shard (bf16 sums of bf16 gradients against fp32 sums: bf16's 8-bit mantissa)."""
    from loom.parallel.grad_buffer import flat_buffers
    from loom.training.step import grad_getter
    from loom.training.trainer import Trainer
    runs = {k: Trainer(make_cfg(2, bf16=True, grad_reduce_in_bf16=k == "bf16"),
                       mesh=ParallelMesh.build()) for k in ("bf16", "fp32")}
    out = {"dtypes": {k: sorted({str(b.buffer.dtype) for r in flat_buffers(t.reducers)
                                 for b in r.buckets}) for k, t in runs.items()},
           "loss": 0.0, "grad": 0.0, "compared": 0}
    for _ in range(3):
        got = {}
        for k, t in runs.items():
            loss = t.global_loss(t.forward_backward(t.batches(t.train_ds, t.consumed_samples)))
            grad_of = grad_getter(t.reducers)
            got[k] = (loss, [grad_of(q).float().clone() for c in t.model_chunks
                             for q in c.parameters()])
        out["loss"] = max(out["loss"], abs(got["bf16"][0] - got["fp32"][0]) / got["fp32"][0])
        for a, b in zip(got["bf16"][1], got["fp32"][1]):
            out["grad"] = max(out["grad"], rel_err(a, b, b))
            out["compared"] += 1
        for t in runs.values():
            t.optimizer_step()
            t.consumed_samples += t.global_batch
    return out


def expected_bytes(zero: int, d: int) -> float:
    """bf16 parameters, fp32 main gradients: 2 + 4 + 12 (ZeRO-1: 12/d; ZeRO-2: 16/d)."""
    return {0: 18.0, 1: 6 + 12 / d, 2: 2 + 16 / d}[zero]


def save_world(path: str, zero: int) -> dict:
    """DP=2 with the distributed optimizer (ZeRO-``zero``): 2 steps, save, 2 more steps (the
    reference)."""
    from loom.training.trainer import Trainer
    cfg = make_cfg(2, zero=zero, m=2)
    cfg.training.train_iters = 4
    tr = Trainer(cfg, mesh=ParallelMesh.build())
    losses = [tr.train_step()["loss"] for _ in range(2)]
    tr.save(path)
    losses += [tr.train_step()["loss"] for _ in range(2)]
    return {"losses": losses}


def world2(tmp: str) -> dict:
    res = {"dp2": parity_case(), "dp2-overlap": parity_case(og=True, opg=True),
           "dp2-m3": parity_case(m=3, og=True), "dp2-zero2": parity_case(zero=2),
           "dp2-zero2-m3": parity_case(zero=2, m=3),
           "ep2-moe": parity_case(moe=True, ep=2, opg=True, og=True)}
    res |= {name: comm_case(2, **kw) for name, kw in COMM2.items()}
    for zero in (0, 1, 2):
        res[f"mem-zero{zero}"] = memory_case(2, zero)
    res["mem-zero1-bf16-grads"] = memory_case(2, 1, grad_reduce_in_bf16=True)
    res["bf16-grads"] = bf16_grads_case()
    for zero in (1, 2):
        res[f"save{zero}"] = save_world(f"{tmp}/zero{zero}", zero)
    return res


def world4() -> dict:
    res = {"dp4": parity_case(), "dp4-overlap": parity_case(og=True, opg=True),
           "tp2xdp2": parity_case(tp=2, og=True), "pp2xdp2": parity_case(pp=2, layers=4)}
    res |= {name: comm_case(4, **kw) for name, kw in COMM4.items()}
    for zero in (0, 1, 2):
        res[f"mem-zero{zero}"] = memory_case(4, zero)
    return res


@pytest.fixture(scope="module")
def results2(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt"))
    return run_distributed(2, world2, path, timeout=900), path


@pytest.fixture(scope="module")
def results4():
    return run_distributed(4, world4, timeout=900)


def _check(case: dict) -> None:
    assert case["kind"] == "DistributedOptimizer" and case["compared"] > 10, case
    assert case["loss"] < PARITY_RTOL and case["grad"] < PARITY_RTOL \
        and case["norm"] < PARITY_RTOL, case
    assert case["param"] < PARAM_RTOL, case


@pytest.mark.parametrize("name", ["dp2", "dp2-overlap", "dp2-m3", "dp2-zero2", "dp2-zero2-m3",
                                  "ep2-moe"])
def test_parity_two_ranks(results2, name):
    res, _ = results2
    for r in res:
        _check(r[name])
    # the shards partition every parameter: each element owned by exactly one DP rank (with EP
    # the experts differ between the ranks)
    assert name.startswith("ep") or sum(r[name]["owned"] for r in res) == 3 * res[0][name]["total"]


@pytest.mark.parametrize("name", ["dp4", "dp4-overlap", "tp2xdp2", "pp2xdp2"])
def test_parity_four_ranks(results4, name):
    for r in results4:
        _check(r[name])


@pytest.mark.parametrize("name", sorted(COMM2) + sorted(COMM4))
def test_collectives_per_bucket_per_step(results2, results4, name):
    """Exact calls and elements of each collective on the DP group over 2 steps (ZeRO-1: one
    reduce-scatter and one all-gather per bucket per step; ZeRO-2: a reduce-scatter per bucket
    per micro-batch; plain: one all-reduce per bucket), and overlap launches them in backward."""
    for r in (results2[0] if name in COMM2 else results4):
        c = r[name]
        assert c["buckets"] > 1, c
        got = {k: c[k] for k in expected_comm(c)}
        assert got == expected_comm(c), (name, c)


def _positional_group() -> list:
    from testkit import count_collectives
    group = dist.new_group([0])
    with count_collectives() as rec:
        dist.all_reduce(torch.ones(3), dist.ReduceOp.SUM, group)
        dist.all_reduce(torch.ones(2), group=group)
        dist.all_reduce(torch.ones(4))
    return [(r["op"], r["group"] is group, r["numel"]) for r in rec]


def test_collective_count_sees_a_positional_group():
    """The counter binds arguments to the signature: a group passed positionally is seen."""
    assert run_distributed(1, _positional_group, start_method="fork") == [
        [("all_reduce", True, 3), ("all_reduce", True, 2), ("all_reduce", False, 4)]]


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_bytes_per_parameter_match_the_formula(results2, results4, zero):
    measured = {1: memory_case(1, zero)}
    measured[2] = results2[0][0][f"mem-zero{zero}"]
    measured[4] = results4[0][f"mem-zero{zero}"]
    for d, m in measured.items():
        want = expected_bytes(zero, d) if d > 1 else 18.0
        assert abs(m["per_param"] / want - 1) < 0.01, (d, zero, m, want)
    if zero == 1:  # the main gradients stay whole; ZeRO-2 keeps 1/d of them
        assert measured[4]["bytes"]["main_grads"] > 0.99 * 4 * measured[4]["n"]
    if zero == 2:
        assert measured[4]["bytes"]["main_grads"] < 1.01 * measured[4]["n"]


@pytest.mark.parametrize("zero", [1, 2])
def test_checkpoint_of_distributed_optimizer_resumes_at_dp1_without_it(results2, zero):
    from loom.training.trainer import Trainer
    res, path = results2
    cfg = make_cfg(2, zero=0, m=2)
    cfg.training.use_distributed_optimizer, cfg.training.zero_stage = False, 0
    cfg.training.global_batch_size = 8  # the same global batch at DP=1: m = 4
    cfg.training.train_iters = 4
    cfg.checkpoint.load = f"{path}/zero{zero}"
    tr = Trainer(cfg.validate(1), mesh=ParallelMesh.single())
    assert tr.iteration == 2
    resumed = [tr.train_step()["loss"] for _ in range(2)]
    want = res[0][f"save{zero}"]["losses"][2:]
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(resumed, want)), (resumed, want)


def resume_world(path: str, zero: int) -> list:
    from loom.training.trainer import Trainer
    cfg = make_cfg(2, zero=zero, m=2)
    cfg.training.train_iters = 4
    cfg.checkpoint.load = path
    tr = Trainer(cfg, mesh=ParallelMesh.build())
    assert tr.iteration == 2
    return [tr.train_step()["loss"] for _ in range(2)]


def test_plain_checkpoint_resumes_with_zero2_at_dp2(tmp_path):
    from loom.training.trainer import Trainer
    cfg = make_cfg(2, zero=0, m=2)
    cfg.training.global_batch_size, cfg.training.train_iters = 8, 4
    tr = Trainer(cfg.validate(1), mesh=ParallelMesh.single())
    for _ in range(2):
        tr.train_step()
    tr.save(str(tmp_path))
    want = [tr.train_step()["loss"] for _ in range(2)]
    for resumed in run_distributed(2, resume_world, str(tmp_path), 2, timeout=600):
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(resumed, want)), \
            (resumed, want)


def test_grad_reduce_in_bf16_keeps_and_reduces_bf16_gradients(results2):
    """``--grad-reduce-in-bf16`` (Megatron's flag, arguments.py:1213): the buckets are bf16
    (the fp32 run's fp32), the main gradients take 2 bytes per parameter (ZeRO-1 at d 2:
    2 + 2 + 12/2 = 10 bytes), and loss and gradient shards stay within bf16's rounding of the
    fp32-reduced run's."""
    for r in results2[0]:
        c = r["bf16-grads"]
        assert c["dtypes"] == {"bf16": ["torch.bfloat16"], "fp32": ["torch.float32"]}, c
        assert c["compared"] > 10 and c["loss"] < 1e-2 and 0 < c["grad"] < 5e-2, c
        m = r["mem-zero1-bf16-grads"]
        assert abs(m["per_param"] / 10.0 - 1) < 0.01, m
        assert m["bytes"]["main_grads"] < 1.01 * 2 * m["n"], m

