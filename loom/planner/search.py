"""Search: enumerate every valid layout, evaluate the memory and time models on all of them in one
vectorized numpy pass, keep those that fit, rank by predicted iteration time.

Search space: TP ``t`` (divides heads, query groups, FFN; within a node unless allowed), PP ``p``
(``p <= L``; when ``p`` does not divide L, the uneven first/last-stage splits of
:mod:`loom.planner.stages`, without interleaving unless ``Options.uneven_interleaved``), CP
``c`` (``s`` divisible by ``2c``), DP ``d = n / (t p c)`` (divides B), virtual
stages ``v`` (divides L/p; interleaving needs Megatron-Core's micro-batch groups of ``N``
(default ``p``): ``p <= N <= m`` and ``m mod N`` 0 or ``>= p``; ``N`` is searched only at its
default, which no larger ``N`` beats in the model: same bubble, more micro-batches held),
micro-batch ``b`` (divides B/d), recompute none/selective/full, sequence parallel (with t > 1 and
``t c`` dividing s; MoE models with t > 1 only with it, Megatron-Core's rule: :func:`sp_options`),
ZeRO stage 0-3 (with d c > 1; stage 1 = Megatron distributed optimizer; stages 2-3 only
without PP), and for MoE models expert TP ``u`` and EP ``e`` (u divides t, u e divides t c d, e
divides E; CP with dropless routing; :func:`_moe_rules`); Mamba / hybrid
models: t divides the Mamba heads and groups and the heads / FFN of the kinds present, no CP with
Mamba layers (:func:`loom.planner.mamba.tp_divides`, :func:`loom.planner.mamba.refuses_cp`;
a given ``--context-parallel-size`` > 1 is refused with a ConfigError). The rules are
those of
:meth:`loom.config.LoomConfig.validate`. Any dimension given in ``fixed`` is held at that value;
``fixed`` may also carry the split constraints ``first_layers`` / ``last_layers``
(``--decoder-first/last-pipeline-num-layers``) and ``account_embedding`` / ``account_loss``
(``--account-for-embedding/loss-in-pipeline-split``) and ``vpg``
(``--microbatch-group-size-per-virtual-pipeline-stage``: the interleaved rows' micro-batch
group, carried as the column ``L["vpg"]``, :func:`loom.planner.stage_table.stage_slots`).
"""

from __future__ import annotations

import itertools
from typing import get_args

import numpy as np

from loom.config import ConfigError, ModelConfig
from loom.config.sections import PipelineSchedule
from loom.planner.hardware import GB, Cluster
from loom.planner.layout import KEYS, RECOMPUTE, SCHEDULES, Options, num_microbatches
from loom.planner.context_parallel import CP_COMM_TYPES, a2a_ranks
from loom.planner.mamba import check_supported, is_hybrid, refuses_cp, tp_divides
from loom.planner.memory import memory_terms
from loom.planner.moe import DISPATCHERS, expert_tp
from loom.planner.refine import REFINE_TOP, cp_types, refine  # noqa: F401 - REFINE_TOP
from loom.planner.stage_table import group_size_ok, recomputed_share, stage_slots
from loom.planner.stages import (accounted_split, block_recompute_options, describe_counts,
                                 given_split, interleave_options, max_chunk_layers,
                                 search_splits)
from loom.planner.flops import throughput
from loom.planner.timing import time_terms

