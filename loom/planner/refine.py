"""The second pass of :func:`loom.planner.search.search`: the variants of the evaluated base
space (ZeRO-2 with PP, the other ``--cp-comm-type`` values, ``--recompute-method block``
counts) that could rank among the :data:`REFINE_TOP` fastest fitting layouts, found by branch
and bound (tests/planner/test_planner_search_space.py: the same best layouts as evaluating every
variant), and :func:`cp_types`, the CP types searched at a (t, c).
"""

from __future__ import annotations

import numpy as np

from loom.config import ModelConfig
from loom.planner.context_parallel import CP_COMM_TYPES, a2a_divides
from loom.planner.hardware import Cluster
from loom.planner.layout import KEYS, Options
from loom.planner.moe import DISPATCHERS
from loom.planner.stages import block_recompute_options, max_chunk_layers


def cp_types(model: ModelConfig, cluster: Cluster, opts: Options, t: int, c: int) -> tuple:
    """The CP communication types (codes of CP_COMM_TYPES) searched at (t, c): ``(-1,)``
    without CP; ``opts.cp_comm_type`` alone when set, else every type; a2a types only where
    the heads divide (:func:`loom.planner.context_parallel.a2a_divides`)."""
    if c == 1:
        return (-1,)
    names = (opts.cp_comm_type,) if opts.cp_comm_type else CP_COMM_TYPES
    out = []
    for name in names:
        k_a2a = c if name == "a2a" else (min(c, opts.cp_a2a_size) if opts.cp_a2a_size else
                                         min(c, max(1, cluster.gpus_per_node // t)))
        if name == "a2a+p2p" and (c % k_a2a or k_a2a in (1, c)):  # A x B = c with A, B > 1
            continue  # (A = 1 is p2p, B = 1 is a2a: the same layout twice)
        if a2a_divides(name, model.num_attention_heads, model.num_kv_groups, t, k_a2a):
            out.append(CP_COMM_TYPES.index(name))
    return tuple(out)


REFINE_TOP = 100  # refine() keeps every variant that could rank in this many rows


def _threshold(res: dict) -> float:
    """The time of the REFINE_TOP-th fastest fitting layout (inf with fewer)."""
    t = np.sort(res["time_iteration"][res["fits"]])
    return float(t[REFINE_TOP - 1]) if len(t) >= REFINE_TOP else np.inf


def _row_codes(cols: list) -> np.ndarray:
    """Dense integer ids of the rows of the columns ``cols`` (equal rows, equal ids): the
    column ranks combined one column at a time, re-densified after each."""
    code = np.zeros(len(cols[0]), dtype=np.int64)
    for col in cols:
        r = np.unique(col, return_inverse=True)[1].reshape(-1)
        code = np.unique(code * (int(r.max(initial=0)) + 1) + r, return_inverse=True)[1]
        code = code.reshape(-1)
    return code


def _rows(res: dict, idx: np.ndarray, **set_to) -> dict:
    """Layout rows ``idx`` of an evaluation (keys and ``split``), some columns set."""
    out = {k: res[k][idx].copy() for k in KEYS}
    if res.get("split") is not None:
        out["split"] = res["split"][idx]
    for k, v in set_to.items():
        out[k] = np.broadcast_to(np.asarray(v, np.float64), idx.shape).copy()
    return out


def refine(model: ModelConfig, cluster: Cluster, res: dict, opts: Options | None,
           kind: str, global_batch_size: int, seq_length: int, evaluate) -> dict | None:
    """The variants of the evaluated rows that :func:`search` evaluates second, only where
    they could rank among the REFINE_TOP fastest fitting layouts (branch and bound: a lower
    bound of the variant's time below that row's time). ``kind`` ``"zero2"``: ZeRO-2 of the
    ZeRO-1 rows with PP (bound: the row's time less its DP exposure); ``"cp"``: the other
    ``--cp-comm-type`` values of rows with CP (bound: the row's time less its CP
    communication, the bubble's share of it and the straggler wait);
    ``"block"``: ``--recompute-method block`` counts of fitting full-recompute rows (bound:
    the same layout without recompute, less its exposed DP time, which recompute can only
    hide more of; where recompute is fixed to full those layouts are evaluated with
    ``evaluate``, :func:`loom.planner.search.evaluate`); ``"disp"``: the allgather twins of
    the searched alltoall rows at EP > 1 that do not fit (allgather moves at least the
    all-to-all's bytes, ``e (1 + k) / 2k`` times them, so it is never faster; under loom's
    runtime it keeps ``e S k r w`` bytes less per MoE layer, :mod:`loom.planner.moe`; bound: the
    alltoall row's time). None when nothing qualifies."""
    opts = opts or Options()
    thr = _threshold(res)
    parts = []
    if kind == "zero2" and opts.max_zero_stage >= 2:
        # ZeRO-2 with PP: the same compute as ZeRO-1, more DP traffic (m reduce-scatters)
        bound = res["time_iteration"] - res["time_dp_comm"] - res["time_straggler"]
        cand = np.nonzero((res["zero"] == 1) & (res["pp"] > 1) & (bound < thr)
                          & (res["ep"] == 1))[0]
        parts.append(_rows(res, cand, zero=2))
    if kind == "cp" and opts.cp_comm_type is None:
        # the slowest stage sheds at most its CP time per micro-batch, the bubble (p - 1) of
        # that; DP exposure does not depend on CP (the backward it hides behind has none)
        m = res["m"]
        bound = (res["time_iteration"] - res["time_cp_comm"] * (1 + (res["pp"] - 1) / m)
                 - res["time_straggler"])
        cand = np.nonzero((res["cp"] > 1) & (bound < thr) & (res["cpt"] == 0))[0]
        tc = np.stack([res["tp"][cand], res["cp"][cand]], axis=1)
        for (t, c) in {tuple(x) for x in tc}:
            at = cand[(tc[:, 0] == t) & (tc[:, 1] == c)]
            for code in cp_types(model, cluster, opts, int(t), int(c))[1:]:
                parts.append(_rows(res, at, cpt=code))
    if kind == "block":
        rc, rcl = res["recompute"], res["rcl"]
        cols = [res[k] for k in KEYS if k not in ("recompute", "rcl")]
        if res.get("split") is not None:
            cols.append(np.array([id(x) for x in res["split"]], dtype=np.float64))
        inv = _row_codes(cols)
        none_t = np.full(inv.max(initial=0) + 1, np.inf)
        base = rc == 0
        none_t[inv[base]] = (res["time_iteration"] - res["time_dp_comm"])[base]
        full = np.nonzero((rc == 2) & (rcl == 0) & res["fits"])[0]
        missing = full[~base[full] & np.isinf(none_t[inv[full]])]
        if len(missing):  # recompute fixed to full: its layouts without recompute, for the bound
            ev = evaluate(model, _rows(res, missing, recompute=0), global_batch_size,
                          seq_length, cluster, opts)
            none_t[inv[missing]] = ev["time_iteration"] - ev["time_dp_comm"]
        cand = full[none_t[inv[full]] < thr]
        from loom.planner.stage_table import layout_of_row
        by_n: dict = {}
        split = res.get("split")
        for i in cand:
            n = (max(layout_of_row(model, res, int(i)).counts())
                 if split is not None and split[i] is not None else
                 max_chunk_layers(model.num_layers, *(int(res[k][i]) for k in
                                                      ("pp", "vp", "lf", "ll"))))
            by_n.setdefault(n, []).append(i)
        for n, rows in by_n.items():
            for k in block_recompute_options(n):
                parts.append(_rows(res, np.asarray(rows), rcl=k))
    if kind == "disp":
        a2a, ag = DISPATCHERS.index("alltoall"), DISPATCHERS.index("allgather")
        cand = np.nonzero((res["disp"] == a2a) & (res["ep"] > 1) & ~res["fits"]
                          & (res["time_iteration"] < thr))[0]
        parts.append(_rows(res, cand, disp=ag))
    parts = [p for p in parts if len(p["tp"])]
    if not parts:
        return None
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
