"""Does blocking pipeline p2p add bubble to the interleaved 1F1B schedule? A max-plus simulation
of Megatron-LM 285068c8's schedule (the Megatron-LM of MegaScale's baseline, issue 47 item 3).

Megatron-LM at 285068c8 (``megatron/schedules.py``, ``forward_backward_pipelining_with_
interleaving``; ``megatron/p2p_communication.py``, ``_communicate``) runs, per pipeline rank:
an initial receive; ``W_r = 2 (p - r - 1) + (v - 1) p`` warm-up forwards, each followed by one
blocking exchange (send the output to the next rank, receive the next input from the previous
one; the last warm-up exchange also receives a gradient from the next rank); ``m v - W_r`` steady
steps of one forward, one backward and one blocking exchange with both neighbours; then ``W_r``
cool-down backwards, each followed by an exchange. Every exchange is one ``batch_isend_irecv``
group waited on (and a ``torch.cuda.synchronize``): it completes when every matching partner
operation has been posted. The rank after the last wraps to the first (model chunks).

This script rebuilds those operation lists (the warm-up count, ``get_model_chunk_id``, which
ranks skip which receive), matches every send with its receive in order per (source,
destination, direction), and computes each exchange's completion as the latest posting among it
and its partners plus a transfer time ``x``: a max-plus system, solved in program order. Chunk
forward time 1, backward 2 (balanced stages unless ``extra_last``, the output layer's share on
the last chunk of the last rank).

Result (``python -m benchmarks.pipeline_lockstep``): the overhead over ``m v`` chunk steps is
exactly ``p - 1`` chunk steps, i.e. the ``(p - 1) / v`` micro-batch bubble the planner uses, for
every m: the coupling of both neighbours in one blocking exchange adds no bubble when the stages
are balanced; an unbalanced last stage adds its extra per micro-batch (the slowest stage, as the
planner prices it); a transfer time adds ``x`` per exchange on the critical path. So the ~1.3 s
per iteration MegaScale's Megatron-LM rows pay beyond the model (docs/planner.md, "Scale") is
not the schedule.
"""

from __future__ import annotations

import json
from collections import defaultdict


def rank_ops(r: int, p: int, v: int, m: int) -> list[tuple]:
    """The operations of pipeline rank ``r``: ``(work, sends, recvs)`` per blocking exchange;
    ``work`` a list of ``("F"|"B", chunk)`` computed before it, ``sends`` / ``recvs`` lists of
    ``(peer, "f"|"b")``."""
    n = m * v
    first, last = r == 0, r == p - 1
    warm = min((p - r - 1) * 2 + (v - 1) * p, n)
    nxt, prv = (r + 1) % p, (r - 1) % p

    def chunk(k, fwd):
        c = (k % (p * v)) // p
        return c if fwd else v - c - 1

    ops = [([], [], [] if first else [(prv, "f")])]  # the initial recv_forward
    for k in range(warm):
        c = chunk(k, True)
        sends = [] if (last and c == v - 1) else [(nxt, "f")]
        recv_prev = not (first and chunk(k + 1, True) == 0) and k != n - 1
        recvs = [(prv, "f")] if recv_prev else []
        if k == warm - 1 and warm < n and not last:
            recvs = recvs + [(nxt, "b")]
        ops.append(([("F", c)], sends, recvs))
    rest = n - warm
    for k in range(rest):
        cf, cb = chunk(k + warm, True), chunk(k, False)
        sends = ([] if (last and cf == v - 1) else [(nxt, "f")]) + \
            ([] if (first and cb == 0) else [(prv, "b")])
        recv_prev = not (first and chunk(k + warm - (p - 1), True) == v - 1)
        recv_next = not (last and chunk(k - (p - 1), False) == 0)
        if k == rest - 1:
            recv_prev = False
        recvs = ([(prv, "f")] if recv_prev else []) + ([(nxt, "b")] if recv_next else [])
        ops.append(([("F", cf), ("B", cb)], sends, recvs))
    for k in range(rest, n):
        cb = chunk(k, False)
        sends = [] if (first and cb == 0) else [(prv, "b")]
        recv_next = not (last and chunk(k + 1, False) == v - 1) and k != n - 1
        ops.append(([("B", cb)], sends, [(nxt, "b")] if recv_next else []))
    return ops


def iteration_time(p: int, v: int, m: int, x: float = 0.0, extra_last: float = 0.0) -> float:
    """Time of one iteration in chunk-forward units (backward 2): every exchange completes at the
    latest posting among it and its matched partners, plus ``x``."""
    ops = [rank_ops(r, p, v, m) for r in range(p)]
    sends, recvs = defaultdict(list), defaultdict(list)
    for r in range(p):
        for i, (_, s, rc) in enumerate(ops[r]):
            for q, kind in s:
                sends[(r, q, kind)].append(i)
            for q, kind in rc:
                recvs[(q, r, kind)].append(i)
    partners = [defaultdict(list) for _ in range(p)]
    for key in set(sends) | set(recvs):
        assert len(sends[key]) == len(recvs[key]), key  # the schedule's sends and receives pair
        src, dst, _ = key
        for a, b in zip(sends[key], recvs[key]):
            partners[src][a].append((dst, b))
            partners[dst][b].append((src, a))
    post = [[None] * len(o) for o in ops]
    done = [[None] * len(o) for o in ops]
    at = [0] * p

    def work(r, w):
        t = sum(1.0 if kind == "F" else 2.0 for kind, _ in w)
        return t + sum(extra_last * (1 if kind == "F" else 2) for kind, c in w
                       if r == p - 1 and c == v - 1)
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while at[r] < len(ops[r]):
                i = at[r]
                if post[r][i] is None:
                    post[r][i] = (done[r][i - 1] if i else 0.0) + work(r, ops[r][i][0])
                peers = partners[r][i]
                if any(post[q][j] is None for q, j in peers):
                    break
                done[r][i] = max([post[r][i]] + [post[q][j] for q, j in peers]) + \
                    (x if peers else 0.0)
                at[r] += 1
                moved = True
    assert all(at[r] == len(ops[r]) for r in range(p)), "deadlock"
    return max(done[r][-1] for r in range(p))


def overhead_steps(p: int, v: int, m: int, **kw) -> float:
    """Iteration time minus ``m v`` chunk steps of forward + backward, in chunk steps (3 units)."""
    return (iteration_time(p, v, m, **kw) - 3.0 * m * v) / 3.0


if __name__ == "__main__":
    rows = []
    for m in (32, 48, 64, 96, 128, 192):  # MegaScale's micro-batches per replica, p 8, v 6
        rows.append(dict(m=m, balanced=overhead_steps(8, 6, m), theory=7,
                         output_layer=round(overhead_steps(8, 6, m, extra_last=0.21), 2),
                         transfer=round(overhead_steps(8, 6, m, x=0.05), 2)))
    print(json.dumps(rows, indent=1))
