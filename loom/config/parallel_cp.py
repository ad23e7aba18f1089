"""Context-parallel communication fields of :class:`~loom.config.sections.ParallelConfig`
(Megatron-LM's ``--cp-comm-type`` and ``--hierarchical-context-parallel-sizes``) and their rules.

Both flags take several words (``nargs='+'`` in Megatron; a YAML list here too); loom stores
them joined by spaces and reads them with :func:`cp_comm_types` / :func:`hierarchical_sizes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from loom.config.fields import opt
from loom.errors import ConfigError

COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")


@dataclass
class ContextParallelFields:
    """The CP communication flags; a mixin of ParallelConfig."""

    cp_comm_type: str = opt(
        "p2p", "context-parallel communication: p2p (ring attention, K/V passed around the CP "
               "ring overlapped with compute), a2a (all-to-all from sequence to head sharding), "
               "allgather (K/V all-gathered) or a2a+p2p (a2a inside groups, ring across them); "
               "one value for every layer or one per layer, e.g. p2p p2p a2a a2a", words=True)
    hierarchical_context_parallel_sizes: Optional[str] = opt(
        None, "A B: for a2a+p2p, a2a inside groups of A consecutive CP ranks, a ring across the "
              "B groups (A x B = --context-parallel-size)", words=True)


def cp_comm_types(p: Any, num_layers: int) -> tuple[str, ...]:
    """One comm type per layer from ``--cp-comm-type`` (one word repeated, or one per layer).
    Raises ConfigError for an unknown word or a list of the wrong length."""
    words = str(p.cp_comm_type).split()
    bad = [w for w in words if w not in COMM_TYPES]
    if not words or bad:
        raise ConfigError(f"--cp-comm-type {' '.join(bad) or '(empty)'}: each value must be one "
                          f"of {', '.join(COMM_TYPES)}")
    if len(words) == 1:
        return tuple(words) * num_layers
    if len(words) != num_layers:
        raise ConfigError(f"--cp-comm-type gives {len(words)} values for --num-layers "
                          f"{num_layers}: give one value for all layers or exactly {num_layers}")
    return tuple(words)


def hierarchical_sizes(p: Any) -> Optional[tuple[int, int]]:
    """``(A, B)`` of ``--hierarchical-context-parallel-sizes``, or None.
    Raises ConfigError unless two positive integers."""
    if p.hierarchical_context_parallel_sizes is None:
        return None
    words = str(p.hierarchical_context_parallel_sizes).split()
    if len(words) != 2 or not all(w.isdigit() and int(w) > 0 for w in words):
        raise ConfigError(f"--hierarchical-context-parallel-sizes "
                          f"{p.hierarchical_context_parallel_sizes}: give two positive integers "
                          f"A B (a2a group size, ring size)")
    return int(words[0]), int(words[1])


def check_context_parallel(m: Any, p: Any) -> None:
    """The CP comm-type rules (model ``m``, parallel ``p``): known types, per-layer list length,
    hierarchical sizes multiplying to c when a2a+p2p is used (Megatron's assertions), and for
    a2a the local query heads ``a/t`` divisible by the a2a size A and by ``lcm(g_local, A)``
    (key/value groups are repeated up to a multiple of A). Raises ConfigError with a fix."""
    types = cp_comm_types(p, m.num_layers)
    c, t = p.context_parallel_size, p.tensor_model_parallel_size
    hier = hierarchical_sizes(p)
    if hier is not None and hier[0] * hier[1] != c:
        raise ConfigError(f"--hierarchical-context-parallel-sizes {hier[0]} {hier[1]} must "
                          f"multiply to --context-parallel-size {c}")
    a = m.num_attention_heads
    g = m.num_query_groups or a
    heads, groups = a // t, max(g // t, 1)
    ok = [n for n in range(c, 1, -1) if c % n == 0 and heads % math.lcm(groups, n) == 0]
    if "a2a+p2p" in types and hier is None and c > 1:
        raise ConfigError("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes "
                          "A B (A x B = --context-parallel-size), e.g. "
                          f"--hierarchical-context-parallel-sizes {ok[0] if ok else 1} "
                          f"{c // (ok[0] if ok else 1)}")
    if c == 1:
        return
    for kind, size in (("a2a", c), ("a2a+p2p", hier[0] if hier else 1)):
        if kind not in types or size == 1:
            continue
        need = math.lcm(groups, size)
        if heads % need:
            fix = "use --cp-comm-type p2p or allgather"
            if ok:
                fix += (f", or --cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes "
                        f"{ok[0]} {c // ok[0]}")
            raise ConfigError(f"--cp-comm-type {kind} splits the {heads} attention heads per "
                              f"tensor-parallel rank (--num-attention-heads {a} / "
                              f"--tensor-model-parallel-size {t}, {groups} query groups) over "
                              f"{size} ranks: {heads} must be divisible by {need}; {fix}")
