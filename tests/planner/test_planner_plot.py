"""The MFU-vs-memory figure (issue 15 item 8): Pareto front by hand, the chosen layout's full
label, device-capacity line and error band drawn (`loom plan --plot`)."""

from __future__ import annotations

import numpy as np

from loom.planner.report import chosen_label, pareto_front


def test_pareto_front_by_hand():
    mem = np.array([30.0, 10.0, 20.0, 25.0, 40.0])
    mfu = np.array([50.0, 20.0, 40.0, 35.0, 45.0])
    xs, ys = pareto_front(mem, mfu)
    assert xs.tolist() == [10.0, 20.0, 30.0] and ys.tolist() == [20.0, 40.0, 50.0]


def test_chosen_label_names_every_choice():
    rec = {"tp": 4, "pp": 8, "dp": 16, "cp": 2, "ep": 1, "vp": 6, "micro_batch_size": 3,
           "recompute": "none", "sequence_parallel": True, "zero": 1}
    assert chosen_label(rec) == "t4 p8 d16 c2 v6 b3 recompute none SP on ZeRO-1"
    assert " e8 " in chosen_label(dict(rec, ep=8))


def test_plot_writes_a_figure(tmp_path):
    import pytest
    from loom.cli import main
    out = tmp_path / "plan.png"
    with pytest.raises(SystemExit) as e:
        main(["plan", "gpt3-175b", "--gpu", "A100-80GB", "--num-gpus", "64",
              "--global-batch-size", "512", "--plot", str(out)])
    assert e.value.code == 0 and out.stat().st_size > 10_000
