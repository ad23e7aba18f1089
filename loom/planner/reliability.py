"""Checkpoint interval and the expected time lost to failures (Young 1974, Daly 2006).

Failures are modelled as a Poisson process: a job on ``N`` nodes, each failing independently with
mean time between failures ``MTBF_node``, fails with mean time ``M = MTBF_node / N``. With ``delta``
the time to write one checkpoint and ``R`` the time to restart (reload + warm-up), all in seconds:

* Young's interval (Young 1974, "A first order approximation to the optimum checkpoint
  interval", CACM 17(9)): ``tau = sqrt(2 delta M)``.
* Daly's higher-order interval (Daly 2006, "A higher order estimate of the optimum checkpoint
  interval for restart dumps", FGCS 22(3), eq. 37): ``tau = sqrt(2 delta M) (1 + sqrt(delta /
  (2M)) / 3 + delta / (18 M)) - delta`` for ``delta < 2M``, else ``tau = M``.
* Expected wall-clock time of ``T_s`` seconds of work (Daly 2006, eq. 13, exponential failures):
  ``T_w = M exp(R/M) (exp((tau + delta)/M) - 1) T_s / tau``. The overhead ``T_w - T_s`` is the
  checkpoint writes (``T_s delta / tau`` of it) plus rework and restarts after failures.

Pure functions of floats (or numpy arrays); no state. Used by ``loom plan --mtbf-hours-per-node``
and reusable by the trainer for its ``--save-interval``.
"""

from __future__ import annotations

import math


def job_mtbf(mtbf_per_node_s: float, num_nodes: int) -> float:
    """Mean time between failures of a job on ``num_nodes`` nodes (seconds): ``MTBF_node / N``.
    Raises ValueError for a non-positive MTBF or node count."""
    if mtbf_per_node_s <= 0 or num_nodes < 1:
        raise ValueError(f"need MTBF > 0 and >= 1 node, got {mtbf_per_node_s} s, {num_nodes}")
    return mtbf_per_node_s / num_nodes


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimal compute time between checkpoints, seconds: ``sqrt(2 delta M)``."""
    if checkpoint_s < 0 or mtbf_s <= 0:
        raise ValueError(f"need checkpoint time >= 0 and MTBF > 0, got {checkpoint_s}, {mtbf_s}")
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's optimal compute time between checkpoints, seconds (Daly 2006 eq. 37):
    ``sqrt(2 delta M) (1 + sqrt(delta/(2M))/3 + delta/(18M)) - delta`` if ``delta < 2M``
    else ``M``."""
    d, M = checkpoint_s, mtbf_s
    if d >= 2 * M:
        return M
    x = d / (2.0 * M)
    return math.sqrt(2.0 * d * M) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - d


def expected_wall_time(work_s: float, interval_s: float, checkpoint_s: float, mtbf_s: float,
                       restart_s: float = 0.0) -> float:
    """Expected wall-clock seconds to finish ``work_s`` seconds of failure-free work with a
    checkpoint every ``interval_s`` seconds of work (Daly 2006 eq. 13):
    ``M exp(R/M) (exp((tau + delta)/M) - 1) T_s / tau``. Raises ValueError for ``tau <= 0``."""
    if interval_s <= 0 or mtbf_s <= 0:
        raise ValueError(f"need interval > 0 and MTBF > 0, got {interval_s}, {mtbf_s}")
    M = mtbf_s
    return M * math.exp(restart_s / M) * math.expm1((interval_s + checkpoint_s) / M) \
        * work_s / interval_s


def failure_overhead(work_s: float, checkpoint_s: float, mtbf_s: float,
                     restart_s: float = 0.0) -> dict:
    """Checkpointing at Daly's interval: ``interval_s``, ``young_interval_s``, ``wall_s``
    (expected), ``checkpoint_s`` (time writing checkpoints, ``T_s delta / tau``) and ``lost_s``
    (expected rework + restarts: ``wall - work - checkpoint``), all seconds."""
    tau = daly_interval(checkpoint_s, mtbf_s)
    tau = max(tau, 1e-9)
    wall = expected_wall_time(work_s, tau, checkpoint_s, mtbf_s, restart_s)
    ckpt = work_s * checkpoint_s / tau
    return {"interval_s": tau, "young_interval_s": young_interval(checkpoint_s, mtbf_s),
            "wall_s": wall, "checkpoint_s": ckpt, "lost_s": wall - work_s - ckpt,
            "job_mtbf_s": mtbf_s}
