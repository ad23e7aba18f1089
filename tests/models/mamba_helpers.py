"""The tiny Mamba-2 / hybrid configs and the parity harness shared by the tests of
tests/models (test_mamba.py, test_mamba_compose.py, test_mamba_interop.py). A plain module beside
them, not a test file: pytest puts this folder on ``sys.path`` and spawned ranks inherit it."""

from __future__ import annotations

from typing import Optional

from loom.config import LoomConfig, ModelConfig
from loom.parallel.mesh import ParallelMesh
from loom.parallel.registry import local_shard
from testkit.config import PARITY_ADAM_EPS, tiny_config, tiny_model
from testkit.numerics import PARITY_RTOL, rel_err


def tiny(pattern=None, **kw) -> ModelConfig:
    """h 32, d_inner 64 = 8 heads of P 8 in 2 groups, N 8, chunk 5 (does not divide s 16)."""
    return tiny_model("mamba", {"hybrid_override_pattern": pattern}, kw)


def make_cfg(model: ModelConfig, tp: int = 1, pp: int = 1, dp: int = 1,
             sp: bool = False) -> LoomConfig:
    return tiny_config(
        model=model, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        sequence_parallel=sp,
        global_batch_size=8,  # 4 / dp micro-batches: gradient accumulation
        # lr 3e-4: each AdamW step still moves every weight by ~1.5% of its size, and the two
        # runs' weights drift apart by rounding only ~3e-6 of a gradient by step 3 (1e-3 gave
        # 9.3e-6 on this CPU: too close to the 1e-5 bound to hold on every CPU)
        lr=3e-4, adam_eps=PARITY_ADAM_EPS, clip_grad=0.5, log_interval=10**9,
        world=tp * pp * dp)


# Near initialization dt ~ 1e-3..1e-1 makes every decay exp(dt A) ~ 1, so the gradients of
# A_log and dt_bias are ~1e-7 residues of cancelling terms ~1e-2: fp32 summation order alone
# moves them by ~1e-11 absolute, i.e. 1e-5 of their own size. Gradients are therefore compared
# relative to max(|ref|, GRAD_FLOOR): still 1e-5 of every tensor whose gradient exceeds 1e-5,
# and a real error in a tiny gradient (O(its size), ~1e-7) is ~1e-2 of the floor: caught.
GRAD_FLOOR = 1e-5


def parity(model: ModelConfig, layouts: dict, overrides: Optional[dict] = None) -> dict:
    """3 steps of each layout ``name -> (tp, pp, dp, sp)`` (``overrides[name]``: training
    options, e.g. recompute) vs the single-process run: worst relative error of the loss and
    the grad norm, and of every gradient per step."""
    from loom.parallel.grad_buffer import flat_buffers
    from loom.training.step import grad_getter
    from loom.training.trainer import Trainer

    def run(cfg, mesh):
        tr = Trainer(cfg, mesh=mesh)
        # the distributed optimizer keeps each rank's reduce-scattered range of a gradient
        owner = {id(p): r for r in flat_buffers(tr.reducers) for p in r.params}
        grad_of, out = grad_getter(tr.reducers), []
        for _ in range(3):
            loss = tr.global_loss(tr.forward_backward(tr.batches(tr.train_ds, tr.consumed_samples)))
            grads = {n: (grad_of(p).detach().clone(), tr.registry[n],
                         owner[id(p)].shard_range(p) if id(p) in owner else (0, p.numel()))
                     for c in tr.model_chunks for n, p in c.named_parameters()}
            out.append((loss, grads, tr.optimizer_step()))
            tr.consumed_samples += tr.global_batch
        return out, tr

    ref, _ = run(make_cfg(model), ParallelMesh.single())
    res = {}
    for name, (tp, pp, dp, sp) in layouts.items():
        cfg = make_cfg(model, tp, pp, dp, sp)
        for key, value in (overrides or {}).get(name, {}).items():  # training or parallel
            setattr(cfg.training if hasattr(cfg.training, key) else cfg.parallel, key, value)
        cfg = cfg.validate(tp * pp * dp)
        steps, tr = run(cfg, ParallelMesh.build(tp=tp, pp=pp))
        mesh = tr.mesh
        r = {"loss": 0.0, "norm": 0.0, "grad": [0.0] * 3, "compared": 0,
             "sp_params": len(tr.sp_params)}  # > 0 iff sequence parallelism is active
        for step, ((loss, grads, norm), (rloss, rgrads, rnorm)) in enumerate(zip(steps, ref)):
            r["loss"] = max(r["loss"], abs(loss - rloss) / abs(rloss))
            r["norm"] = max(r["norm"], abs(norm - rnorm) / rnorm)
            for n, (g, meta, (lo, hi)) in grads.items():
                want = local_shard(rgrads[n][0], meta, mesh.tp_rank, mesh.tp_size)
                if hi > lo:
                    r["grad"][step] = max(r["grad"][step], rel_err(
                        g.reshape(-1), want.reshape(-1)[lo:hi], scale=want, floor=GRAD_FLOOR))
                r["compared"] += 1
        res[name] = r
    return res


def check_parity(case: dict):
    """Loss and grad norm of all 3 steps, and every gradient of every step, within rtol 1e-5
    (gradients relative to max(|ref|, GRAD_FLOOR)). Step 1 compares the parallel math alone
    (same weights on both sides); steps 2-3 also the optimizer step, whose rounding drift
    AdamW amplifies on near-zero gradients: measured at most 2.9e-6 with ``make_cfg``'s lr
    3e-4 (1.2e-6 at step 1). A wrong gradient is off by O(1)."""
    assert case["loss"] < PARITY_RTOL and case["norm"] < PARITY_RTOL, case
    assert max(case["grad"]) < PARITY_RTOL, case
