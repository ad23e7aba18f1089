"""``--optimizer sgd`` (Megatron's: torch SGD, ``--sgd-momentum`` 0.9, weight decay added to the
gradient) and ``--deterministic-mode`` at TP=2 x PP=2 x DP=2 on 8 gloo ranks (CPU, fp32, no
dropout), one spawned world for every case (issue 42 item 3).

* Parity with the single-process SGD run for 3 steps, rtol 1e-5 on the loss, every gradient,
  the clipped global norm and the parameters after the steps (SGD has no per-element division
  that amplifies rounding, so the parameters hold 1e-5 too): the plain optimizer, the
  distributed optimizer (ZeRO-1, with --overlap-grad-reduce and --overlap-param-gather: the
  momentum buffers sharded over DP) and FSDP2 (ZeRO-3). Each asserts that SGD ran (the inner
  optimizer's class, non-zero momentum buffers).
* The distributed optimizer's momentum buffers, saved by parameter name at TP2 x PP2 x DP2, load
  into one plain process and equal the single-process run's buffers (rtol 1e-5).
* ``--deterministic-mode``: two runs of the same layout (ZeRO-1 with both overlaps) give
  bitwise-equal losses, gradient norms and parameters, with
  ``torch.are_deterministic_algorithms_enabled()`` on in the run.
"""

from __future__ import annotations

import copy

import pytest
import torch

from loom.config import LoomConfig
from testkit import run_distributed
from testkit.numerics import PARITY_RTOL, rel_err
from testkit.config import PARITY_SHAPE, tiny_config

STEPS = 3


