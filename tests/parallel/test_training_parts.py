"""The trainer assembled from parts (loom/training/builder.py): each part on its own, with its own
narrow interface, and the trainer's small import surface.

- ``trainer.py`` imports at most 12 loom modules (statements anywhere in the file); the old
  trainer imported 23.
- :func:`build_training` returns the parts, and a :class:`Trainer` over prebuilt parts is the
  same run as ``Trainer(cfg)`` (identical losses for 2 steps).
- :class:`BatchSource`: B = b d m samples per step, this rank's micro-batches and the pipeline
  activation shape.
- :func:`finish_gradients` / :func:`optimizer_step` take the parts (buffers, groups, optimizer,
  scheduler), never the trainer; the non-finite guard records the iteration in the given list.
- :class:`Throughput.record`: tokens/s and TFLOP/s per rank from the step time.
- :class:`Checkpointer`: a save of the parts loads back into freshly built parts.
- The gradient buffer takes the distributed optimizer's mode (:func:`buffer_mode`); only the
  optimizer's :class:`ParamGather` moves parameters into flat bucket buffers.
"""

from __future__ import annotations

import ast
import math
import pathlib

import torch

from loom.config import LoomConfig
from loom.parallel.mesh import ParallelMesh
from testkit.config import tiny_config

ROOT = pathlib.Path(__file__).resolve().parents[2] / "loom"
MAX_TRAINER_IMPORTS = 12


def make_cfg(**training) -> LoomConfig:
    return tiny_config("gpt", dict(vocab_size=128, global_batch_size=4, train_iters=4,
                                   no_progress_bar=True), training, world=1)


