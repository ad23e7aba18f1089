"""Megatron-LM's timers (``--timing-log-level``, ``--timing-log-option``,
``--log-timers-to-tensorboard``, ``--no-barrier-with-level-1-timing``; Megatron's
``megatron/core/timers.py`` and ``training_log``), over the phases loom really has.

A timer has a level; the run keeps those at or below ``--timing-log-level`` and every other
call is a shared no-op context (no clock read, no synchronization). A kept timer synchronizes
the CUDA device at its start and stop (as Megatron's ``Timer.start`` / ``stop``: the wall time
then covers the kernels launched inside), and the level-1 timers Megatron starts with a barrier
(:data:`BARRIER_L1`) start with one on every rank unless ``--no-barrier-with-level-1-timing``.
Level 0 adds nothing to an iteration: the iteration time is the trainer's own (one device sync
and one max over ranks per step, as before); ``save-checkpoint`` and ``evaluate`` are timed
around work that already synchronizes all ranks.

=====  ==========================================  =================================================
level  timer                                       loom's phase
=====  ==========================================  =================================================
0      ``save-checkpoint``, ``evaluate``           ``Trainer.save``, an evaluation of each set
1      ``forward-backward``                        the pipeline schedule + gradient reductions
1      ``all-grads-sync``                          the DP gradient buckets' ``finish_grad_sync``
1      ``layernorm-grads-all-reduce``              sequence-parallel gradients summed over TP
1      ``embedding-grads-all-reduce``              the tied embedding's gradient over its group
1      ``optimizer``                               clip + step + LR schedule (all of it)
1      ``optimizer-copy-to-main-grad``             distributed optimizer: main grads -> masters
1      ``optimizer-clip-main-grad``                global norm and clipping
1      ``optimizer-count-zeros``                   ``--log-num-zeros-in-grad``
1      ``optimizer-inner-step``                    the AdamW / SGD update
1      ``optimizer-copy-main-to-model-params``     distributed optimizer: masters -> 16-bit params
1      ``params-all-gather``                       distributed optimizer: parameter all-gather
                                                   (its launch, with ``--overlap-param-gather``)
2      ``batch-generator``                         this rank's micro-batches of the step
2      ``forward-compute``, ``backward-compute``   each F, B (and W) op of the schedule
2      ``forward-recv`` ... ``backward-send``      pipeline receives (posting and waiting) / sends
=====  ==========================================  =================================================

Reported at every ``--log-interval`` (level >= 1), per iteration in ms: ``minmax`` (min and max
over the ranks that ran the timer), ``max``, or ``all`` (each rank); one ``all_gather`` of a
few floats over all ranks, as Megatron's. Megatron's ``optimizer-unscale-and-check-inf`` has no
phase of its own in loom (the fp16 unscale is folded into the norm), nor do the RL timers.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from loom.parallel.sequence import all_gather_into

LEVEL1 = ("forward-backward", "layernorm-grads-all-reduce", "embedding-grads-all-reduce",
          "all-grads-sync", "params-all-gather", "optimizer-copy-to-main-grad",
          "optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step",
          "optimizer-copy-main-to-model-params", "optimizer")
"""Megatron's level-1 timers in ``training_log``'s order (those loom has)."""
LEVEL2 = ("batch-generator", "forward-compute", "backward-compute", "forward-recv",
          "forward-send", "backward-recv", "backward-send")
"""Megatron's level-2 timers in ``training_log``'s order (those loom's schedule has)."""
BARRIER_L1 = ("forward-backward", "all-grads-sync", "optimizer", "params-all-gather")
"""The level-1 timers Megatron starts with ``barrier=args.barrier_with_L1_time``."""
LEVELS = {**{n: 0 for n in ("save-checkpoint", "evaluate")}, **{n: 1 for n in LEVEL1},
          **{n: 2 for n in LEVEL2}}
"""Every timer loom keeps -> its level."""


class Timers:
    """The run's timers: ``timers(name)`` is a context manager timing the block when ``name``'s
    level is at most ``level``. ``option``: ``--timing-log-option``; ``device``: synchronized
    at each start and stop when CUDA; ``barrier_l1``: barriers before :data:`BARRIER_L1`."""

    def __init__(self, level: int = 0, option: str = "minmax",
                 device: torch.device = torch.device("cpu"), barrier_l1: bool = True):
        self.level, self.option, self.device, self.barrier_l1 = level, option, device, barrier_l1
        self.elapsed: dict[str, float] = {}  # name -> seconds since the last report
        self._off = contextlib.nullcontext()

    def __call__(self, name: str):
        """Time the block as timer ``name`` (a key of :data:`LEVELS`), or do nothing when its
        level is above the run's."""
        if LEVELS[name] > self.level:
            return self._off
        return self._span(name)

    @contextlib.contextmanager
    def _span(self, name: str) -> Iterator[None]:
        if self.barrier_l1 and name in BARRIER_L1 and dist.is_initialized() and \
                dist.get_world_size() > 1:
            dist.barrier()
        self.sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.add(name, time.perf_counter() - start)

    def sync(self) -> None:
        """Wait for the device's queued kernels (CUDA only; a no-op on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def add(self, name: str, seconds: float) -> None:
        """Add ``seconds`` to timer ``name``."""
        self.elapsed[name] = self.elapsed.get(name, 0.0) + seconds

    def recorder(self, timeline):
        """The recorder to hand the pipeline schedule: ``timeline`` itself below level 2, else
        one that also feeds the level-2 timers (:class:`ScheduleTimers`)."""
        return timeline if self.level < 2 else ScheduleTimers(self, timeline)

    def gather(self, names: list[str]) -> list[list[float]]:
        """``[rank][i]`` seconds of ``names[i]`` on every rank (0 where a rank did not run it),
        then reset: one ``all_gather`` over all ranks (every rank must call it, same names)."""
        local = torch.tensor([self.elapsed.pop(n, 0.0) for n in names], dtype=torch.float64,
                             device=self.device)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return [local.tolist()]
        out = torch.zeros(dist.get_world_size() * len(names), dtype=torch.float64,
                          device=self.device)
        all_gather_into(out, local, None)  # all_gather_single (the old name warns)
        return out.view(-1, len(names)).tolist()

    def report(self, names: list[str], normalizer: float = 1.0) -> tuple[list[str], dict]:
        """(lines to print, ``{name: {"min": ms, "max": ms}}``) of ``names`` over the ranks
        that ran them, each divided by ``normalizer`` (iterations); a collective
        (:meth:`gather`). Lines follow ``--timing-log-option`` (Megatron's layout); timers no
        rank ran are left out."""
        per_rank = self.gather(names)
        stats, lines = {}, []
        for i, name in enumerate(names):
            ran = [(r, row[i] * 1000.0 / normalizer) for r, row in enumerate(per_rank)
                   if row[i] > 0]
            if not ran:
                continue
            ms = [v for _, v in ran]
            stats[name] = {"min": min(ms), "max": max(ms)}
            label = (name + " ").ljust(48, ".")
            if self.option == "all":
                lines.append(f"    {name}: " + ", ".join(f"rank {r} {v:.2f}" for r, v in ran))
            elif self.option == "max":
                lines.append(f"    {label}: {max(ms):.2f}")
            else:
                lines.append(f"    {label}: ({min(ms):.2f}, {max(ms):.2f})")
        if lines:
            head = {"all": "times across ranks (ms):", "max": "max time across ranks (ms):",
                    "minmax": "(min, max) time across ranks (ms):"}[self.option]
            lines.insert(0, head)
        return lines, stats

    def interval_names(self) -> list[str]:
        """The timers reported at each ``--log-interval``: levels 1 to the run's (none at 0)."""
        return [n for n in LEVEL1 + LEVEL2 if 1 <= LEVELS[n] <= self.level]


class ScheduleTimers:
    """The schedule's recorder at level 2: every span it records also adds to a level-2 timer
    (forward/backward compute, pipeline send/recv) and goes on to the ``--timeline`` recorder;
    its clock synchronizes the CUDA device first, as Megatron's level-2 timers do."""

    def __init__(self, timers: Timers, timeline):
        self.timers, self.timeline = timers, timeline

    def now_us(self) -> float:
        self.timers.sync()
        return time.time_ns() / 1000.0

    def add(self, name: str, cat: str, start_us: float, end_us: float, **args) -> None:
        timer = schedule_timer(name, cat)
        if timer is not None:
            self.timers.add(timer, max(end_us - start_us, 0.0) / 1e6)
        self.timeline.add(name, cat, start_us, end_us, **args)

    def span(self, name: str, cat: Optional[str] = None, **args):
        return self.timeline.span(name, cat, **args)


def schedule_timer(name: str, cat: str) -> Optional[str]:
    """Megatron's level-2 timer of a schedule span (:mod:`loom.parallel.pipeline.schedules`:
    category ``forward``, ``backward``, ``backward_weight``, ``send``, ``recv`` (posting a
    receive) or ``idle`` (waiting for one); the span's name says ``fwd`` or ``bwd``)."""
    if cat == "forward":
        return "forward-compute"
    if cat in ("backward", "backward_weight"):
        return "backward-compute"
    direction = "forward" if " fwd " in f" {name} ".replace("(", " ") else "backward"
    if cat == "send":
        return f"{direction}-send"
    if cat in ("recv", "idle"):
        return f"{direction}-recv"
    return None
