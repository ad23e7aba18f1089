"""The overlap-interference term (``Options.overlap_interference``, issue 47 item 3): a DP
collective hidden behind compute costs that compute the SMs NCCL's CTAs hold while it runs,
``hidden x NCCL_CHANNELS / SMs``. Single process, well under a second."""

from __future__ import annotations

import pytest

from loom.planner.hardware import make_cluster
from loom.planner.layout import Options, make_layouts
from loom.planner.presets import get_preset
from loom.planner.dp_overlap import (NCCL_CHANNELS, fsdp_exposed, nccl_sm_fraction,
                                     overlap_interference)
from loom.planner.timing import time_terms


def test_fraction_and_hand_case():
    """16 channels over the data-sheet SM counts; 2.0 s of collectives, 0.5 s exposed, on an
    A100: 1.5 s hidden x 16/108 = 0.2222 s; nothing hidden or the option off: 0."""
    assert NCCL_CHANNELS == 16
    assert nccl_sm_fraction(make_cluster("A100-80GB", 8)) == pytest.approx(16 / 108)
    assert nccl_sm_fraction(make_cluster("H100-80GB", 8)) == pytest.approx(16 / 132)
    assert nccl_sm_fraction(make_cluster("H100-PCIe", 8)) == pytest.approx(16 / 114)
    a100 = make_cluster("A100-80GB", 16)
    assert float(overlap_interference(2.0, 0.5, a100)) == pytest.approx(1.5 * 16 / 108)
    assert float(overlap_interference(2.0, 0.5, a100)) == pytest.approx(0.22222, abs=1e-5)
    assert float(overlap_interference(2.0, 2.0, a100)) == 0.0
    assert float(overlap_interference(2.0, 0.5, a100, on=False)) == 0.0


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_time_terms_add_the_hidden_dp_time_times_the_fraction(zero):
    """llama3-8b, t 2, 64 replicas on 128 H100: the option adds exactly (total - exposed) x
    16/132 to dp_comm and to the iteration, nothing else moves; without overlap (ZeRO 0-2)
    nothing is hidden, so nothing is added."""
    model = get_preset("llama3-8b")
    L = make_layouts(dict(tp=2, pp=1, cp=1, dp=64, mbs=1, zero=zero, sp=1))
    cl = make_cluster("H100-80GB", 128)
    off = time_terms(model, L, 128, 4096, cl, Options())
    on = time_terms(model, L, 128, 4096, cl, Options(overlap_interference=True))
    hidden = float(off["dp_comm_total"][0] - off["dp_comm"][0])
    assert hidden > 0.0 and float(off["dp_interference"][0]) == 0.0
    added = hidden * 16 / 132
    assert float(on["dp_interference"][0]) == pytest.approx(added, rel=1e-12)
    assert float(on["dp_comm"][0] - off["dp_comm"][0]) == pytest.approx(added, rel=1e-12)
    assert float(on["iteration"][0] - off["iteration"][0]) == pytest.approx(added, rel=1e-9)
    assert float(on["compute"][0]) == float(off["compute"][0])
    if zero < 3:
        plain = time_terms(model, L, 128, 4096, cl,
                           Options(overlap_grad_reduce=False, overlap_interference=True))
        assert float(plain["dp_interference"][0]) == 0.0


def test_fsdp_per_layer_prefetch_by_hand():
    """``fsdp_exposed``: 4 layers, all-gather 1.0 s and reduce-scatter 1.0 s per micro-batch,
    forward 0.5 s, backward 3.0 s: forward 1/4 + 3/4 x (1.0 - 0.5) = 0.625, backward 1/4 + 3/4
    x max(0, 2.0 - 3.0) = 0.25, 0.875 s; with the communication under the compute only the
    first all-gather and the last reduce-scatter show (8 layers: 0.05 + 0.05)."""
    assert float(fsdp_exposed(1.0, 1.0, 0.5, 3.0, 4)) == pytest.approx(0.875)
    assert float(fsdp_exposed(0.4, 0.4, 1.0, 2.0, 8)) == pytest.approx(0.1)
    model = get_preset("llama3-8b")
    L = make_layouts(dict(tp=1, pp=1, cp=1, dp=64, mbs=1, zero=3, sp=0))
    cl = make_cluster("H100-80GB", 64)
    fit = time_terms(model, L, 64, 4096, cl, Options())
    pre = time_terms(model, L, 64, 4096, cl, Options(zero3_prefetch=True))
    assert float(pre["dp_comm_total"][0]) == float(fit["dp_comm_total"][0])
    assert 0.0 < float(pre["dp_comm"][0]) < float(pre["dp_comm_total"][0])
    assert float(pre["dp_comm"][0]) != float(fit["dp_comm"][0])


def test_whatif_defaults_are_restored():
    """The what-if of docs/planner.md flips the default for every source (module-level options
    too) inside its block only."""
    from benchmarks.planner_sources import validation
    from benchmarks.planner_sources.overlap_whatif import option_defaults
    with option_defaults(overlap_interference=True):
        assert Options().overlap_interference and validation.TORCH_DDP_2021.overlap_interference
        assert not Options().zero3_prefetch
    assert not Options().overlap_interference
    assert not validation.TORCH_DDP_2021.overlap_interference