def loom_imports(path: pathlib.Path) -> set[str]:
    """Distinct loom modules a file imports (``import loom.x`` / ``from loom.x import ...``,
    module level and inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "loom"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "loom":
            out.add(node.module)
    return out


def test_trainer_imports_at_most_12_loom_modules():
    mods = loom_imports(ROOT / "training" / "trainer.py")
    assert len(mods) <= MAX_TRAINER_IMPORTS, sorted(mods)


def test_helpers_take_parts_not_the_trainer():
    """No function of step.py, checkpointer.py, batches.py or the Saver takes a trainer."""
    for rel in ("training/step.py", "training/checkpointer.py", "checkpoint/saver.py",
                "training/batches.py"):
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            if isinstance(node, ast.FunctionDef):
                args = [a.arg for a in node.args.args + node.args.kwonlyargs]
                assert "trainer" not in args, f"{rel}: {node.name}({', '.join(args)})"


def test_build_training_parts_and_a_trainer_over_them():
    from loom.training.batches import BatchSource
    from loom.training.builder import build_training
    from loom.training.checkpointer import Checkpointer
    from loom.training.trainer import Trainer
    cfg = make_cfg()
    parts = build_training(cfg, mesh=ParallelMesh.single())
    assert isinstance(parts.data, BatchSource) and isinstance(parts.checkpointer, Checkpointer)
    assert len(parts.reducers) == len(parts.model.chunks) == 1
    assert parts.model.groups.params and parts.throughput.flops_per_iter > 0
    a, b = Trainer(cfg, parts=parts), Trainer(make_cfg(), mesh=ParallelMesh.single())
    assert a.model_chunks is parts.model.chunks and a.optimizer is parts.optimizer
    for _ in range(2):
        la, lb = a.train_step()["loss"], b.train_step()["loss"]
        assert la == lb and math.isfinite(la)


def test_batch_source_sizes_and_shapes():
    from loom.models import get_family
    from loom.training.batches import BatchSource
    cfg = make_cfg(global_batch_size=8)
    src = BatchSource.from_config(cfg, ParallelMesh.single(), get_family("gpt").datasets(cfg))
    assert src.global_batch == 8 and src.num_microbatches == 4
    batches = src.batches(src.train_ds, 0)
    assert len(batches) == 4 and batches[0]["tokens"].shape == (2, 16)
    assert src.p2p_shape(batches) == (16, 2, 32)
    assert [n for n, _ in src.sets()] == ["train", "valid", "test"]


def test_step_functions_take_parts():
    from loom.parallel.grad_buffer import GradBuffer
    from loom.training.optimizer import build_scheduler
    from loom.training.step import ParamGroups, finish_gradients, optimizer_step
    cfg = make_cfg()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    buffers = [GradBuffer(model.parameters(), None)]
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = build_scheduler(opt, cfg.training)
    mesh = ParallelMesh.single()
    groups = ParamGroups(list(model.parameters()), list(model.parameters()))
    model(torch.randn(5, 4)).square().sum().backward()
    finish_gradients(buffers, [], mesh, [])
    before = model.weight.detach().clone()
    nonfinite = [7]
    norm = optimizer_step(opt, sched, buffers, groups, mesh, 1.0, nonfinite=nonfinite,
                          iteration=3)
    assert norm > 0 and nonfinite == [] and not torch.equal(before, model.weight)
    assert all(p.grad is None for p in model.parameters())
    model.weight.grad = torch.full_like(model.weight, float("nan"))
    model.bias.grad = torch.zeros_like(model.bias)
    after = model.weight.detach().clone()
    norm = optimizer_step(opt, sched, buffers, groups, mesh, 1.0, nonfinite=nonfinite,
                          iteration=4)
    assert not math.isfinite(norm) and nonfinite == [5] and torch.equal(after, model.weight)


def test_throughput_record():
    from loom.training.metrics import Throughput
    tp = Throughput(tokens_per_iter=1000, flops_per_iter=4e12, world_size=2, peak_flops=1e12)
    rec = tp.record(3, 2.5, 1e-3, 0.7, 2.0, torch.device("cpu"))
    assert rec["tokens_per_s"] == 500 and rec["tflops_per_rank"] == 1.0 and rec["mfu"] == 1.0
    assert tp.average([rec, {**rec, "loss": 3.5}])["loss"] == 3.0


def test_checkpointer_round_trip(tmp_path):
    from loom.training.builder import build_training
    cfg = make_cfg()
    a = build_training(cfg, mesh=ParallelMesh.single())
    with torch.no_grad():
        for p in a.model.groups.params:
            p.add_(1.0)
    final = a.checkpointer.save(str(tmp_path), iteration=5, consumed_samples=20)
    assert pathlib.Path(final).exists()
    b = build_training(make_cfg(), mesh=ParallelMesh.single())
    resumed = b.checkpointer.load(str(tmp_path))
    assert (resumed.iteration, resumed.consumed_samples) == (5, 20)
    for p, q in zip(a.model.groups.params, b.model.groups.params):
        assert torch.equal(p, q)


def test_buffer_mode_and_param_gather():
    from loom.parallel.grad_buffer import GradBuffer
    from loom.training.distributed_optimizer import ParamGather, buffer_mode
    cfg = make_cfg(use_distributed_optimizer=True, zero_stage=2)
    assert buffer_mode(cfg.training) == {"reduce_scatter": True, "shard_gradients": True}
    assert buffer_mode(make_cfg().training) == {"reduce_scatter": False,
                                                "shard_gradients": False}
    model = torch.nn.Linear(4, 3)
    ptrs = [p.data_ptr() for p in model.parameters()]
    buf = GradBuffer(model.parameters(), None, **buffer_mode(cfg.training))
    assert [p.data_ptr() for p in model.parameters()] == ptrs  # the buffer moves no parameter
    assert buf.main_grads and buf.buckets and buf.shard_range(model.weight) == (0, 12)
    gather = ParamGather(buf)
    flat = gather.buffers[id(buf.buckets[0])]
    assert all(flat.data_ptr() <= p.data_ptr() < flat.data_ptr() + flat.numel() * 4
               for p in model.parameters())
