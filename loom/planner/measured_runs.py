"""The measured runs ``loom plan --calibrate-from`` reads (:mod:`loom.planner.calibrate_runs`
fits on them): a JSONL file of one run per line, ``{"layout": {...}, "step_time_s": T,
"peak_memory_gb": M}`` (the format of calibrate_runs' module docstring), or ``loom train``'s own
``--log-json`` file, one or more runs appended to it (:func:`runs_from_loom_log`). Each run is a
dict: ``layout`` (:data:`loom.planner.layout.KEYS` names), ``step_time_s`` and optionally
``peak_memory_gb``, ``global_batch_size``, ``seq_length``, ``num_gpus``, ``options`` (the
:class:`~loom.planner.layout.Options` fields it ran with), ``model_shape`` and ``source``.
"""

from __future__ import annotations

import json
import statistics

from loom.config import ConfigError
from loom.jsonl import json_lines
from loom.planner.hardware import GB
from loom.planner.layout import KEYS


def read_runs(path: str) -> list[dict]:
    """The runs of a JSONL file (module docstring), or of a ``loom train --log-json`` file
    (:func:`runs_from_loom_log`); ConfigError naming the line of a bad one."""
    runs = []
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
    except OSError as e:
        raise ConfigError(f"--calibrate-from {path}: {e.strerror}") from None
    if _is_loom_log(next((ln for ln in lines if ln.strip()), "")):
        return runs_from_loom_log(path)
    for n, r in json_lines(enumerate(lines, 1), f"--calibrate-from {path}",
                           " (one JSON object per measured run)"):
        where = f"--calibrate-from {path}:{n}"
        lay = r.get("layout") if isinstance(r, dict) else None
        if not isinstance(lay, dict) or "dp" not in lay:
            raise ConfigError(f"{where}: needs \"layout\": {{\"tp\": .., \"pp\": .., \"dp\": .., "
                              f"...}} (dp required)")
        bad = sorted(set(lay) - set(KEYS))
        if bad:
            raise ConfigError(f"{where}: unknown layout key(s) {bad}; known: {', '.join(KEYS)}")
        t = r.get("step_time_s")
        if not isinstance(t, (int, float)) or t <= 0:
            raise ConfigError(f"{where}: needs \"step_time_s\" > 0 (seconds per iteration)")
        runs.append(r)
    if not runs:
        raise ConfigError(f"--calibrate-from {path}: no runs (one JSON line per measured run)")
    return runs


def _is_loom_log(first_line: str) -> bool:
    """Whether a file's first line is a ``loom train --log-json`` run header."""
    try:
        rec = json.loads(first_line)
    except json.JSONDecodeError:
        return False
    return isinstance(rec, dict) and rec.get("kind") == "run" and "config" in rec


LOG_WARMUP = 1
"""Iterations of each run in a ``--log-json`` file left out of its step time (the first one
builds kernels, caches and the allocator's pools)."""
RUN_OPTIONS = ("flash_attention", "layer_memory", "overlap_grad_reduce", "overlap_param_gather",
               "ddp_bucket_elems", "ddp_bucket_per_rank", "ddp_bucket_count",
               "optimizer_state_bytes", "master_bytes", "grad_bytes", "muon_ns_steps",
               "muon_split_qkv", "muon_fp32", "muon_blockwise", "optimizer_offload_fraction")
"""The :class:`~loom.planner.layout.Options` fields a logged run fixes for itself
(:func:`loom.planner.predict.run_options`): it is predicted as it ran, not as the plan's
defaults would run it."""


def runs_from_loom_log(path: str) -> list[dict]:
    """The runs of a ``loom train --log-json`` file (:func:`loom.config.run_log.read_run_log`;
    one or more runs appended to it): per ``{"kind": "run", "config": ..., "world_size": W}``
    header, its layout at W (:func:`loom.planner.predict.layout_of`), the median
    ``step_time_s`` of its training records after the first :data:`LOG_WARMUP`, its global
    batch, sequence length and GPU count, the options it ran with (:data:`RUN_OPTIONS`) and
    its model's shape (checked against the plan's by :func:`calibrate`), and
    ``peak_memory_gb`` from the records' ``peak_memory_reserved_bytes`` (CUDA runs) when the
    run has no pipeline (the log is rank 0's, and without pipelining every rank holds the
    same; with it the neediest stage may be another). ConfigError naming the run (1-based,
    with its start time) whose header has no world size (a log of an older loom)."""
    from loom.config import LoomConfig
    from loom.config.run_log import read_run_log
    from loom.planner.predict import layout_of, run_options
    runs = []
    for i, logged in enumerate(read_run_log(path), 1):
        header, times = logged["header"], [float(r["step_time_s"]) for r in logged["train"]
                                           if "step_time_s" in r]
        where = f"--calibrate-from {path}: run {i} ({header.get('start_utc', 'no header')})"
        if not isinstance(header.get("world_size"), int):
            raise ConfigError(f"{where} has no world_size in its header (a log of an older "
                              f"loom): give the runs as JSON lines (layout, step_time_s)")
        if not times:
            continue  # an evaluation-only run
        cfg = LoomConfig.from_flat(header["config"])
        w, m, opts = header["world_size"], cfg.model, run_options(cfg)
        lay = layout_of(cfg, w)
        run = {"layout": lay, "step_time_s": statistics.median(times[LOG_WARMUP:] or times),
               "global_batch_size": cfg.global_batch_size(w), "seq_length": m.seq_length,
               "num_gpus": w, "options": {k: getattr(opts, k) for k in RUN_OPTIONS},
               "model_shape": {k: getattr(m, k) for k in MODEL_SHAPE}, "source": where}
        reserved = [r["peak_memory_reserved_bytes"] for r in logged["train"]
                    if "peak_memory_reserved_bytes" in r]
        if reserved and lay["pp"] == 1:  # rank 0's peak is every rank's without pipelining
            run["peak_memory_gb"] = max(reserved) / GB
        runs.append(run)
    return runs


MODEL_SHAPE = ("num_layers", "hidden_size", "num_attention_heads", "num_kv_groups", "ffn_size",
               "vocab_size", "num_experts", "moe_router_topk")
"""The model fields a logged run must share with the plan to calibrate it."""
