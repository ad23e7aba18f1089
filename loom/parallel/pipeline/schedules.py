"""Pipeline schedules: GPipe, 1F1B (PipeDream-Flush) and interleaved 1F1B (Narayanan et al.
2021, sec. 2.2), and the zero-bubble ZB-H1 / ZB-V (Qi et al. 2024; op lists in
:mod:`.zero_bubble`), run by one executor over point-to-point sends of activations ``[s, b, h]``.

A schedule is an ordered list of ops per rank, ``("F" | "B" | "W", chunk, micro_batch)``; the
executor runs them in order. A "B" whose (chunk, micro-batch) also has a "W" in the list
computes the input gradient only and W the weight gradients later
(:mod:`.split_backward`); otherwise B is the whole backward. Communication: every send is asynchronous (``isend`` via
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

from loom.parallel.grad_buffer import flat_buffers
from loom.parallel.interface import ForwardStep
from loom.parallel.pipeline.split_backward import backward_input, backward_weight
from loom.parallel.pipeline.timeline import Timeline
from loom.parallel.pipeline.zero_bubble import V_SHAPED, zb_h1_ops, zbv_ops

Op = tuple  # ("F" | "B" | "W", chunk, micro_batch)


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


def interleaved_ops(m: int, p: int, rank: int, v: int, group: Optional[int] = None) -> list[Op]:
    """Megatron-LM's interleaved 1F1B over v model chunks. Micro-batches run in groups of
    ``group`` N (``--microbatch-group-size-per-virtual-pipeline-stage``, default p): each group
    goes through chunk 0, then chunk 1, ... (Megatron-Core's ``get_schedule_table``; the last
    group holds the m mod N left over); backwards visit the chunks in reverse. Warm-up:
    (p - rank - 1) 2 + (v - 1) N forwards, at most m v (Megatron-Core 0.16's
    ``get_pp_rank_microbatches``; Megatron-LM before 2024 ran every forward first when m = p,
    which Megatron-Core dropped). Raises ValueError unless
    p <= N <= m and m mod N is 0 or at least p (Megatron-Core's rules; config/pipeline.py
    refuses such flags first)."""
    n = p if group is None else group
    if not p <= n <= m or 0 < m % n < p:
        raise ValueError(f"the interleaved schedule needs micro-batch groups of N = {n} with "
                         f"p = {p} <= N <= m = {m} and m mod N = 0 or >= p")
    table = [(c, j) for lo in range(0, m, n) for c in range(v) for j in range(lo, min(lo + n, m))]
    total = m * v

    def chunk_mb(k: int, forward: bool) -> tuple[int, int]:
        c, j = table[k]
        return (c if forward else v - 1 - c), j

    warm = min((p - rank - 1) * 2 + (v - 1) * n, total)
    ops: list[Op] = [("F",) + chunk_mb(k, True) for k in range(warm)]
    for i in range(total - warm):
        ops += [("F",) + chunk_mb(warm + i, True), ("B",) + chunk_mb(i, False)]
    ops += [("B",) + chunk_mb(k, False) for k in range(total - warm, total)]
    return ops


OP_LISTS = {"gpipe": gpipe_ops, "1f1b": one_f_one_b_ops, "interleaved": interleaved_ops,
            "zero-bubble": zb_h1_ops, "zbv": zbv_ops}
MULTI_CHUNK = ("interleaved",) + V_SHAPED  # schedules running several chunks per stage


# -- statistics ----------------------------------------------------------------------------------

@dataclass
class PipelineStats:
    """Of one schedule run on this rank."""

    peak_in_flight: int = 0  # max micro-batches (x chunks) between forward and backward
    idle_s: float = 0.0  # time blocked waiting for receives (the bubble, plus comm latency)
    flush_s: float = 0.0  # wall time of the whole forward-backward (one pipeline flush)
    num_microbatches: int = 0
    op_counts: dict = field(default_factory=dict)  # ops run: {"F": n, "B": n, "W": n}

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


def p2p_dtype(model_chunks) -> torch.dtype:
    """The dtype activations travel in between stages: the first floating-point parameter's
    (fp32 when there is none, or when the chunks' model keeps an fp32 residual stream:
    ``--fp32-residual-connection``, Megatron's ``pipeline_dtype`` override)."""
    if any(getattr(getattr(c, "cfg", None), "fp32_residual_connection", False)
           for c in model_chunks):
        return torch.float32
    for chunk in model_chunks:
        for q in chunk.parameters():
            if q.is_floating_point():
                return q.dtype
    return torch.float32


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` detached, in the p2p ``dtype``."""
    return t.detach().to(dtype)


@contextlib.contextmanager
def _sync_ctx(reducers, c: int, done: list, m: int):
    """The DP gradient reduction of chunk ``c`` runs only in its last (m-th) weight-gradient
    pass (a fused backward or a W): ``no_sync`` around the others."""
    done[c] += 1
    if reducers is None or done[c] == m:
        yield
    else:
        with reducers[c].no_sync():
            yield


@contextlib.contextmanager
def _deferring(reducers, c: int):
    """Chunk ``c``'s gradient buffers launch nothing inside (a B pass; its W comes later)."""
    with contextlib.ExitStack() as stack:
        for buf in flat_buffers([reducers[c]]) if reducers is not None else []:
            if hasattr(buf, "deferred"):
                stack.enter_context(buf.deferred())
        yield


class _P2P:
    """Asynchronous sends, look-ahead receives, idle-time accounting."""

    def __init__(self, mesh, num_virtual: int, recorder: Timeline):
        self.p, self.r, self.v = mesh.pp_size, mesh.pp_rank, num_virtual
        self.ranks = mesh.ranks["pp"]  # global rank of each pipeline stage
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
            train: bool = True, dtype: Optional[torch.dtype] = None,
            v_shape: bool = False) -> ScheduleResult:
    """Run ``ops`` on this rank with ``forward_step(chunk, batch, hidden_states)``.

    ``p2p_shape``: the activations exchanged between stages, ``[s, b, h]`` of this rank's
    tokens (``s/c`` under CP, ``s/(c t)`` under SP), and their gradients travel in ``dtype``
    (default: the parameters' dtype, so 16-bit under ``--bf16`` / ``--fp16``, as Megatron's
    ``pipeline_dtype``; every stage infers the same). ``reducers``: one
    :class:`~loom.parallel.grad_buffer.GradBuffer` per chunk (gradients are reduced on each
    chunk's last backward only), or None. ``v_shape``: two chunks per stage placed in a V
    (ZB-V: chunk 0 is virtual stage r, chunk 1 virtual stage 2p - 1 - r, so the last virtual
    stage, the loss, is on stage 0), else chunk c is virtual stage c p + r. A message between
    two virtual stages of the same rank (the V's bottom) is handed over in memory.
    """
    rec = recorder or Timeline()
    p, r, v, m = mesh.pp_size, mesh.pp_rank, len(model_chunks), len(batches)
    dtype = dtype or p2p_dtype(model_chunks)
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
    split = {(c, j) for kind, c, j in ops if kind == "W"}
    deferred: dict = {}
    done_w = [0] * v  # backwards (fused B or W) finished per chunk
    params = [[q for q in ch.parameters() if q.requires_grad] for ch in model_chunks]
    start = time.perf_counter()

    def vstage(c: int) -> int:
        return (2 * p - 1 - r if c else r) if v_shape else c * p + r

    def stage_of(vs: int) -> int:  # the pipeline rank holding virtual stage vs
        return (vs if vs < p else 2 * p - 1 - vs) if v_shape else vs % p

    local: dict = {}  # (receiving virtual stage, micro-batch, direction) -> tensor

    def post(op: Op) -> None:
        kind, c, j = op
        if op in pending:
            return
        vs = vstage(c)
        if kind == "F" and vs > 0 and stage_of(vs - 1) != r:
            pending[op] = comm.recv(shape, dtype, device, comm.ranks[stage_of(vs - 1)],
                                    comm.tag(j, vs, 0), f"fwd c{c} mb{j}")
        elif kind == "B" and vs < last_v and stage_of(vs + 1) != r:
            pending[op] = comm.recv(shape, dtype, device, comm.ranks[stage_of(vs + 1)],
                                    comm.tag(j, vs, 1), f"bwd c{c} mb{j}")

    def receive(op: Op, vs: int, direction: int) -> torch.Tensor:
        if (vs, op[2], direction) in local:
            return local.pop((vs, op[2], direction))
        return comm.wait(pending.pop(op))

    def send(t: torch.Tensor, to_vs: int, j: int, direction: int, what: str) -> None:
        if stage_of(to_vs) == r:
            local[(to_vs, j, direction)] = _as(t, dtype)
        else:
            comm.send(_as(t, dtype), comm.ranks[stage_of(to_vs)], comm.tag(j, to_vs, direction),
                      what)

    counts: dict = {}
    for i, op in enumerate(ops):
        post(op)
        if i + 1 < len(ops):
            post(ops[i + 1])
        kind, c, j = op
        counts[kind] = counts.get(kind, 0) + 1
        chunk, vs = model_chunks[c], vstage(c)
        if kind == "F":
            x = None
            if vs > 0:
                x = receive(op, vs, 0)
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
                send(out, vs + 1, j, 0, f"fwd c{c} mb{j}")
                if train:
                    _deallocate(out)
            if train:
                inputs[(c, j)], outputs[(c, j)] = x, out
                in_flight += 1
                peak = max(peak, in_flight)
        elif kind == "B":
            grad = receive(op, vs, 1) if vs < last_v else None
            t0 = rec.now_us()
            x, out = inputs.pop((c, j)), outputs.pop((c, j))
            if (c, j) in split:  # B now (input gradient only), W later
                with _deferring(reducers, c):
                    deferred[(c, j)] = backward_input(out, grad, x, params[c])
                rec.add(f"B c{c} mb{j}", "backward", t0, rec.now_us())
            else:
                with _sync_ctx(reducers, c, done_w, m):
                    if grad is None:
                        out.backward()
                    else:
                        _backward(out, grad)
                rec.add(f"B c{c} mb{j}", "backward", t0, rec.now_us())
                in_flight -= 1
            del out, grad
            if vs > 0:
                send(x.grad, vs - 1, j, 1, f"bwd c{c} mb{j}")
            del x
        else:  # "W": the deferred weight gradients
            t0 = rec.now_us()
            with _sync_ctx(reducers, c, done_w, m):
                backward_weight(deferred.pop((c, j)))
            rec.add(f"W c{c} mb{j}", "backward_weight", t0, rec.now_us())
            in_flight -= 1
    comm.finish()
    stats = PipelineStats(peak_in_flight=peak, idle_s=comm.idle,
                          flush_s=time.perf_counter() - start, num_microbatches=m,
                          op_counts=counts)
    owns_loss = stage_of(last_v) == r
    loss = (total / m).cpu() if owns_loss else torch.zeros((), dtype=torch.float32)
    return ScheduleResult(loss=loss, metrics={k: float(val) for k, val in metrics.items()}
                          if owns_loss else {}, stats=stats)


def get_schedule(name: str, pipeline_size: int = 2, group: Optional[int] = None) -> Callable:
    """``fn(model_chunks, batches, forward_step, mesh, **run_ops kwargs) -> ScheduleResult`` for
    ``--pipeline-schedule`` (``gpipe``, ``1f1b``, ``interleaved``, ``zero-bubble``; ``zbv``:
    two chunks per stage placed in a V, run with ``v_shape=True``; the chunk builder lays them
    out under the flag). With one stage every schedule is one forward and one
    backward per micro-batch (1F1B at p = 1). ``group``: the interleaved schedule's micro-batch
    group (:func:`interleaved_ops`). Raises ValueError for an unknown name."""
    if name not in OP_LISTS:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(OP_LISTS)}")
    make_ops = OP_LISTS["1f1b" if pipeline_size == 1 else name]

    def forward_backward(model_chunks, batches, forward_step, mesh, **kw) -> ScheduleResult:
        p, v, m = mesh.pp_size, len(model_chunks), len(batches)
        if name not in MULTI_CHUNK and v != 1:
            raise ValueError(f"--pipeline-schedule {name} runs one model chunk per stage, got {v}")
        ops = make_ops(m, p, mesh.pp_rank, v, group) if make_ops is interleaved_ops else \
            make_ops(m, p, mesh.pp_rank, v)
        if name in V_SHAPED and p > 1:
            kw["v_shape"] = True
        return run_ops(ops, model_chunks, batches, forward_step, mesh, train=True, **kw)

    forward_backward.__name__ = f"forward_backward_{name}"
    return forward_backward


@torch.no_grad()
def forward_only(model_chunks, batches, forward_step: ForwardStep, mesh, **kw) -> ScheduleResult:
    """Evaluation: every micro-batch forward through every chunk; mean loss on the stage holding
    the last virtual stage (pass ``v_shape=True`` for ZB-V's layout)."""
    v, m = len(model_chunks), len(batches)
    ops = [("F", c, j) for c in range(v) for j in range(m)]
    return run_ops(ops, model_chunks, batches, forward_step, mesh, train=False, **kw)
