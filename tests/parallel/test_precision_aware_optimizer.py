"""``--use-precision-aware-optimizer`` and its dtypes (Megatron's flags; Transformer Engine's
FusedAdam storage rules, :mod:`loom.training.state_precision`) on 2 gloo ranks with the
distributed optimizer (ZeRO-1), 3 steps each, beside the same run without the flag:

* fp32 training, every dtype fp32: the flag changes nothing (loss, parameters within 1e-5);
* bf16 training, every dtype fp32: the fp32 masters are kept as 2-byte remainders, 2 + 4 +
  10/2 = 11 bytes per parameter (6 + 12/2 = 12 without the flag); lossless: fed the same
  gradients, the masters are bit-identical to the 4-byte masters' and the parameters differ
  only where the master sits on a tie of bf16's rounding (TE rounds ties away from zero, torch
  to even), so the runs' losses agree within 1e-4 over 3 steps;
* bf16 moments: 2 + 4 + 6/2 = 9 bytes; loss within bf16 rounding;
* fp16 / fp8 moments and fp16 masters: stored as such, the loss finite and near;
* ``--main-grads-dtype bf16``: bf16 gradient buckets under ``--bf16``;
* a checkpoint of the bf16-moment run resumes with the losses of the uninterrupted run.
"""

from __future__ import annotations

import math

import pytest
import torch

from loom.parallel.mesh import ParallelMesh
from testkit import run_distributed
from testkit.config import PARITY_ADAM_EPS, PARITY_SHAPE, tiny_config, tiny_model
from testkit.numerics import rel_err

PA = dict(use_precision_aware_optimizer=True)


def make_cfg(bf16: bool, **flags):
    return tiny_config(model=tiny_model("gpt", PARITY_SHAPE, num_layers=4), mock_data=True,
                       ddp_bucket_size=None, zero_stage=1, bf16=bf16, global_batch_size=4,
                       adam_eps=PARITY_ADAM_EPS, clip_grad=0.5, log_interval=10**9,
                       world=2, **flags)


def run_case(bf16: bool, steps: int = 3, **flags) -> dict:
    """``steps`` train steps: losses, the parameters after them, the bytes held after the last
    (:func:`param_bytes`), the stored dtypes, and whether the flag took effect."""
    from loom.training.distributed_optimizer import param_bytes
    from loom.training.trainer import Trainer
    tr = Trainer(make_cfg(bf16, **flags), mesh=ParallelMesh.build())
    losses = [tr.train_step()["loss"] for _ in range(steps)]
    opt = tr.optimizer
    n = sum(p.numel() for p in tr.params)
    stored = sorted({f"{k}:{v.data.dtype}" for slot in opt.stored.packed.values()
                     for k, v in slot.items()})
    ranges = [rg for rg in opt.ranges if rg.hi > rg.lo]
    offloaded = sum(rg.hi - rg.lo for rg in ranges if rg.offloaded)
    return {"losses": losses, "params": [p.detach().float().clone() for p in tr.params],
            "offloaded": offloaded, "owned": sum(rg.hi - rg.lo for rg in ranges),
            "largest": max(rg.hi - rg.lo for rg in ranges),
            "on_host": all(rg.master.device.type == "cpu" and rg.master.data_ptr() !=
                           rg.param.data_ptr() for rg in ranges if rg.offloaded),
            "per_param": sum(param_bytes(opt).values()) / n, "bytes": param_bytes(opt), "n": n,
            "stored": stored, "active": opt.precision is not None and opt.stored.is_packed,
            "buckets": sorted({str(b.buffer.dtype) for r in opt.reducers for b in r.buckets})}


def compare(a: dict, b: dict) -> dict:
    return {"loss": max(abs(x - y) / abs(y) for x, y in zip(a["losses"], b["losses"])),
            "param": max(rel_err(p, q, q) for p, q in zip(a["params"], b["params"]))}


