"""The pipeline in-flight micro-batches the planner counts, per schedule, against a replay of
loom's own op lists (issue 47 item 1): the interleaved schedule's micro-batch groups
(``--microbatch-group-size-per-virtual-pipeline-stage N``, Megatron-Core's schedule table and
warm-up), uneven first/last stages and layout strings, 1F1B, ZB-H1 and ZB-V, fewer
micro-batches than stages; the bubble's independence of N; ``loom plan`` fixing N and printing
it. Single process, ~2 s."""

from __future__ import annotations

import argparse
import itertools

import numpy as np
import pytest

from loom.config import ConfigError
from loom.parallel.pipeline.schedules import gpipe_ops, interleaved_ops, one_f_one_b_ops
from loom.parallel.pipeline.zero_bubble import zb_h1_ops, zbv_ops
from loom.planner.cli_args import fixed_from_args
from loom.planner.command import command_config, train_command
from loom.planner.hardware import make_cluster
from loom.planner.layout import Options, make_layouts
from loom.planner.presets import gpt
from loom.planner.search import record, search, with_group
from loom.planner.stage_table import (_m_keys, group_size_ok, held_microbatches, row_layout,
                                      stage_slots)
from loom.planner.timing import pipeline_bubble


def _peak(ops, weights) -> float:
    """Peak of sum_c held_c x weights_c over an op list (a micro-batch of chunk c is held from
    its F to the end of its backward: its W when the list has one, else its B)."""
    has_w = {(c, j) for kind, c, j in ops if kind == "W"}
    held, peak = [0] * len(weights), 0.0
    for kind, c, j in ops:
        if kind == "F":
            held[c] += 1
            peak = max(peak, float(np.dot(held, weights)))
        elif kind == "W" or (kind == "B" and (c, j) not in has_w):
            held[c] -= 1
    return peak


def _planner_peak(vecs, weights) -> float:
    return max(float(np.dot(h, weights)) for h in vecs)


def test_held_microbatches_equal_a_replay_of_loom_s_schedules():
    """For every rank of 1F1B, GPipe, interleaved (m = p and m > p, even and uneven chunks),
    ZB-H1 and ZB-V, the planner's non-dominated held vectors give exactly the replayed peak of
    any chunk weights (layers per chunk)."""
    rng = np.random.default_rng(0)
    cases = [("1f1b", one_f_one_b_ops, 1), ("gpipe", gpipe_ops, 1), ("zb-h1", zb_h1_ops, 1),
             ("interleaved", interleaved_ops, 2), ("interleaved", interleaved_ops, 3),
             ("zbv", zbv_ops, 2)]
    for (name, fn, v), p in itertools.product(cases, (2, 4, 5)):
        for m in sorted({1, 2, p - 1, p, 2 * p, 3 * p, 5 * p + 1} - {0}):
            if name == "interleaved" and m % p:
                continue
            for r in range(p):
                ops = fn(m, p, r, v) if name != "gpipe" else fn(m, p, r)
                vecs = held_microbatches(name, p, m, v, r)
                for w in [np.ones(v)] + [rng.integers(0, 5, v) for _ in range(3)]:
                    assert _planner_peak(vecs, w) == _peak(ops, w), (name, p, m, v, r, w)


def test_interleaved_groups_held_equal_a_replay():
    """Every micro-batch group N Megatron-Core accepts (p <= N <= m, m mod N 0 or >= p, the
    last group the remainder), every rank, even and uneven chunk weights: the planner's held
    vectors give exactly the replayed peak of loom's interleaved op list."""
    rng = np.random.default_rng(1)
    n_cases = 0
    for p, v in itertools.product((2, 3, 4), (2, 3)):
        for m in (p, p + 1, 2 * p, 2 * p + 1, 3 * p + 2):
            for n in range(p, m + 1):
                if not group_size_ok(m, p, n):
                    continue
                for r in range(p):
                    ops = interleaved_ops(m, p, r, v, n)
                    vecs = held_microbatches("interleaved", p, m, v, r, n)
                    for w in [np.ones(v)] + [rng.integers(0, 5, v) for _ in range(2)]:
                        assert _planner_peak(vecs, w) == _peak(ops, w), (p, v, m, n, r, w)
                    n_cases += 1
    assert n_cases > 200
    # a larger N holds more: rank r's warm-up grows by (v - 1)(N - p) chunk micro-batches
    assert [sum(held_microbatches("interleaved", 4, 16, 2, 0, n)[0]) for n in (4, 8, 16)] \
        == [2 * 3 + 4 + 1, 2 * 3 + 8 + 1, 2 * 3 + 16 + 1]


