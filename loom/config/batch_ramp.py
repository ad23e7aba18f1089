"""The global batch size B by consumed samples: Megatron-LM's two batch-size ramps.

* ``--rampup-batch-size START INCREMENT SAMPLES`` (Megatron-Core's
  ``RampupBatchsizeNumMicroBatchesCalculator``, through megatron-core 0.16; GPT-3's ramp, Brown
  et al. 2020, sec. 2.3 and appendix B): B starts at START and grows by INCREMENT
  ``n = (B_final - START) / INCREMENT`` times, once every ``SAMPLES / n`` consumed samples
  (``B = START + INCREMENT x floor(consumed / (SAMPLES / n))``), and is B_final (``--global-
  batch-size``) once more than SAMPLES samples are consumed. Megatron-LM requires sample-based
  training for it (``--train-samples``); its run is ``train_iters`` iterations as Megatron's
  ``update_train_iters`` counts them (the ramp's iterations while at most SAMPLES and at most
  ``--train-samples`` samples are consumed, then whole final batches of the rest).
  Megatron-LM since 532ad926 (2026-04) parses the flag and ignores it; loom runs the ramp the
  script asked for.
* ``--step-batch-size-schedule "T0:B0 T1:B1 ..."`` (Megatron-Core's
  ``StepBatchsizeNumMicroBatchesCalculator``, since 532ad926): B is the B_k of the last
  threshold T_k reached. The thresholds count tokens (Megatron's training passes
  ``--seq-length``): a threshold is ``T // s`` samples; suffixes K, M, B, T (10^3..10^12).
  With ``--train-samples`` the run is the iterations until at least that many samples are
  consumed (Megatron's count: the last batch may pass it).

B must be a multiple of ``--micro-batch-size`` b x DP d at every size the run reaches: each
iteration runs ``m = B / (b d)`` micro-batches. Pure arithmetic (no torch); refusals are
ConfigError naming the flag.
"""

from __future__ import annotations

import re
from typing import Optional

from loom.errors import ConfigError

