"""Bubble and activation memory of each pipeline schedule, pure functions of p, m, v and the
pass times (torch-free, for the planner and the benchmark).

Times: ``tf``, ``tb``, ``tw`` are one micro-batch's forward, input-gradient backward (B) and
weight-gradient backward (W) on one stage, in any one unit (a fused backward is ``tb + tw``);
1, 1, 1 is the zero-bubble paper's model (T_F = T_B = T_W). Bubbles are idle time per stage
in that unit; :func:`bubble_fraction` turns one into idle / step time. Activation memory is in
micro-batches' worth of one stage's activations (M_B in the paper), at the busiest stage.

Sources: Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", sec. 2.2: 1F1B bubble (p-1)(t_f + t_b), interleaved (p-1)(t_f + t_b) / v);
Qi et al. 2024 ("Zero Bubble Pipeline Parallelism", sec. 3.1 / table 3: ZB-H1 bubble
(p-1)(T_F + T_B - T_W) at 1F1B's memory p M_B, ZB-H2 / ZB-V (sec. 4) bubble ~0 when
T_F = T_B = T_W, at 2p M_B per stage counted in the 2p-stage model's chunk size, i.e. p full
stages' worth, the same as 1F1B's).
"""

from __future__ import annotations


def bubble_1f1b(p: int, m: int, tf: float = 1.0, tb: float = 1.0, tw: float = 1.0) -> float:
    """GPipe and 1F1B: ``(p - 1)(tf + tb + tw)`` (Narayanan et al. 2021, sec. 2.2.1); valid
    for any m >= 1."""
    return (p - 1) * (tf + tb + tw)


def bubble_interleaved(p: int, m: int, v: int, tf: float = 1.0, tb: float = 1.0,
                       tw: float = 1.0) -> float:
    """Interleaved 1F1B over v chunks (each ``1/v`` of a stage): ``(p - 1)(tf + tb + tw) / v``
    (Narayanan et al. 2021, sec. 2.2.2)."""
    return (p - 1) * (tf + tb + tw) / v


def bubble_zb_h1(p: int, m: int, tf: float = 1.0, tb: float = 1.0, tw: float = 1.0) -> float:
    """ZB-H1: ``(p - 1)(tf + tb - tw)`` for m >= p (Qi et al. 2024, sec. 3.1): the W passes of
    the last p - 1 micro-batches fill the cool-down. With fewer micro-batches than stages the
    warm-up is not full and it is 1F1B's minus what W can fill."""
    if m >= p:
        return (p - 1) * max(tf + tb - tw, 0.0)
    return (p - 1) * (tf + tb + tw) - m * tw


def bubble_zbv(p: int, m: int, tf: float = 1.0, tb: float = 1.0, tw: float = 1.0) -> float:
    """ZB-V (two chunks per stage in a V, each half a stage; tf, tb, tw a whole stage's times):
    the authors give a bubble rate of 0 at T_F = T_B = T_W and m >= 2p - 1 (Qi et al. 2024,
    sec. 6, and their table "Comparison assuming T_F=T_B=T_W"); the op order built here
    (:func:`~loom.parallel.pipeline.zero_bubble.zbv_ops`) leaves the V's forward fill,
    ``(p - 1) tf / 2``, in a unit-time simulation (tests/parallel/test_zero_bubble.py), which
    is what this returns for m >= 2p - 1; below that, 1F1B's bubble scaled by the chunks'
    half size plus the missing micro-batches' fill, ``(p - 1)(tf + tb + tw) / 2``. Only
    checked at tf = tb = tw."""
    if m >= 2 * p - 1:
        return (p - 1) * tf / 2
    return (p - 1) * (tf + tb + tw) / 2


def bubble_fraction(bubble: float, m: int, tf: float = 1.0, tb: float = 1.0,
                    tw: float = 1.0) -> float:
    """Idle / step time of a stage with ``bubble`` idle time and m micro-batches of work:
    ``bubble / (m (tf + tb + tw) + bubble)``."""
    return bubble / (m * (tf + tb + tw) + bubble)


def activation_microbatches(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Peak activations held by the busiest stage, in micro-batches of one whole stage's
    activations (counted from F to the end of the micro-batch's backward, W included):
    GPipe m; 1F1B and ZB-H1 min(p, m) (Qi et al. 2024, sec. 2.1: ZB-H1 stays within 1F1B's
    peak); interleaved the warm-up of Megatron's schedule, ``min(m v, 2(p - 1) + (v - 1) p
    + 1)`` chunks of 1/v stage (Narayanan et al. 2021, sec. 2.2.2); ZB-V ``min(p, m)`` (the
    authors' table: 1x 1F1B's; 2p half-stage chunks). Raises ValueError for an unknown
    schedule."""
    if schedule == "gpipe":
        return float(m)
    if schedule in ("1f1b", "zero-bubble"):
        return float(min(p, m))
    if schedule == "interleaved":
        return min(m * v, (p - 1) * 2 + (v - 1) * p + 1) / v
    if schedule == "zbv":
        return float(min(p, m))
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


FORMULAS = {"gpipe": "(p-1)(F+B+W)", "1f1b": "(p-1)(F+B+W)", "interleaved": "(p-1)(F+B+W)/v",
            "zero-bubble": "(p-1)(F+B-W)", "zbv": "(p-1)F/2 (~0)"}


def schedule_bubble(schedule: str, p: int, m: int, v: int = 1, tf: float = 1.0,
                    tb: float = 1.0, tw: float = 1.0) -> float:
    """The bubble (idle time per stage, the unit of the times) of ``--pipeline-schedule``
    ``schedule``; raises ValueError for an unknown one."""
    if schedule in ("gpipe", "1f1b"):
        return bubble_1f1b(p, m, tf, tb, tw)
    if schedule == "interleaved":
        return bubble_interleaved(p, m, v, tf, tb, tw)
    if schedule == "zero-bubble":
        return bubble_zb_h1(p, m, tf, tb, tw)
    if schedule == "zbv":
        return bubble_zbv(p, m, tf, tb, tw)
    raise ValueError(f"unknown pipeline schedule {schedule!r}")