def resume_case(path: str) -> dict:
    """bf16 moments: 2 steps, save, 2 more (the reference); then a new trainer loads the save and
    runs the 2 steps again."""
    from loom.training.trainer import Trainer
    flags = dict(PA, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16", train_iters=4)
    tr = Trainer(make_cfg(True, **flags), mesh=ParallelMesh.build())
    first = [tr.train_step()["loss"] for _ in range(2)]
    tr.save(path)
    want = [tr.train_step()["loss"] for _ in range(2)]
    again = Trainer(make_cfg(True, load=path, **flags), mesh=ParallelMesh.build())
    return {"first": first, "want": want, "iteration": again.iteration,
            "resumed": [again.train_step()["loss"] for _ in range(2)]}


def lockstep_case() -> dict:
    """bf16 without and with the flag (every dtype fp32), fed the same reduced gradients (the
    plain run's buckets copied into the other's before each step) for 3 steps: the masters
    evolve by the same AdamW operations, so they must be bit-identical; the parameters are the
    masters rounded to nearest, ties away from zero under the flag (TE's remainder split)."""
    from loom.parallel.grad_buffer import flat_buffers
    from loom.training.state_precision import split_remainder
    from loom.training.trainer import Trainer
    a, b = (Trainer(make_cfg(True, **flags), mesh=ParallelMesh.build()) for flags in ({}, PA))
    for _ in range(3):
        for t in (a, b):
            t.forward_backward(t.batches(t.train_ds, t.consumed_samples))
        for ra, rb in zip(flat_buffers(a.reducers), flat_buffers(b.reducers)):
            for ba, bb in zip(ra.buckets, rb.buckets):
                bb.buffer.copy_(ba.buffer)
        for t in (a, b):
            t.optimizer_step()
            t.consumed_samples += t.global_batch
    out = {"ranges": 0, "masters_equal": True, "params_rounded": True, "ties": 0, "elements": 0}
    with b.optimizer.stored.unpacked():
        for x, y in zip(a.optimizer.ranges, b.optimizer.ranges):
            out["ranges"] += x.hi > x.lo
            out["masters_equal"] &= torch.equal(x.master.view(torch.int32),
                                                y.master.view(torch.int32))
            pb = y.param.detach().view(-1)[y.lo:y.hi]
            out["params_rounded"] &= torch.equal(pb, split_remainder(x.master)[0])
            out["ties"] += int((pb != x.param.detach().view(-1)[x.lo:x.hi]).sum())
            out["elements"] += x.hi - x.lo
    return out


def world(path: str) -> dict:
    base = {"fp32": run_case(False), "bf16": run_case(True)}
    runs = {"fp32-pa": run_case(False, **PA), "bf16-pa": run_case(True, **PA),
            "bf16-moments": run_case(True, **PA, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16"),
            "fp16-fp8": run_case(True, **PA, exp_avg_dtype="fp8", exp_avg_sq_dtype="fp16",
                                 main_params_dtype="fp16"),
            "bf16-grads": run_case(True, **PA, main_grads_dtype="bf16"),
            "fp32-offload": run_case(False, **PA, optimizer_cpu_offload=True,
                                     optimizer_offload_fraction=0.5),
            "bf16-offload": run_case(True, **PA, optimizer_cpu_offload=True,
                                     optimizer_offload_fraction=0.5)}
    out = {name: {k: v for k, v in r.items() if k != "params"} for name, r in runs.items()}
    for name, r in runs.items():
        out[name]["vs"] = compare(r, base["bf16" if not name.startswith("fp32") else "fp32"])
    out["base-bf16"] = {k: v for k, v in base["bf16"].items() if k != "params"}
    out["resume"] = resume_case(path)
    out["lockstep"] = lockstep_case()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_distributed(2, world, str(tmp_path_factory.mktemp("pa")), timeout=900)


def test_fp32_dtypes_change_nothing_in_fp32_training(results):
    for r in results:
        c = r["fp32-pa"]
        assert c["active"] and c["stored"] == ["exp_avg:torch.float32",
                                                "exp_avg_sq:torch.float32"], c
        assert c["vs"]["loss"] < 1e-6 and c["vs"]["param"] < 1e-6, c["vs"]


@pytest.mark.parametrize("name,grad_bytes,dtypes", [
    ("base-bf16", 4, None), ("bf16-pa", 4, ("fp32", "fp32", "fp32")),
    ("bf16-moments", 4, ("bf16", "bf16", "fp32")), ("fp16-fp8", 4, ("fp8", "fp16", "fp16")),
    ("bf16-grads", 2, ("fp32", "fp32", "fp32"))])
def test_planner_prices_the_bytes_loom_holds(results, name, grad_bytes, dtypes):
    """The planner's bytes per parameter (ZeRO-1 at d 2: weights + gradients + optimizer,
    :func:`precision_aware_bytes` for the stored states) equal what the run holds."""
    from loom.planner.memory import model_state_bytes_per_param, precision_aware_bytes
    priced = precision_aware_bytes(*dtypes) if dtypes else {}
    per = sum(float(x) for x in model_state_bytes_per_param(
        1, 2, grad_bytes, state_bytes=priced.get("optimizer_state_bytes", 8.0),
        master_bytes=priced.get("master_bytes", 4.0)))
    for r in results:
        assert abs(r[name]["per_param"] / per - 1) < 0.01, (name, r[name]["per_param"], per)


def test_bf16_masters_are_kept_as_lossless_remainders(results):
    for r in results:
        c, base = r["bf16-pa"], r["base-bf16"]
        assert c["active"] and "master:torch.int16" in c["stored"], c
        assert c["losses"][0] == base["losses"][0] and c["vs"]["loss"] < 1e-4, c["vs"]
        assert abs(c["per_param"] / 11.0 - 1) < 0.01, c  # 2 + 4 + (2 + 4 + 4) / 2
        assert abs(base["per_param"] / 12.0 - 1) < 0.01, base  # 2 + 4 + 12 / 2
        assert c["bytes"]["master"] < 1.01 * c["n"], c  # 2 bytes over d = 2
        lock = r["lockstep"]
        assert lock["ranges"] > 10 and lock["masters_equal"] and lock["params_rounded"], lock
        assert lock["ties"] < 1e-3 * lock["elements"], lock  # RNE and ties-away differ at ties


def test_bf16_moments_take_a_third_of_the_states(results):
    for r in results:
        c = r["bf16-moments"]
        assert c["stored"] == ["exp_avg:torch.bfloat16", "exp_avg_sq:torch.bfloat16",
                               "master:torch.int16"], c
        assert abs(c["per_param"] / 9.0 - 1) < 0.01, c  # 2 + 4 + (2 + 2 + 2) / 2
        assert 0 < c["vs"]["loss"] < 1e-2, c["vs"]  # active: bf16 moments round


def test_fp8_and_fp16_storage(results):
    for r in results:
        c = r["fp16-fp8"]
        assert c["stored"] == ["exp_avg:torch.float8_e4m3fn", "exp_avg_sq:torch.float16",
                               "master:torch.float16"], c
        assert all(math.isfinite(x) for x in c["losses"]) and 0 < c["vs"]["loss"] < 5e-2, c
        assert abs(c["per_param"] / 8.5 - 1) < 0.01, c  # 2 + 4 + (2 + 1 + 2) / 2


def test_main_grads_dtype_bf16_keeps_bf16_gradient_buckets(results):
    for r in results:
        c = r["bf16-grads"]
        assert c["buckets"] == ["torch.bfloat16"] and r["bf16-pa"]["buckets"] == \
            ["torch.float32"], c
        assert abs(c["per_param"] / 9.0 - 1) < 0.01, c  # 2 + 2 + (2 + 4 + 4) / 2


def test_checkpoint_resumes_the_packed_states(results):
    for r in results:
        c = r["resume"]
        assert c["iteration"] == 2, c
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(c["resumed"], c["want"])), c


def test_remainders_round_trip_bit_for_bit():
    from loom.training.state_precision import join_remainder, split_remainder
    x = torch.randn(4096, dtype=torch.float64).mul(torch.logspace(-30, 30, 4096)).float()
    x[:4] = torch.tensor([0.0, -0.0, 1.0 + 2 ** -8, -(1.0 + 2 ** -8)])  # ties at bf16's ulp
    value, rest = split_remainder(x)
    assert value.dtype == torch.bfloat16 and rest.dtype == torch.int16
    assert torch.equal(join_remainder(value, rest).view(torch.int32), x.view(torch.int32))
    assert torch.all((value.float() - x).abs() <= x.abs() * 2 ** -8)  # rounded to nearest
    assert value[2].item() == 1.0 + 2 ** -7 and value[3].item() == -(1.0 + 2 ** -7)  # ties away


@pytest.mark.parametrize("dtype,bound", [(torch.bfloat16, 2 ** -8), (torch.float16, 2 ** -10),
                                         (torch.float8_e4m3fn, 2 ** -3)])
def test_scaled_storage_error_is_the_dtype_s_rounding(dtype, bound):
    from loom.training.state_precision import pack, unpack
    x = torch.randn(1000) * 1e-6  # fp16 unscaled would flush most of these to zero
    p = pack(x, dtype)
    assert p.data.dtype == dtype
    err = rel_err(unpack(p), x)
    assert err <= bound, err
    assert torch.equal(unpack(pack(torch.zeros(3), dtype)), torch.zeros(3))


def test_cpu_offload_keeps_half_the_optimizer_on_the_host_with_the_same_math(results):
    """``--optimizer-cpu-offload --optimizer-offload-fraction 0.5``: the first ranges up to half
    of each rank's elements keep an fp32 master (a copy, on the host) and fp32 states, stepped by
    the same AdamW: in fp32 training the losses and weights equal the run without offload
    (1e-6); in bf16 the host part holds 4 + 8 bytes per element, the device part the
    precision-aware storage (2 + 8), and the loss stays within 1e-4 of plain bf16."""
    for r in results:
        for name in ("fp32-offload", "bf16-offload"):
            c = r[name]
            share = c["offloaded"] / c["owned"]
            assert c["on_host"] and 0.5 <= share <= 0.5 + c["largest"] / c["owned"], c
        c = r["fp32-offload"]
        assert c["vs"]["loss"] < 1e-6 and c["vs"]["param"] < 1e-6, c["vs"]
        c = r["bf16-offload"]
        assert c["vs"]["loss"] < 1e-4, c["vs"]
        assert c["bytes"]["host"] == 12 * c["offloaded"], c
        assert c["bytes"]["master"] + c["bytes"]["optimizer"] == 10 * (c["owned"] -
                                                                        c["offloaded"]), c
