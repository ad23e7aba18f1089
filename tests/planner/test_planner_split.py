"""Any layer split plans (issue 47, item 2): Megatron's --pipeline-model-parallel-layout parsed
as Megatron-Core parses it, placed by loom's placement, planned for any L and p (28 layers over
16 stages); the micro-batches every rank holds per schedule are checked against a replay of
loom's own op lists in test_planner_vp_group.py. Single process, ~5 s."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from loom.config import ConfigError
from loom.config.pipeline_layout import (LayoutError, layout_from_counts, parse_layout,
                                           rank_counts_to_chunks, standard_layout)
from loom.parallel.pipeline.placement import chunk_layers
from loom.planner.hardware import make_cluster
from loom.planner.layout import Options, make_layouts
from loom.planner.memory import memory_terms, stage_memory_terms
from loom.planner.presets import get_preset, gpt
from loom.planner.search import evaluate, record, search
from loom.planner.stage_table import (balanced_counts, held_microbatches, row_layout,
                                      stage_slots)

EXAMPLES = [("Ettt|(tt|)*29,m|L", 8), ("Et*7|(t*8|)*14,t*7L", 16), ("Et|t|(tt|)*12,t|tL", 16),
            ("E|t*4|t*4|L", 2), ("E|(t|)*3,m|m||L", 2), ("Etttt|tttt|tttt|ttttL", 2)]


@pytest.mark.parametrize("text,pp", EXAMPLES)
def test_layout_string_parses_as_megatron_core_parses_it(text, pp):
    """The stages (and layer kinds) are Megatron-Core 0.16.1's own parse of the same string;
    rendering gives a string that parses back to the same stages."""
    mc = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
    want = mc.PipelineParallelLayerLayout.parse_str_to_list(text)
    names = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
    got = parse_layout(text, pp)
    assert [list(s) for s in got.stages] == [[names[x.name] for x in st] for st in want]
    assert parse_layout(got.to_string(), pp) == got
    assert len(got.stages) == pp * got.vp


def test_layout_errors_name_the_problem():
    with pytest.raises(LayoutError, match="unknown character"):
        parse_layout("Ex|L", 2)
    with pytest.raises(LayoutError, match="not a multiple"):
        parse_layout("Et|t|tL", 2)
    with pytest.raises(LayoutError, match="transformer layers"):
        parse_layout("Ett|ttL", 2).validate(5)
    with pytest.raises(LayoutError, match="embedding"):
        parse_layout("tE|tL", 2).validate(2)
    with pytest.raises(LayoutError, match="MTP"):
        parse_layout("Et|tmL", 2).validate(2)
    parse_layout("Et|tmL", 2).validate(2, 1)


def test_placement_runs_the_layout_and_matches_the_flags():
    """loom's placement places a layout string exactly (virtual stage k p + r is chunk k of
    rank r), and the flags' own splits are layouts too (standard_layout)."""
    text = "Et|t|(tt|)*12,t|tL"
    lay = parse_layout(text, 16)
    assert lay.rank_layer_counts() == [1, 1] + [2] * 12 + [1, 1]
    for r in range(16):
        assert chunk_layers(28, 16, r, layout=text) == lay.chunk_layers(r)
    assert chunk_layers(28, 16, 2, layout=text) == [[2, 3]]
    inter = parse_layout("Et|t|t|tt|t|ttL", 3)  # v = 2: rank 0 holds virtual stages 0 and 3
    assert chunk_layers(8, 3, 0, layout="Et|t|t|tt|t|ttL") == [[0], [3, 4]]
    assert inter.vp == 2 and inter.rank_layer_counts() == [3, 2, 3]
    for L, p, v, f, last in ((96, 8, 2, None, None), (126, 16, 1, 6, None), (8, 2, 4, None, None)):
        lay = standard_layout(L, p, v, f, last)
        for r in range(p):
            assert lay.chunk_layers(r) == chunk_layers(L, p, r, L // (p * v) if v > 1 else None,
                                                       f, last)


def test_28_layers_over_16_stages_plan():
    """The held-out benchmark's 114 unplannable layouts (issue 47): 28 layers over 16 stages
    plan now, as the balanced split 1+1+1+12x2+1, its command carrying the layout string."""
    m = gpt(28, 2048, 16)
    cl = make_cluster("H100-80GB", 128)
    res = search(m, cl, 256, 2048, fixed=dict(tp=8, pp=16), opts=Options(flash_attention=True))
    assert len(res["order"]) > 0
    rec = record(res, int(res["order"][0]))
    assert rec["pipeline_split"] == "3x1+12x2+1"
    assert rec["pipeline_layout"] == "Et|t|t|(tt|)*12,tL"
    assert balanced_counts(28, 16) == [1, 1, 1] + [2] * 12 + [1]
    from loom.planner.command import train_command
    cmd = train_command(rec, m, 256, 2048, 128, 8)
    assert "--pipeline-model-parallel-layout 'Et|t|t|(tt|)*12,tL'" in cmd


