"""The CUDA correctness tier, one process on one GPU (``pytest -m cuda``; skipped without CUDA).

What the CPU suite proves on CPU, held again where loom is meant to run:

- a bf16 run's loss tracks the fp32 run's for 20 steps on real text within the bound the CPU
  bf16 test uses (``tests/parallel/test_mixed_precision.py``, ``BF16_LOSS_RTOL``);
- the attention core runs a fused SDPA kernel (flash or cuDNN) in bf16, forward and backward,
  with and without attention dropout: the dispatched ``aten`` ops are read off the profiler,
  and the same step runs with SDPA restricted to those two backends (no math fallback);
- the fused, token-chunked output GEMM + cross-entropy equals ``F.cross_entropy`` on the full
  logits (loss and both gradients; fp32 rtol 1e-5 with TF32 off, bf16 1e-2);
- ``--compile`` (each layer ``torch.compile``'d: inductor, Triton) equals eager for 3 steps
  within the CPU compile test's tolerance, and Dynamo really compiled;
- dropout drawn from the RNG tracker's CUDA state (the per-TP-rank generator, forced on at
  t = 1) replays bit for bit under full and selective recompute, and recompute changes no loss
  or gradient (``tests/parallel/test_recompute.py``'s harness and tolerance);
- an ``--async-save`` checkpoint of CUDA tensors taken while training goes on loads bit-equal to
  the state at the save;
- ``--optimizer-cpu-offload``: half the optimizer on the host, half on the GPU, one AdamW over
  both, the fp32 run tracking the run without offload (the mixed-device path the CPU suite
  cannot reach).

fp32 comparisons run with TF32 off (matmul and cuDNN). Each test records what it measured as
junit properties (``record_property``), which ``benchmarks/gpu_check.py`` prints.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cpu_twins import twin
from loom.config import LoomConfig, ModelConfig
from loom.parallel.mesh import ParallelMesh
from testkit.numerics import rel_err
from testkit.config import PARITY_ADAM_EPS, tiny_config, tiny_model

# what the aten ops SDPA dispatches to are called, by backend: aten::_scaled_dot_product_
# flash_attention (its backward: ..._backward), ..._cudnn_attention, ..._efficient_attention,
# aten::_scaled_dot_product_attention_math (and the kernels they call: _flash_attention_forward)
SDPA_OPS = {"flash": "flash_attention", "cudnn": "cudnn_attention",
            "efficient": "efficient_attention", "math": "attention_math"}
FUSED = ("flash", "cudnn")


@pytest.fixture(autouse=True)
def _no_tf32():
    """fp32 GEMMs in full fp32 (the tolerances below are fp32's), restored afterwards."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def tiny_llama(**kw) -> ModelConfig:
    """The CPU tests' tiny LLaMA (GQA: 4 heads, 2 groups)."""
    return tiny_model("llama", dict(num_layers=4, hidden_size=64, ffn_hidden_size=96,
                                    vocab_size=300), kw)


def cuda_cfg(model: ModelConfig, **training) -> LoomConfig:
    return tiny_config(model=model, world=1, **{
        "device": "cuda", "global_batch_size": 8, "adam_eps": PARITY_ADAM_EPS,
        "clip_grad": 0.5,  # as tests/parallel/test_compile.py
        "log_interval": 10**9, "no_progress_bar": True, **training})


def trainer(cfg: LoomConfig):
    from loom.training.trainer import Trainer
    return Trainer(cfg, mesh=ParallelMesh.single("cuda"))


# -- bf16 -------------------------------------------------------------------------------------------

def test_bf16_step_tracks_fp32(tmp_path, record_property):
    mp = twin("parallel", "test_mixed_precision")
    losses = mp.bf16_and_fp32_losses(tmp_path, "cuda")
    record_property("bf16_max_rel_loss_err", max(losses["rel"]))
    fp32 = losses["fp32"]
    assert fp32[-1] < fp32[0] - 0.5, fp32  # it learns
    assert max(losses["rel"]) < mp.BF16_LOSS_RTOL, losses


# -- fused attention ---------------------------------------------------------------------------------

def sdpa_backends(names) -> dict:
    """``{"forward": [backend], "backward": [backend]}`` of the SDPA ops among profiler event
    names (``aten::`` op names: they name the backend on any device, no CUPTI needed)."""
    seen = {"forward": set(), "backward": set()}
    for name in names:
        if not name.startswith("aten::"):
            continue
        for backend, key in SDPA_OPS.items():
            if key in name:
                seen["backward" if "backward" in name else "forward"].add(backend)
    return {k: sorted(v) for k, v in seen.items()}


def _attention_step(dropout: float) -> None:
    """Forward + backward of a bf16 LLaMA chunk (head dim 128, GQA 4 heads / 2 groups)."""
    from loom.models import get_family
    from loom.parallel.parallelize import build_model
    from loom.training.precision import cast_parameters
    model = tiny_llama(num_layers=2, hidden_size=512, ffn_hidden_size=1024, seq_length=512,
                       vocab_size=1000, attention_dropout=dropout)
    family = get_family("gpt")
    chunk = build_model(family, model, ParallelMesh.single("cuda"))
    cast_parameters([chunk], torch.bfloat16)
    chunk.train()
    tokens = torch.randint(0, 1000, (2, 512), device="cuda")
    batch = {"tokens": tokens, "labels": tokens.roll(-1, 1),
             "position_ids": torch.arange(512, device="cuda")}
    out, loss_fn = family.forward_step(chunk, batch)
    loss, _ = loss_fn(out)
    loss.backward()
    torch.cuda.synchronize()


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_attention_runs_a_fused_sdpa_kernel(dropout, record_property):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile
    _attention_step(dropout)  # warm-up: kernel selection and loading outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _attention_step(dropout)
    seen = sdpa_backends(e.name for e in prof.events())
    record_property(f"sdpa_backend_dropout_{dropout}", seen)
    assert seen["forward"] and set(seen["forward"]) <= set(FUSED), seen
    assert seen["backward"] and set(seen["backward"]) <= set(FUSED), seen
    # and nothing else is needed: the step runs with SDPA restricted to the fused kernels
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        _attention_step(dropout)


# -- fused cross-entropy ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)],
                         ids=["fp32", "bf16"])
