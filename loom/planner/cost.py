"""Time to train, GPU-hours, energy, cost and the expected loss to failures of a layout.

Given the predicted throughput (tokens/s) of a layout:

* ``days``: failure-free training time ``T_s = train_tokens / tokens_per_s`` (NAR table 2's
  "training time for 300B tokens" convention, NAR eq 4 ``8 T P / (n X)`` with the planner's own
  time instead of ``X``), in days of 86,400 s.
* failures (only with an MTBF per node): checkpoints every Daly interval; the expected wall time
  ``T_w`` and its parts from :mod:`loom.planner.reliability`. Checkpoint write time ``delta`` =
  checkpoint bytes / aggregate write bandwidth, checkpoint bytes = ``CHECKPOINT_BYTES_PER_PARAM``
  x parameters (bf16 weights 2 + fp32 master weights, Adam m and v 12).
* ``gpu_hours = n T_w / 3600``; ``energy_kwh = gpu_hours x TDP x node_overhead x PUE / 1000``;
  ``cost = gpu_hours x gpu_hour_price``.

Defaults (all overridable on the command line; assumptions, not measurements):
``NODE_POWER_OVERHEAD`` 1.8 = node power / GPU power (DGX H100 data sheet: 10.2 kW max for
8 x 700 W GPUs = 1.82; DGX A100: 6.5 kW for 8 x 400 W = 2.03), ``PUE`` 1.2 (data-centre power
usage effectiveness; hyperscale sites report 1.1-1.2), ``CHECKPOINT_BANDWIDTH_PER_GPU`` 1 GB/s of
aggregate storage write bandwidth per GPU up to ``CHECKPOINT_BANDWIDTH_MAX`` 2 TB/s
(the sustained throughput of Llama 3's Tectonic storage, arXiv 2407.21783 sec 3.3.1),
``RESTART_S`` 600 s (reload and warm-up after a failure). Llama 3 (arXiv 2407.21783
sec 3.3.4) saw 419 unexpected interruptions in 54 days on 16,384 GPUs (2,048 nodes):
``54 x 24 x 2048 / 419 = 6,335`` hours MTBF per node.
"""

from __future__ import annotations

import re

from loom.config import ConfigError
from loom.planner.reliability import failure_overhead, job_mtbf

NODE_POWER_OVERHEAD = 1.8
PUE = 1.2
CHECKPOINT_BYTES_PER_PARAM = 14.0
CHECKPOINT_BANDWIDTH_PER_GPU = 1e9  # bytes/s
CHECKPOINT_BANDWIDTH_MAX = 2e12  # bytes/s
RESTART_S = 600.0
DAY_S = 86400.0
_SUFFIX = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def parse_count(text: str, flag: str = "--train-tokens") -> float:
    """``"300B"`` -> 3e11, ``"15T"`` -> 1.5e13, ``"2.5e9"`` -> 2.5e9, ``"10M"`` -> 1e7.
    Raises ConfigError naming ``flag`` for anything else or a value <= 0."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMBGTkmbgt]?)\s*", str(text))
    if not m or float(m.group(1)) * _SUFFIX[m.group(2).upper()] <= 0:
        raise ConfigError(f"{flag} {text!r}: give a positive count such as 300B, 15T or 2.5e9")
    return float(m.group(1)) * _SUFFIX[m.group(2).upper()]


def training_estimate(tokens_per_s: float, num_gpus: int, train_tokens: float, params: float,
                      tdp_w: float, gpus_per_node: int = 8,
                      node_overhead: float = NODE_POWER_OVERHEAD, pue: float = PUE,
                      gpu_hour_price: float | None = None,
                      mtbf_hours_per_node: float | None = None,
                      checkpoint_bw: float | None = None,
                      restart_s: float = RESTART_S) -> dict:
    """Time, GPU-hours, energy and cost of training ``train_tokens`` tokens at ``tokens_per_s``
    on ``num_gpus`` GPUs of ``tdp_w`` watts (see the module docstring for the formulas).

    ``params``: parameter count (checkpoint size). ``checkpoint_bw``: aggregate write
    bandwidth, bytes/s (default ``min(CHECKPOINT_BANDWIDTH_PER_GPU x n,
    CHECKPOINT_BANDWIDTH_MAX)``). Returns seconds (``train_s``, ``wall_s``), ``days``,
    ``wall_days``, ``gpu_hours``, ``energy_kwh``, ``cost`` (None without a price) and, with an
    MTBF, ``failures`` (:func:`loom.planner.reliability.failure_overhead` plus
    ``checkpoint_write_s``). Raises ConfigError for non-positive inputs."""
    if tokens_per_s <= 0 or num_gpus < 1 or train_tokens <= 0:
        raise ConfigError("time to train needs a positive throughput, GPU count and token count")
    train_s = train_tokens / tokens_per_s
    out = {"train_tokens": train_tokens, "train_s": train_s, "days": train_s / DAY_S}
    wall = train_s
    if mtbf_hours_per_node:
        nodes = max(1, -(-num_gpus // gpus_per_node))
        bw = checkpoint_bw or min(CHECKPOINT_BANDWIDTH_PER_GPU * num_gpus,
                                  CHECKPOINT_BANDWIDTH_MAX)
        delta = CHECKPOINT_BYTES_PER_PARAM * params / bw
        fo = failure_overhead(train_s, delta, job_mtbf(mtbf_hours_per_node * 3600.0, nodes),
                              restart_s)
        fo["checkpoint_write_s"] = delta
        out["failures"] = fo
        wall = fo["wall_s"]
    out["wall_s"] = wall
    out["wall_days"] = wall / DAY_S
    out["gpu_hours"] = num_gpus * wall / 3600.0
    out["energy_kwh"] = out["gpu_hours"] * tdp_w * node_overhead * pue / 1000.0
    out["cost"] = None if gpu_hour_price is None else out["gpu_hours"] * gpu_hour_price
    return out


def format_estimate(est: dict, currency: str = "$") -> str:
    """One or two lines of text for :func:`training_estimate`'s result."""
    tok = est["train_tokens"]
    tok_s = next((f"{tok / v:g}{k}" for k, v in (("T", 1e12), ("B", 1e9), ("M", 1e6))
                  if tok >= v), f"{tok:g}")
    line = (f"time to train {tok_s} tokens: {est['days']:.1f} days failure-free"
            f", {est['gpu_hours']:.4g} GPU-hours, {est['energy_kwh'] / 1e3:.4g} MWh")
    if est["cost"] is not None:
        line += f", cost {currency}{est['cost']:,.0f}"
    fo = est.get("failures")
    if fo:
        line += (f"\nwith failures (job MTBF {fo['job_mtbf_s'] / 3600:.3g} h, checkpoint "
                 f"{fo['checkpoint_write_s']:.3g} s every {fo['interval_s'] / 60:.3g} min (Daly; "
                 f"Young {fo['young_interval_s'] / 60:.3g} min)): {est['wall_days']:.1f} days "
                 f"expected, of which {fo['checkpoint_s'] / DAY_S:.2f} writing checkpoints and "
                 f"{fo['lost_s'] / DAY_S:.2f} lost to failures (rework + restarts)")
    return line
