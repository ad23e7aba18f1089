"""Pipeline schedules: GPipe, 1F1B (PipeDream-Flush) and interleaved 1F1B (Narayanan et al.
2021, sec. 2.2), run by one executor over point-to-point sends of activations ``[s, b, h]``.

A schedule is an ordered list of ops per rank, ``("F" | "B", chunk, micro_batch)``; the
executor runs them in order. Communication: every send is asynchronous (``isend`` via
``dist.batch_isend_irecv``) and is only waited on at the end of the step (or reaped when done), so a rank
never blocks on a send; a receive is posted one op ahead and waited on when its op starts. Any
schedule whose ops respect the data dependencies is therefore deadlock-free, whatever the order
of sends and receives. Tags name the (micro-batch, receiving virtual stage, direction), so
messages match exactly even when several are in flight between the same two ranks.

Memory: a stage's output is sent, then its storage is freed at once (Megatron's
``deallocate_output_tensor``: only the autograd graph is kept); the backward pass runs the engine
directly with the received gradient.

Every schedule drives the model family's forward step (:mod:`loom.models.family`): the last
virtual stage applies its ``loss_fn`` and backpropagates ``loss / m``. The no-pipeline path is
the same executor with p = 1 (one forward and backward per micro-batch). A run returns a
:class:`ScheduleResult`: the mean loss, the named metrics averaged over micro-batches, and
:class:`PipelineStats` (peak in-flight micro-batches, idle time, bubble); spans go to the
caller's :class:`~loom.parallel.pipeline.timeline.Timeline`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from loom.parallel.interface import ForwardStep
from loom.parallel.pipeline.timeline import Timeline

Op = tuple  # ("F" | "B", chunk, micro_batch)


# -- op lists ------------------------------------------------------------------------------------

def gpipe_ops(m: int, p: int, rank: int, v: int = 1) -> list[Op]:
    """All forwards, then all backwards (GPipe): m micro-batches in flight."""
    return [("F", 0, j) for j in range(m)] + [("B", 0, j) for j in range(m)]


def one_f_one_b_ops(m: int, p: int, rank: int, v: int = 1) -> list[Op]:
    """1F1B: ``p - rank - 1`` warm-up forwards, steady one-forward-one-backward, cool-down."""
    warm = min(p - rank - 1, m)
    ops: list[Op] = [("F", 0, j) for j in range(warm)]
    for i in range(m - warm):
        ops += [("F", 0, warm + i), ("B", 0, i)]
    ops += [("B", 0, j) for j in range(m - warm, m)]
    return ops


def interleaved_ops(m: int, p: int, rank: int, v: int) -> list[Op]:
    """Megatron-LM's interleaved 1F1B over v model chunks (needs ``m % p == 0``)."""
    if m % p:
        raise ValueError(f"the interleaved schedule needs the number of micro-batches ({m}) to be "
                         f"divisible by the pipeline size ({p})")
    total = m * v

    def chunk_mb(k: int, forward: bool) -> tuple[int, int]:
        c = (k % (p * v)) // p
        if not forward:
            c = v - 1 - c
        return c, (k // (p * v)) * p + k % p

    warm = total if m == p else min((p - rank - 1) * 2 + (v - 1) * p, total)
    ops: list[Op] = [("F",) + chunk_mb(k, True) for k in range(warm)]
    for i in range(total - warm):
        ops += [("F",) + chunk_mb(warm + i, True), ("B",) + chunk_mb(i, False)]
    ops += [("B",) + chunk_mb(k, False) for k in range(total - warm, total)]
    return ops


OP_LISTS = {"gpipe": gpipe_ops, "1f1b": one_f_one_b_ops, "interleaved": interleaved_ops}


# -- statistics ----------------------------------------------------------------------------------

@dataclass
class PipelineStats:
    """Of one schedule run on this rank."""

    peak_in_flight: int = 0  # max micro-batches (x chunks) between forward and backward
    idle_s: float = 0.0  # time blocked waiting for receives (the bubble, plus comm latency)
    flush_s: float = 0.0  # wall time of the whole forward-backward (one pipeline flush)
    num_microbatches: int = 0

    @property
    def bubble_fraction(self) -> float:
        """Idle time of this stage during the flush / flush time."""
        return self.idle_s / self.flush_s if self.flush_s > 0 else 0.0


@dataclass
class ScheduleResult:
    """``loss``: mean over the m micro-batches of the last stage's loss (0 on other stages),
    detached, on the host; ``metrics``: the loss function's named metrics, same averaging;
    ``stats``: this rank's :class:`PipelineStats`."""

    loss: torch.Tensor
    metrics: dict = field(default_factory=dict)
    stats: PipelineStats = field(default_factory=PipelineStats)


# -- helpers -------------------------------------------------------------------------------------

def _deallocate(out: torch.Tensor) -> None:
    """Free the storage of a sent stage output, keeping its autograd graph (Megatron)."""
    if out._base is None and out.grad_fn is not None:
        out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def _backward(out: torch.Tensor, grad: torch.Tensor) -> None:
    """``out.backward(grad)`` for a deallocated ``out`` (skips the shape check on its data)."""
    torch.autograd.Variable._execution_engine.run_backward(
        (out,), (grad,), False, False, (), True, True)


class _P2P:
    """Asynchronous sends, look-ahead receives, idle-time accounting."""

    def __init__(self, mesh, num_virtual: int, recorder: Timeline):
        self.p, self.r, self.v = mesh.pp_size, mesh.pp_rank, num_virtual
        ranks = mesh.ranks["pp"]
        self.next, self.prev = ranks[(self.r + 1) % self.p], ranks[(self.r - 1) % self.p]
        self.group = mesh.groups["pp"]
        self.rec = recorder
        self.sends: list = []
        self.idle = 0.0

    def tag(self, mb: int, recv_vstage: int, direction: int) -> int:
        return (mb * self.p * self.v + recv_vstage) * 2 + direction

    def send(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> None:
        t0 = self.rec.now_us()
        buf = tensor.detach().contiguous()
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, buf, peer, self.group, tag)])
        self.sends.append((works, buf))
        self.rec.add(f"send {what}", "send", t0, self.rec.now_us(), peer=peer)
        self.reap()

    def recv(self, shape, dtype, device, peer: int, tag: int, what: str):
        t0 = self.rec.now_us()
        buf = torch.empty(shape, dtype=dtype, device=device)
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, peer, self.group, tag)])
        self.rec.add(f"recv {what}", "recv", t0, self.rec.now_us(), peer=peer)
        return buf, works, what

    def wait(self, pending) -> torch.Tensor:
        buf, works, what = pending
        t0 = time.perf_counter()
        ts = self.rec.now_us()
        for w in works:
            w.wait()
        self.idle += time.perf_counter() - t0
        self.rec.add(f"idle (wait {what})", "idle", ts, self.rec.now_us())
        return buf

    def reap(self) -> None:
        self.sends = [(ws, b) for ws, b in self.sends if not all(w.is_completed() for w in ws)]

    def finish(self) -> None:
        t0 = time.perf_counter()
        for works, _ in self.sends:
            for w in works:
                w.wait()
        self.idle += time.perf_counter() - t0
        self.sends = []


