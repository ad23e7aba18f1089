"""Megatron's ``--hybrid-override-pattern`` / ``--hybrid-layer-pattern`` as a flag of the one
command line: the depth it sets and the pipeline segments ``|`` cuts (Megatron's
``validate_args`` reads the pattern whatever the model; the Mamba family's own rules, which
symbols it builds and which sizes fit, are its ``check`` hook: :mod:`loom.models.mamba.config`;
another family refuses the flag through that family's ``refuse_own_flags``). Earlier releases'
``--hybrid-attention-ratio`` / ``--hybrid-mlp-ratio`` give the pattern by shares instead
(:func:`allocate_pattern`)."""

from __future__ import annotations

from typing import Any

from loom.errors import ConfigError


def allocate_pattern(num_layers: int, attention_ratio: float, mlp_ratio: float) -> str:
    """The hybrid pattern of ``num_layers`` layers with ``round(L x attention_ratio)``
    attention layers spread evenly among the Mamba layers (each Mamba run between them about
    equally long), then ``round(L x mlp_ratio)`` of the Mamba layers turned into MLPs the same
    way: Megatron-LM core_v0.16's ``_allocate_auto``
    (megatron/core/ssm/mamba_hybrid_layer_allocation.py), equal to megatron-core 0.16.1's
    ``allocate_layers`` on every depth 1..40 and shares tried
    (tests/unit/test_flag_rows_removed.py)."""
    n_att = round(num_layers * attention_ratio)
    kinds = ["M"] * num_layers
    run = (num_layers - n_att) / (n_att + 1)  # Mamba layers per run between attention ones
    x = run
    for i in range(num_layers):
        if x < 0.5:
            kinds[i], x = "*", x + run
        else:
            x -= 1
    n_mlp = round(num_layers * mlp_ratio)
    if n_mlp > 0:
        per = (num_layers - n_att - n_mlp) / n_mlp  # Mamba layers kept per MLP
        x = per
        for i in range(num_layers):
            if kinds[i] == "M":
                if x < 0.5:
                    kinds[i], x = "-", x + per
                else:
                    x -= 1
    return "".join(kinds)


def _apply_ratios(m: Any) -> None:
    """``--hybrid-attention-ratio`` / ``--hybrid-mlp-ratio`` (Megatron-LM <= core_v0.16): the
    pattern they allocate when none is given; with one given, its counts of each kind must be
    theirs (Megatron's rule). Raises ConfigError."""
    ra, rm = m.hybrid_attention_ratio, m.hybrid_mlp_ratio
    if not (ra or rm):
        return
    if ra + rm > 1.0:
        raise ConfigError(f"--hybrid-attention-ratio {ra} + --hybrid-mlp-ratio {rm} exceeds 1: "
                          f"the shares of attention and MLP layers among all layers")
    pat = m.hybrid_override_pattern
    if pat is None:
        if not m.num_layers:
            raise ConfigError("--hybrid-attention-ratio / --hybrid-mlp-ratio need --num-layers "
                              "(the depth the shares are taken of)")
        m.hybrid_override_pattern = allocate_pattern(m.num_layers, ra, rm)
        return
    flat = pat.replace("|", "")
    auto = allocate_pattern(len(flat), ra, rm)
    if any(flat.count(k) != auto.count(k) for k in set(flat + auto)):
        raise ConfigError(f"--hybrid-override-pattern {pat!r} has other counts of layer kinds "
                          f"than --hybrid-attention-ratio {ra} / --hybrid-mlp-ratio {rm} give "
                          f"({auto!r}); Megatron requires them equal: drop the ratios or fix "
                          f"the pattern")


def resolve_hybrid_pattern(m: Any, p: Any) -> None:
    """Megatron's ``--hybrid-override-pattern`` / ``--hybrid-layer-pattern`` (``m``: model,
    ``p``: parallel section, changed in place): the pattern sets the depth (a different
    ``--num-layers`` is ignored, as Megatron ignores it; said at start), and ``|`` splits it
    into pipeline segments: ``p`` segments of equal length are loom's even split, unequal
    first/last ones set ``--decoder-first/last-pipeline-num-layers``, ``v x p`` equal segments
    set ``--num-layers-per-virtual-pipeline-stage``; the shares of earlier releases allocate
    the pattern when none is given (:func:`_apply_ratios`). Raises ConfigError (Megatron's
    rules, or a layout loom's pipeline does not have)."""
    _apply_ratios(m)
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