def test_fused_cross_entropy_equals_plain(dtype, tol, record_property):
    from loom.parallel.cross_entropy import linear_cross_entropy
    S, B, H, V, VP = 512, 4, 256, 5000, 5120  # 120 padding rows with random values
    g = torch.Generator(device="cuda").manual_seed(7)
    weight = (torch.randn(VP, H, device="cuda", generator=g) * 0.05).to(dtype)
    hidden = torch.randn(S, B, H, device="cuda", generator=g).to(dtype)
    target = torch.randint(0, V, (S, B), device="cuda", generator=g)
    w_ref, x_ref = weight.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    ref = F.cross_entropy(F.linear(x_ref, w_ref[:V]).float().reshape(-1, V), target.reshape(-1),
                          reduction="none").view(S, B)
    ref.mean().backward()
    worst = {}
    for chunk in (None, 300):  # the default rule (one chunk here), and 300: a non-divisor of 2048
        w, x = weight.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
        loss = linear_cross_entropy(x, w, target, group=None, vocab_start=0, vocab_size=V,
                                    chunk_tokens=chunk)
        loss.mean().backward()
        errs = {"loss": rel_err(loss, ref), "dx": rel_err(x.grad, x_ref.grad),
                "dw": rel_err(w.grad[:V], w_ref.grad[:V])}
        assert float(w.grad[V:].abs().max()) == 0.0  # padding rows get no probability
        worst = {k: max(v, worst.get(k, 0.0)) for k, v in errs.items()}
    record_property(f"cross_entropy_{str(dtype).split('.')[-1]}_rel_err", worst)
    assert max(worst.values()) < tol, worst


# -- --compile ----------------------------------------------------------------------------------------

