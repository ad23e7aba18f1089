"""Expert parallelism over tensor- and context-parallel ranks, as Megatron-Core folds it (issue
42's functional-test layouts): the ranks of a pipeline stage re-folded as expert TP u x EP e x
expert DP, so an EP group may hold ranks of different TP and CP coordinates.

Parity rows (fp32, same seed, 3 optimizer steps, one 4-rank world): the loss, every gradient's
reduced shard, the gradient norm (clipping active: the norm counts each expert element once)
and the parameters after the steps against the single-process run, with the distributed
optimizer (ZeRO-1, and ZeRO-2) and both dispatchers, at TP2 PP2 EP2 ETP1 (the EP groups are the
TP groups), TP4 EP2 ETP2 (expert TP between 1 and t) and TP2 CP2 EP2 (the EP groups are the CP
groups); each case asserts where the experts went (the EP group spans TP or CP coordinates, E/e
local experts, u-way expert shards, the pair split over TP). The rank grid itself against
Megatron-Core's ``RankGenerator`` (pure, no process group) and the one refusal that remains
(expert TP not dividing TP). ZeRO-3 with expert TP 1 (its expert-DP group spanning TP):
tests/parallel/test_fsdp.py; the checkpoint moving into and out of TP2 EP4 ETP1:
tests/models/test_moe.py.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from loom.config import ConfigError, LoomConfig
from testkit import run_distributed
from testkit.numerics import PARAM_RTOL, PARITY_RTOL, rel_err
from testkit.config import PARITY_ADAM_EPS, tiny_config

STEPS = 3
CLIP = 0.05  # below every step's gradient norm here: clipping is active

CASES = {  # name: layout on 4 ranks (d = 1: Megatron's grid is the only way to EP 2 here)
    "tp2-pp2-ep2-etp1-a2a-zero1": dict(tp=2, pp=2, ep=2, etp=1, kind="alltoall", zero=1),
    "tp4-ep2-etp2-allgather-zero1": dict(tp=4, ep=2, etp=2, kind="allgather", zero=1),
    "tp2-cp2-ep2-a2a-zero2": dict(tp=2, cp=2, ep=2, kind="alltoall", zero=2),
}


def make_cfg(tp=1, pp=1, cp=1, ep=1, etp=None, kind="alltoall", zero=0, world=4) -> LoomConfig:
    return tiny_config(
        "moe", num_query_groups=4, seq_length=16, padded_vocab_size=128, num_experts=8,
        moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=16, moe_layer_freq=1,
        moe_token_dispatcher_type=kind, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, context_parallel_size=cp, sequence_parallel=tp > 1,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        ddp_bucket_size=5_000,  # several buckets per reducer
        zero_stage=zero, global_batch_size=8, adam_eps=PARITY_ADAM_EPS, clip_grad=CLIP,
        log_interval=10**9, world=world)


def reference(case: dict) -> dict:
    """The single-process run of ``case`` (computed once, in the test process): per step the
    loss, every full gradient and the norm; the parameters after the steps."""
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    cfg = make_cfg(kind=case["kind"], world=1)
    tr = Trainer(cfg, mesh=ParallelMesh.single())
    steps = []
    for _ in range(STEPS):
        loss = float(tr.forward_backward(tr.batches(tr.train_ds, tr.consumed_samples)))
        grads = {n: p.grad.detach().clone() for n, p in tr.model_chunks[0].named_parameters()}
        steps.append((loss, grads, tr.optimizer_step()))
        tr.consumed_samples += tr.global_batch
    return {"steps": steps, "params": {n: p.detach().clone()
                                       for n, p in tr.model_chunks[0].named_parameters()}}


def placement(tr, mesh) -> dict:
    """Where this rank's experts are: the TP / CP coordinates in its EP group, the local expert
    ids per MoE layer, the expert shard fraction, the dispatcher's pair split."""
    coords = [dict(tp=r % mesh.sizes["tp"], cp=r // mesh.sizes["tp"] % mesh.sizes["cp"])
              for r in mesh.ranks["ep"]]
    layers = [m for c in tr.model_chunks for n, m in c.named_modules() if n.endswith(".mlp")]
    fc1 = layers[0].experts[next(iter(layers[0].experts))].linear_fc1.weight
    return {"ep_tp": sorted({c["tp"] for c in coords}), "ep_cp": sorted({c["cp"] for c in coords}),
            "local": [sorted(int(i) for i in m.experts) for m in layers],
            "fc1_rows": fc1.shape[0], "pair_split": layers[0].dispatcher.pair_stride,
            "kinds": sorted({m.dispatcher.kind for m in layers})}


def parity_case(case: dict, ref: dict) -> dict:
    import torch.distributed as dist

    from loom.parallel.grad_buffer import flat_buffers
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.registry import local_shard
    from loom.training.step import finish_param_gather, grad_getter
    from loom.training.trainer import Trainer
    cfg = make_cfg(**case, world=dist.get_world_size())
    p = cfg.parallel
    mesh = ParallelMesh.build(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                              cp=p.context_parallel_size, ep=p.expert_model_parallel_size,
                              etp=p.expert_tensor_parallel_size)
    tr = Trainer(cfg, mesh=mesh)
    owner = {id(q): r for r in flat_buffers(tr.reducers) for q in r.params}
    grad_of = grad_getter(tr.reducers)
    errors, compared, norms = [], 0, []

    def shard(full, name):
        meta = tr.registry[name]
        return local_shard(full, meta, *mesh.shard_of(meta))
    for step in range(STEPS):
        loss = tr.global_loss(tr.forward_backward(tr.batches(tr.train_ds, tr.consumed_samples)))
        rloss, rgrads, rnorm = ref["steps"][step]
        if not math.isclose(loss, rloss, rel_tol=PARITY_RTOL):
            errors.append(f"step {step}: loss {loss} != {rloss}")
        for chunk in tr.model_chunks:
            for name, q in chunk.named_parameters():
                if not q.requires_grad:
                    continue
                want = shard(rgrads[name], name).reshape(-1)
                lo, hi = owner[id(q)].shard_range(q)
                got = grad_of(q).reshape(-1)
                compared += 1
                err = rel_err(got, want[lo:hi], scale=want) if hi > lo else 0.0
                if err > PARITY_RTOL:
                    errors.append(f"step {step}: grad {name} relative error {err:.2e}")
        norm = tr.optimizer_step()
        norms.append(norm)
        if not math.isclose(norm, rnorm, rel_tol=PARITY_RTOL):
            errors.append(f"step {step}: grad norm {norm} != {rnorm}")
        tr.consumed_samples += tr.global_batch
    finish_param_gather(tr.optimizer)
    for chunk in tr.model_chunks:
        for name, q in chunk.named_parameters():
            want = shard(ref["params"][name], name)
            err = rel_err(q, want)
            if err > PARAM_RTOL:  # 3 Adam steps
                errors.append(f"parameter {name} after the steps: relative error {err:.2e}")
    return {"errors": errors, "compared": compared, "norms": norms,
            "optimizer": type(tr.optimizer).__name__,
            "sharded": all(r.reduce_scatter for r in flat_buffers(tr.reducers) if r.size > 1),
            "expert_reducer": len(flat_buffers(tr.reducers)) > len(tr.model_chunks),
            **placement(tr, mesh)}


def world4(refs: bytes) -> dict:
    refs = torch.load(io.BytesIO(refs))
    return {name: parity_case(case, refs[name]) for name, case in CASES.items()}


@pytest.fixture(scope="module")
def results4():
    buf = io.BytesIO()  # as bytes: the fork server would pass each tensor as a file descriptor
    torch.save({name: reference(case) for name, case in CASES.items()}, buf)
    return run_distributed(4, world4, buf.getvalue(), timeout=600)


@pytest.mark.parametrize("name", list(CASES))
def test_expert_grid_parity(results4, name):
    case = CASES[name]
    t, e, u = case["tp"], case["ep"], case.get("etp") or case["tp"]
    for rank, r in enumerate(results4):
        got = r[name]
        assert got["compared"] > 10 and not got["errors"], \
            f"rank {rank}: " + "; ".join(got["errors"][:4])
        assert min(got["norms"]) > CLIP  # clipping was active
        assert got["optimizer"] == "DistributedOptimizer" and got["sharded"], got
        assert got["expert_reducer"], got  # expert gradients reduced over their own group
        assert got["kinds"] == [case["kind"]], got
        assert all(len(ids) == 8 // e for ids in got["local"]), got  # E / e local experts
        assert got["fc1_rows"] == 2 * 32 // u, got  # SwiGLU FC1 split over the u expert-TP ranks
        assert got["pair_split"] == t // u, got  # the kept pairs split over TP when u < t
    if u < t:  # the experts really are split across TP ranks: EP groups mix TP coordinates
        assert all(len(r[name]["ep_tp"]) > 1 for r in results4), [r[name] for r in results4]
    if case.get("cp", 1) > 1:  # Megatron's fold: EP over CP before DP
        assert all(r[name]["ep_cp"] == [0, 1] for r in results4), [r[name] for r in results4]
    # different ranks hold different experts: the union over ranks is all of them
    assert {i for r in results4 for ids in r[name]["local"] for i in ids} == set(range(8))


def test_rank_grid_is_megatrons():
    """The expert groups equal Megatron-Core's (``RankGenerator`` of megatron-core 0.16.1,
    order ``tp-cp-ep-dp-pp`` for the dense grid, the expert grid with cp=1), and the dense
    groups too, for the corpus layouts."""
    from megatron.core.parallel_state import RankGenerator

    from loom.parallel.mesh import expert_rank_groups, rank_groups
    for t, c, d, p, e, u in [(2, 1, 2, 2, 4, 1), (4, 1, 1, 2, 2, 2), (2, 2, 2, 1, 2, 2),
                             (2, 1, 4, 1, 2, 1), (2, 2, 2, 2, 4, 1), (4, 1, 2, 1, 4, 2)]:
        sizes = {"tp": t, "cp": c, "dp": d, "pp": p}
        n = t * c * d
        dense = RankGenerator(tp=t, ep=1, dp=d, pp=p, cp=c, order="tp-cp-ep-dp-pp")
        expert = RankGenerator(tp=u, ep=e, dp=n // (u * e), pp=p, cp=1, order="tp-cp-ep-dp-pp")
        for ours, theirs in (("tp", "tp"), ("cp", "cp"), ("dp", "dp"), ("pp", "pp")):
            assert sorted(rank_groups(sizes, [ours])) == sorted(dense.get_ranks(theirs))
        for ours, theirs in (("etp", "tp"), ("ep", "ep"), ("edp", "dp")):
            assert sorted(expert_rank_groups(sizes, u, e, ours)) == \
                sorted(expert.get_ranks(theirs)), (t, c, d, p, e, u, ours)


def test_layouts_megatron_allows_are_accepted_and_one_is_refused():
    """Megatron's rule: u e divides t c d (its world / PP); loom's one remaining refusal: u
    must divide t. The corpus layouts pass validation."""
    for case, world in [(dict(tp=2, pp=2, ep=4, etp=1), 8), (dict(tp=4, pp=2, ep=2, etp=2), 16),
                        (dict(tp=2, cp=2, ep=2), 8), (dict(tp=2, ep=8, etp=1), 8),
                        (dict(tp=2, cp=2, pp=2, ep=2), 8)]:
        make_cfg(**case, world=world)
    with pytest.raises(ConfigError, match="--expert-tensor-parallel-size 4 must divide "
                                          "--tensor-model-parallel-size 2"):
        make_cfg(tp=2, ep=1, etp=4, world=8)
    with pytest.raises(ConfigError, match="--expert-tensor-parallel-size 2 x "
                                          "--expert-model-parallel-size 8 must divide the 8"):
        make_cfg(tp=2, ep=8, world=8)
