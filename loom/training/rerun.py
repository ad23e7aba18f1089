"""Megatron's rerun state machine (``--rerun-mode``; Megatron-LM's
``megatron/core/rerun_state_machine.py``, wired into its ``train_step`` and ``pretrain_gpt.py``'s
loss function): every training micro-batch loss is validated, and a rejected one makes every
rank run the iteration again from the same state to attribute it.

Validations, per micro-batch on the ranks that compute the loss, in this order (Megatron's):
``found NaN in local forward loss calculation`` and ``found Inf in local forward loss
calculation`` (fatal; off with ``--no-check-for-nan-in-loss-and-grad``), ``Spiky loss`` (with
``--check-for-spiky-loss``, non-fatal: the loss is >= :data:`SPIKY_LOSS_FACTOR` x the largest
of the first 100 losses seen). The value checked is loom's micro-batch loss (the token mean;
Megatron checks the token sum: the same NaN and inf, the same ratio at a fixed token count).
Then, as Megatron's ``check_grads`` (``param_and_grad_buffer.py``), each gradient bucket's local
norm just before its data-parallel reduction (:meth:`RerunStateMachine.watch_buckets`):
``found NaN`` / ``found Inf in local grad norm for bucket #i ...`` (fatal; off with
``--no-check-for-nan-in-loss-and-grad`` and under fp16's dynamic loss scaling),
``found unexpected large grads in bucket #i ...`` (``--check-for-large-grads``, non-fatal:
>= 10x the largest of the first 100 bucket norms), each reproduced within 0.1%. Runs whose
gradients live in no bucket (one fp32 process) and ZeRO-3 (FSDP2) have none to check.
The first iteration of a run is never validated (Megatron: no checkpoint could precede it).

``--rerun-mode validate_results`` (Megatron's default): after the forward-backward pass the
ranks agree (one all-reduce) whether any rejected a result. If so the iteration runs again in
place (the random generators, the MoE routers' running loads and the gradients restored: the
same batches, the same dropout) and the first rejected validation is compared with its rerun
(relative difference, exact match required):

- not reproduced, a fatal check: a transient fault; exit :data:`EXIT_FAILED_ON_RESULT_VALIDATION`
  (17) without a checkpoint (resume from the last one);
- not reproduced, a non-fatal check (a spike): training continues with the rerun's gradients;
- reproduced, a fatal check: the result may be a persistent fault of this device or correct;
  the iteration's starting state is checkpointed (with ``--save``) and the run exits
  :data:`EXIT_RESUME_TO_DISAMBIGUATE` (16), so the job can be resumed on other hardware;
- reproduced, a non-fatal check: training continues.

A job resumed after status 16 runs the iteration as a normal one: loom's checkpoint does not
hold the state machine, so Megatron's second rerun on other hardware, compared with the first
result, is not made. ``--rerun-mode disabled``: a rejected fatal result stops the run (status 1,
every rank together), a spike is reported. Megatron's third mode, ``report_stats``, is refused:
Megatron-LM d98e8a6 itself cannot start with it.

``--error-injection-rate N`` (with ``--error-injection-type``): each validation rejects its
result with probability 1/N (Megatron's draw: ``(randint(0, N-1) + rank) % N == 0``, from a
generator seeded by ``--seed`` and the pipeline rank), at most once per iteration, and the
rerun's comparison is forced: ``transient_error`` never matches, ``persistent_error`` and
``correct_result`` always match. ``--result-rejected-tracker-filename``: every rejection and
rerun verdict is appended as one line in Megatron's format (``ts= node= device= jobID= rank=
iteration= status= result= message=``).
"""

from __future__ import annotations

import datetime
import math
import os
import random
import socket
from enum import Enum
from typing import Callable, Optional, Sequence

import torch

