"""Zero-bubble pipeline schedules (ZB-H1, ``--pipeline-schedule zero-bubble``; ZB-V,
``--pipeline-schedule zbv``): parity with the single-process run (loss and every gradient, 3
steps, and the evaluation loss) at PP=2 and PP=4, with TP=2 x SP, DP buckets overlapped, ZeRO-1
and ZeRO-2, recomputation, MoE and (ZB-V) tied embeddings on stage 0, each asserting that B and W
ran as separate ops; their op lists against the paper's bubble; the 16-bit p2p dtype; ZeRO-2's
reduce-scatter overlapping backward; a checkpoint saved under ZB-V loaded under 1F1B. Parity
helpers are tests/parallel/test_pipeline.py's.
"""

from __future__ import annotations

import pytest
import torch

from loom.config import ConfigError
from loom.parallel.pipeline import bubble
from loom.parallel.pipeline.schedules import OP_LISTS
from testkit import run_distributed
from tests.parallel.test_pipeline import _check, _parity_cases, make_cfg

ZB = "zero-bubble"


def _simulate(lists, cost, v_shape=False):
    """Run per-stage op lists with the pass times ``cost`` ({"F": t, ...}) and zero-latency p2p;
    returns (makespan, peak micro-batches held between F and W per stage, in whole stages).
    ``v_shape``: two chunks per stage in a V (chunk 1 = virtual stage 2p - 1 - r). Raises
    AssertionError on a deadlock."""
    p = len(lists)
    v = 2 if v_shape else 1
    last = v * p - 1

    def vstage(r, c):
        return 2 * p - 1 - r if c else r
    done, clock, idx, progress = {}, [0.0] * p, [0] * p, True
    while progress:
        progress = False
        for r in range(p):
            while idx[r] < len(lists[r]):
                kind, c, j = lists[r][idx[r]]
                s = vstage(r, c)
                dep = {"F": (s - 1, "F", j) if s > 0 else None,
                       "B": (s + 1, "B", j) if s < last else (s, "F", j),
                       "W": (s, "B", j)}[kind]
                if dep is not None and dep not in done:
                    break
                clock[r] = max(clock[r], done.get(dep, 0.0)) + cost[kind]
                done[(s, kind, j)] = clock[r]
                idx[r] += 1
                progress = True
    assert all(i == len(ops) for i, ops in zip(idx, lists)), "deadlock"
    peaks = []
    for ops in lists:
        held = peak = 0
        for kind, _, _ in ops:
            held += (kind == "F") - (kind == "W")
            peak = max(peak, held)
        peaks.append(peak / v)
    return max(clock), peaks


UNIT = {"F": 1.0, "B": 1.0, "W": 1.0}


def test_zb_h1_op_lists_match_the_paper():
    for p in (2, 4):
        for m in (1, 2, p, 2 * p + 1):
            lists = [OP_LISTS[ZB](m, p, r) for r in range(p)]
            for ops in lists:
                assert sorted(ops) == sorted((k, 0, j) for k in "FBW" for j in range(m))
                seen = set()
                for kind, c, j in ops:  # B after its F, W after its B
                    assert kind == "F" or ({"B": "F", "W": "B"}[kind], c, j) in seen
                    seen.add((kind, c, j))
            makespan, peaks = _simulate(lists, UNIT)
            assert max(peaks) <= min(p, m)  # 1F1B's activation memory
            if m >= p:  # bubble (p-1)(F+B-W) = p-1 units, a third of 1F1B's 3(p-1)
                assert makespan - 3 * m == bubble.bubble_zb_h1(p, m) == p - 1
            fused = [OP_LISTS["1f1b"](m, p, r) for r in range(p)]
            t_1f1b, _ = _simulate(fused, {"F": 1.0, "B": 2.0})  # fused B = B + W
            assert t_1f1b - 3 * m == bubble.bubble_1f1b(p, m)
    assert bubble.schedule_bubble(ZB, 4, 8) == bubble.schedule_bubble("1f1b", 4, 8) / 3


