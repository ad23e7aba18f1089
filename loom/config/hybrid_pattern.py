"""Megatron's ``--hybrid-override-pattern`` / ``--hybrid-layer-pattern`` as a flag of the one
command line: the depth it sets and the pipeline segments ``|`` cuts (Megatron's
``validate_args`` reads the pattern whatever the model; the Mamba family's own rules, which
symbols it builds and which sizes fit, are its ``check`` hook: :mod:`loom.models.mamba.config`;
another family refuses the flag through that family's ``refuse_own_flags``)."""

from __future__ import annotations

from typing import Any

from loom.errors import ConfigError


def resolve_hybrid_pattern(m: Any, p: Any) -> None:
    """Megatron's ``--hybrid-override-pattern`` / ``--hybrid-layer-pattern`` (``m``: model,
    ``p``: parallel section, changed in place): the pattern sets the depth (a different
    ``--num-layers`` is ignored, as Megatron ignores it; said at start), and ``|`` splits it
    into pipeline segments: ``p`` segments of equal length are loom's even split, unequal
    first/last ones set ``--decoder-first/last-pipeline-num-layers``, ``v x p`` equal segments
    set ``--num-layers-per-virtual-pipeline-stage``. Raises ConfigError (Megatron's rules, or a
    layout loom's pipeline does not have)."""
    pat = m.hybrid_override_pattern
    if pat is None:
        return
    segments = pat.split("|")
    m.hybrid_override_pattern = "".join(segments)
    m.num_layers = len(m.hybrid_override_pattern)
    if len(segments) == 1:
        return
    pp, lengths = p.pipeline_model_parallel_size, [len(s) for s in segments]
    if len(segments) % pp:
        raise ConfigError(f"--hybrid-override-pattern {pat!r} has {len(segments)} pipeline "
                          f"segments (|), not a multiple of --pipeline-model-parallel-size {pp}")
    if p.decoder_first_pipeline_num_layers or p.decoder_last_pipeline_num_layers or \
            p.num_layers_per_virtual_pipeline_stage:
        raise ConfigError("--hybrid-override-pattern with | sets the pipeline layout: drop "
                          "--decoder-first/last-pipeline-num-layers and "
                          "--num-layers-per-virtual-pipeline-stage (Megatron's rule)")
    if len(set(lengths)) == 1:
        if len(segments) > pp:
            p.num_layers_per_virtual_pipeline_stage = lengths[0]
        return
    if len(segments) == pp and len(set(lengths[1:-1])) <= 1:
        p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers = \
            lengths[0], lengths[-1]
        return
    raise ConfigError(f"--hybrid-override-pattern {pat!r}: pipeline segments of {lengths} layers; "
                      f"loom's stages hold equal numbers of layers but the first and the last "
                      f"(and equal model chunks when interleaved)")