MEMORY_TERMS = ("weights", "gradients", "optimizer", "activations", "embedding_output", "reserve")
TIME_TERMS = ("compute", "recompute", "elementwise", "tp_comm", "cp_comm", "ep_comm", "pp_bubble",
              "pp_comm", "dp_comm", "optimizer", "straggler")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _moe_rules(model: ModelConfig, t: int, c: int, d: int) -> list[tuple[int, int]] | None:
    """``(u, e)`` expert TP and EP sizes allowed at (t, c, d) for an MoE model, None when
    (t, c) is refused; ``[(0, 1)]`` for a dense model (no expert grid). loom train's rules,
    exactly (``loom/config/validate.py::_check_moe``, Megatron's expert grid ``u x e x
    expert-DP = t c d``; ``tests/planner/test_planner_moe_sp_cp.py`` checks them against loom's
    validation on a grid): u divides t and the expert width, ``u e`` divides ``t c d``, e
    divides E; the shared expert splits over TP (its width divisible by t); CP only with
    dropless routing (no ``--moe-expert-capacity-factor``: a capacity per sequence shard would
    drop other tokens than one rank). At u = t this is e dividing ``c d``; at u < t EP may also
    span the TP ranks. Biases under TP are loom train's too (``AddBias``: only expert-TP rank 0
    adds FC2's). Sequence parallelism: :func:`sp_options`."""
    if not model.num_experts:
        return [(0, 1)]
    if (model.moe_shared_expert_intermediate_size or 0) % t or (
            c > 1 and model.moe_expert_capacity_factor is not None):
        return None
    return [(u, e) for u in _divisors(t) if model.moe_ffn_size % u == 0
            for e in _divisors(t * c * d // u) if model.num_experts % e == 0]


def sp_options(model: ModelConfig, t: int, c: int, seq_length: int, given=None) -> tuple:
    """The sequence-parallel settings searched at TP ``t``, CP ``c``: none at t = 1 or when
    ``t c`` does not divide the sequence (loom train's ``--sequence-parallel`` rule,
    ``loom/config/validate.py``); off and on for a dense model; for an MoE model on only, since
    Megatron-Core refuses MoE training with TP > 1 without SP (``megatron/core/transformer/
    moe/moe_layer.py``, ``MoELayer.forward`` raises a ValueError in training when the attention
    TP group is larger than 1 and ``sequence_parallel`` is off) -- unless ``given`` is 0 (a loom train run's own layout, which loom accepts:
    ``loom.planner.predict``)."""
    if t == 1:
        return (0,)
    sp_ok = seq_length % (t * c) == 0
    if model.num_experts and given != 0:
        return (1,) if sp_ok else ()
    return (0, 1) if sp_ok else (0,)


def _given_layout(model: ModelConfig, text: str, pp):
    """The ``--pipeline-model-parallel-layout`` string parsed at ``--pipeline-model-parallel-
    size`` (required) and checked against the model; ConfigError naming the flag otherwise."""
    from loom.config import ConfigError
    from loom.config.pipeline_layout import LayoutError, parse_layout
    if not pp:
        raise ConfigError("--pipeline-model-parallel-layout needs --pipeline-model-parallel-size "
                          "(the layout's stages are p x v virtual stages)")
    try:
        return parse_layout(text, int(pp)).validate(model.num_layers, model.mtp_num_layers or 0)
    except LayoutError as e:
        raise ConfigError(f"--pipeline-model-parallel-layout: {e}") from None


def evaluate(model: ModelConfig, L: dict, global_batch_size: int, seq_length: int,
             cluster: Cluster, opts: Options | None = None) -> dict:
    """Memory (``mem_*``, bytes), time (``time_*``, seconds) and throughput of every layout in
    ``L`` (arrays), plus ``fits`` (total memory <= the GPU's HBM) and ``m``."""
    opts = opts or Options()
    slots = stage_slots(model, L, num_microbatches(L, global_batch_size),
                        opts.legacy_interleaved_warmup)
    mem = memory_terms(model, L, global_batch_size, seq_length, opts, slots)
    tim = time_terms(model, L, global_batch_size, seq_length, cluster, opts, slots)
    thr = throughput(model, L, global_batch_size, seq_length, cluster, tim["iteration"],
                     recomputed_share(model, L))
    out = dict(L)
    out.update({f"mem_{k}": v for k, v in mem.items()})
    out.update({f"time_{k}": v for k, v in tim.items()})
    out.update(thr)
    out["m"] = num_microbatches(L, global_batch_size)
    out["num_layers"] = model.num_layers
    out["mtp_layers"] = 0 if is_hybrid(model) else (model.mtp_num_layers or 0)
    out["cp_comm_default"] = opts.cp_comm_type
    out["disp_default"] = model.moe_token_dispatcher_type
    # a2a+p2p: the all-to-all over the CP ranks of a node (context_parallel.cp_layer_cost)
    out["cp_a2a"] = a2a_ranks(cluster.gpus_per_node, L["tp"], L["cp"], opts.cp_a2a_size)
    out["fits"] = mem["total"] <= cluster.hbm_bytes
    return out


def enumerate_layouts(model: ModelConfig, cluster: Cluster, global_batch_size: int,
                      seq_length: int, fixed: dict | None = None, opts: Options | None = None,
                      max_micro_batch: int = 16, variants: bool = True) -> dict:
    """All valid layouts as arrays (see module docstring); ``variants=False``: without the CP
    types other than the default and without block recompute counts (what :func:`search`
    evaluates first, then refines, :func:`refine`). ``fixed`` maps layout keys
    (``tp, pp, cp, dp, vp, mbs, recompute, sp, zero, ep, etp``) to a required value."""
    opts = opts or Options()
    fixed = {k: v for k, v in (fixed or {}).items() if v is not None}
    first, last = fixed.pop("first_layers", None), fixed.pop("last_layers", None)
    acc_e, acc_l = fixed.pop("account_embedding", False), fixed.pop("account_loss", False)
    given = fixed.pop("layout", None)  # --pipeline-model-parallel-layout (a string)
    group = fixed.pop("vpg", None)  # --microbatch-group-size-per-virtual-pipeline-stage
    n, B, s = cluster.num_gpus, global_batch_size, seq_length
    nl = model.num_layers
    check_supported(model, fixed.get("cp"))
    lay = _given_layout(model, given, fixed.get("pp")) if given else None

    def want(k: str, v) -> bool:  # pruning early what _apply_fixed would drop at the end
        return k not in fixed or float(fixed[k]) == float(v)

    base = []
    for t in _divisors(n):
        if not want("tp", t) or not tp_divides(model, t):
            continue
        if t > cluster.gpus_per_node and not opts.allow_tp_across_nodes:
            continue
        for p in _divisors(n // t):
            if "pp" in fixed and p != fixed["pp"]:
                continue
            if lay is not None:
                splits = [(0, 0)] if p == lay.pp else []
            elif first is not None or last is not None:
                splits = [given_split(nl, p, first, last)] if p <= nl else []
            elif acc_e or acc_l:
                splits = [accounted_split(nl, p, acc_e, acc_l)]
            else:
                splits = search_splits(nl, p)
            splits = [sp for sp in splits if sp is not None]
            if not splits:
                continue
            for c in _divisors(n // (t * p)):
                if not want("cp", c) or c > 1 and (s % (2 * c) or refuses_cp(model, c)):
                    continue
                cpts = cp_types(model, cluster, opts, t, c)
                if not cpts:
                    continue
                if not variants:
                    cpts = cpts[:1]
                d = n // (t * p * c)
                eps = _moe_rules(model, t, c, d)
                if B % d or eps is None or not want("dp", d):
                    continue
                eps = [(u, e) for u, e in eps if want("ep", e) and (u == 0 or want("etp", u))]
                for b in _divisors(B // d):
                    if b > max(max_micro_batch, fixed.get("mbs", 0)):
                        break
                    m = B // (b * d)
                    if not want("mbs", b):
                        continue
                    for lf, ll in splits:
                        vs = [1]
                        if lay is not None:  # the given layout decides the chunks
                            vs = [lay.vp] if lay.vp == 1 or group_size_ok(m, p, group) else []
                        elif p > 1 and group_size_ok(m, p, group) and (opts.uneven_interleaved or (
                                not lf and nl % p == 0)):
                            # v chunks per rank; with uneven ranks each rank's layers split
                            # over its chunks as evenly as possible (Megatron's layout string)
                            vs += list(interleave_options(nl, p, lf, ll))
                        vs = [v for v in vs if want("vp", v)
                              and (v > 1 or not fixed.get("interleaved"))]
                        for v, (u, e) in itertools.product(vs, eps):
                            base.append((t, p, d, c, v, b, lf, ll, e, cpts, u))
    rows = []
    zbv_ok = "zbv" in get_args(PipelineSchedule)
    # the MoE dispatcher at EP > 1 (moe.py): the given one, else allgather and alltoall
    disp_given = fixed.get("disp")
    if isinstance(disp_given, str):
        disp_given = DISPATCHERS.index(disp_given)
    for (t, p, d, c, v, b, lf, ll, e, cpts, u) in base:
        # (alltoall first, allgather refined where it could fit and rank: refine.refine)
        disps = ((disp_given,) if disp_given is not None else (0, 1) if variants else (1,)) \
            if e > 1 else (-1,)
        sps = sp_options(model, t, c, s, fixed.get("sp"))
        # ZeRO-2/3 shard gradients/weights per micro-batch: not combined with PP (Megatron's
        # FSDP and DeepSpeed ZeRO-3 do not compose with its pipeline schedules).
        # ZeRO-2 with PP: loom's (Megatron's) gradient buffer reduce-scatters every
        # micro-batch's gradients into the kept shard (timing.py prices m reduce-scatters)
        zs = ((0, 1, 2, 3) if p == 1 else (0, 1, 2) if variants else (0, 1)) \
            if d * c > 1 else tuple({0, fixed.get("zero", 0)})  # a given stage at d c = 1: 0's
        zs = tuple(z for z in zs if z <= max(opts.max_zero_stage, fixed.get("zero", 0)))
        # zero-bubble schedules (Qi et al. 2024): ZB-H1 on one chunk per stage, ZB-V on two
        # (searched when loom train's --pipeline-schedule accepts it, or when it is given)
        # (ZB-H1 where loom train runs it: a split its flags give, not a layout string)
        flag_split = lay is None and (not lf or p <= 2 or (nl - lf - ll) % (p - 2) == 0)
        zbs = (0, 1) if p > 1 and v == 1 and flag_split else (
            (0, 2) if p > 1 and v == 2 and not lf and nl % (2 * p) == 0 and lay is None
            and (zbv_ok or fixed.get("zb") == 2) else (0,))
        if fixed.get("zb") == 3 and p > 1 and v == 1:  # GPipe: only when given
            zbs = (3,)
        # full recompute of every layer (uniform 1) or of the first rcl layers of each chunk
        # (--recompute-method block --recompute-num-layers rcl), the others keeping theirs
        rcs = [(0, 0), (1, 0), (2, 0)] + ([(2, k) for k in block_recompute_options(
            max(lay.counts()) if lay is not None else max_chunk_layers(nl, p, v, lf, ll))]
            if variants else [])
        for (rc, rcl), sp, z, zb, cpt, dsp in itertools.product(rcs, sps, zs, zbs, cpts, disps):
            rows.append((t, p, d, c, v, b, rc, sp, z, lf, ll, e, zb, rcl, cpt, u, dsp))
    arr = np.asarray(rows, dtype=np.float64).reshape(-1, len(KEYS))
    L = {k: arr[:, i].copy() for i, k in enumerate(KEYS)}
    if lay is not None:
        c = lay.rank_layer_counts()
        L["lf"][:], L["ll"][:] = c[0], c[-1]
        L["split"] = np.empty(len(arr), dtype=object)
        L["split"][:] = [lay] * len(arr)
    return _apply_fixed(with_group(L, group), fixed)


def with_group(L: dict, group) -> dict:
    """``L`` with the column ``vpg`` = ``group`` (the interleaved micro-batch group) on every
    row; ``L`` itself when ``group`` is None (the default, p)."""
    if not group:
        return L
    return dict(L, vpg=np.full(len(L["tp"]), float(group)))


def _apply_fixed(L: dict, fixed: dict) -> dict:
    """The rows of ``L`` whose layout keys equal ``fixed``'s values (names of recompute,
    schedule and CP type allowed; other entries ignored)."""
    keep = np.ones(len(L["tp"]), dtype=bool)
    for k, v in fixed.items():
        if k not in KEYS or v is None:
            continue
        if k == "recompute" and isinstance(v, str):
            v = RECOMPUTE.index(v)
        if k == "zb" and isinstance(v, str):
            v = SCHEDULES.index(v)
        if k == "cpt" and isinstance(v, str):
            v = CP_COMM_TYPES.index(v)
        if k == "disp":
            if isinstance(v, str):
                v = DISPATCHERS.index(v)
            keep &= (L[k] == float(v)) | (L[k] < 0)  # -1: no EP, the model's own
            continue
        keep &= L[k] == float(v)
    return {k: vv[keep] for k, vv in L.items()}


def search(model: ModelConfig, cluster: Cluster, global_batch_size: int, seq_length: int,
           fixed: dict | None = None, opts: Options | None = None) -> dict:
    """Evaluate every valid layout; returns the evaluation arrays (see :func:`evaluate`) and
    ``order``: indices of the layouts that fit, fastest first (ties: less memory)."""
    fixed = dict(fixed or {})
    if fixed.get("recompute") in ("full", 2) and fixed.get("rcl") is None:
        fixed["rcl"] = 0  # full recompute given: of every layer unless a block count is
    # a fixed variant (a CP type, a block count, ZeRO-2) is enumerated with the base space;
    # otherwise the variants are refined, only those the fixed keys leave (rcl 0: full
    # recompute of every layer, no block counts; a fixed ZeRO stage: no ZeRO-2 variants)
    exact = fixed.get("cpt") is not None or bool(fixed.get("rcl")) or fixed.get("zero") == 2
    kinds = [k for k in ("zero2", "cp", "block", "disp")
             if not (k == "zero2" and fixed.get("zero") is not None)
             and not (k == "disp" and fixed.get("disp") is not None)
             and not (k == "block" and (fixed.get("rcl") == 0 or fixed.get("recompute")
                                        not in (None, "full", 2)))]
    group = fixed.get("vpg")

    def evaluate_group(model, L, *args, **kw):  # the refined rows carry the fixed group too
        return evaluate(model, with_group(L, group), *args, **kw)

    L = enumerate_layouts(model, cluster, global_batch_size, seq_length, fixed, opts,
                          variants=exact)
    if group and not len(L["tp"]) and len(enumerate_layouts(
            model, cluster, global_batch_size, seq_length,
            {k: v for k, v in fixed.items() if k != "vpg"}, opts, variants=False)["tp"]):
        raise ConfigError(
            f"--microbatch-group-size-per-virtual-pipeline-stage {group}: no layout's "
            f"micro-batch count m = B / (b d) takes groups of N = {group} (Megatron-Core needs "
            f"p <= N <= m and m mod N = 0 or >= p): choose N dividing m, or another "
            f"--global-batch-size / --micro-batch-size")
    res = evaluate_group(model, L, global_batch_size, seq_length, cluster, opts)
    if not exact:
        for kind in kinds:
            more = refine(model, cluster, res, opts, kind, global_batch_size, seq_length,
                          evaluate_group)
            more = None if more is None else _apply_fixed(more, fixed)
            if more is not None and len(more["tp"]):
                new = evaluate_group(model, more, global_batch_size, seq_length, cluster, opts)
                res = {k: (np.concatenate([v, new[k]]) if isinstance(v, np.ndarray)
                           and v.shape[:1] == res["tp"].shape else v) for k, v in res.items()}
    idx = np.nonzero(res["fits"])[0]
    order = idx[np.lexsort((res["mem_total"][idx], res["time_iteration"][idx]))]
    res["order"] = order
    return res


def dominant_parallelism(rec: dict) -> str:
    """The parallelism with the largest degree (ties: tp > pp > cp > dp)."""
    sizes = {"tp": rec["tp"], "pp": rec["pp"], "cp": rec["cp"], "dp": rec["dp"]}
    return max(sizes, key=lambda k: (sizes[k], -list(sizes).index(k)))


def record(res: dict, i: int) -> dict:
    """One layout as a plain dict (the ``--json`` schema): sizes (``ep``: expert-parallel
    size, part of ``dp``), options, ``memory_gb`` and
    ``memory_terms_gb`` (GB = 1e9 bytes), ``time_terms_s`` (seconds), ``iteration_time_s``,
    ``tokens_per_s``, ``tflops_per_gpu`` (model FLOPs), ``hw_tflops_per_gpu`` (with recompute),
    ``mfu``, ``first_stage_layers`` / ``last_stage_layers`` (0 = even split),
    ``pipeline_split`` (layers per rank, e.g. ``"7+14x8+7"``), ``pipeline_layout`` (Megatron's
    ``--pipeline-model-parallel-layout`` string of the split, e.g. ``"Et*7|(t*8|)*14,t*7L"``),
    ``chunk_layers`` (layers per virtual stage, pipeline order), ``layout_given`` and
    ``microbatch_group_size`` (the interleaved schedule's micro-batch group N, p by default;
    absent on one chunk per stage)."""
    rc = RECOMPUTE[int(res["recompute"][i])]
    rec = {
        "tp": int(res["tp"][i]), "pp": int(res["pp"][i]), "dp": int(res["dp"][i]),
        "ep": int(res["ep"][i]) if "ep" in res else 1,
        "etp": int(expert_tp(res)[i]),  # expert TP u (t when the row has none)
        "cp": int(res["cp"][i]), "vp": int(res["vp"][i]),
        "pipeline_schedule": SCHEDULES[int(res["zb"][i])] if "zb" in res else "1f1b",
        "first_stage_layers": int(res["lf"][i]), "last_stage_layers": int(res["ll"][i]),
        "micro_batch_size": int(res["mbs"][i]), "num_microbatches": int(round(res["m"][i])),
        "recompute": rc, "sequence_parallel": bool(res["sp"][i]), "zero": int(res["zero"][i]),
        "recompute_num_layers": int(res["rcl"][i]) if "rcl" in res else 0,
        "cp_comm_type": CP_COMM_TYPES[int(res["cpt"][i])] if "cpt" in res and res["cpt"][i] >= 0
        else (res.get("cp_comm_default") or "p2p"),
        "cp_a2a_size": int(res["cp_a2a"][i]) if "cp_a2a" in res else 1,
        "moe_token_dispatcher_type": DISPATCHERS[int(res["disp"][i])]
        if "disp" in res and res["disp"][i] >= 0 else res.get("disp_default", "allgather"),
        "memory_gb": float(res["mem_total"][i] / GB),
        "memory_terms_gb": {k: float(res[f"mem_{k}"][i] / GB) for k in MEMORY_TERMS},
        "time_terms_s": {k: float(res[f"time_{k}"][i]) for k in TIME_TERMS},
        "iteration_time_s": float(res["time_iteration"][i]),
        "tokens_per_s": float(res["tokens_per_s"][i]),
        "tflops_per_gpu": float(res["tflops_per_gpu"][i]),
        "hw_tflops_per_gpu": float(res["hw_tflops_per_gpu"][i]),
        "mfu": float(res["mfu"][i]),
        "fits": bool(res["fits"][i]),
    }
    rec["dominant"] = dominant_parallelism(rec)
    if rec["vp"] > 1 and rec["pipeline_schedule"] == "1f1b":  # interleaved
        g = res["vpg"][i] if "vpg" in res else 0
        rec["microbatch_group_size"] = int(g) if g else rec["pp"]
    if "num_layers" in res:
        lay = layout_record(res, i)
        rec["pipeline_split"] = describe_counts(lay.rank_layer_counts())
        rec["pipeline_layout"] = lay.to_string()
        rec["chunk_layers"] = list(lay.counts())
        rec["layout_given"] = res.get("split") is not None and res["split"][i] is not None
    return rec


def layout_record(res: dict, i: int):
    """The PipelineLayout of row ``i`` of an :func:`evaluate` result."""
    from loom.planner.stage_table import row_layout
    split = res.get("split")
    if split is not None and split[i] is not None:
        return split[i]
    return row_layout(int(res["num_layers"]), res["pp"][i], res["vp"][i], res["lf"][i],
                      res["ll"][i], res["zb"][i] if "zb" in res else 0,
                      int(res.get("mtp_layers", 0)))
