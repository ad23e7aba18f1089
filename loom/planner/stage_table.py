"""Pipeline stages of a layout, rank by rank: the layers each pipeline rank holds (by kind), and
how many micro-batches of each of its chunks it holds at its memory peak, per schedule.

A layout row's split is a :class:`~loom.config.pipeline_layout.PipelineLayout` (Megatron's
``--pipeline-model-parallel-layout``: any number of layers on every virtual stage), given in the
row's optional ``split`` entry (an object array) or derived from ``pp, vp, lf, ll, zb``
(:func:`row_layout`). The memory and time models evaluate one *slot* per distinct stage: a rank's
layers and one of its peak held-micro-batch vectors (:func:`stage_slots`); the memory of a
layout is the largest slot's, its micro-batch time the slowest slot's.

Micro-batches held (activations kept from a chunk's forward to the end of its backward, W
included for the zero-bubble schedules), rank ``r`` of ``p``, ``m`` micro-batches, ``v`` chunks
(:func:`held_microbatches`; tests/planner/test_planner_vp_group.py replays loom's op lists,
``loom.parallel.pipeline.schedules`` / ``zero_bubble``, and finds the same peaks):

* GPipe: ``m``; 1F1B: ``min(p - r, m)`` (PipeDream-Flush, Narayanan et al. 2021 sec 2.2);
* ZB-H1: ``min(p, m)`` on every rank (W lags B by ``r`` micro-batches on rank ``r``; Qi et al.
  2024 sec 3.1), counted as whole micro-batches although after B only W's inputs remain;
* interleaved, micro-batch groups of ``N`` (``--microbatch-group-size-per-virtual-pipeline-
  stage``, default p; Megatron-Core's ``get_schedule_table``: each group of N micro-batches runs
  through chunk 0, then chunk 1, ..., the last group holding the ``m mod N`` left over; backward
  ``k`` runs the mirror chunk of forward ``k``), ``w = min(2 (p - r - 1) + (v - 1) N, m v)``
  warm-up forwards (Megatron-Core's ``get_pp_rank_microbatches``, m = p included, as loom's op
  list runs it): every steady-state
  step's held counts per chunk, the non-dominated ones kept (with uneven chunks the peak depends
  on which chunks are in flight). A larger N holds more: rank r's warm-up grows by
  ``(v - 1)(N - p)`` chunk micro-batches;
* ZB-V: loom's op list (:func:`loom.parallel.pipeline.zero_bubble.zbv_ops`) replayed.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from loom.config import ModelConfig
from loom.config.pipeline_layout import (LayoutError, PipelineLayout, layout_from_counts,
                                           rank_counts_to_chunks)

GPIPE, ONE_F_ONE_B, ZB_H1, ZB_V = "gpipe", "1f1b", "zb-h1", "zbv"


def schedule_name(zb: int, v: int) -> str:
    """The schedule of layout code ``zb`` (:data:`loom.planner.layout.SCHEDULES`) at ``v``
    chunks: ``"1f1b"`` (``"interleaved"`` when v > 1), ``"zb-h1"``, ``"zbv"``, ``"gpipe"``."""
    return {1: ZB_H1, 2: ZB_V, 3: GPIPE}.get(int(zb), "interleaved" if v > 1 else ONE_F_ONE_B)


def group_size_ok(m: int, p: int, group=None) -> bool:
    """Whether the interleaved schedule takes micro-batch groups of ``group`` N (None or 0: p)
    at ``m`` micro-batches and pipeline size ``p``: ``p <= N <= m`` and ``m mod N`` 0 or at
    least p (Megatron-Core's rules, :func:`loom.config.pipeline.check_microbatch_groups`)."""
    n = int(group or p)
    return p <= n <= m and not 0 < m % n < p


def chunk_table(m: int, v: int, group: int) -> np.ndarray:
    """Chunk of each of the ``m v`` forwards of the interleaved order (micro-batch groups of
    ``group``; the module docstring)."""
    return np.concatenate([np.repeat(np.arange(v), min(group, m - lo))
                           for lo in range(0, m, group)])


@lru_cache(maxsize=4096)
def held_microbatches(schedule: str, p: int, m: int, v: int, rank: int, group=None) -> tuple:
    """Peak micro-batches held per chunk of pipeline rank ``rank``: a tuple of the
    non-dominated vectors ``(held chunk 0, ..., held chunk v-1)`` (one vector when the chunks
    are interchangeable). ``group``: the interleaved schedule's micro-batch group N (None or 0:
    p; the search plans only those :func:`group_size_ok` accepts, as loom train runs only
    those, but any N >= 1 is evaluated, e.g. a published layout's). See the module docstring
    for each schedule."""
    p, m, v, r = int(p), int(m), int(v), int(rank)
    if p == 1:
        return ((1,) * v,) if schedule != GPIPE else ((m,),)
    if schedule == GPIPE:
        return ((m,),)
    if schedule == ONE_F_ONE_B:
        return ((min(p - r, m),),)
    if schedule == ZB_H1:
        return ((min(p, m),),)
    if schedule == ZB_V:
        return _replay_zbv(p, m, r)
    n = int(group or p)  # interleaved
    total = m * v
    warm = min(2 * (p - r - 1) + (v - 1) * n, total)  # schedules.interleaved_ops' warm-up
    if warm >= total:
        return ((m,) * v,)
    # done[k, j]: forwards of chunk j among the first k of the order; backward k runs the
    # mirror chunk v - 1 - c of forward k, so backwards of chunk j = done[k, v - 1 - j]
    done = np.zeros((total + 1, v), dtype=np.int64)
    done[1:] = np.cumsum(np.eye(v, dtype=np.int64)[chunk_table(m, v, n)], axis=0)
    k = np.arange(total - warm)  # steady step k: forward warm + k done, backward k not yet
    held = done[warm + k + 1] - done[k][:, ::-1]
    return _non_dominated(held)


def _undominated(rows: np.ndarray) -> np.ndarray:
    """Mask of the rows of ``rows`` (distinct, integer matrix) that no other row dominates
    componentwise."""
    ge = np.all(rows[:, None, :] >= rows[None, :, :], axis=2)  # ge[j, i]: row j >= row i
    np.fill_diagonal(ge, False)
    return ~ge.any(axis=0)


def _non_dominated(held) -> tuple:
    """The rows of ``held`` (integer matrix) not dominated componentwise by another row, as
    tuples, largest sum first."""
    rows = np.unique(np.asarray(held, dtype=np.int64).reshape(len(held), -1), axis=0)
    rows = rows[_undominated(rows)]
    rows = rows[np.argsort(-rows.sum(axis=1), kind="stable")]
    return tuple(tuple(int(x) for x in row) for row in rows)


def _replay_zbv(p: int, m: int, rank: int) -> tuple:
    """ZB-V's held vectors from loom's op list; ``m`` capped at ``4 p`` (the peak is reached in
    the warm-up and the first steady steps; the test checks larger m give the same)."""
    from loom.parallel.pipeline.zero_bubble import zbv_ops
    ops = zbv_ops(min(m, 4 * p), p, rank)
    has_w = {(c, j) for kind, c, j in ops if kind == "W"}
    held, rows = [0, 0], []
    for kind, c, j in ops:
        if kind == "F":
            held[c] += 1
            rows.append(tuple(held))
        elif kind == "W" or (kind == "B" and (c, j) not in has_w):
            held[c] -= 1
    return _non_dominated(np.asarray(rows))


def middle_counts(num_layers: int, n: int) -> list[int]:
    """``L`` layers over ``n`` middle ranks as evenly as possible, the ``L mod n`` heavier ranks
    last (later ranks hold fewer micro-batches in flight)."""
    if n <= 0:
        return []
    q, r = divmod(num_layers, n)
    return [q] * (n - r) + [q + 1] * r


def balanced_counts(num_layers: int, pp: int) -> list[int]:
    """``L`` layers over ``p`` ranks as evenly as possible (sizes ``q = L div p`` and ``q + 1``):
    the first and the last rank (embedding, most micro-batches in flight; output layer and loss)
    hold ``q`` while the ``L mod p`` extra layers fit the middle ranks, the heavier middle ranks
    last (:func:`middle_counts`); 28 layers over 16 ranks: ``1+1+1+12x2+1``."""
    q, r = divmod(num_layers, pp)
    if pp <= 2:
        return [q] * (pp - 1) + [q + r] if pp == 2 else [num_layers]
    if r <= pp - 2:
        return [q] + middle_counts(num_layers - 2 * q, pp - 2) + [q]
    return [q] + [q + 1] * (pp - 2) + [q + 1]


def row_layout(num_layers: int, pp: int, vp: int, lf: int, ll: int, zb: int,
               mtp_layers: int = 0) -> PipelineLayout:
    """The layout of a row without a ``split``: ``lf = ll = 0`` the even split (``L / p``;
    :func:`balanced_counts` when p does not divide L), else ``lf`` / ``ll`` layers on the first /
    last rank and the rest over the middle ranks by :func:`middle_counts`; each rank's layers over ``vp`` chunks by
    :func:`~loom.config.pipeline_layout.rank_counts_to_chunks`; ZB-V (``zb`` 2) its V."""
    pp, vp, lf, ll = int(pp), max(1, int(vp)), int(lf), int(ll)
    if pp == 1:
        return layout_from_counts([num_layers] * 1 if vp == 1 else
                                  rank_counts_to_chunks([num_layers], vp), 1, mtp_layers)
    if int(zb) == 2 and vp == 2 and not lf and num_layers % (2 * pp) == 0:
        return layout_from_counts([num_layers // (2 * pp)] * (2 * pp), pp, mtp_layers, True)
    if lf or ll:
        if pp == 2:
            counts = [lf or num_layers - ll, ll or num_layers - lf]
        else:
            counts = [lf] + middle_counts(num_layers - lf - ll, pp - 2) + [ll]
    else:
        counts = balanced_counts(num_layers, pp)
    if sum(counts) != num_layers or min(counts) < 0:
        raise LayoutError(f"first {lf} / last {ll} layers do not fit {num_layers} layers on "
                          f"{pp} stages")
    return layout_from_counts(rank_counts_to_chunks(counts, vp), pp, mtp_layers)


def layer_kinds(model: ModelConfig) -> tuple[tuple[str, ...], list[int]]:
    """``(kind names, kind index of every layer)``: one kind for a dense model, ``("dense",
    "moe")`` for MoE, the hybrid pattern's ``("M", "*", "-")`` for Mamba / hybrid stacks."""
    from loom.planner.mamba import KINDS, is_hybrid, layer_pattern
    if is_hybrid(model):
        return KINDS, [KINDS.index(ch) for ch in layer_pattern(model)]
    if model.num_experts:
        return ("dense", "moe"), [int(model.is_moe_layer(i)) for i in range(model.num_layers)]
    return ("dense",), [0] * model.num_layers


def _rank_candidates(lay: PipelineLayout, kinds: tuple, n_kinds: int, schedule: str,
                     m: int, nrc: int = 0, group: int = 0) -> list[dict]:
    """Slot candidates of every rank: its layers per kind, whether it holds the embedding
    (``emb``) / the output layer and loss (``out``), its MTP layers (``mtp``), and for each of
    its peak held vectors the layer-micro-batches held per kind (``held``), the micro-batches
    of the embedding's / the loss's / the MTP layers' activations held (``emb_held``,
    ``out_held``, ``mtp_held``), and of those the fully recomputed ones (``layers_rc``,
    ``held_rc``: the first ``nrc`` layers of every chunk, Megatron's block method; MTP layers
    with the rest when every layer is); candidates dominated by another of the same stage
    content (same layers, ends and MTP) are dropped. ``group``: the interleaved schedule's
    micro-batch group N (0: p)."""
    vs = lay.virtual_stage_layers()
    kinds_arr = np.asarray(kinds, dtype=np.int64)
    groups: dict = {}
    for r in range(lay.pp):
        chunks = lay.rank_chunks(r)
        # per chunk: layers of each kind, then E, L, MTP layers (matrix v x (K + 3))
        K = n_kinds
        C = np.zeros((len(chunks), 2 * K + 3), dtype=np.int64)
        for i, j in enumerate(chunks):
            if vs[j]:
                C[i, :K] = np.bincount(kinds_arr[vs[j]], minlength=K)
                C[i, K + 3:] = np.bincount(kinds_arr[vs[j][:nrc]], minlength=K)
            st = lay.stages[j]
            C[i, K:K + 3] = ("E" in st, "L" in st, st.count("m"))
        tot = C.sum(axis=0)
        content = (tuple(int(x) for x in tot[:K]), int(tot[K] > 0), int(tot[K + 1] > 0),
                   int(tot[K + 2]), tuple(int(x) for x in tot[K + 3:]))
        H = np.asarray(held_microbatches(schedule, lay.pp, m, len(chunks), r, group or None),
                       dtype=np.int64)
        groups.setdefault(content, []).append((H @ C, r))
    out = []
    for (layers, emb, end, mtp, layers_rc), mems in groups.items():
        allm = np.concatenate([mm for mm, _ in mems])
        ranks = np.concatenate([[r] * len(mm) for mm, r in mems])
        # the first (lowest) rank of each distinct memory row, then the undominated ones
        _, first = np.unique(allm[np.argsort(ranks, kind="stable")], axis=0, return_index=True)
        first = np.argsort(ranks, kind="stable")[first]
        first = first[_undominated(allm[first])]
        for i in first[np.lexsort((ranks[first], -allm[first].sum(axis=1)))]:
            mem = [int(x) for x in allm[i]]
            out.append(dict(rank=int(ranks[i]), layers=layers, emb=emb, out=end, mtp=mtp,
                            held=tuple(mem[:n_kinds]), emb_held=mem[n_kinds],
                            out_held=mem[n_kinds + 1], mtp_held=mem[n_kinds + 2],
                            layers_rc=layers_rc, held_rc=tuple(mem[n_kinds + 3:])))
    return out


SLOT_SCALARS = ("rank", "emb", "out", "mtp", "emb_held", "out_held", "mtp_held")
SLOT_KINDS = ("layers", "held", "layers_rc", "held_rc")
_SCHED_CODES = (ONE_F_ONE_B, "interleaved", ZB_H1, ZB_V, GPIPE)


def _sched_codes(zb, vp) -> np.ndarray:
    """Index into ``_SCHED_CODES`` of every row (:func:`schedule_name`, vectorized)."""
    zb = np.asarray(zb)
    return np.select([zb == 1, zb == 2, zb == 3, vp > 1], [2, 3, 4, 1], 0)


def _m_keys(code: np.ndarray, p: np.ndarray, m: np.ndarray, group=None) -> np.ndarray:
    """A micro-batch count with the same held vectors as ``m`` (module docstring: 1F1B and ZB-H1
    saturate at p, ZB-V's replay at 4p; the interleaved schedule with groups of N (``group``, 0:
    p) at ``3 N + m mod N``: past three groups every steady step's vector repeats one of the
    first groups', tests/planner/test_planner_vp_group.py checks it)."""
    m = np.round(m)
    n = p if group is None else np.where(np.asarray(group) > 0, group, p)
    inter = np.where(m >= 4 * n, 3 * n + np.mod(m, n), m)
    return np.select([code == 0, code == 2, code == 1, code == 3],
                     [np.minimum(m, p), np.minimum(m, p), inter, np.minimum(m, 4 * p)], m)


@lru_cache(maxsize=4096)
def _cached_candidates(lay: PipelineLayout, kinds: tuple, n_kinds: int, schedule: str,
                       m: int, nrc: int, group: int = 0) -> tuple:
    return tuple(_rank_candidates(lay, kinds, n_kinds, schedule, m, nrc, group))


ALL_LAYERS = 1 << 20  # "every layer of the chunk" for the recompute count


def recomputed_per_chunk(L: dict) -> np.ndarray:
    """Layers per chunk fully recomputed on every row: 0 without full recompute, the
    ``rcl`` of ``--recompute-method block``, or every layer (``rcl`` 0: uniform 1)."""
    rc = np.asarray(L["recompute"])
    rcl = np.asarray(L.get("rcl", 0 * rc))
    return np.where(rc == 2, np.where(rcl > 0, rcl, ALL_LAYERS), 0).astype(np.int64)


def stage_slots(model: ModelConfig, L: dict, m, legacy_warmup: bool = False) -> dict:
    """The stage slots of every row of ``L`` (``m``: micro-batches per row), as arrays of shape
    ``(R, N)`` (R the most slots of any row; rows with fewer repeat their slot 0):
    ``rank``, ``emb``, ``out``, ``mtp``, ``emb_held``, ``out_held``, ``mtp_held`` and
    ``layers`` / ``held`` and their recomputed parts ``layers_rc`` / ``held_rc`` (the row's
    :func:`recomputed_per_chunk`) of shape ``(K, R, N)`` per layer kind (:func:`layer_kinds`),
    plus ``kinds`` (names), ``pp`` and ``mtp_rc`` (N,: 1 when MTP layers are recomputed).
    An optional ``L["vpg"]`` holds each row's interleaved micro-batch group
    (``--microbatch-group-size-per-virtual-pipeline-stage``; 0 or absent: p).
    ``legacy_warmup``: the interleaved schedule of Megatron-LM before 2024-11 (merge request
    !2117, commit 4295be1a6c, removed the rule): at ``m = p`` every rank runs all ``m v``
    forwards before its first backward (``Options.legacy_interleaved_warmup``; the published
    runs of that software)."""
    from loom.planner.mla import mtp_depth
    from loom.planner.mamba import is_hybrid
    names, kinds = layer_kinds(model)
    kinds = tuple(kinds)
    K = len(names)
    mtp = 0 if is_hybrid(model) else mtp_depth(model)
    N = len(L["pp"])
    m = np.broadcast_to(np.asarray(m, dtype=np.float64), (N,))
    split = L.get("split")
    objs: dict = {}
    by_id: dict = {}
    sid = np.zeros(N, dtype=np.int64)
    if split is not None:
        for i, obj in enumerate(split):
            if obj is not None:
                if id(obj) not in by_id:
                    by_id[id(obj)] = objs.setdefault(obj, len(objs) + 1)
                sid[i] = by_id[id(obj)]
    zb = np.asarray(L.get("zb", np.zeros(N)), dtype=np.int64)
    pp, vp = np.asarray(L["pp"], np.int64), np.asarray(L["vp"], np.int64)
    code = _sched_codes(zb, vp)
    grp = np.where(code == 1, np.asarray(L.get("vpg", np.zeros(N)), np.int64), 0)
    if legacy_warmup:  # all m v forwards first at m = p: one group of m v (warm-up = all)
        m_int = np.round(m).astype(np.int64)
        grp = np.where((code == 1) & (m_int == pp), m_int * vp, grp)
    mk = _m_keys(code, pp, m, grp).astype(np.int64)
    lf, ll = np.asarray(L["lf"], np.int64), np.asarray(L["ll"], np.int64)
    nrc = recomputed_per_chunk(L)
    nrc_code = np.unique(nrc, return_inverse=True)[1].reshape(-1)
    split_code = ((((sid * 4096 + pp) * 256 + vp) * 1024 + lf) * 1024 + ll) * 8 + code
    split_code = np.unique(np.stack([split_code, grp], axis=1), axis=0,
                           return_inverse=True)[1].reshape(-1)
    u1, inv1 = np.unique(split_code, return_inverse=True)
    key = inv1.reshape(-1) * (int(mk.max(initial=0)) + 1) + mk
    key = np.unique(key, return_inverse=True)[1].reshape(-1) * (int(nrc_code.max(initial=0))
                                                                + 1) + nrc_code
    u2, inv = np.unique(key, return_inverse=True)
    inv = inv.reshape(-1)
    first = np.zeros(len(u2), dtype=np.int64)
    first[inv[::-1]] = np.arange(N)[::-1]  # a row of every group
    by_obj = {v: k for k, v in objs.items()}
    groups = []
    for i in first:
        sc = _SCHED_CODES[code[i]]
        lay = by_obj[int(sid[i])] if sid[i] else row_layout(model.num_layers, pp[i], vp[i],
                                                             lf[i], ll[i], zb[i], mtp)
        groups.append(_cached_candidates(lay, kinds, K, sc, int(mk[i]), int(nrc[i]),
                                         int(grp[i])))
    R = max(len(g) for g in groups) if groups else 1
    table = {k: np.zeros((R, len(groups))) for k in SLOT_SCALARS}
    per_kind = {k: np.zeros((K, R, len(groups))) for k in SLOT_KINDS}
    for g, cands in enumerate(groups):
        for r in range(R):
            c = cands[r if r < len(cands) else 0]
            for k in SLOT_SCALARS:
                table[k][r, g] = c[k]
            for k in SLOT_KINDS:
                per_kind[k][:, r, g] = c[k]
    out = {k: table[k][:, inv] for k in SLOT_SCALARS}
    out.update({k: v[:, :, inv] for k, v in per_kind.items()})
    out["mtp_rc"] = (nrc >= ALL_LAYERS).astype(np.float64)  # MTP recomputed with every layer
    out["kinds"] = names
    out["pp"] = np.asarray(L["pp"], dtype=np.float64)
    return out


def layout_of_row(model: ModelConfig, L: dict, i: int) -> PipelineLayout:
    """The PipelineLayout of row ``i`` of ``L`` (its ``split``, else :func:`row_layout`)."""
    from loom.planner.mla import mtp_depth
    from loom.planner.mamba import is_hybrid
    split = L.get("split")
    if split is not None and split[i] is not None:
        return split[i]
    zb = L["zb"][i] if "zb" in L else 0
    return row_layout(model.num_layers, L["pp"][i], L["vp"][i], L["lf"][i], L["ll"][i], zb,
                      0 if is_hybrid(model) else mtp_depth(model))


def recomputed_share(model: ModelConfig, L: dict) -> np.ndarray:
    """Share of all transformer layers fully recomputed on every row (1 with full recompute of
    every layer, 0 without; block: ``sum_j min(rcl, n_j) / L`` over the virtual stages)."""
    nrc = recomputed_per_chunk(L)
    out = np.where(nrc >= ALL_LAYERS, 1.0, 0.0)
    block = np.nonzero((nrc > 0) & (nrc < ALL_LAYERS))[0]
    if not len(block):
        return out
    split = L.get("split")
    sid = np.array([0 if split is None or split[i] is None else id(split[i]) for i in block],
                   dtype=np.float64)
    keys = np.stack([sid] + [np.asarray(L[k], np.float64)[block]
                             for k in ("pp", "vp", "lf", "ll", "zb")] + [nrc[block]], axis=1)
    _, first, inv = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    share = np.array([sum(min(int(nrc[block[i]]), n)
                          for n in layout_of_row(model, L, int(block[i])).counts())
                      for i in first]) / model.num_layers
    out[block] = share[inv.reshape(-1)]
    return out


def stage_layers(num_layers: int, L: dict) -> tuple:
    """Transformer layers ``(first, middle, last)`` per pipeline stage (arrays): the first
    rank's, the largest middle rank's (with ``p <= 2`` the larger of the two ends, so that it
    never decides a maximum) and the last rank's, of the row's split
    (:func:`layout_of_row`: ``lf = ll = 0`` the even split, balanced
    when p does not divide L; Llama 3 405B's 7 + 14 x 8 + 7 from ``lf = ll = 7``)."""
    split = L.get("split")
    keys = np.stack([L["pp"], L["vp"], L["lf"], L["ll"], L.get("zb", 0 * L["pp"])], axis=1)
    out = np.zeros((len(keys), 3))
    for i, key in enumerate(keys):
        lay = (split[i] if split is not None and split[i] is not None
               else row_layout(num_layers, *key))
        c = lay.rank_layer_counts()
        mid = max(c[1:-1]) if len(c) > 2 else max(c[0], c[-1])
        out[i] = (c[0], mid, c[-1])
    return out[:, 0], out[:, 1], out[:, 2]
