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

from typing import Optional

from loom.errors import ConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble", "zbv")
# loom's own schedule names (Megatron-LM's flag has no such value): zero-bubble = ZB-H1,
# zbv = ZB-V (two chunks per stage in a V)
ZERO_BUBBLE = ("zero-bubble", "zbv")


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
    if par.pipeline_model_parallel_layout:
        _check_layout(cfg, world_size)
        return
    zbv = par.pipeline_schedule == "zbv"  # its two chunks: --num-layers-per-virtual-... L/(2p)
    interleaved = par.pipeline_schedule == "interleaved" or (lpv is not None and not zbv)
    if par.pipeline_schedule in ZERO_BUBBLE:
        _check_zero_bubble(cfg)
    if zbv and (pp > 1 or lpv is not None):
        _check_zbv(cfg, L, pp, lpv, first, last)
        return
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
        check_microbatch_groups(cfg.num_microbatches(world_size), pp,
                                par.microbatch_group_size_per_virtual_pipeline_stage,
                                pp * cfg.training.micro_batch_size
                                * cfg.data_parallel_size(world_size))
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


def _check_zero_bubble(cfg) -> None:
    """``--pipeline-schedule zero-bubble`` splits each backward into an input-gradient and a
    weight-gradient pass: refused where the weight pass cannot be deferred."""
    t, name = cfg.training, cfg.parallel.pipeline_schedule
    if getattr(t, "zero_stage", 0) == 3 or getattr(t, "use_torch_fsdp2", False):
        raise _config_error(
            f"--pipeline-schedule {name} defers weight gradients past the backward that FSDP2 "
            f"(--zero-stage 3 / --use-torch-fsdp2) reduce-scatters them in: use "
            f"--zero-stage 1 or 2 (--use-distributed-optimizer), or --pipeline-schedule 1f1b")
    if getattr(t, "compile", False):
        raise _config_error(
            f"--pipeline-schedule {name} splits the backward graph of each stage, which "
            f"--compile's compiled layers do not expose: drop --compile or use "
            f"--pipeline-schedule 1f1b")


def _check_zbv(cfg, L: int, pp: int, lpv, first, last) -> None:
    """ZB-V holds exactly two chunks per stage, virtual stages r and 2p - 1 - r, of L / (2p)
    layers each (``--num-layers-per-virtual-pipeline-stage``, optional, must say so). A tied
    embedding then has both of its copies on stage 0, under one name, which the name-keyed
    checkpoint load fills only once: ``--load`` is refused (a checkpoint saved under ZB-V loads
    under any other schedule)."""
    m = cfg.model
    if pp == 1:
        raise _config_error(
            "--num-layers-per-virtual-pipeline-stage with --pipeline-schedule zbv needs "
            "--pipeline-model-parallel-size > 1: raise the pipeline size or drop the flag")
    if L % (2 * pp) == 0 and lpv is not None and lpv != L // (2 * pp):
        raise _config_error(
            f"--pipeline-schedule zbv holds exactly two model chunks per stage, "
            f"L / (2p) = {L // (2 * pp)} layers each, but --num-layers-per-virtual-pipeline-stage "
            f"is {lpv}: set it to {L // (2 * pp)} or drop it (or use --pipeline-schedule "
            f"interleaved for {lpv}-layer chunks)")
    if cfg.checkpoint.load and (not m.untie_embeddings_and_output_weights
                                or getattr(m, "mtp_num_layers", None)):
        raise _config_error(
            f"--load {cfg.checkpoint.load} with --pipeline-schedule zbv: stage 0 holds both "
            f"copies of the tied word embeddings, and loading fills only one; resume under "
            f"--pipeline-schedule zero-bubble (or 1f1b: checkpoints do not depend on the "
            f"schedule), or add --untie-embeddings-and-output-weights to a new run")
    if first is not None or last is not None:
        raise _config_error(
            "--decoder-first/last-pipeline-num-layers are not supported with --pipeline-schedule "
            "zbv (its 2p virtual stages hold L / (2p) layers each): drop them or use "
            "--pipeline-schedule zero-bubble")
    if L % (2 * pp):
        raise _config_error(
            f"--pipeline-schedule zbv needs --num-layers {L} divisible by 2 x "
            f"--pipeline-model-parallel-size {pp} = {2 * pp} (two model chunks per stage): "
            f"choose a pipeline size p with L / (2p) an integer"
            + (f" (e.g. {pp // 2})" if pp % 2 == 0 and L % pp == 0 and pp > 2 else "")
            + ", or use --pipeline-schedule zero-bubble")