def test_zbv_op_lists():
    """ZB-V: every op once per chunk, dependencies along the V, deadlock-free, 1F1B's memory;
    the bubble with unit pass times is bubble.bubble_zbv's (p-1)F/2 for m >= 2p - 1."""
    for p in (2, 4):
        for m in (1, 2, p, 2 * p - 1, 3 * p):
            lists = [OP_LISTS["zbv"](m, p, r) for r in range(p)]
            for ops in lists:
                assert sorted(ops) == sorted((k, c, j) for k in "FBW" for c in (0, 1)
                                             for j in range(m))
            makespan, peaks = _simulate(lists, {k: t / 2 for k, t in UNIT.items()}, True)
            assert max(peaks) <= min(p, m)
            if m >= 2 * p - 1:
                assert makespan - 3 * m == bubble.bubble_zbv(p, m) < bubble.bubble_zb_h1(p, m)
    with pytest.raises(ValueError):
        OP_LISTS["zbv"](4, 2, 0, 3)


class _Twice(torch.autograd.Function):
    """A custom Function whose backward refuses to run twice (as the fused cross-entropy)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.done = False
        return x @ w

    @staticmethod
    def backward(ctx, g):
        assert not ctx.done, "backward ran twice"
        ctx.done = True
        x, w = ctx.saved_tensors
        return g @ w.t(), x.transpose(-1, -2) @ g


@pytest.mark.parametrize("shape", ["mlp", "custom_function", "input_unused"])
def test_split_backward_equals_fused(shape):
    """B then W gives the input gradient and every weight gradient of one fused backward."""
    from loom.parallel.pipeline.split_backward import backward_input, backward_weight
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.LayerNorm(6), torch.nn.GELU(),
                              torch.nn.Linear(6, 6))
    w = torch.nn.Parameter(torch.randn(6, 6))
    params = list(net.parameters()) + [w]
    x0, g = torch.randn(3, 6), torch.randn(3, 6)

    def run(x):
        h = net(x)
        if shape == "custom_function":
            return _Twice.apply(h, w)
        if shape == "input_unused":
            return w.sum() * torch.ones(3, 6)
        return h + w[0]
    x = x0.clone().requires_grad_(True)
    run(x).backward(g)
    want = [None if t.grad is None else t.grad.clone() for t in params + [x]]
    for q in params:
        q.grad = None
    x = x0.clone().requires_grad_(True)
    state = backward_input(run(x), g, x, params)
    assert (x.grad is None) == (shape == "input_unused")
    if shape == "mlp":  # weights untouched by B
        assert all(q.grad is None for q in params)
    backward_weight(state)
    got = [q.grad for q in params] + [x.grad]
    for a, b in zip(got, want):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, atol=1e-6))


def _world2(cases, tmp):
    import torch.distributed as dist

    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    out = {"parity": _parity_cases(cases), "p2p": {}, "zbv": _toy_v_parity(),
           "ckpt": _zbv_checkpoint(tmp)}
    # --bf16 / --fp16: activations and their gradients cross stages in the 16-bit type
    sent = []
    real = dist.batch_isend_irecv

    def spy(ops):
        sent.extend((o.op.__name__, o.tensor.dtype, o.tensor.numel() * o.tensor.element_size())
                    for o in ops)
        return real(ops)
    mesh = ParallelMesh.build(pp=2)
    dist.batch_isend_irecv = spy
    try:
        for flag, sched in (("bf16", ZB), ("fp16", "1f1b")):
            cfg = make_cfg("llama", pp=2, m=2, schedule=sched)
            setattr(cfg.training, flag, True)
            tr = Trainer(cfg.validate(2), mesh=mesh)
            sent.clear()
            tr.forward_backward(tr.batches(tr.train_ds, tr.consumed_samples))
            out["p2p"][flag] = [(k, str(d), n) for k, d, n in sent]
    finally:
        dist.batch_isend_irecv = real
    out["p2p"]["fp32_bytes"] = 16 * 2 * 32 * 4  # one [s, b, h] message in fp32
    return out


def _zero2_overlap():
    """ZeRO-2 buffers over 4 ranks, 4 buckets, 2 micro-batches: with ``overlap`` reduce-scatters
    launch while backward still runs (counted when the first layer's input gradient arrives)
    and the shards equal those of the non-overlapped buffer."""
    import torch
    import torch.distributed as dist

    from loom.parallel import grad_buffer as gb
    rank = dist.get_rank()
    calls = []
    real = gb._reduce_scatter

    def counting(out, inp, group, async_op):
        calls.append(async_op)
        return real(out, inp, group, async_op)
    gb._reduce_scatter = counting
    res = {}
    try:
        for overlap in (True, False):
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
            buf = gb.GradBuffer(model.parameters(), dist.group.WORLD, bucket_size=272,
                                overlap=overlap, reduce_scatter=True, shard_gradients=True)
            in_backward = []
            for mb in range(2):
                torch.manual_seed(10 + 4 * mb + rank)
                x = torch.randn(3, 16)
                h = model[0](x)
                h.register_hook(lambda g: in_backward.append(len(calls)))
                calls.clear()
                ctx = buf.no_sync() if mb == 0 else torch.enable_grad()
                with ctx:
                    model[1:](h).square().sum().backward()
            buf.finish_grad_sync()
            res[overlap] = {"launched_in_backward": in_backward, "buckets": len(buf.buckets),
                            "shards": [buf.shard_grad(p).clone() for p in model.parameters()]}
    finally:
        gb._reduce_scatter = real
    same = all(torch.allclose(a, b, rtol=1e-6, atol=1e-7)
               for a, b in zip(res[True]["shards"], res[False]["shards"]))
    return {"same": same, "overlap": res[True]["launched_in_backward"],
            "plain": res[False]["launched_in_backward"], "buckets": res[True]["buckets"]}


def _toy_v_parity(m: int = 5) -> dict:
    """ZB-V in the executor on a toy model (2p tanh-linear layers in a V, the MSE loss on
    stage 0) against the single-process loss and gradients."""
    import torch
    import torch.distributed as dist

    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.pipeline.placement import v_chunk_layers
    from loom.parallel.pipeline.schedules import get_schedule
    p = dist.get_world_size()
    mesh = ParallelMesh.build(pp=p)
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(2 * p)]
    batches = [{"x": torch.randn(4, 2, 8), "y": torch.randn(4, 2, 8)} for _ in range(m)]
    ref = torch.nn.Sequential(*layers)
    ref_loss = sum(((ref(b["x"]) - b["y"]) ** 2).mean() for b in batches) / m
    ref_loss.backward()
    want = [[q.grad.clone() for q in layer.parameters()] for layer in layers]
    ref.zero_grad()
    mine = [i for (i,) in v_chunk_layers(2 * p, p, mesh.pp_rank)]

    def forward_step(chunk, batch, hidden):
        out = chunk(batch["x"] if hidden is None else hidden)
        return out, lambda o: (((o - batch["y"]) ** 2).mean(), {})
    res = get_schedule("zbv", p)([layers[i] for i in mine], batches, forward_step, mesh,
                                 p2p_shape=(4, 2, 8))
    ok = all(q.grad is not None and torch.allclose(q.grad, g, rtol=1e-5, atol=1e-7)
             for i in mine for q, g in zip(layers[i].parameters(), want[i]))
    return {"grads_ok": ok, "loss": float(res.loss), "ref_loss": float(ref_loss),
            "ops": res.stats.op_counts, "layers": mine}


def _world4(cases):
    return {"parity": _parity_cases(cases), "zero2": _zero2_overlap(), "zbv": _toy_v_parity()}


def _check_zbv(results):
    p = len(results)
    for rank, r in enumerate(results):
        z = r["zbv"]
        assert z["grads_ok"] and z["ops"] == {"F": 10, "B": 10, "W": 10}, z
        assert z["layers"] == [rank, 2 * p - 1 - rank]
    loss = results[0]["zbv"]  # the last virtual stage, hence the loss, is on stage 0
    assert abs(loss["loss"] - loss["ref_loss"]) <= 1e-5 * abs(loss["ref_loss"])


def _zbv_checkpoint(tmp: str) -> dict:
    """One ZB-V step of a tied model at PP=2, saved; loaded under 1F1B: every parameter by name
    (arrays, to cross the process boundary), and each run's next loss."""
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    mesh = ParallelMesh.build(pp=2)
    runs = []
    for sched, load in (("zbv", None), ("1f1b", tmp)):
        cfg = make_cfg("gpt2", pp=2, m=2, schedule=sched)
        cfg.checkpoint.load = load
        tr = Trainer(cfg.validate(2), mesh=mesh)
        if load is None:
            tr.train_step()
            tr.save(tmp)
        params = [(n, q.detach().numpy().copy()) for c in tr.model_chunks
                  for n, q in c.named_parameters()]
        runs.append({"params": params, "loss": tr.train_step()["loss"]})
    return {"saved": runs[0], "loaded": runs[1]}


def _check_zbv_checkpoint(results):
    import numpy as np
    named = [{}, {}]
    for r in results:
        for i, run in enumerate((r["ckpt"]["saved"], r["ckpt"]["loaded"])):
            for n, a in run["params"]:
                named[i].setdefault(n, []).append(a)
    assert set(named[0]) == set(named[1])
    for n, copies in named[0].items():  # both copies of the tied embedding alike, too
        for a in copies + named[1][n]:
            assert np.allclose(a, copies[0], rtol=1e-6, atol=1e-8), n
    loss = results[0]["ckpt"]
    assert abs(loss["saved"]["loss"] - loss["loaded"]["loss"]) <= 1e-5 * loss["saved"]["loss"]


def _check_ran(results, cases):
    for rank, per_rank in enumerate(results):
        for case, r in zip(cases, per_rank):
            m = case["m"] * (2 if case["schedule"] == "zbv" else 1)  # ZB-V: two chunks
            assert r["ops"] == {"F": m, "B": m, "W": m}, (case, r["ops"])  # B and W apart
            if case["schedule"] == "zbv":  # the V: chunks hold virtual stages r, 2p - 1 - r
                p = case["pp"]
                n = case.get("layers", 4) // (2 * p)
                r_pp = r["pp_rank"]
                assert r["chunks"] == [list(range(s * n, (s + 1) * n))
                                       for s in (r_pp, 2 * p - 1 - r_pp)], (case, r["chunks"])


def test_zero_bubble_pp2_recompute_moe_and_16bit_p2p(tmp_path):
    moe = {"model.num_experts": 4, "model.moe_router_topk": 2}
    cases = [dict(layout="gpt2", pp=2, m=4, schedule=ZB),
             dict(layout="llama", pp=2, m=3, schedule=ZB,
                  extra={"training.recompute_granularity": "full",
                         "training.recompute_method": "uniform",
                         "training.recompute_num_layers": 1}),
             dict(layout="gpt2", pp=2, m=2, schedule=ZB, extra=moe),
             dict(layout="gpt2", pp=2, m=4, schedule="zbv"),  # tied: both copies on stage 0
             dict(layout="llama", pp=2, m=3, schedule="zbv"),
             dict(layout="gpt2", pp=2, m=2, schedule="zbv", extra=moe)]
    results = run_distributed(2, _world2, cases, str(tmp_path))
    parity = [r["parity"] for r in results]
    _check(parity, len(cases))
    _check_ran(parity, cases)
    _check_zbv(results)
    _check_zbv_checkpoint(results)
    for flag, dtype in (("bf16", "torch.bfloat16"), ("fp16", "torch.float16")):
        msgs = results[0]["p2p"][flag]
        assert msgs and {d for _, d, _ in msgs} == {dtype}, msgs
        assert {n for _, _, n in msgs} == {results[0]["p2p"]["fp32_bytes"] // 2}


def test_zero_bubble_pp4_tp_sp_dp_buckets_zero():
    dp = {"parallel.overlap_grad_reduce": True, "parallel.ddp_bucket_size": 3000}
    cases = [dict(layout="gpt2", pp=4, m=4, schedule=ZB),
             dict(layout="llama", tp=2, pp=2, m=3, schedule=ZB, sp=True),
             dict(layout="gpt2", pp=2, m=3, schedule=ZB, extra=dp),
             dict(layout="llama", pp=2, m=3, schedule=ZB, extra={**dp, "training.zero_stage": 2}),
             dict(layout="gpt2", layers=8, pp=4, m=5, schedule="zbv"),
             dict(layout="llama", tp=2, pp=2, m=3, schedule="zbv", sp=True),
             # ZB-V x DP=2 buckets x ZeRO-1: the tied embedding's two shards summed on stage 0
             dict(layout="gpt2", pp=2, m=3, schedule="zbv", extra={**dp, "training.zero_stage": 1})]
    results = run_distributed(4, _world4, cases)
    parity = [r["parity"] for r in results]
    _check(parity, len(cases))
    _check_ran(parity, cases)
    _check_zbv(results)
    for r in results:
        z = r["zero2"]
        assert z["same"] and z["buckets"] >= 3
        # overlapped: reduce-scatters launched before the first layer's input gradient exists,
        # in both micro-batches; not overlapped: none until backward has ended
        assert all(n >= 1 for n in z["overlap"]) and z["plain"] == [0, 0], z


@pytest.mark.parametrize("extra, words", [
    ({"training.zero_stage": 3}, ["--pipeline-schedule zero-bubble", "--zero-stage"]),
    ({"training.compile": True}, ["--pipeline-schedule zero-bubble", "--compile"]),
    ({"parallel.pipeline_schedule": "zbv", "model.num_layers": 6},
     ["--pipeline-schedule zbv", "--num-layers 6", "divisible by 2 x"]),
    ({"parallel.pipeline_schedule": "zbv", "parallel.decoder_first_pipeline_num_layers": 2},
     ["--pipeline-schedule zbv", "--decoder-first"]),
    ({"parallel.pipeline_schedule": "zbv", "parallel.num_layers_per_virtual_pipeline_stage": 2},
     ["--pipeline-schedule zbv", "--num-layers-per-virtual-pipeline-stage is 2", "set it to 1"]),
    ({"parallel.pipeline_schedule": "zbv", "checkpoint.load": "/nonexistent"},
     ["--pipeline-schedule zbv", "--load", "--pipeline-schedule zero-bubble"]),
    ({"parallel.pipeline_schedule": "zbv", "training.zero_stage": 3},
     ["--pipeline-schedule zbv", "--zero-stage"]),
])
def test_zero_bubble_refused(extra, words):
    cfg = make_cfg(pp=2, m=2, schedule=ZB)
    for key, val in extra.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, val)
    with pytest.raises(ConfigError) as e:
        cfg.validate(2)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_zbv_config_accepts_its_own_chunk_size():
    """``loom plan``'s ZB-V command gives --num-layers-per-virtual-pipeline-stage L / (2p)."""
    cfg = make_cfg(pp=2, m=2, schedule="zbv", lpv=1).validate(2)
    assert cfg.parallel.pipeline_schedule == "zbv"
    assert make_cfg(pp=1, m=2, schedule="zbv").validate(1).parallel.pipeline_schedule == "zbv"