EXIT_RESUME_TO_DISAMBIGUATE = 16  # Megatron's EXIT_CODE_RESUME_TO_DISAMBIGUATE
EXIT_FAILED_ON_RESULT_VALIDATION = 17  # Megatron's EXIT_CODE_FAILED_ON_RESULT_VALIDATION
SPIKY_LOSS_FACTOR = 10  # pretrain_gpt.py's threshold of --check-for-spiky-loss
SPIKY_SAMPLES = 100  # losses that set the reference maximum
NAN_MESSAGE = "found NaN in local forward loss calculation"
INF_MESSAGE = "found Inf in local forward loss calculation"
SPIKY_MESSAGE = "Spiky loss"
GRAD_MESSAGES = {"nan": "found NaN in local grad norm for bucket #{}",
                 "inf": "found Inf in local grad norm for bucket #{}",
                 "large": "found unexpected large grads in bucket #{}"}
"""Megatron's bucket validations (``param_and_grad_buffer.py::check_grads``), each followed by
:data:`GRAD_WHERE`."""
GRAD_WHERE = " in backward pass before data-parallel communication collective"
LARGE_GRADS_FACTOR = 10  # check_grads' threshold of --check-for-large-grads
GRAD_TOLERANCE = 0.001  # check_grads' tolerance: non-deterministic attention backward

MATCH, MISMATCH = 0.0, math.inf


class State(Enum):
    """Where the machine is within one iteration (Megatron's ``RerunState``, without the
    states of a rerun from a checkpoint)."""

    NOT_RUNNING = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    WILL_RERUN_FROM_CHECKPOINT = 3