def make_cfg(world: int, tp: int = 2, pp: int = 2, zero: int = 0, og: bool = False,
             opg: bool = False, deterministic: bool = False) -> LoomConfig:
    return tiny_config(
        "gpt", PARITY_SHAPE, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        overlap_grad_reduce=og, ddp_bucket_size=20_000,  # several buckets
        zero_stage=zero, overlap_param_gather=opg, optimizer="sgd", sgd_momentum=0.9,
        weight_decay=0.1, deterministic_mode=deterministic, train_iters=10, lr=0.05,
        clip_grad=0.5,
        global_batch_size=2 * 2 * (world // (tp * pp)),  # two micro-batches per DP rank
        log_interval=10**9, no_progress_bar=True, world=world)


def single(cfg: LoomConfig) -> LoomConfig:
    """The same run on one process: no model parallelism, no ZeRO, no overlap."""
    ref = copy.deepcopy(cfg)
    ref.parallel.tensor_model_parallel_size = ref.parallel.pipeline_model_parallel_size = 1
    ref.parallel.overlap_grad_reduce = False
    ref.training.zero_stage, ref.training.use_distributed_optimizer = 0, False
    ref.training.overlap_param_gather = False
    return ref.validate(1)


_REF: dict = {}


def reference(cfg: LoomConfig, steps: int = STEPS) -> dict:
    """Losses, gradients, norms, parameters and SGD momentum buffers (by name) of ``steps``
    single-process steps (cached per process)."""
    key = (repr(single(cfg)), steps)
    if key not in _REF:
        _REF[key] = _reference(cfg, steps)
    return _REF[key]


def _reference(cfg: LoomConfig, steps: int) -> dict:
    from loom.parallel.mesh import ParallelMesh
    from loom.training.optimizer import optimizer_state_by_name
    from loom.training.trainer import Trainer
    ref = Trainer(single(cfg), mesh=ParallelMesh.single())
    params = dict(ref.model_chunks[0].named_parameters())
    out = {"loss": [], "grads": [], "norm": []}
    for _ in range(steps):
        out["loss"].append(float(ref.forward_backward(ref.batches(ref.train_ds,
                                                                   ref.consumed_samples))))
        out["grads"].append({n: q.grad.detach().clone() for n, q in params.items()})
        out["norm"].append(ref.optimizer_step())
        ref.consumed_samples += ref.global_batch
    out["params"] = {n: q.detach().clone() for n, q in params.items()}
    out["momentum"] = {n: st["momentum_buffer"] for n, st in
                       optimizer_state_by_name(ref.optimizer, params).items()}
    return out


def parity_case(ref: dict, save: str | None = None, **kw) -> dict:
    """3 steps of the layout ``kw`` beside ``ref``: worst relative errors, and whether SGD ran."""
    import torch.distributed as dist

    from loom.parallel.fsdp import full_tensor
    from loom.parallel.grad_buffer import flat_buffers
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.registry import local_shard
    from loom.training.optimizer import local_optimizer
    from loom.training.step import finish_param_gather, grad_getter
    from loom.training.trainer import Trainer
    cfg = make_cfg(dist.get_world_size(), **kw)
    tr = Trainer(cfg, mesh=ParallelMesh.build(tp=2, pp=2))
    zero3 = cfg.training.zero_stage == 3
    owner = {} if zero3 else {id(q): r for r in flat_buffers(tr.reducers) for q in r.params}
    grad_of = grad_getter(tr.reducers)
    out = {"loss": 0.0, "grad": 0.0, "norm": 0.0, "param": 0.0, "compared": 0}

    def want(t: torch.Tensor, name: str) -> torch.Tensor:
        return local_shard(t, tr.registry[name], tr.mesh.tp_rank, tr.mesh.tp_size)
    for step in range(STEPS):
        loss = tr.global_loss(tr.forward_backward(tr.batches(tr.train_ds, tr.consumed_samples)))
        out["loss"] = max(out["loss"], abs(loss - ref["loss"][step]) / abs(ref["loss"][step]))
        for chunk in tr.model_chunks:
            for name, q in chunk.named_parameters():
                w = want(ref["grads"][step][name], name)
                if zero3:
                    got, w = full_tensor(q.grad), w
                else:  # the owned range (the whole tensor without the distributed optimizer)
                    lo, hi = owner[id(q)].shard_range(q)
                    got, w = grad_of(q).reshape(-1), w.reshape(-1)[lo:hi]
                out["grad"] = max(out["grad"], rel_err(got, w))
                out["compared"] += 1
        norm = tr.optimizer_step()
        out["norm"] = max(out["norm"], abs(norm - ref["norm"][step]) / ref["norm"][step])
        tr.consumed_samples += tr.global_batch
    finish_param_gather(tr.optimizer)
    for chunk in tr.model_chunks:
        for name, q in chunk.named_parameters():
            got = full_tensor(q.detach()) if zero3 else q.detach()
            out["param"] = max(out["param"], rel_err(got, want(ref["params"][name], name)))
    inner = local_optimizer(tr.optimizer)
    out["optimizer"] = (type(tr.optimizer).__name__, type(inner).__name__)
    out["momentum_norm"] = sum(float(st["momentum_buffer"].float().norm())
                               for st in inner.state.values() if "momentum_buffer" in st)
    if save:
        tr.iteration = STEPS  # the steps above ran outside train_step
        tr.save(save)
    return out


def deterministic_case() -> dict:
    """The same ZeRO-1 layout with both overlaps, twice, under --deterministic-mode."""
    import torch.distributed as dist

    from loom.parallel.mesh import ParallelMesh
    from loom.training.step import finish_param_gather
    from loom.training.trainer import Trainer
    runs = []
    for _ in range(2):
        cfg = make_cfg(dist.get_world_size(), zero=1, og=True, opg=True, deterministic=True)
        tr = Trainer(cfg, mesh=ParallelMesh.build(tp=2, pp=2))
        recs = [tr.train_step() for _ in range(STEPS)]
        finish_param_gather(tr.optimizer)
        runs.append({"loss": [r["loss"] for r in recs], "norm": [r["grad_norm"] for r in recs],
                     "params": [q.detach().clone() for q in tr.params],
                     "on": torch.are_deterministic_algorithms_enabled()})
    a, b = runs
    return {"losses": a["loss"], "same_loss": a["loss"] == b["loss"],
            "same_norm": a["norm"] == b["norm"],
            "same_params": all(torch.equal(x, y) for x, y in zip(a["params"], b["params"])),
            "on": a["on"] and b["on"]}


def world8(save: str) -> dict:
    ref = reference(make_cfg(8))
    return {"sgd": parity_case(ref), "sgd-zero1": parity_case(ref, save, zero=1, og=True,
                                                              opg=True),
            "sgd-zero3": parity_case(ref, zero=3), "deterministic": deterministic_case()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("sgd") / "ckpt")
    return run_distributed(8, world8, path, timeout=900, start_method="fork"), path


@pytest.mark.parametrize("case, kind", [("sgd", "SGD"), ("sgd-zero1", "DistributedOptimizer"),
                                        ("sgd-zero3", "SGD")])
def test_sgd_parity_at_tp2_pp2_dp2(results, case, kind):
    for r in results[0]:
        c = r[case]
        assert c["optimizer"] == (kind, "SGD") and c["momentum_norm"] > 0, c
        assert c["compared"] > 0 and c["loss"] < PARITY_RTOL and c["grad"] < PARITY_RTOL, c
        assert c["norm"] < PARITY_RTOL and c["param"] < PARITY_RTOL, c


def test_sgd_momentum_saved_sharded_loads_on_one_rank(results):
    """Momentum buffers by name: the ZeRO-1 TP2 x PP2 x DP2 save, loaded by one plain process,
    equal the single-process run's after the same 3 steps."""
    from loom.parallel.mesh import ParallelMesh
    from loom.training.optimizer import optimizer_state_by_name
    from loom.training.trainer import Trainer
    _, path = results
    cfg = single(make_cfg(8))
    ref = reference(make_cfg(8))
    cfg.checkpoint.load = path
    tr = Trainer(cfg.validate(1), mesh=ParallelMesh.single())
    assert tr.iteration == STEPS
    params = dict(tr.model_chunks[0].named_parameters())
    loaded = optimizer_state_by_name(tr.optimizer, params)
    assert set(loaded) == set(ref["momentum"])
    for name, st in loaded.items():
        assert rel_err(st["momentum_buffer"], ref["momentum"][name]) < PARITY_RTOL, name
        assert rel_err(params[name].detach(), ref["params"][name]) < PARITY_RTOL, name


def test_the_harness_fails_a_wrong_momentum():
    """A harness that can fail: the plain run with another --sgd-momentum is far outside."""
    a = reference(make_cfg(8), steps=2)
    cfg = make_cfg(8)
    cfg.training.sgd_momentum = 0.5
    b = reference(cfg, steps=2)
    assert max(rel_err(b["params"][n], a["params"][n]) for n in a["params"]) > 100 * PARITY_RTOL


def test_deterministic_mode_runs_are_bitwise_equal(results):
    for r in results[0]:
        d = r["deterministic"]
        assert d["on"] and d["same_loss"] and d["same_norm"] and d["same_params"], d