def test_compile_per_layer_equals_eager(record_property):
    from torch._dynamo.utils import counters
    tol = twin("parallel", "test_compile").TOL
    torch._dynamo.reset()
    counters.clear()
    compiled = trainer(cuda_cfg(tiny_llama(), compile=True))
    eager = trainer(cuda_cfg(tiny_llama()))
    layers = compiled.model_chunks[0].layers.values()
    assert all(getattr(layer, "_compiled_call_impl", None) is not None for layer in layers)
    worst = {"loss": 0.0, "grad": 0.0, "norm": 0.0}
    for _ in range(3):
        lc = float(compiled.forward_backward(compiled.batches(compiled.train_ds,
                                                              compiled.consumed_samples)))
        le = float(eager.forward_backward(eager.batches(eager.train_ds, eager.consumed_samples)))
        worst["loss"] = max(worst["loss"], abs(lc - le) / abs(le))
        ref = dict(eager.model_chunks[0].named_parameters())
        for name, p in compiled.model_chunks[0].named_parameters():
            worst["grad"] = max(worst["grad"], rel_err(_grad(compiled, p).reshape(-1),
                                                       _grad(eager, ref[name]).reshape(-1)))
        nc, ne = compiled.optimizer_step(), eager.optimizer_step()
        worst["norm"] = max(worst["norm"], abs(nc - ne) / ne)
        for tr in (compiled, eager):
            tr.consumed_samples += tr.global_batch
    graphs = counters["stats"]["unique_graphs"]
    record_property("compile_rel_err", worst)
    record_property("compile_unique_graphs", graphs)
    torch._dynamo.reset()
    assert graphs > 0, "Dynamo compiled nothing"
    assert max(worst.values()) < tol, worst


def _grad(tr, p: torch.Tensor) -> torch.Tensor:
    """``p``'s gradient as the trainer holds it (``.grad``, or its fp32 main gradient)."""
    from loom.training.step import grad_getter
    return grad_getter(tr.reducers)(p)


# -- dropout under the RNG tracker, recomputed -----------------------------------------------------

def _partitioned_always(self, module, ctx):
    """:class:`loom.parallel.plan.PartitionedRNG` as at t > 1 with sequence parallelism: the
    attention core and the hidden dropouts draw from the RNG tracker (here its CUDA state)."""
    from loom.parallel.random import ForkedDropout
    if isinstance(module, nn.Dropout):
        return ForkedDropout(module.p, ctx.tracker), {}
    module.rng = ctx.tracker
    return module, {}


def test_dropout_on_the_cuda_rng_tracker_replays_under_recompute(monkeypatch, record_property):
    from loom.models.attention import DotProductAttention
    from loom.parallel.plan import PartitionedRNG
    from loom.parallel.random import ForkedDropout
    rc = twin("parallel", "test_recompute")
    monkeypatch.setattr(PartitionedRNG, "apply", _partitioned_always)
    mesh = ParallelMesh.single("cuda")
    base_cfg = rc.make_cfg("llama", 1)  # dropout 0.1 in attention and hidden states, fp32
    base = rc.run(base_cfg, mesh)
    tr = base["trainer"]
    chunk = tr.model_chunks[0]
    assert tr.tracker.device.type == "cuda"
    forked = [m for m in chunk.modules() if isinstance(m, ForkedDropout)]
    cores = [m for m in chunk.modules() if isinstance(m, DotProductAttention)]
    assert forked and cores and all(c.rng is tr.tracker for c in cores)
    errors = {"none": rc.count_errors(base, None, None, 0)}
    for gran, method, n in rc.VARIANTS:
        cfg = copy.deepcopy(base_cfg)
        cfg.training.recompute_granularity = gran
        cfg.training.recompute_method = method
        cfg.training.recompute_num_layers = n
        other = rc.run(cfg, mesh)
        errors[f"{gran}-{method}{n}"] = rc.compare(base, other) + rc.count_errors(
            other, gran, method, n)
    no_dropout = rc.run(rc._no_dropout(base_cfg), mesh, steps=1)
    record_property("recompute_variants", sorted(errors))
    assert base["losses"][0] != no_dropout["losses"][0], "dropout had no effect"
    assert not any(errors.values()), {k: v[:3] for k, v in errors.items() if v}