# Megatron-Core 0.16.1's warm-up forwards per rank (get_pp_rank_microbatches, its
# p2p_communicator argument a stand-in with pp_group.size()/rank()), (p, v, N, m) -> ranks 0..p-1
MEGATRON_WARMUP = {(2, 2, 3, 5): [5, 3], (4, 2, 4, 8): [10, 8, 6, 4],
                   (4, 2, 6, 16): [12, 10, 8, 6], (4, 3, 5, 14): [16, 14, 12, 10],
                   (4, 2, 8, 8): [14, 12, 10, 8], (4, 2, 4, 4): [8, 8, 6, 4]}
# Megatron-Core's schedule table example (model_parallel_config.py, PP2 VP2 N3 M5):
# (micro-batch, chunk) of every forward
MEGATRON_TABLE_N3_M5 = [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1),
                        (4, 1)]


def test_loom_s_interleaved_order_is_megatron_core_s():
    """loom's op list runs Megatron-Core 0.16.1's schedule table and warm-up, m = p included
    (Megatron-LM before 2024 ran every forward first at m = p; Megatron-Core dropped that
    rule, and so did loom): the planner follows loom's op list, which it plans for."""
    fwd = [(j, c) for kind, c, j in interleaved_ops(5, 2, 1, 2, 3) if kind == "F"]
    assert fwd == MEGATRON_TABLE_N3_M5
    for (p, v, n, m), warm in MEGATRON_WARMUP.items():
        # forwards before the first backward: the warm-up, plus the first steady step's forward
        # unless the warm-up is every forward (m v)
        first_b = [next(i for i, op in enumerate(interleaved_ops(m, p, r, v, n)) if op[0] == "B")
                   for r in range(p)]
        loom = [k if k == m * v else k - 1 for k in first_b]
        assert loom == warm, (p, v, n, m)
    # 1F1B: min(p - r - 1, m) warm-up forwards (Megatron-Core's non-interleaved schedule),
    # then one forward and one backward per step
    for p, m, r in itertools.product((4,), (2, 8), range(4)):
        ops, w = one_f_one_b_ops(m, p, r), min(p - r - 1, m)
        assert [op[0] for op in ops[:w]] == ["F"] * w
        assert ops[w][0] == "B" if w == m else ops[w:w + 2] == [("F", 0, w), ("B", 0, 0)]


def test_held_vectors_saturate_after_three_groups():
    """The stage table evaluates the interleaved schedule at 3 N + m mod N micro-batches
    (stage_table._m_keys): the held vectors there equal those at m."""
    for p, v, n in ((2, 2, 2), (2, 3, 3), (4, 2, 4), (4, 2, 6), (4, 3, 5), (3, 4, 7)):
        for m in range(4 * n, 7 * n + 2):
            if group_size_ok(m, p, n):
                key = int(_m_keys(np.array([1]), np.array([p]), np.array([m]), n)[0])
                assert key == 3 * n + m % n
                for r in range(p):
                    assert held_microbatches("interleaved", p, m, v, r, n) == \
                        held_microbatches("interleaved", p, key, v, r, n), (p, v, n, m)


def _slots_peak(model, row: dict, m: int, group=None) -> float:
    """The largest held layer-micro-batches of any stage slot of one layout row."""
    L = with_group(make_layouts([row]), group)
    return float(stage_slots(model, L, m)["held"][0][:, 0].max())