_SUFFIX = {"": 1, "K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}
_NUMBER = re.compile(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)([KMBT]?)")


def _number(word: str, text: str) -> int:
    """A schedule number with Megatron's suffixes (``int(float(x) x suffix)``)."""
    m = _NUMBER.fullmatch(word.strip().upper())
    if not m:
        raise ConfigError(f"--step-batch-size-schedule {text!r}: {word!r} is not a number "
                          f"(with an optional K, M, B or T suffix)")
    return int(float(m.group(1)) * _SUFFIX[m.group(2)])


def parse_step_schedule(text: str, seq_length: Optional[int] = None) -> list[tuple[int, int]]:
    """``"0:16 2.4B:320 12B:1536"`` -> ``[(0, 16), (T1, 320), ...]``, (threshold, B) pairs sorted
    by threshold (Megatron sorts them), thresholds in samples: tokens // ``seq_length`` when it is
    given (as Megatron's training reads them), else as written. Commas separate as spaces do.

    Raises ConfigError naming the flag for a malformed entry, a first threshold above 0,
    thresholds that repeat, or a batch size below 1."""
    out: list[tuple[int, int]] = []
    for word in text.replace(",", " ").split():
        if ":" not in word:
            raise ConfigError(f"--step-batch-size-schedule {text!r}: {word!r} is not "
                              f"THRESHOLD:BATCH (e.g. '0:16 2.4B:320')")
        left, right = word.split(":", 1)
        threshold, batch = _number(left, text), _number(right, text)
        if seq_length:
            threshold //= seq_length
        out.append((threshold, batch))
    out.sort(key=lambda p: p[0])
    if not out or out[0][0] != 0 or any(a[0] >= b[0] for a, b in zip(out, out[1:])):
        raise ConfigError(f"--step-batch-size-schedule {text!r}: the thresholds must start at 0 "
                          f"and differ" + (f" (in samples: tokens // --seq-length {seq_length})"
                                           if seq_length else ""))
    if any(b < 1 for _, b in out):
        raise ConfigError(f"--step-batch-size-schedule {text!r}: every batch size must be at "
                          f"least 1")
    return out


def parse_rampup(text: str) -> tuple[int, int, int]:
    """``--rampup-batch-size START INCREMENT SAMPLES`` as three ints; ConfigError otherwise
    (START, INCREMENT and SAMPLES at least 1: Megatron-Core asserts the first two and divides by
    the third)."""
    words = text.split()
    if len(words) != 3 or not all(w.isdigit() for w in words):
        raise ConfigError(f"--rampup-batch-size {text!r}: give three integers START INCREMENT "
                          f"SAMPLES (e.g. 32 32 1000000)")
    start, incr, samples = (int(w) for w in words)
    if start < 1 or incr < 1:
        raise ConfigError(f"--rampup-batch-size {text!r}: START and INCREMENT must be at least 1")
    if samples < 1:  # Megatron-Core accepts 0 and then divides by it at the first update
        raise ConfigError(f"--rampup-batch-size {text!r}: SAMPLES must be at least 1 (or drop "
                          f"the ramp: --global-batch-size from the start)")
    return start, incr, samples


class BatchRamp:
    """B by consumed samples for one of Megatron's ramps (module docstring). ``steps``: the
    step schedule's (threshold samples, B) pairs; ``rampup``: (START, INCREMENT, SAMPLES) with
    ``final`` B_final. Exactly one of the two is given. Holds a growing cache of the samples
    consumed before each iteration (:meth:`consumed_before`)."""

    def __init__(self, final: int, steps: Optional[list[tuple[int, int]]] = None,
                 rampup: Optional[tuple[int, int, int]] = None):
        if (steps is None) == (rampup is None):
            raise ValueError("give steps or rampup")
        self.final, self.steps, self.rampup = final, steps, rampup
        self.flag = "--rampup-batch-size" if rampup else "--step-batch-size-schedule"
        if rampup:
            start, incr, _ = rampup
            if final < start or (final - start) % incr:
                raise ConfigError(
                    f"--rampup-batch-size {start} {incr} {rampup[2]}: --global-batch-size "
                    f"{final} must be START {start} plus a whole number of INCREMENT {incr} "
                    f"(Megatron's rule)")
            self._increments = (final - start) // incr
        self._consumed = [0]

    @classmethod
    def from_training(cls, t, seq_length: Optional[int]) -> Optional["BatchRamp"]:
        """The ramp of a TrainingConfig ``t`` (``--rampup-batch-size`` with its final
        ``--global-batch-size``, or ``--step-batch-size-schedule`` with thresholds in tokens of
        ``seq_length``), or None without one. Raises ConfigError naming the flag."""
        if t.rampup_batch_size and t.step_batch_size_schedule:
            raise ConfigError("--rampup-batch-size and --step-batch-size-schedule both ramp the "
                              "batch size: give one")
        if t.rampup_batch_size:
            rampup = parse_rampup(t.rampup_batch_size)
            if t.global_batch_size is None:
                raise ConfigError("--rampup-batch-size ramps up to --global-batch-size: give it")
            return cls(t.global_batch_size, rampup=rampup)
        if t.step_batch_size_schedule:
            steps = parse_step_schedule(t.step_batch_size_schedule, seq_length)
            return cls(steps[-1][1], steps=steps)
        return None

    def batch_at(self, consumed: int) -> int:
        """B of the iteration that starts after ``consumed`` samples."""
        if self.steps is not None:
            batch = self.steps[0][1]
            for threshold, b in self.steps:
                if consumed < threshold:
                    break
                batch = b
            return batch
        start, incr, samples = self.rampup
        if consumed > samples or not self._increments:
            return self.final
        return start + int(consumed / (samples / self._increments)) * incr

    def consumed_before(self, iteration: int) -> int:
        """Samples consumed by iterations 0 .. ``iteration`` - 1 (0-based)."""
        c = self._consumed
        while len(c) <= iteration:
            c.append(c[-1] + self.batch_at(c[-1]))
        return c[iteration]

    def train_iters(self, train_samples: int) -> int:
        """Iterations of a ``--train-samples`` run, as Megatron-LM counts them (module
        docstring: the rampup's rule, or the step schedule's)."""
        iters, consumed = 0, 0
        if self.steps is not None:
            while consumed < train_samples:
                consumed += self.batch_at(consumed)
                iters += 1
            return iters
        while consumed <= self.rampup[2] and consumed <= train_samples:
            consumed += self.batch_at(consumed)
            iters += 1
        return iters + max(train_samples - consumed, 0) // self.final

    def sizes(self, iterations: int) -> list[int]:
        """The distinct batch sizes of the first ``iterations`` iterations, in order."""
        out: list[int] = []
        consumed = 0
        for _ in range(iterations):
            b = self.batch_at(consumed)
            if not out or out[-1] != b:
                out.append(b)
            if b == self.final and (self.steps is None or consumed >= self.steps[-1][0]):
                break  # the last size: nothing changes after it
            consumed += b
        return out

    def describe(self) -> str:
        """One line: the sizes and where they change."""
        if self.rampup:
            start, incr, samples = self.rampup
            return (f"global batch {start} -> {self.final} in steps of {incr} over the first "
                    f"{samples:,} samples ({self.flag})")
        return "global batch " + ", ".join(f"{b} from sample {t:,}" for t, b in self.steps) + \
            f" ({self.flag})"
