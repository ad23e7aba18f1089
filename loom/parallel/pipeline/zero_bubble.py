"""Zero-bubble op lists (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): each backward is
two ops, ``("B", chunk, micro_batch)`` (input gradient, sent to the previous stage) and
``("W", chunk, micro_batch)`` (weight gradients, deferred into what would be bubble). The
executor (:func:`loom.parallel.pipeline.schedules.run_ops`) splits a backward into B and W
whenever the op list holds a W for it (:mod:`loom.parallel.pipeline.split_backward`).

``--pipeline-schedule zero-bubble`` is ZB-H1 (paper sec. 3.1; ``torch.distributed.pipelining``'s
``ScheduleInterleavedZeroBubble`` at one chunk, its "ZB1P"): 1F1B's warm-up of p - r - 1
forwards and its one-forward-one-backward steady state, but stage r runs its first r steady
backwards without their W, so W lags B by r micro-batches and the last stages, which wait
longest in 1F1B's cool-down, fill it with W. Every stage holds at most p micro-batches between
F and W (1F1B's peak); with T_F = T_B = T_W the bubble is (p - 1) units against 1F1B's 3(p - 1)
(:mod:`loom.parallel.pipeline.bubble`). These names are loom's own: Megatron-LM has no
zero-bubble value for a schedule flag.
"""

from __future__ import annotations

Op = tuple  # ("F" | "B" | "W", chunk, micro_batch)
V_SHAPED = ("zbv",)  # chunk 0 = virtual stage r, chunk 1 = virtual stage 2p - 1 - r


def is_v_shaped(schedule, pp: int) -> bool:
    """Whether ``--pipeline-schedule`` ``schedule`` at pipeline size ``pp`` lays its two chunks
    per stage out in a V (ZB-V at p > 1; at p = 1 every schedule is one chunk, 1F1B)."""
    return schedule in V_SHAPED and pp > 1


def loss_stage(schedule, pp: int) -> int:
    """The pipeline rank holding the last virtual stage (the output layer and the loss): 0 under
    a V layout, else p - 1."""
    return 0 if is_v_shaped(schedule, pp) else pp - 1


def zb_h1_ops(m: int, p: int, rank: int, v: int = 1) -> list[Op]:
    """ZB-H1 on stage ``rank`` of p for m micro-batches (one chunk)."""
    warm = min(p - rank - 1, m)
    ops: list[Op] = [("F", 0, j) for j in range(warm)]
    b = w = 0
    for i in range(m):  # one B per step; an F with each while forwards remain
        if warm + i < m:
            ops.append(("F", 0, warm + i))
        ops.append(("B", 0, b))
        b += 1
        if i >= rank:  # W lags B by `rank` micro-batches
            ops.append(("W", 0, w))
            w += 1
    ops += [("W", 0, j) for j in range(w, m)]
    return ops


def zbv_ops(m: int, p: int, rank: int, v: int = 2) -> list[Op]:
    """ZB-V (paper sec. 6; ``torch.distributed.pipelining``'s ``ScheduleZBVZeroBubble`` order)
    on stage ``rank``: two chunks in a V, chunk 0 = virtual stage ``rank`` (going down), chunk
    1 = virtual stage ``2p - 1 - rank`` (coming back up, the loss on stage 0). Built for
    ``n = max(2p - 1, m)`` micro-batches, then the ops of micro-batches >= m are dropped.
    Raises ValueError unless v == 2."""
    if v != 2:
        raise ValueError(f"ZB-V runs exactly 2 model chunks per stage, got {v}")
    n = max(2 * p - 1, m)
    ops: list[Op] = []
    nxt = {("F", 0): 0, ("F", 1): 0, ("B", 0): 0, ("B", 1): 0, ("W", 0): 0, ("W", 1): 0}

    def add(*pairs) -> None:
        for kind, c in pairs:
            ops.append((kind, c, nxt[(kind, c)]))
            nxt[(kind, c)] += 1

    for _ in range(2 * (p - rank) - 1):  # warm-up: chunk 0 forwards
        add(("F", 0))
    for _ in range(rank):
        add(("F", 1), ("F", 0))
    for _ in range(p - rank):  # the V's return: chunk 1 forward, B and W at once
        add(("F", 1), ("B", 1), ("W", 1))
    while nxt[("F", 1)] < nxt[("F", 0)] or nxt[("F", 0)] < n:  # steady state
        if nxt[("F", 0)] < n:
            add(("F", 0))
        add(("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1))
    for _ in range(rank):  # cool-down: B first, W deferred into the tail
        add(("B", 0), ("B", 1))
    for _ in range(p - rank):
        add(("B", 0), ("W", 0))
    while nxt[("W", 1)] < nxt[("B", 1)]:
        add(("W", 1))
    while nxt[("W", 0)] < nxt[("B", 0)]:
        add(("W", 0))
    return [op for op in ops if op[2] < m]