@pytest.mark.parametrize("case", [
    # (schedule, p, v, lf, ll, zb, layers, m values, N)
    ("interleaved", 4, 2, 3, 3, 0, 26, (8, 12, 40), None),   # uneven first/last, v = 2
    ("interleaved", 4, 2, 3, 3, 0, 26, (12, 17, 41), 6),     # ... with groups of 6 (m mod 6)
    ("interleaved", 4, 3, 0, 0, 0, 24, (10, 20, 44), 5),
    ("1f1b", 4, 1, 5, 2, 0, 19, (1, 2, 3, 4, 9), None),      # uneven, m < p
    ("zb-h1", 4, 1, 1, 1, 1, 14, (1, 3, 4, 9), None),
    ("zbv", 4, 2, 0, 0, 2, 16, (1, 3, 7, 8, 21), None),      # ZB-V, m < 2p - 1 and above
])
def test_stage_slots_equal_a_replay_per_rank(case):
    """End to end (row layout, m capped by the stage table's keys, slots per distinct stage):
    the largest held layer-micro-batches of a row equal the replay of loom's op list on every
    rank with its chunks' layer counts as weights."""
    name, p, v, lf, ll, zb, nl, ms, n = case
    model = gpt(nl, 256, 4, V=1024)
    lay = row_layout(nl, p, v, lf, ll, zb)
    for m in ms:
        want = 0.0
        for r in range(p):
            w = [len(c) for c in lay.chunk_layers(r)]
            ops = (interleaved_ops(m, p, r, v, n) if name == "interleaved" else
                   one_f_one_b_ops(m, p, r) if name == "1f1b" else
                   zb_h1_ops(m, p, r) if name == "zb-h1" else zbv_ops(m, p, r))
            want = max(want, _peak(ops, w))
        row = dict(pp=p, vp=v, lf=lf, ll=ll, zb=zb, dp=1, mbs=1)
        assert _slots_peak(model, row, m, n) == want, (case, m)


def test_layout_string_with_groups_equals_a_replay():
    """A given layout string (uneven virtual stages, v = 2) with groups of N = 3 at p = 2."""
    model = gpt(8, 256, 4, V=1024)
    text = "Et|ttt|tt|ttL"  # rank 0: chunks of 1 and 2 layers, rank 1: 3 and 2
    for m in (5, 6, 8, 17):
        want = max(_peak(interleaved_ops(m, 2, r, 2, 3), w) for r, w in ((0, (1, 2)),
                                                                       (1, (3, 2))))
        assert _slots_peak(model, dict(pp=2, dp=1, mbs=1, split=text), m, 3) == want


def _simulated_bubble(m: int, p: int, v: int, n: int, tf: float = 1.0, tb: float = 2.0) -> float:
    """Idle time of the busiest rank: every rank runs loom's interleaved op list in order, each
    op as soon as its input arrives (no latency), a chunk's F taking tf / v and B tb / v."""
    ops = {r: interleaved_ops(m, p, r, v, n) for r in range(p)}
    done, pos, clock = {}, dict.fromkeys(range(p), 0), dict.fromkeys(range(p), 0.0)
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while pos[r] < len(ops[r]):
                kind, c, j = ops[r][pos[r]]
                vs = c * p + r
                dep = (("F", vs - 1, j) if vs else None) if kind == "F" else \
                    (("B", vs + 1, j) if vs < p * v - 1 else ("F", vs, j))
                if dep is not None and dep not in done:
                    break
                clock[r] = max(clock[r], done[dep] if dep else 0.0) + (tf if kind == "F"
                                                                      else tb) / v
                done[(kind, vs, j)] = clock[r]
                pos[r] += 1
                moved = True
    assert all(pos[r] == len(ops[r]) for r in range(p))
    return max(clock.values()) - m * (tf + tb)


def test_bubble_does_not_depend_on_the_group():
    """Without p2p latency, loom's interleaved op list idles (p - 1)(F + B) / v for every N
    (what timing.pipeline_bubble charges): a larger N buys slack for the p2p transfers that
    the planner's pp_comm term already counts as exposed, and costs activation memory."""
    for p, v, m in ((4, 2, 16), (4, 3, 12), (2, 2, 6)):
        L = {"pp": np.array([float(p)]), "vp": np.array([float(v)])}
        want = float(pipeline_bubble(L, 3.0, 0.0, 1.0, m)[0])
        assert want == pytest.approx((p - 1) * 3.0 / v)
        for n in range(p, m + 1):
            if group_size_ok(m, p, n):
                assert _simulated_bubble(m, p, v, n) == pytest.approx(want), (p, v, m, n)


def _plan_args(**kw) -> argparse.Namespace:
    """``loom plan``'s parsed flags that fixed_from_args reads (the rest None)."""
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
            "context_parallel_size", "data_parallel_size", "micro_batch_size",
            "recompute_granularity", "zero_stage", "expert_model_parallel_size",
            "num_layers_per_virtual_pipeline_stage", "pipeline_schedule",
            "microbatch_group_size_per_virtual_pipeline_stage")
    base = dict.fromkeys(keys)
    base.update(sequence_parallel=False, use_distributed_optimizer=False,
                use_torch_fsdp2=False)
    base.update(kw)
    return argparse.Namespace(**base)