def relative_difference(a: float, b: float) -> float:
    """Megatron's comparison of two results: 0 when equal (two NaNs are equal), inf when one
    is NaN or inf and the other not (or NaN against inf), else ``|a - b| / mean(a, b)``."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return MATCH
    if math.isnan(a) or math.isnan(b) or math.isinf(a) != math.isinf(b):
        return MISMATCH
    return abs((a - b) / (a + b) * 2)


class ErrorInjector:
    """``--error-injection-rate`` / ``--error-injection-type`` (module docstring). ``rng``: its
    own generator; ``rank``: the global rank (shifts the draw)."""

    def __init__(self, rate: int, kind: str, rng: random.Random, rank: int):
        self.rate, self.kind, self.rng, self.rank = rate, kind, rng, rank
        self.injected: Optional[str] = None  # the kind injected in this iteration, if any

    def maybe_inject(self) -> bool:
        """Whether this validation rejects its result (at most once until its rerun)."""
        if self.rate <= 0 or self.injected is not None:
            return False
        if (self.rng.randint(0, self.rate - 1) + self.rank) % self.rate != 0:
            return False
        self.injected = self.kind
        return True

    def compare(self, initial: float, result: float) -> float:
        """The first rerun's comparison: forced for an injected error, else
        :func:`relative_difference`."""
        if self.injected is None:
            return relative_difference(initial, result)
        transient = self.injected == "transient_error"
        self.injected = None
        return MISMATCH if transient else MATCH


class RerunStateMachine:
    """One rank's state machine (module docstring). ``mode``: ``validate_results`` or
    ``disabled``; ``save_state() -> state`` / ``restore_state(state)``: what a rerun must start
    from again (generators, the routers' loads); ``say(line)``: this rank's diagnostics."""

    def __init__(self, mode: str, injector: ErrorInjector, tracker_file: Optional[str],
                 rank: int, save_state: Callable[[], object],
                 restore_state: Callable[[object], None], say: Callable[[str], None] = print):
        self.mode, self.injector, self.tracker_file, self.rank = mode, injector, tracker_file, rank
        self.save_state, self.restore_state, self.say = save_state, restore_state, say
        self.state = State.NOT_RUNNING
        self.iteration = 0  # 1-based, of the iteration being run
        self.first_iteration_complete = False
        self.rerun_requested = self.checkpoint_requested = self.continue_requested = False
        self.counts: dict[str, int] = {}  # validations per message in this run of the step
        self.bucket_norms: list = []  # (bucket index, 0-d norm) of this run (watch_buckets)
        self.grad_checks = (False, False)  # (NaN / inf, large) of the buckets (rerun_machine)
        self.failed: Optional[tuple[str, int]] = None  # (message, sequence) first rejected
        self.initial: Optional[float] = None
        self.saved = None
        self.max_values: dict[str, float] = {}
        self.samples: dict[str, int] = {}
        self.verdict = ""  # what the rerun established (said by the rank that compared)
        self.reruns = 0  # iterations rerun in this job (for tests and the summary)
        if tracker_file is not None:
            with open(tracker_file, "a", encoding="utf-8"):
                pass  # refuse at start a file that cannot be appended to (OSError names it)

    # -- the loop ------------------------------------------------------------------------------
    def should_run(self, iteration: int, reduce_any: Callable[[Sequence[bool]], list]) -> bool:
        """Whether to run (again) the forward-backward pass of ``iteration`` (1-based);
        ``reduce_any(flags) -> [any rank's flag true, ...]`` over every rank."""
        self.counts = {}
        self.bucket_norms.clear()
        if self.state == State.NOT_RUNNING:
            self.iteration, self.state = iteration, State.INITIAL_RUN
            if self.mode != "disabled":
                self.saved = self.save_state()
                self.rerun_requested = self.checkpoint_requested = False
                self.continue_requested = False
            return True
        if self.state == State.INITIAL_RUN:
            if self.mode == "disabled" or not reduce_any([self.rerun_requested])[0]:
                self.state = State.NOT_RUNNING
                return False
            self.state = State.RERUNNING_IN_PLACE
            self.reruns += 1
            self.restore_state(self.saved)
            return True
        if self.state == State.RERUNNING_IN_PLACE:
            cont, checkpoint = reduce_any([self.continue_requested, self.checkpoint_requested])
            if cont:
                self.state = State.NOT_RUNNING
                return False
            if checkpoint:
                self.state = State.WILL_RERUN_FROM_CHECKPOINT
            self.restore_state(self.saved)  # the checkpoint holds the iteration's start
            return False
        raise RuntimeError(f"rerun state machine: should_run in state {self.state}")

    def should_checkpoint_and_exit(self) -> tuple[bool, bool, int]:
        """After the loop: ``(checkpoint, exit, status)``; a run that goes on resets to
        NOT_RUNNING."""
        self.first_iteration_complete = True
        if self.mode == "disabled":
            return False, False, 0
        if self.state == State.RERUNNING_IN_PLACE:
            self.state = State.NOT_RUNNING
            return False, True, EXIT_FAILED_ON_RESULT_VALIDATION
        if self.state == State.WILL_RERUN_FROM_CHECKPOINT:
            self.state = State.NOT_RUNNING
            return True, True, EXIT_RESUME_TO_DISAMBIGUATE
        return False, False, 0

    # -- validations ---------------------------------------------------------------------------
    def validate(self, result: float, reject: Callable[[float], bool], message: str,
                 fatal: bool = True, tolerance: float = 0.0) -> bool:
        """Validate one result (Megatron's ``validate_result``). Returns whether this rank
        rejected it in disabled mode (the caller stops the run for a fatal one)."""
        if self.mode == "disabled":
            if not reject(result):
                return False
            self._track("rerun_disabled", result, message)
            if not fatal:
                self.say(f"iteration {self.iteration}: unexpected result {result} ({message})")
            return fatal
        if self.state == State.NOT_RUNNING:
            raise RuntimeError("rerun state machine: a validation outside the forward-backward "
                               "pass")
        seq = self.counts.get(message, 0)
        self.counts[message] = seq + 1
        call = (message, seq)
        if self.state == State.INITIAL_RUN and not self.rerun_requested:
            if not self.first_iteration_complete:
                return False
            injected = self.injector.maybe_inject()
            if injected:
                self.say(f"iteration {self.iteration}: injecting a {self.injector.kind} "
                         f"(--error-injection-rate {self.injector.rate})")
            if injected or reject(result):
                self.failed, self.initial, self.rerun_requested = call, result, True
                self._track("initial_run", result, message)
                self.say(f"iteration {self.iteration}: unexpected result {result} of micro-batch "
                         f"validation #{seq} ({message}): rerunning the iteration")
        elif self.state == State.RERUNNING_IN_PLACE and call == self.failed:
            how = "" if self.injector.injected is None else f" ({self.injector.kind} injected)"
            diff = self.injector.compare(self.initial, result)
            if diff > tolerance:
                self.continue_requested = not fatal
                self._track("first_rerun_not_reproducible", result, message)
                self.verdict = (f"the rerun gave {result}, not {self.initial} ({message}): a "
                                f"transient fault{how}")
            else:
                self.checkpoint_requested, self.continue_requested = fatal, not fatal
                self._track("first_rerun_reproducible", result, message)
                self.verdict = (f"the rerun reproduced {result} ({message}): a persistent fault "
                                f"of this device or a correct result{how}")
            self.say(f"iteration {self.iteration}: {self.verdict}" +
                     ("" if fatal else "; continuing (a non-fatal check)"))
        return False

    def is_unexpectedly_large(self, value: float, context: str,
                              threshold: float = SPIKY_LOSS_FACTOR,
                              num_samples: int = SPIKY_SAMPLES) -> bool:
        """Whether ``|value|`` is >= ``threshold`` x the largest of the first ``num_samples``
        values of ``context`` (False while sampling, and for NaN or inf: checked apart)."""
        value = abs(value)
        if math.isnan(value) or math.isinf(value):
            return False
        n = self.samples.get(context, 0)
        if n < num_samples:
            self.samples[context] = n + 1
            self.max_values[context] = max(self.max_values.get(context, 0.0), value)
            return False
        return value >= self.max_values[context] * threshold

    def validate_losses(self, losses: Sequence[float], nan_check: bool, spiky_check: bool
                        ) -> Optional[str]:
        """The loss function's validations of each micro-batch loss (module docstring), in
        order. Returns the message of a fatal rejection in disabled mode, else None."""
        stop = None
        for loss in losses:
            checks = [(math.isnan, NAN_MESSAGE, True), (math.isinf, INF_MESSAGE, True)] \
                if nan_check else []
            if spiky_check:
                checks.append((lambda v: self.is_unexpectedly_large(v, "loss"), SPIKY_MESSAGE,
                               False))
            for reject, message, fatal in checks:
                if self.validate(loss, reject, message, fatal) and stop is None:
                    stop = f"{message} (loss {loss})"
        return stop

    def watch_buckets(self, reducers) -> None:
        """Record each gradient bucket's local norm (a 0-d fp32 tensor, no host sync) just
        before its data-parallel reduction (:attr:`loom.parallel.grad_buffer.GradBuffer.
        on_launch`), for :meth:`validate_grads`; cleared at each run of the step."""
        from loom.parallel.grad_buffer import flat_buffers

        def record(index: int, buffer: torch.Tensor) -> None:
            if self.state is not State.NOT_RUNNING:  # a training step under should_run
                self.bucket_norms.append((index, torch.linalg.vector_norm(
                    buffer, dtype=torch.float32)))
        for r in flat_buffers(reducers):
            r.on_launch = record

    def validate_grads(self) -> Optional[str]:
        """Megatron's validations of each recorded bucket norm (:meth:`watch_buckets`), in
        launch order, as :attr:`grad_checks` says: NaN and inf (fatal), unexpectedly large
        (``--check-for-large-grads``, non-fatal: >= 10x the largest of the first 100 bucket
        norms), each with a relative tolerance of 0.1% on the rerun. Returns the message of a
        fatal rejection in disabled mode, else None."""
        nan_check, large_check = self.grad_checks
        if not self.bucket_norms or not (nan_check or large_check):
            return None
        values = torch.stack([n for _, n in self.bucket_norms]).tolist()  # one host sync
        stop = None
        for (index, _), norm in zip(self.bucket_norms, values):
            checks = [(math.isnan, "nan", True), (math.isinf, "inf", True)] if nan_check else []
            if large_check:
                checks.append((lambda v: self.is_unexpectedly_large(
                    v, "grads", threshold=LARGE_GRADS_FACTOR), "large", False))
            for reject, kind, fatal in checks:
                message = GRAD_MESSAGES[kind].format(index) + GRAD_WHERE
                if self.validate(norm, reject, message, fatal, GRAD_TOLERANCE) and stop is None:
                    stop = f"{message} (norm {norm})"
        return stop

    def recording(self, forward_step: Callable, losses: list) -> Callable:
        """:func:`recording` (for the trainer, which holds the machine as a part)."""
        return recording(forward_step, losses)

    def exit_message(self, code: int) -> str:
        """The one line a run that stops with ``code`` ends with (the same on every rank)."""
        if code == EXIT_RESUME_TO_DISAMBIGUATE:
            return (f"iteration {self.iteration}: the rerun reproduced a rejected result (a "
                    f"persistent fault of a device, or a correct result; --rerun-mode "
                    f"validate_results): exit status {code}, resume from the checkpoint on other "
                    f"hardware to tell which")
        return (f"iteration {self.iteration}: the rerun did not reproduce a rejected result (a "
                f"transient fault; --rerun-mode validate_results): exit status {code}, resume "
                f"from the last checkpoint")

    def _track(self, status: str, result: float, message: str) -> None:
        """Append one line to ``--result-rejected-tracker-filename`` (Megatron's fields)."""
        if self.tracker_file is None:
            return
        device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        with open(self.tracker_file, "a", encoding="utf-8") as f:
            f.write(f"ts={datetime.datetime.now()} node={socket.gethostname()} device={device} "
                    f"jobID={os.getenv('SLURM_JOBID', 'N/A')} rank={self.rank} "
                    f"iteration={self.iteration} status={status} result={result} "
                    f"message='{message}'\n")


def recording(forward_step: Callable, losses: list) -> Callable:
    """``forward_step`` whose loss function also appends each micro-batch's loss (detached) to
    ``losses`` (the values the state machine validates)."""
    def step(chunk, batch, hidden_states=None):
        out, loss_fn = forward_step(chunk, batch, hidden_states)

        def checked(output):
            loss, named = loss_fn(output)
            losses.append(loss.detach())
            return loss, named
        return out, checked
    return step


def rerun_machine(cfg, pp_rank: int, rank: int, chunks: Sequence[torch.nn.Module], tracker,
                  reducers) -> RerunStateMachine:
    """The training loop's state machine from ``cfg.fault_tolerance`` on global rank ``rank``
    (pipeline rank ``pp_rank``): a rerun restores every generator
    (:func:`loom.parallel.random.get_rng_state`), the MoE routers' loads of the step so far and
    their per-layer loss logs, and zeroes the gradients of ``reducers``."""
    from loom.parallel.random import get_rng_state, set_rng_state
    ft = cfg.fault_tolerance
    modules = [m for c in chunks for m in c.modules()]
    routers = [m for m in modules if hasattr(m, "reset_load")]
    logged = [m for m in modules if isinstance(getattr(m, "loss_log", None), dict)]

    def save():
        return (get_rng_state(tracker),
                [(r.tokens_per_expert, r.global_tokens, r.global_steps) for r in routers],
                [dict(m.loss_log) for m in logged])

    def restore(state):
        rng, loads, logs = state
        set_rng_state(rng, tracker)
        for r, (n, g, k) in zip(routers, loads):
            r.tokens_per_expert, r.global_tokens, r.global_steps = n, g, k
        for m, log in zip(logged, logs):
            m.loss_log = dict(log)
        for r in reducers:
            r.zero_grad()

    injector = ErrorInjector(ft.error_injection_rate, ft.error_injection_type,
                             random.Random(cfg.training.seed + 100 * pp_rank), rank)
    machine = RerunStateMachine(ft.rerun_mode, injector, ft.result_rejected_tracker_filename,
                                rank, save, restore,
                                lambda line: print(f" rank {rank}: {line}", flush=True))
    # the buckets' NaN / inf check: off under fp16's dynamic loss scaling, whose overflows are
    # expected (Megatron's rule, arguments.py:1197-1203)
    dynamic = cfg.training.fp16 and cfg.training.loss_scale is None
    machine.grad_checks = (not ft.no_check_for_nan_in_loss_and_grad and not dynamic,
                           ft.check_for_large_grads)
    if any(machine.grad_checks):
        machine.watch_buckets(reducers)
    return machine