def test_given_layout_is_evaluated_exactly():
    """A given layout string plans only itself; its per-rank parameters are its layers'; the
    memory of each rank counts its own held micro-batches (uneven chunks of the interleaved
    schedule: rank 0's lighter first chunk holds the most)."""
    m = gpt(8, 512, 8, V=1024)
    cl = make_cluster("H100-80GB", 2)
    text = "Et|ttt|tt|ttL"  # p = 2, v = 2: rank 0 chunks [1] and [2], rank 1 [3] and [2]
    res = search(m, cl, 8, 256, fixed=dict(pp=2, layout=text, mbs=1),
                 opts=Options(flash_attention=True))
    assert set(res["vp"]) == {2.0} and len(res["tp"]) > 0
    rec = record(res, int(res["order"][0]))
    assert parse_layout(rec["pipeline_layout"], 2) == parse_layout(text, 2) and rec["layout_given"]
    assert rec["chunk_layers"] == [1, 3, 2, 2] and rec["pipeline_split"] == "3+5"
    L = make_layouts([dict(pp=2, dp=1, mbs=1, split=text)])
    slots = stage_slots(m, L, 8)
    want = [max(w[0] * a + w[1] * b for a, b in held_microbatches("interleaved", 2, 8, 2, r))
            for r, w in ((0, (1, 2)), (1, (3, 2)))]
    assert max(slots["held"][0][:, 0]) == max(want)
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-layout"):
        search(m, cl, 8, 256, fixed=dict(pp=2, layout="Et|tt|L"))


def test_interleaved_last_stage_holds_more_than_one_micro_batch():
    """The interleaved schedule's last rank holds (v - 1) p + 1 chunk micro-batches at its
    peak, not 1 (what the planner counted before), m = p included (Megatron-Core's warm-up; the
    first rank then holds all m v); the memory model counts them (Llama 3 405B's layout,
    v = 4)."""
    # 2 (p - r - 1) + (v - 1) p + 1 = 49 chunk micro-batches on the last rank; m = p: the same
    # on the last rank (its chunks 0-2 full, one of chunk 3), all m v on the first
    assert max(sum(h) for h in held_microbatches("interleaved", 16, 32, 4, 15)) == 49
    assert held_microbatches("interleaved", 16, 16, 4, 15) == ((16, 16, 16, 1),)
    assert held_microbatches("interleaved", 16, 16, 4, 0) == ((16,) * 4,)
    m = get_preset("llama3-405b")
    L = make_layouts([dict(tp=8, pp=16, dp=64, mbs=1, sp=1, vp=4, lf=7, ll=7, zero=1)])
    st = stage_memory_terms(m, L, 2048, 8192, Options(flash_attention=True))
    lay = row_layout(126, 16, 4, 7, 7, 0)
    last = [len(c) for c in lay.chunk_layers(15)]
    assert last == [1, 2, 2, 2]
    held_layers = max(float(np.dot(h, last))
                      for h in held_microbatches("interleaved", 16, 32, 4, 15))
    assert held_layers == 82  # the old model held one micro-batch there: 7 layers
    from loom.planner.memory import activation_bytes_per_layer
    per = activation_bytes_per_layer(m, 8192, L, flash_attention=True)["none"][0]
    assert st["last"]["activations"][0] >= held_layers * per


def test_uneven_interleaved_is_searched_by_default():
    m = get_preset("llama3-405b")
    res = search(m, make_cluster("H100-80GB", 8192), 2048, 8192, fixed=dict(tp=8, pp=16),
                 opts=Options(flash_attention=True))
    uneven = (res["lf"] > 0) & (res["vp"] > 1)
    assert uneven.any()
    i = int(np.nonzero(uneven)[0][0])
    rec = record(res, i)
    assert rec["pipeline_split"] == "7+14x8+7" and len(rec["chunk_layers"]) == 16 * rec["vp"]
    assert sum(rec["chunk_layers"]) == 126


def test_zero_stage_2_command_and_pipeline():
    """ZeRO-2 rows (also with PP, reduce-scattering every micro-batch) print --zero-stage 2,
    which loom train's config accepts (issue 45 item 4)."""
    from loom.planner.command import command_config, train_command
    m = gpt(8, 512, 8, V=1024)
    cl = make_cluster("A100-80GB", 8)
    res = search(m, cl, 32, 512, fixed=dict(zero=2, pp=2), opts=Options(flash_attention=True))
    assert len(res["order"]) > 0
    rec = record(res, int(res["order"][0]))
    text = train_command(rec, m, 32, 512, 8, 8)
    assert "--zero-stage 2" in text and not text.startswith("#")
    cfg = command_config(text, 8)
    assert cfg.training.zero_stage == 2 and cfg.parallel.pipeline_model_parallel_size == 2
    # m reduce-scatters per iteration: more DP traffic than ZeRO-1 at the same layout
    L = make_layouts([dict(pp=2, dp=4, mbs=1, zero=z) for z in (1, 2)])
    ev = evaluate(m, L, 32, 512, cl, Options(flash_attention=True))
    assert ev["time_dp_comm_total"][1] > 2 * ev["time_dp_comm_total"][0]
    assert ev["mem_gradients"][1] < ev["mem_gradients"][0]


def test_memory_is_the_neediest_rank():
    m = gpt(40, 2048, 16)
    L = make_layouts([dict(tp=1, pp=4, dp=1, mbs=1, lf=1, ll=1)])
    mem = memory_terms(m, L, 64, 2048, Options())
    assert int(mem["stage"][0]) == 2 and int(mem["rank"][0]) == 1


def test_rank_counts_to_chunks():
    assert rank_counts_to_chunks([7, 8, 7], 2) == [3, 4, 3, 4, 4, 4]
    lay = layout_from_counts(rank_counts_to_chunks([7] + [8] * 14 + [7], 4), 16)
    assert lay.rank_layer_counts() == [7] + [8] * 14 + [7] and lay.vp == 4
