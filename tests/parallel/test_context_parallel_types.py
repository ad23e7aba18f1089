"""Context parallelism by comm type (``--cp-comm-type p2p|a2a|allgather|a2a+p2p``, one per layer
or one for all, ``--hierarchical-context-parallel-sizes A B``) against the unsharded run.

Primitives: each type's attention (loss-weighted output, q/k/v gradients) equals the unsharded
core in fp64 at CP=2 and CP=4, with GQA (g=2 and g=1: a2a repeats the groups), a value head dim
different from the query/key one (MLA), Gemma 3's sliding window and score soft-capping; the
collectives per attention call are counted (p2p: c-1 isend/irecv forward, 2c-1 backward; a2a:
4 all-to-alls each way; allgather: 2 all-gathers; a2a+p2p: both). p2p with dropout: the same
seed gives the same output and backward is the exact gradient of that output (central
differences). Trainer rows: 3 steps of LLaMA (GQA) and Gemma 3 (local/global layers) at CP=2,
CP=4 and CP=2 x TP=2 for each type (allgather at CP=2: tests/parallel/test_parallel_parity.py):
loss, every gradient and the updated parameters equal the single-process run (rtol 1e-5), and
each row asserts its type ran (counted on the CP groups). Query tiles smaller than a chunk
(ring attention's memory bound) are checked with and without a window.
Config: Megatron's defaults, per-layer lists, the refusals naming the flag and a fix.
Two spawned worlds (2 and 4 ranks) run all distributed checks.
"""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
import torch.distributed as dist

from loom.config import LoomConfig
from loom.errors import ConfigError
from loom.parallel.mesh import ParallelMesh
from testkit import count_collectives, run_distributed
from testkit.numerics import PARAM_RTOL, PARITY_RTOL, rel_err
from testkit.config import PARITY_ADAM_EPS, PARITY_SHAPE, tiny_config, tiny_model


# -- primitives against the unsharded core -------------------------------------------------------

def _cores():
    from loom.models.attention import DotProductAttention
    from loom.models.gemma3.model import GemmaAttentionCore
    return {"dpa": (DotProductAttention, dict(g=2)), "gqa1": (DotProductAttention, dict(g=1)),
            "mla-dv": (DotProductAttention, dict(g=4, dv=6)),  # v padded for the fused kernel
            "gemma-window": (lambda: GemmaAttentionCore(0.3, 5, None), dict(g=2)),
            # soft-capping: ring attention's plain-tensor path (and d_v > d_qk)
            "gemma-softcap": (lambda: GemmaAttentionCore(0.3, None, 20.0), dict(g=2, dv=12))}


