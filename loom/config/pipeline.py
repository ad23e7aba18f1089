"""The pipeline layout rules, torch-free: how many layers each pipeline stage holds
(:func:`stage_layer_counts`) and which pipeline flags go together (:func:`validate_pipeline`).
Config validation applies them; the placement of layers on ranks
(:mod:`loom.parallel.pipeline.placement`, which re-exports them) and the planner use them too.

Stages split the L layers evenly; ``--decoder-first-pipeline-num-layers`` /
``--decoder-last-pipeline-num-layers`` pin the first/last stage's count and the rest is split
evenly over the remaining stages. With interleaving (``--num-layers-per-virtual-pipeline-stage``
= l) each stage holds ``v = L / (p l)`` chunks of l layers.
"""

from __future__ import annotations

from loom.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved")


class _Err(ValueError):
    pass


def _config_error(msg: str) -> ConfigError:
    return ConfigError(msg)


def stage_layer_counts(num_layers: int, pp: int, first=None, last=None) -> list[int]:
    """Layers per pipeline stage (no interleaving); raises ValueError when impossible."""
    counts: list = [None] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    rest = num_layers - sum(c for c in counts if c is not None)
    free = [i for i, c in enumerate(counts) if c is None]
    if free:
        if rest % len(free) or rest // len(free) < 1:
            raise _Err(rest)
        for i in free:
            counts[i] = rest // len(free)
    elif rest != 0:
        raise _Err(rest)
    if any(c < 1 for c in counts):
        raise _Err(rest)
    return counts


def validate_pipeline(cfg, world_size: int) -> None:
    """Refuse impossible pipeline layouts with a ConfigError naming the flag and the fix."""
    par, L = cfg.parallel, cfg.model.num_layers
    pp, lpv = par.pipeline_model_parallel_size, par.num_layers_per_virtual_pipeline_stage
    first, last = par.decoder_first_pipeline_num_layers, par.decoder_last_pipeline_num_layers
    if par.pipeline_schedule not in SCHEDULES + (None,):
        raise _config_error(f"--pipeline-schedule {par.pipeline_schedule!r} is unknown: choose "
                            f"one of {', '.join(SCHEDULES)}")
    interleaved = par.pipeline_schedule == "interleaved" or lpv is not None
    if pp == 1:
        if interleaved:
            raise _config_error(
                "interleaving (--pipeline-schedule interleaved / "
                "--num-layers-per-virtual-pipeline-stage) needs --pipeline-model-parallel-size "
                "> 1: raise the pipeline size or drop the interleaving flags")
        return
    if interleaved:
        if lpv is None:
            raise _config_error("--pipeline-schedule interleaved needs "
                                "--num-layers-per-virtual-pipeline-stage N (layers per model chunk)")
        if par.pipeline_schedule not in (None, "interleaved"):
            raise _config_error(
                f"--num-layers-per-virtual-pipeline-stage {lpv} selects the interleaved schedule, "
                f"which conflicts with --pipeline-schedule {par.pipeline_schedule}: drop "
                f"--pipeline-schedule (or set --pipeline-schedule interleaved), or drop the "
                f"virtual-stage flag")
        if lpv < 1:
            raise _config_error(f"--num-layers-per-virtual-pipeline-stage must be >= 1, got {lpv}")
        if first is not None or last is not None:
            raise _config_error(
                "--decoder-first/last-pipeline-num-layers are not supported with the interleaved "
                "schedule: drop them or use --pipeline-schedule 1f1b")
        if L % (pp * lpv):
            raise _config_error(
                f"--num-layers {L} is not divisible by --pipeline-model-parallel-size {pp} x "
                f"--num-layers-per-virtual-pipeline-stage {lpv} = {pp * lpv}: choose a "
                f"virtual-stage size with L / (p x N) an integer")
        m = cfg.num_microbatches(world_size)
        if m % pp:
            raise _config_error(
                f"the interleaved schedule needs the number of micro-batches m = "
                f"--global-batch-size / (--micro-batch-size x DP) = {m} to be divisible by "
                f"--pipeline-model-parallel-size {pp}: set --global-batch-size to a multiple of "
                f"{pp * cfg.training.micro_batch_size * cfg.data_parallel_size(world_size)}, "
                f"or use --pipeline-schedule 1f1b")
        return
    for name, val in (("decoder_first_pipeline_num_layers", first),
                      ("decoder_last_pipeline_num_layers", last)):
        if val is not None and val < 1:
            raise _config_error(f"--{name.replace('_', '-')} must be >= 1, got {val}")
    if L < pp:
        raise _config_error(f"--num-layers {L} is smaller than --pipeline-model-parallel-size {pp}:"
                            f" every stage needs at least one layer; lower the pipeline size")
    try:
        stage_layer_counts(L, pp, first, last)
    except _Err as e:
        rest = e.args[0]
        n_free = pp - (first is not None) - (last is not None)
        given = " and ".join(f"--decoder-{w}-pipeline-num-layers {v}" for w, v in
                             (("first", first), ("last", last)) if v is not None)
        if not given:
            raise _config_error(
                f"--num-layers {L} is not divisible by --pipeline-model-parallel-size {pp}: "
                f"choose a PP size dividing L, or set --decoder-first-pipeline-num-layers") from None
        raise _config_error(
            f"--num-layers {L} minus {given} leaves {rest} layers for the other {n_free} "
            f"stage(s): it must be a positive multiple of {max(n_free, 1)} (every stage needs "
            f">= 1 layer); adjust --decoder-first/last-pipeline-num-layers") from None