# -- --async-save of CUDA tensors ----------------------------------------------------------------

def test_async_checkpoint_of_cuda_tensors_loads_bit_equal(tmp_path, monkeypatch):
    """The save returns while the write is held back; two more steps change every CUDA tensor
    in place; the checkpoint still holds the state of the save (staged before the return)."""
    import loom.checkpoint.io as ckio
    released = threading.Event()

    class HeldWriter(ckio._Writer):
        def write_data(self, plan, planner):
            assert released.wait(120)
            return super().write_data(plan, planner)
    monkeypatch.setattr(ckio, "_storage_writer", lambda path, after=None: HeldWriter(path, after))

    def cfg(async_save: bool) -> LoomConfig:
        return tiny_config(model=tiny_llama(), device="cuda", bf16=True, global_batch_size=4,
                           train_iters=10, async_save=async_save,
                           save=str(tmp_path) if async_save else None, world=1)

    tr = trainer(cfg(True))
    for _ in range(2):
        tr.train_step()
    params = {n: p.detach().clone() for n, p in tr.model_chunks[0].named_parameters()}
    masters = {rg.name: rg.master.clone() for rg in tr.optimizer.ranges}
    assert all(p.is_cuda for p in params.values()) and all(m.is_cuda for m in masters.values())
    tr.save(str(tmp_path))
    assert tr.saver.pending is not None  # returned mid-write
    for _ in range(2):
        tr.train_step()  # every parameter and master changes while the write is held
    assert any(not torch.equal(p, params[n]) for n, p in tr.model_chunks[0].named_parameters())
    released.set()
    tr.saver.finish(lambda line: None)
    again = trainer(cfg(False))
    assert again.load(str(tmp_path)) and again.iteration == 2
    for n, p in again.model_chunks[0].named_parameters():
        assert p.is_cuda and torch.equal(p, params[n]), n
    for rg in again.optimizer.ranges:
        assert torch.equal(rg.master, masters[rg.name]), rg.name


# -- --optimizer-cpu-offload and the precision-aware storage on a GPU -------------------------------

def test_offloaded_optimizer_steps_on_the_host_with_the_same_math(record_property):
    """``--optimizer-cpu-offload --optimizer-offload-fraction 0.5`` (with
    ``--use-precision-aware-optimizer``): half the masters and states live on the host, the
    other half on the GPU, one AdamW steps both (fused per device), gradients go to the host and
    weights come back; fp32 losses and weights track the run without offload for 3 steps (the
    host's and the GPU's AdamW kernels round differently: 1e-5). The CPU suite's
    tests/parallel/test_precision_aware_optimizer.py holds the same on one device only."""
    from loom.training.distributed_optimizer import param_bytes
    runs = {}
    for name, flags in (("plain", {}), ("offload", dict(optimizer_cpu_offload=True,
                                                       optimizer_offload_fraction=0.5))):
        tr = trainer(cuda_cfg(tiny_llama(), use_distributed_optimizer=True,
                              use_precision_aware_optimizer=True, **flags))
        losses = [tr.train_step()["loss"] for _ in range(3)]
        runs[name] = (tr, losses, [p.detach().float().clone() for p in tr.params])
    tr, losses, params = runs["offload"]
    devices = {rg.offloaded: {rg.master.device.type} for rg in tr.optimizer.ranges
               if rg.hi > rg.lo}
    assert devices == {True: {"cpu"}, False: {"cuda"}}, devices
    assert all(p.is_cuda for p in tr.params)
    held = param_bytes(tr.optimizer)
    record_property("offload_host_bytes", held["host"])
    assert held["host"] > 0 and held["optimizer"] > 0
    _, base, base_params = runs["plain"]
    err = max(abs(a - b) / abs(b) for a, b in zip(losses, base))
    record_property("offload_max_rel_loss_err", err)
    assert err < 1e-5, (losses, base)
    assert max(rel_err(p.cpu(), q.cpu()) for p, q in zip(params, base_params)) < 1e-4
