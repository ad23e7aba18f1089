"""Pipeline splits: how many transformer layers the first and last pipeline stage hold.

A split is ``(lf, ll)``: layers of the first and the last stage; the ``p - 2`` middle stages hold
``(L - lf - ll) / (p - 2)`` each (Megatron-LM's ``--decoder-first-pipeline-num-layers`` /
``--decoder-last-pipeline-num-layers``; the rest is split evenly). ``(0, 0)`` is the even split
``L / p``. Sources of the uneven splits:

* searched when ``L`` is not divisible by ``p`` (:func:`uneven_splits`): the middle stages hold
  ``k = ceil(L/p) - 1`` or ``ceil(L/p)`` layers and the first/last stage the rest, nearly
  balanced and at most ``k + 1`` each. The planner's time and memory models (embedding on the
  first stage, output layer and loss on the last) then pick among them. Llama 3 405B (L = 126,
  p = 16; Llama 3 paper, arXiv 2407.21783 sec 3.3.2: "we remove one Transformer layer each from
  the first and the last stages") is the split 7 + 14 x 8 + 7.
* given (:func:`given_split`): first and/or last fixed, the rest even, as ``loom train`` runs it
  (:func:`loom.parallel.pipeline.placement.stage_layer_counts`).
* ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``
  (:func:`accounted_split`, Megatron-LM semantics): the embedding and/or the loss count as one
  layer each in an even split of ``L + e + l`` "layers", the first/last stage giving up one
  transformer layer for them (126 + 2 = 128 = 16 x 8 -> 7 + 14 x 8 + 7).
"""

from __future__ import annotations

import math
from functools import lru_cache