# -- the executor ----------------------------------------------------------------------------------

def run_ops(ops: Sequence[Op], model_chunks, batches, forward_step: ForwardStep, mesh, *,
            p2p_shape: Sequence[int], reducers=None, recorder: Optional[Timeline] = None,
            train: bool = True, dtype: torch.dtype = torch.float32) -> ScheduleResult:
    """Run ``ops`` on this rank with ``forward_step(chunk, batch, hidden_states)``.

    ``p2p_shape``: the activations exchanged between stages, ``[s, b, h]`` of this rank's
    tokens (``s/c`` under CP, ``s/(c t)`` under SP), in ``dtype``. ``reducers``: one
    :class:`~loom.parallel.grad_buffer.GradBuffer` per chunk (gradients are reduced on each
    chunk's last backward only), or None.
    """
    rec = recorder or Timeline()
    p, r, v, m = mesh.pp_size, mesh.pp_rank, len(model_chunks), len(batches)
    last_v = p * v - 1
    comm = _P2P(mesh, v, rec)
    device = mesh.device
    shape = tuple(p2p_shape)
    inputs: dict = {}
    outputs: dict = {}
    pending: dict = {}
    total = torch.zeros((), dtype=torch.float32, device=device)
    metrics: dict = {}
    in_flight = peak = 0
    start = time.perf_counter()

    def vstage(c: int) -> int:
        return c * p + r

    def post(op: Op) -> None:
        kind, c, j = op
        if op in pending:
            return
        if kind == "F" and vstage(c) > 0:
            pending[op] = comm.recv(shape, dtype, device, comm.prev, comm.tag(j, vstage(c), 0),
                                    f"fwd c{c} mb{j}")
        elif kind == "B" and vstage(c) < last_v:
            pending[op] = comm.recv(shape, dtype, device, comm.next, comm.tag(j, vstage(c), 1),
                                    f"bwd c{c} mb{j}")

    for i, op in enumerate(ops):
        post(op)
        if i + 1 < len(ops):
            post(ops[i + 1])
        kind, c, j = op
        chunk, vs = model_chunks[c], vstage(c)
        if kind == "F":
            x = None
            if vs > 0:
                x = comm.wait(pending.pop(op))
                if train:
                    x.requires_grad_(True)
            t0 = rec.now_us()
            out, loss_fn = forward_step(chunk, batches[j], x)
            if vs == last_v:
                loss, named = loss_fn(out)
                out = loss / m
                total += loss.detach().float()
                for k, val in named.items():
                    metrics[k] = metrics.get(k, 0.0) + val.detach().float() / m
            rec.add(f"F c{c} mb{j}", "forward", t0, rec.now_us())
            if vs < last_v:
                comm.send(out.detach().to(dtype), comm.next, comm.tag(j, vs + 1, 0),
                          f"fwd c{c} mb{j}")
                if train:
                    _deallocate(out)
            if train:
                inputs[(c, j)], outputs[(c, j)] = x, out
                in_flight += 1
                peak = max(peak, in_flight)
        else:
            grad = comm.wait(pending.pop(op)) if vs < last_v else None
            t0 = rec.now_us()
            x, out = inputs.pop((c, j)), outputs.pop((c, j))
            sync = j == m - 1  # reduce over DP only on the chunk's last backward
            ctx = contextlib.nullcontext() if sync or reducers is None else reducers[c].no_sync()
            with ctx:
                if grad is None:
                    out.backward()
                else:
                    _backward(out, grad)
            del out, grad
            rec.add(f"B c{c} mb{j}", "backward", t0, rec.now_us())
            in_flight -= 1
            if vs > 0:
                comm.send(x.grad, comm.prev, comm.tag(j, vs - 1, 1), f"bwd c{c} mb{j}")
            del x
    comm.finish()
    stats = PipelineStats(peak_in_flight=peak, idle_s=comm.idle,
                          flush_s=time.perf_counter() - start, num_microbatches=m)
    owns_loss = mesh.pp_rank == p - 1
    loss = (total / m).cpu() if owns_loss else torch.zeros((), dtype=torch.float32)
    return ScheduleResult(loss=loss, metrics={k: float(val) for k, val in metrics.items()}
                          if owns_loss else {}, stats=stats)