def test_plan_fixes_the_group_and_prints_a_command_loom_train_takes():
    """--microbatch-group-size-per-virtual-pipeline-stage N fixes the interleaved rows' group:
    they hold more micro-batches than at N = p (rank 0: 2 (p - 1) + (v - 1) N + 1 chunk
    micro-batches), rows whose m breaks Megatron-Core's group rules are dropped, and the printed
    command carries N, which loom train's config accepts; N < p, or an N that no m takes when
    only interleaved rows are asked for, is refused by name."""
    model = gpt(16, 512, 8, V=1024)
    cl = make_cluster("H100-80GB", 8)
    B, s = 32, 512

    def plan(group):
        fixed = fixed_from_args(_plan_args(
            pipeline_model_parallel_size=4, tensor_model_parallel_size=2,
            num_layers_per_virtual_pipeline_stage=2, pipeline_schedule="interleaved",
            recompute_granularity="selective",
            microbatch_group_size_per_virtual_pipeline_stage=group), model)
        return search(model, cl, B, s, fixed, Options(flash_attention=True))

    base, grouped = plan(None), plan(8)
    assert set(grouped["vp"]) == {2.0} and set(grouped["vpg"]) == {8.0}
    ms = np.round(grouped["m"]).astype(int)
    assert all(group_size_ok(m, 4, 8) for m in ms) and set(np.round(base["m"])) > set(ms)
    rec = record(grouped, int(grouped["order"][0]))
    assert rec["microbatch_group_size"] == 8
    same = (base["mbs"] == rec["micro_batch_size"]) & (base["sp"] == rec["sequence_parallel"])
    i = int(np.nonzero(same)[0][0])
    assert record(base, i)["microbatch_group_size"] == 4
    assert rec["memory_terms_gb"]["activations"] > record(base, i)["memory_terms_gb"][
        "activations"]
    text = train_command(rec, model, B, s, 8, 8)
    assert "--microbatch-group-size-per-virtual-pipeline-stage 8" in text
    cfg = command_config(text, 8)
    assert cfg.parallel.microbatch_group_size_per_virtual_pipeline_stage == 8
    assert "--microbatch-group-size" not in train_command(record(base, i), model, B, s, 8, 8)
    with pytest.raises(ConfigError, match="groups of N = 5"):  # m = 32, 16, 8, 4: none fits
        plan(5)
    with pytest.raises(ConfigError, match="--microbatch-group-size-per-virtual-pipeline-stage 3"):
        fixed_from_args(_plan_args(pipeline_model_parallel_size=4,
                                   microbatch_group_size_per_virtual_pipeline_stage=3), model)


def test_uneven_interleaved_plan_prints_its_layout_and_group():
    """--decoder-first/last-pipeline-num-layers with virtual stages and a group N: the row's
    memory is its own layout's (the replay of loom's op list with its chunks' layers as
    weights) and the printed command, a layout string plus N, is one loom train accepts with
    that same layout (loom train refuses the first/last flags with interleaving)."""
    model = gpt(26, 512, 8, V=1024)
    fixed = fixed_from_args(_plan_args(
        pipeline_model_parallel_size=4, tensor_model_parallel_size=2, micro_batch_size=1,
        num_layers_per_virtual_pipeline_stage=5, pipeline_schedule="interleaved",
        decoder_first_pipeline_num_layers=4, decoder_last_pipeline_num_layers=2,
        microbatch_group_size_per_virtual_pipeline_stage=6), model)
    res = search(model, make_cluster("H100-80GB", 8), 48, 512, fixed,
                 Options(flash_attention=True))
    rec = record(res, int(res["order"][0]))
    assert rec["pipeline_split"] == "4+2x10+2" and rec["microbatch_group_size"] == 6
    assert set(res["vpg"]) == {6.0} and set(res["vp"]) == {2.0}
    lay = row_layout(26, 4, 2, 4, 2, 0)
    assert rec["chunk_layers"] == list(lay.counts())
    m = rec["num_microbatches"]
    want = max(_peak(interleaved_ops(m, 4, r, 2, 6), [len(c) for c in lay.chunk_layers(r)])
               for r in range(4))
    assert _slots_peak(model, dict(pp=4, vp=2, lf=4, ll=2, dp=1, mbs=1), m, 6) == want
    text = train_command(rec, model, 48, 512, 8, 8)
    cfg = command_config(text, 8)
    assert cfg.parallel.microbatch_group_size_per_virtual_pipeline_stage == 6
    assert cfg.parallel.pipeline_model_parallel_layout == rec["pipeline_layout"]