def uneven_splits(num_layers: int, pp: int) -> list[tuple[int, int]]:
    """Candidate ``(lf, ll)`` for ``L = num_layers`` not divisible by ``p = pp`` (``[(0, 0)]``
    when it is, ``[]`` when ``p > L``). Every candidate gives each stage >= 1 layer."""
    L, p = num_layers, pp
    if p > L:
        return []
    if p == 1 or L % p == 0:
        return [(0, 0)]
    if p == 2:
        return [(L // 2, L - L // 2), (L - L // 2, L // 2)]
    out = []
    top = math.ceil(L / p)
    for k in (top - 1, top):
        r = L - (p - 2) * k  # layers for the first and last stage together
        if k < 1 or r < 2:
            continue
        lo, hi = max(1, r - (k + 1)), min(k + 1, r - 1)
        for f in sorted({r // 2 - 1, r // 2, (r + 1) // 2, r // 2 + 1}):
            if lo <= f <= hi and (f, r - f) not in out:
                out.append((f, r - f))
    return out


def given_split(num_layers: int, pp: int, first: int | None, last: int | None):
    """``(lf, ll)`` with the first and/or last stage fixed and the rest split evenly (as
    ``loom train`` does); None when impossible (a stage would get < 1 layer or the rest does not
    divide). ``p = 1``: ``(0, 0)``."""
    if pp == 1:
        return (0, 0)
    from loom.parallel.pipeline.placement import stage_layer_counts  # torch-free
    try:
        counts = stage_layer_counts(num_layers, pp, first, last)
    except ValueError:
        return None
    if len(set(counts)) == 1:
        return (0, 0)
    return (counts[0], counts[-1])


def accounted_split(num_layers: int, pp: int, embedding: bool, loss: bool):
    """Megatron's ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-
    pipeline-split``: ``k = (L + e + l) / p`` per stage, first ``k - e``, last ``k - l``; None
    when ``L + e + l`` is not divisible by ``p`` or a stage would be empty."""
    if pp == 1:
        return (0, 0)
    e, lo = int(bool(embedding)), int(bool(loss))
    total = num_layers + e + lo
    if total % pp:
        return None
    k = total // pp
    if k - e < 1 or k - lo < 1:
        return None
    return (0, 0) if e == lo == 0 else (k - e, k - lo)


def describe_counts(counts) -> str:
    """Layers per pipeline rank, runs of equal ranks as ``n x k``: ``"7+14x8+7"``,
    ``"16x8"``, ``"126"`` (one rank), ``"3x1+12x2+1"`` (28 layers over 16 ranks)."""
    counts = [int(c) for c in counts]
    parts, i = [], 0
    while i < len(counts):
        j = i
        while j + 1 < len(counts) and counts[j + 1] == counts[i]:
            j += 1
        parts.append(str(counts[i]) if j == i else f"{j - i + 1}x{counts[i]}")
        i = j + 1
    return "+".join(parts)


def describe_split(num_layers: int, pp: int, lf: int, ll: int) -> str:
    """``"7+14x8+7"`` (uneven) or ``"16x8"`` (even) or ``"126"`` (p = 1): the layers per rank
    of the split ``(lf, ll)`` (:func:`loom.planner.stage_table.row_layout`; p not dividing L
    with ``lf = ll = 0``: balanced)."""
    from loom.planner.stage_table import row_layout
    return describe_counts(row_layout(num_layers, pp, 1, lf, ll, 0).rank_layer_counts())


@lru_cache(maxsize=1024)
def search_splits(num_layers: int, pp: int) -> tuple[tuple[int, int], ...]:
    """The ``(lf, ll)`` splits searched at pipeline size ``pp``: ``(0, 0)``, the even split,
    when p divides L; otherwise the balanced split (:func:`loom.planner.stage_table.
    balanced_counts`: any L over any p, e.g. 28 layers over 16 stages as ``1+1+1+12x2+1``) and
    :func:`uneven_splits` (first / last stage uneven, the middle even), each as its first and
    last rank's layers (the middle by :func:`loom.planner.stage_table.middle_counts`), no
    split twice; none when ``p > L``."""
    from loom.planner.stage_table import balanced_counts
    if pp > num_layers:
        return ()
    if pp == 1 or num_layers % pp == 0:
        return ((0, 0),)
    c = balanced_counts(num_layers, pp)
    out = [(c[0], c[-1])]
    return tuple(out + [sp for sp in uneven_splits(num_layers, pp) if sp not in out])


@lru_cache(maxsize=4096)
def interleave_options(num_layers: int, pp: int, lf: int, ll: int) -> tuple[int, ...]:
    """Chunks per rank ``v > 1`` searched with the split ``(lf, ll)``: the divisors of the most
    common rank size (the middle ranks'; the larger end with ``p = 2``) that leave every rank
    at least one layer per chunk (each rank's layers over v chunks as evenly as possible,
    :func:`loom.config.pipeline_layout.rank_counts_to_chunks`)."""
    from loom.planner.stage_table import row_layout
    if pp == 1:
        return ()
    counts = row_layout(num_layers, pp, 1, lf, ll, 0).rank_layer_counts()
    mid = counts[1:-1] if pp > 2 else [max(counts)]
    mode = max(set(mid), key=lambda c: (mid.count(c), c))
    return tuple(v for v in range(2, mode + 1) if mode % v == 0 and v <= min(counts))


@lru_cache(maxsize=4096)
def max_chunk_layers(num_layers: int, pp: int, vp: int, lf: int, ll: int) -> int:
    """Layers of the largest chunk of the split ``(lf, ll)`` at ``vp`` chunks per rank."""
    from loom.planner.stage_table import row_layout
    return max(row_layout(num_layers, pp, vp, lf, ll, 0).counts())


def block_recompute_options(chunk_layers: int) -> tuple[int, ...]:
    """``--recompute-num-layers`` searched with ``--recompute-method block`` (full recompute of
    the first N layers of every chunk, Megatron-LM): about a quarter, a half and three quarters
    of the largest chunk, strictly between none and all of it."""
    n = int(chunk_layers)
    return tuple(sorted({k for k in (-(-n // 4), -(-n // 2), -(-3 * n // 4)) if 0 < k < n}))
