"""Pipeline placement without torch: which layers each (virtual) stage holds.

Stages split the L layers evenly; ``--decoder-first-pipeline-num-layers`` /
``--decoder-last-pipeline-num-layers`` pin the first/last stage's count and the rest is split
evenly over the remaining stages. With interleaving (``--num-layers-per-virtual-pipeline-stage``
= l), there are ``v = L / (p l)`` chunks per stage and virtual stage ``j`` (``0 <= j < p v``)
holds layers ``[j l, (j + 1) l)``; chunk ``k`` of stage ``r`` is virtual stage ``k p + r``
(Megatron-LM's order). ``--pipeline-model-parallel-layout`` (:mod:`.layout`, Megatron's string)
places any number of layers on every virtual stage instead. The rules (:func:`stage_layer_counts`, :func:`validate_pipeline`,
``SCHEDULES``) live in :mod:`loom.config.pipeline`, where config validation applies them, and
are re-exported here.
"""

from __future__ import annotations

from loom.config.pipeline import (SCHEDULES, stage_layer_counts,  # noqa: F401 - re-exported
                                  validate_pipeline)
from loom.config.pipeline_layout import parse_layout


def virtual_stage_layers(num_layers: int, pp: int, layers_per_virtual_stage=None, first=None,
                         last=None, layout: str | None = None) -> list[list[int]]:
    """Global layer indices of every virtual stage ``j = 0 .. p v - 1`` in pipeline order
    (``layout``: a ``--pipeline-model-parallel-layout`` string, which decides alone)."""
    if layout:
        return parse_layout(layout, pp).validate(num_layers, None).virtual_stage_layers()
    if layers_per_virtual_stage:
        n = layers_per_virtual_stage
        return [list(range(j * n, (j + 1) * n)) for j in range(num_layers // n)]
    counts = stage_layer_counts(num_layers, pp, first, last)
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


def chunk_layers(num_layers: int, pp: int, pp_rank: int, layers_per_virtual_stage=None,
                 first=None, last=None, layout: str | None = None) -> list[list[int]]:
    """Layers of each of stage ``pp_rank``'s chunks: chunk k = virtual stage ``k p + pp_rank``."""
    vs = virtual_stage_layers(num_layers, pp, layers_per_virtual_stage, first, last, layout)
    v = len(vs) // pp
    return [vs[k * pp + pp_rank] for k in range(v)]


def v_chunk_layers(num_layers: int, pp: int, pp_rank: int) -> list[list[int]]:
    """ZB-V's two chunks of stage ``pp_rank``: virtual stages ``pp_rank`` and
    ``2 pp - 1 - pp_rank`` of L / (2 pp) layers each (the last one, with the output layer, is on
    stage 0). Raises ValueError unless 2 pp divides L."""
    if num_layers % (2 * pp):
        raise ValueError(f"ZB-V needs --num-layers ({num_layers}) divisible by 2 x pipeline "
                         f"size ({2 * pp})")
    vs = virtual_stage_layers(num_layers, pp, num_layers // (2 * pp))
    return [vs[pp_rank], vs[2 * pp - 1 - pp_rank]]