def check_microbatch_groups(m: int, pp: int, group: Optional[int], batch_unit: int) -> None:
    """Megatron-Core's rules for the interleaved schedule's micro-batch groups (``group`` N:
    ``--microbatch-group-size-per-virtual-pipeline-stage``, default p): p <= N <= m, and the
    last group (m mod N micro-batches) is empty or holds at least p, otherwise the pipeline
    waits on its own dependencies. ``batch_unit``: p x b x d, the global-batch step that keeps
    m a multiple of p. Raises ConfigError naming the flags and a fix."""
    n = pp if group is None else group
    fix = (f"set --global-batch-size to a multiple of {batch_unit}, or use "
           f"--pipeline-schedule 1f1b")
    if n < pp or n > m:
        raise _config_error(
            f"the interleaved schedule runs micro-batches in groups of N = "
            f"--microbatch-group-size-per-virtual-pipeline-stage {n} (default "
            f"--pipeline-model-parallel-size), which must lie in [p = {pp}, m = {m}] (m = "
            f"--global-batch-size / (--micro-batch-size x DP)): " + fix)
    if 0 < m % n < pp:
        raise _config_error(
            f"the interleaved schedule's last micro-batch group holds m mod N = {m} mod {n} = "
            f"{m % n} micro-batches, fewer than --pipeline-model-parallel-size {pp} (Megatron-"
            f"Core refuses it: the pipeline would wait on itself): set "
            f"--microbatch-group-size-per-virtual-pipeline-stage to a divisor of {m} (>= {pp}), "
            + fix)


def layout_virtual_stages(par, model) -> int:
    """v of ``--pipeline-model-parallel-layout`` (its stages / p). Raises ConfigError naming the
    flag when the string does not parse or does not hold this model (:mod:`.pipeline_layout`)."""
    from loom.config.pipeline_layout import LayoutError, parse_layout
    text = par.pipeline_model_parallel_layout
    try:
        lay = parse_layout(text, par.pipeline_model_parallel_size)
        lay.validate(model.num_layers, getattr(model, "mtp_num_layers", 0) or 0)
    except LayoutError as e:
        raise _config_error(f"--pipeline-model-parallel-layout {text!r}: {e}") from None
    return lay.vp


def _check_layout(cfg, world_size: int) -> None:
    """``--pipeline-model-parallel-layout`` places every layer itself: no other split flag, no
    ZB-V; v > 1 virtual stages run the interleaved schedule (its micro-batch groups checked)."""
    par = cfg.parallel
    pp = par.pipeline_model_parallel_size
    others = [f for f, val in (
        ("--num-layers-per-virtual-pipeline-stage", par.num_layers_per_virtual_pipeline_stage),
        ("--num-virtual-stages-per-pipeline-rank", par.num_virtual_stages_per_pipeline_rank),
        ("--decoder-first-pipeline-num-layers", par.decoder_first_pipeline_num_layers),
        ("--decoder-last-pipeline-num-layers", par.decoder_last_pipeline_num_layers)) if val]
    if others:
        raise _config_error(f"--pipeline-model-parallel-layout places every layer itself: drop "
                            f"{', '.join(others)} (Megatron's rule)")
    v = layout_virtual_stages(par, cfg.model)
    want = "interleaved" if v > 1 else None
    if par.pipeline_schedule in ZERO_BUBBLE or (v > 1 and par.pipeline_schedule not in (
            None, "interleaved")) or (v == 1 and par.pipeline_schedule == "interleaved"):
        raise _config_error(f"--pipeline-model-parallel-layout with {v} virtual stage(s) per "
                            f"rank runs " + (want or "1f1b or gpipe") + f", not --pipeline-"
                            f"schedule {par.pipeline_schedule}")
    if v > 1:
        check_microbatch_groups(cfg.num_microbatches(world_size), pp,
                                par.microbatch_group_size_per_virtual_pipeline_stage,
                                pp * cfg.training.micro_batch_size
                                * cfg.data_parallel_size(world_size))