def get_schedule(name: str, pipeline_size: int = 2) -> Callable:
    """``fn(model_chunks, batches, forward_step, mesh, **run_ops kwargs) -> ScheduleResult`` for
    ``--pipeline-schedule`` (``gpipe``, ``1f1b``, ``interleaved``). With one stage every schedule
    is one forward and one backward per micro-batch (1F1B at p = 1). Raises ValueError for an
    unknown name."""
    if name not in OP_LISTS:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(OP_LISTS)}")
    make_ops = OP_LISTS["1f1b" if pipeline_size == 1 else name]

    def forward_backward(model_chunks, batches, forward_step, mesh, **kw) -> ScheduleResult:
        p, v, m = mesh.pp_size, len(model_chunks), len(batches)
        if name != "interleaved" and v != 1:
            raise ValueError(f"--pipeline-schedule {name} runs one model chunk per stage, got {v}")
        ops = make_ops(m, p, mesh.pp_rank, v)
        return run_ops(ops, model_chunks, batches, forward_step, mesh, train=True, **kw)

    forward_backward.__name__ = f"forward_backward_{name}"
    return forward_backward


@torch.no_grad()
def forward_only(model_chunks, batches, forward_step: ForwardStep, mesh, **kw) -> ScheduleResult:
    """Evaluation: every micro-batch forward through every chunk; mean loss on the last stage."""
    v, m = len(model_chunks), len(batches)
    ops = [("F", c, j) for c in range(v) for j in range(m)]
    return run_ops(ops, model_chunks, batches, forward_step, mesh, train=False, **kw)
