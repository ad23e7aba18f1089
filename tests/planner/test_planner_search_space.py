"""The search covers what Megatron runs, by default (issue 47 item 2): every --cp-comm-type,
--recompute-method block counts, ZeRO-2 with PP, uneven interleaving; its branch and bound
(search.refine) finds the same best layouts as evaluating every variant; every ranked row's
command is one loom train accepts. Single process, ~10 s."""

from __future__ import annotations

import numpy as np
import pytest

from loom.planner.command import command_config, loom_takes_layout_string, train_command
from loom.planner.hardware import make_cluster
from loom.planner.layout import Options, make_layouts
from loom.planner.presets import get_preset, gpt, llama3
from loom.planner.search import REFINE_TOP, enumerate_layouts, evaluate, record, search


def _best_times(res, n):
    t = np.sort(res["time_iteration"][res["fits"]])
    return t[:n]


@pytest.mark.parametrize("case", ["llama-cp", "gpt-pp"])
def test_refined_search_finds_the_exhaustive_best(case):
    """The REFINE_TOP fastest fitting layouts of search() (base space, then the variants that
    may rank) are those of evaluating every variant (enumerate_layouts(variants=True))."""
    if case == "llama-cp":
        m, cl, B, s = llama3(16, 4096, 32, 14336, s=32768), make_cluster("H100-80GB", 64), 16, 32768
    else:
        m, cl, B, s = gpt(24, 2048, 16), make_cluster("A100-40GB", 64), 256, 2048
    opts = Options(flash_attention=True)
    res = search(m, cl, B, s, opts=opts)
    full = evaluate(m, enumerate_layouts(m, cl, B, s, opts=opts, variants=True), B, s, cl,
                    opts)
    assert len(full["tp"]) > len(res["tp"])
    n = min(REFINE_TOP, int(full["fits"].sum()))
    assert _best_times(res, n) == pytest.approx(_best_times(full, n), rel=1e-12)


def test_every_cp_comm_type_is_searched_and_its_command_runs():
    """At 32K on 64 H100 with CP, rows of every --cp-comm-type the heads allow are evaluated;
    a2a+p2p's command carries --hierarchical-context-parallel-sizes; loom's config accepts
    each."""
    m = llama3(16, 4096, 32, 14336, s=32768)
    cl = make_cluster("H100-80GB", 64)
    res = search(m, cl, 16, 32768, fixed=dict(tp=2, cp=8, pp=1),
                 opts=Options(flash_attention=True))
    types = {record(res, int(i))["cp_comm_type"] for i in range(len(res["tp"]))}
    assert types == {"p2p", "allgather", "a2a+p2p"}  # a2a: 8 KV groups not divisible by c t
    for kind in types:
        i = next(int(i) for i in res["order"] if record(res, int(i))["cp_comm_type"] == kind)
        rec = record(res, i)
        text = train_command(rec, m, 16, 32768, 64, 8)
        cfg = command_config(text, 64)
        assert cfg.parallel.context_parallel_size == 8
        if kind == "a2a+p2p":
            assert "--hierarchical-context-parallel-sizes 4 2 " in text
        from loom.planner.report import format_table
        assert (f"  cp {kind}" in format_table([rec], "header")) == (kind != "p2p")


def test_block_recompute_counts_fill_the_memory():
    """Between no recompute (does not fit) and full recompute of every layer, full recompute of
    the first N layers of every chunk (--recompute-method block): memory and time in between,
    the command says so and loom's config accepts it; the search takes it when it fits best."""
    m = get_preset("llama3-70b")
    cl = make_cluster("H100-80GB", 64)
    L = make_layouts([dict(tp=8, pp=4, dp=2, mbs=1, sp=1, zero=1, recompute=r, rcl=k)
                      for r, k in (("none", 0), ("full", 5), ("full", 10), ("full", 0))])
    ev = evaluate(m, L, 64, 8192, cl, Options(flash_attention=True))
    act, t = ev["mem_activations"], ev["time_iteration"]
    assert act[0] > act[1] > act[2] > act[3] and t[0] < t[1] < t[2] < t[3]
    # 20 layers per rank, 5 of each recomputed: a quarter of the recompute FLOPs
    hw = ev["hardware_flops"]
    assert (hw[1] - hw[0]) == pytest.approx(0.25 * (hw[3] - hw[0]))
    import dataclasses
    m = dataclasses.replace(m, seq_length=32768, max_position_embeddings=32768)
    cl = make_cluster("H100-80GB", 128)
    res = search(m, cl, 64, 32768, fixed=dict(tp=8, pp=4, vp=1, zb=0, cp=1),
                 opts=Options(flash_attention=True))
    best = record(res, int(res["order"][0]))
    assert best["recompute"] == "full" and 0 < best["recompute_num_layers"] < 20
    text = train_command(best, m, 64, 32768, 128, 8)
    words = " ".join(text.replace("\\\n", " ").split())
    assert f"--recompute-method block --recompute-num-layers {best['recompute_num_layers']}" \
        in words
    cfg = command_config(text, 128)
    assert cfg.training.recompute_method == "block"
    from loom.planner.report import format_table
    assert f" block {best['recompute_num_layers']} " in format_table([best], "header")


def test_every_ranked_row_prints_a_command_loom_accepts():
    """The top rows of a default search (uneven splits, interleaving, ZeRO-2, CP types,
    block recompute included) each print a command loom train's config accepts, but those
    needing --pipeline-model-parallel-layout while loom's config lacks it (said in the
    command's first line)."""
    m = gpt(30, 2048, 16, s=4096)
    cl = make_cluster("A100-80GB", 64)
    res = search(m, cl, 256, 4096, opts=Options(flash_attention=True))
    for i in res["order"][:30]:
        rec = record(res, int(i))
        text = train_command(rec, m, 256, 4096, 64, 8)
        if "--pipeline-model-parallel-layout" in text and not loom_takes_layout_string():
            assert text.startswith("#")
            continue
        cfg = command_config(text, 64)
        assert cfg.data_parallel_size(64) == rec["dp"]


def test_a2a_p2p_only_where_both_levels_exist():
    """a2a+p2p needs all-to-all groups of A > 1 CP ranks inside a node and B > 1 of them: at
    t 8 on 8-GPU nodes A would be 1 (the p2p ring again), at c <= GPUs per node / t B would be 1
    (a2a); neither is searched as a2a+p2p (no layout listed twice under two names)."""
    from loom.planner.context_parallel import CP_COMM_TYPES
    from loom.planner.refine import cp_types
    m, cl, o = get_preset("llama3-405b"), make_cluster("H100-80GB", 64), Options()
    names = lambda t, c: {CP_COMM_TYPES[k] for k in cp_types(m, cl, o, t, c)}  # noqa: E731
    assert "a2a+p2p" not in names(8, 2) and "a2a+p2p" not in names(2, 4)
    assert "a2a+p2p" in names(2, 8) and "p2p" in names(8, 2)