def _hier_groups(c: int, a: int):
    """The mesh's hierarchical CP groups of a world that is one CP group."""
    mesh = ParallelMesh.build(cp=c, hierarchical_cp=(a, c // a))
    return mesh.groups["cp"], mesh.groups.get("cp_a2a"), mesh.groups.get("cp_p2p")


def primitive_case(make_core, kind: str, groups, g: int, dv: int = 8, s: int = 32) -> dict:
    from loom.parallel.context.attention import ContextParallelAttention
    from loom.parallel.context.split import local_positions, slice_for_cp
    cp, a2a, p2p = groups
    c, r = dist.get_world_size(cp), dist.get_rank(cp)
    gen = torch.Generator().manual_seed(7)
    b, a, d = 2, 4, 8
    q, k = torch.randn(b, a, s, d, generator=gen), torch.randn(b, g, s, d, generator=gen)
    v, go = torch.randn(b, g, s, dv, generator=gen), torch.randn(b, a, s, dv, generator=gen)
    q, k, v, go = (t.double() for t in (q, k, v, go))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    (make_core()(*ref) * go).sum().backward()
    mine = [slice_for_cp(t, r, c, 2).clone().requires_grad_() for t in (q, k, v)]
    attn = ContextParallelAttention(make_core(), cp, kind, a2a, p2p)
    with count_collectives(p2p=True) as fwd:
        out = attn(*mine, local_positions(s, r, c))
    with count_collectives(p2p=True) as bwd:
        (out * slice_for_cp(go, r, c, 2)).sum().backward()
    want = [make_core()(*ref)] + [t.grad for t in ref]
    err = max(rel_err(x, slice_for_cp(w, r, c, 2), scale=w)
              for x, w in zip([out.detach()] + [t.grad for t in mine], [w.detach() for w in want]))

    def ops(records):
        out = {}
        for rec in records:
            out[rec["op"]] = out.get(rec["op"], 0) + 1
        return out
    sent = {op: sum(rec["bytes"] for rec in fwd if rec["op"] == op)
            for op in ("isend", "all_to_all")}
    return {"err": err, "fwd": ops(fwd), "bwd": ops(bwd), "sent": sent, "g": g, "dv": dv}


def tiled_ring_case(groups, window) -> float:
    """Ring attention with query tiles of 3 rows (runs cut mid-chunk: a tile sees the keys
    before it whole and its own square causally), with and without a sliding window."""
    from loom.parallel.context.split import all_positions, local_positions, slice_for_cp
    from loom.parallel.context.ring import CoreMath, ring_attention
    from loom.models.gemma3.model import GemmaAttentionCore
    cp = groups[0]
    c, r = dist.get_world_size(cp), dist.get_rank(cp)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 40, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    want = GemmaAttentionCore(0.5, window, None)(q, k, v)
    mine = [slice_for_cp(t, r, c, 2) for t in (q, k, v)]
    got = ring_attention(*mine, all_positions(40, c), cp,
                         CoreMath(scale=0.5, window=window, tile=3))
    assert torch.equal(all_positions(40, c)[r], local_positions(40, r, c))
    return rel_err(got, slice_for_cp(want, r, c, 2))


def dropout_case(groups) -> dict:
    """p2p with attention dropout: deterministic per seed, and backward is the gradient of
    what forward computed (directional central difference, fp64)."""
    from loom.models.attention import DotProductAttention
    from loom.parallel.context.attention import ContextParallelAttention
    from loom.parallel.context.split import local_positions
    cp = groups[0]
    c, r = dist.get_world_size(cp), dist.get_rank(cp)
    gen = torch.Generator().manual_seed(3 + r)
    x = [torch.randn(1, 2, 8, 4, generator=gen, dtype=torch.float64) for _ in range(3)]
    go = torch.randn(1, 2, 8, 4, generator=gen, dtype=torch.float64)
    dirs = [torch.randn(t.shape, generator=gen, dtype=torch.float64) for t in x]
    attn = ContextParallelAttention(DotProductAttention(dropout=0.3), cp, "p2p")
    pos = local_positions(8 * c, r, c)

    def f(ts):
        torch.manual_seed(11)
        return float((attn(*ts, pos) * go).sum())
    ts = [t.clone().requires_grad_() for t in x]
    torch.manual_seed(11)
    (attn(*ts, pos) * go).sum().backward()
    # the loss summed over ranks changes with every rank's inputs: sum the local dot products
    eps = 1e-6
    plus = f([t + eps * dv for t, dv in zip(x, dirs)])
    minus = f([t - eps * dv for t, dv in zip(x, dirs)])
    local = torch.tensor([plus - minus, sum(float((t.grad * dv).sum())
                                            for t, dv in zip(ts, dirs))], dtype=torch.float64)
    dist.all_reduce(local, group=cp)
    numeric, analytic = float(local[0]) / (2 * eps), float(local[1])
    no_drop = ContextParallelAttention(DotProductAttention(), cp, "p2p")
    same = f(x) == f(x) and f(x) != float((no_drop(*x, pos) * go).sum())
    return {"numeric": numeric, "analytic": analytic, "deterministic": same}


def primitives(c: int) -> dict:
    res = {}
    plain = (dist.group.WORLD, None, None)
    kinds = [("allgather", plain), ("p2p", plain), ("a2a", plain)]
    if c == 4:
        kinds.append(("a2a+p2p", _hier_groups(4, 2)))
    for kind, groups in kinds:
        for name, (make, kw) in _cores().items():
            res[f"{kind}/{name}"] = primitive_case(make, kind, groups, **kw)
    res["dropout"] = dropout_case(plain)
    res["tiled"] = max(tiled_ring_case(plain, 7), tiled_ring_case(plain, None))
    return res


# -- whole-model rows through the Trainer ---------------------------------------------------------

def model_cfg(family: str, c: int, kind: str, tp: int = 1, hier=None) -> LoomConfig:
    if family == "llama":
        model = tiny_model("llama", PARITY_SHAPE, seq_length=32, ffn_hidden_size=96)
    else:  # gemma3: a local (sliding window 5) and a global layer
        model = tiny_model("gpt", PARITY_SHAPE, num_query_groups=2, seq_length=32,
                           model_type="gemma3", kv_channels=16, ffn_hidden_size=96,
                           sliding_window=5, layer_types="LG", query_pre_attn_scalar=24,
                           init_method_std=0.05)
    return tiny_config(model=model, mock_data=False, tensor_model_parallel_size=tp,
                       context_parallel_size=c, cp_comm_type=kind,
                       hierarchical_context_parallel_sizes=hier, global_batch_size=4,
                       adam_eps=PARITY_ADAM_EPS, clip_grad=0.5, log_interval=10**9,
                       world=tp * c)


def trainer_row(family: str, c: int, kind: str, tp: int = 1, hier=None) -> dict:
    """3 steps side by side with the single-process run: worst relative errors, and the
    collectives on the CP groups."""
    from loom.config.parallel_cp import hierarchical_sizes
    from loom.parallel.registry import local_shard
    from loom.training.trainer import Trainer
    cfg = model_cfg(family, c, kind, tp, hier)
    mesh = ParallelMesh.build(tp=tp, cp=c, hierarchical_cp=hierarchical_sizes(cfg.parallel))
    par = Trainer(cfg, mesh=mesh)
    ref_cfg = copy.deepcopy(cfg)
    ref_cfg.parallel.tensor_model_parallel_size = ref_cfg.parallel.context_parallel_size = 1
    ref_cfg.parallel.hierarchical_context_parallel_sizes = None
    ref_cfg.parallel.cp_comm_type = "p2p"
    ref = Trainer(ref_cfg.validate(1), mesh=ParallelMesh.single())
    out = {"loss": 0.0, "grad": 0.0, "param": 0.0, "nparams": 0, "comm": {}}
    cp_groups = {mesh.groups.get(n) for n in ("cp", "cp_a2a", "cp_p2p")} - {None}
    for _ in range(3):
        with count_collectives(p2p=True) as rec:
            lp = par.global_loss(par.forward_backward(par.batches(par.train_ds,
                                                                  par.consumed_samples)))
        for rcd in rec:
            if any(rcd["group"] is grp for grp in cp_groups):
                out["comm"][rcd["op"]] = out["comm"].get(rcd["op"], 0) + 1
        lr_ = float(ref.forward_backward(ref.batches(ref.train_ds, ref.consumed_samples)))
        out["loss"] = max(out["loss"], abs(lp - lr_) / abs(lr_))
        ref_params = dict(ref.model_chunks[0].named_parameters())
        for name, prm in par.model_chunks[0].named_parameters():
            want = local_shard(ref_params[name].grad, par.registry[name], mesh.tp_rank, tp)
            out["grad"] = max(out["grad"], rel_err(prm.grad, want))
        out["nparams"] = len(ref_params)
        par.optimizer_step(), ref.optimizer_step()
        par.consumed_samples += par.global_batch
        ref.consumed_samples += ref.global_batch
    ref_params = dict(ref.model_chunks[0].named_parameters())
    for name, prm in par.model_chunks[0].named_parameters():
        want = local_shard(ref_params[name].detach(), par.registry[name], mesh.tp_rank, tp)
        out["param"] = max(out["param"], rel_err(prm.detach(), want))
    out["types"] = sorted({m.comm_type for m in par.model_chunks[0].modules()
                           if type(m).__name__ == "ContextParallelAttention"})
    return out


def world2() -> dict:
    res = {f"prim/{k}": v for k, v in primitives(2).items()}
    for kind in ("p2p", "a2a"):
        res[f"llama/cp2/{kind}"] = trainer_row("llama", 2, kind)
    res["gemma3/cp2/p2p"] = trainer_row("gemma3", 2, "p2p")
    res["llama/cp2/a2a+p2p(2x1)"] = trainer_row("llama", 2, "a2a+p2p", hier="2 1")
    res["llama/cp2/per-layer"] = trainer_row("llama", 2, "p2p a2a")
    return res


def world4() -> dict:
    res = {f"prim/{k}": v for k, v in primitives(4).items()}
    for kind, hier in (("p2p", None), ("a2a", None), ("a2a+p2p", "2 2"), ("allgather", None)):
        res[f"llama/cp4/{kind}"] = trainer_row("llama", 4, kind, hier=hier)
    res["gemma3/cp4/a2a+p2p"] = trainer_row("gemma3", 4, "a2a+p2p", hier="2 2")
    for kind in ("p2p", "a2a"):
        res[f"llama/cp2xtp2/{kind}"] = trainer_row("llama", 2, kind, tp=2)
    res["gemma3/cp2xtp2/a2a"] = trainer_row("gemma3", 2, "a2a", tp=2)
    return res


EXPECTED_OPS = {  # per attention call at c ranks: forward, backward (gloo)
    "allgather": lambda c: ({"all_gather": 2}, {"all_reduce": 2}),
    "p2p": lambda c: ({"isend": c - 1, "irecv": c - 1}, {"isend": 2 * c - 1, "irecv": 2 * c - 1}),
    "a2a": lambda c: ({"all_to_all": 4}, {"all_to_all": 4}),
    "a2a+p2p": lambda c: ({"all_to_all": 4, "isend": 1, "irecv": 1},  # A = B = 2
                          {"all_to_all": 4, "isend": 3, "irecv": 3}),
}


def _check_world(results: list, c: int) -> None:
    for rank in results:
        for name, case in rank.items():
            if name == "prim/tiled":
                assert case < 1e-12, case
            elif name == "prim/dropout":
                assert case["deterministic"], case
                assert case["analytic"] == pytest.approx(case["numeric"], rel=1e-6), case
            elif name.startswith("prim/"):
                kind = name.split("/")[1]
                assert case["err"] < 1e-12 or (case["err"] < 1e-6 and "softcap" in name), \
                    (name, case)  # the Gemma core soft-caps in fp32
                fwd, bwd = EXPECTED_OPS[kind](c)
                assert (case["fwd"], case["bwd"]) == (fwd, bwd), (name, case)
                if kind != "allgather":  # the planner's bytes are what was sent
                    _check_cost(kind, c, case)
            else:
                for key in ("loss", "grad"):
                    assert case[key] < PARITY_RTOL, (name, key, case)
                assert case["param"] < PARAM_RTOL and case["nparams"] > 5, (name, case)
                kinds = name.split("/")[2].split("(")[0]
                want = ["a2a", "p2p"] if kinds == "per-layer" else [kinds]
                assert case["types"] == want, (name, case)  # the type was used ...
                comm = case["comm"]
                if kinds == "allgather":
                    assert comm.get("all_gather", 0) > 0 and "isend" not in comm, (name, comm)
                    continue
                assert "all_gather" not in comm, (name, comm)  # ... and nothing else
                ring = "p2p" in kinds or kinds == "per-layer"
                if ring and "(2x1)" not in name:  # a2a+p2p 2 x 1: a ring of one
                    assert comm.get("isend", 0) > 0, (name, comm)
                if "a2a" in kinds or kinds == "per-layer":
                    assert comm.get("all_to_all", 0) > 0, (name, comm)


def _check_cost(kind: str, c: int, case: dict) -> None:
    from loom.parallel.context.cost import AttentionShape, cp_cost
    shape = AttentionShape(s=32, b=2, a=4, g=case["g"], d_qk=8, d_v=case["dv"])
    hier = (2, 2) if kind == "a2a+p2p" else None
    cost = cp_cost(shape, c, kind, hier, bytes_per_element=8)
    n = 2 if hier else c  # all_to_all_single's buffer is the whole share; (n-1)/n leaves
    sent = case["sent"]["isend"] + (n - 1) / n * case["sent"]["all_to_all"]
    assert sent == pytest.approx(cost.bytes_fwd), (kind, case, cost)


def test_cost_model_memory_and_overlap():
    """p2p holds O(s/c) of K/V, allgather O(s); a2a+p2p in between; p2p overlaps everything."""
    from loom.parallel.context.cost import AttentionShape, cp_cost, kv_elements
    shape = AttentionShape(s=131072, b=1, a=128, g=128, d_qk=192, d_v=128, t=8)  # MLA-like
    full = kv_elements(shape, 1, "p2p")
    assert kv_elements(shape, 8, "allgather") == full
    assert kv_elements(shape, 8, "p2p") == full / 4  # own block + the one in flight: 2 s/c
    assert kv_elements(shape, 8, "a2a") == full / 8
    assert kv_elements(shape, 8, "a2a+p2p", (2, 4)) == full / 4
    assert cp_cost(shape, 8, "p2p").overlapped == 1.0
    assert cp_cost(shape, 8, "a2a").overlapped == 0.0
    assert 0 < cp_cost(shape, 8, "a2a+p2p", (2, 4)).overlapped < 1
    with pytest.raises(ValueError, match="A x B = c"):
        cp_cost(shape, 8, "a2a+p2p", (2, 2))


def test_cp_types_world2():
    _check_world(run_distributed(2, world2), 2)


def test_cp_types_world4():
    _check_world(run_distributed(4, world4), 4)


# -- config ---------------------------------------------------------------------------------------

def _parse(argv: list) -> LoomConfig:
    from loom.config import add_config_arguments, config_from_args
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    base = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8",
            "--seq-length", "32", "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters",
            "1", "--mock-data", "--vocab-size", "100"]
    return config_from_args(parser.parse_args(base + argv))


def test_cp_comm_type_flags():
    from loom.config.parallel_cp import cp_comm_types, hierarchical_sizes
    cfg = _parse(["--context-parallel-size", "4"]).validate(4)
    assert cfg.parallel.cp_comm_type == "p2p"  # Megatron's default
    assert cfg.parallel.hierarchical_context_parallel_sizes is None
    assert cp_comm_types(cfg.parallel, 4) == ("p2p",) * 4
    cfg = _parse(["--context-parallel-size", "4", "--cp-comm-type", "p2p", "a2a", "a2a+p2p",
                  "allgather", "--hierarchical-context-parallel-sizes", "2", "2"]).validate(4)
    assert cp_comm_types(cfg.parallel, 4) == ("p2p", "a2a", "a2a+p2p", "allgather")
    assert hierarchical_sizes(cfg.parallel) == (2, 2)


@pytest.mark.parametrize("argv,match", [
    (["--cp-comm-type", "ring"], "--cp-comm-type ring: each value must be one of"),
    (["--cp-comm-type", "p2p", "a2a"], "gives 2 values for --num-layers 4"),
    (["--cp-comm-type", "a2a+p2p"], "needs --hierarchical-context-parallel-sizes A B.*e.g. "
                                    "--hierarchical-context-parallel-sizes 4 1"),
    (["--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "1"],
     "must multiply to --context-parallel-size 4"),
    (["--hierarchical-context-parallel-sizes", "2", "x"], "give two positive integers"),
    (["--cp-comm-type", "a2a", "--num-query-groups", "8", "--group-query-attention",
      "--tensor-model-parallel-size", "4"],
     "2 attention heads per tensor-parallel rank.*over 4 ranks.*--cp-comm-type p2p or "
     "allgather, or --cp-comm-type a2a\\+p2p --hierarchical-context-parallel-sizes 2 2"),
])
def test_cp_comm_type_refusals(argv, match):
    with pytest.raises(ConfigError, match=match):
        cfg = _parse(["--context-parallel-size", "4"] + argv)
        cfg.validate(4 * cfg.parallel.tensor_model_parallel_size)


def test_a2a_accepts_gqa_by_repeating_groups():
    """g = 2 groups over an a2a of 4: repeated to 4 groups (8 heads: 2 per group still)."""
    _parse(["--context-parallel-size", "4", "--cp-comm-type", "a2a", "--num-query-groups", "2",
            "--group-query-attention"]).validate(4)
