"""The planner's optimizer states per parameter (``loom.planner.memory.optimizer_state_bytes``:
Adam 8, SGD 4 with momentum, 0 without, plus the fp32 master copy of a 16-bit run) equal what
loom's real optimizer holds after a step; ``loom plan --optimizer sgd`` and ``loom train
--dry-run`` price it. Single process, ~4 s."""

from __future__ import annotations

import pytest
import torch

from loom.parallel.mesh import ParallelMesh
from loom.planner.memory import model_state_bytes_per_param, optimizer_state_bytes
from loom.training.trainer import Trainer
from testkit.config import tiny_config
from testkit.numerics import held_optimizer_bytes


def _held_optimizer_bytes(**flags) -> tuple[float, int]:
    """(bytes the optimizer holds beyond the model's own parameters after a step:
    :func:`testkit.numerics.held_optimizer_bytes`), the model's parameter count."""
    tr = Trainer(tiny_config("llama", **flags).validate(1),
                 mesh=ParallelMesh.single(torch.device("cpu")))
    tr.train_step()
    n = sum(p.numel() for m in tr.parts.model.chunks for p in m.parameters())
    return held_optimizer_bytes(tr), n


@pytest.mark.parametrize("flags,want", [
    ({"optimizer": "sgd"}, 4),  # fp32: the weights are the master copy; the momentum
    ({"optimizer": "sgd", "sgd_momentum": 0.0}, 0),
    ({"optimizer": "sgd", "bf16": True}, 8),  # + the fp32 master copy
    ({"optimizer": "adam", "bf16": True}, 12),
    ({"optimizer": "adam"}, 8),
], ids=["sgd-fp32", "sgd-no-momentum", "sgd-bf16", "adam-bf16", "adam-fp32"])
def test_optimizer_bytes_per_param_equal_loom_s_optimizer(flags, want):
    state = optimizer_state_bytes(flags["optimizer"], flags.get("sgd_momentum", 0.9))
    bf16 = flags.get("bf16", False)
    per = float(model_state_bytes_per_param(0, 1, 4, bf16=bf16, state_bytes=state)[2])
    assert per == want
    held, n = _held_optimizer_bytes(**flags)
    assert held == pytest.approx(want * n, rel=1e-6), (held / n, want)


def test_muon_is_not_priced_and_said_so():
    assert optimizer_state_bytes("muon") is None


def test_dry_run_counts_sgd_states():
    """``loom train --dry-run --optimizer sgd``: the exact count and the planner's memory use
    SGD's 8 bytes (bf16), not Adam's 12; Muon's 8 on its weights and 12 on the rest, the
    planner's and the count's equal."""
    from loom.config import LoomConfig  # noqa: F401
    from loom.planner.meta_count import count_rank_states
    from loom.planner.predict import predict_layout
    adam, sgd = (tiny_config("llama", bf16=True, optimizer=o).validate(1) for o in ("adam", "sgd"))
    a, s = count_rank_states(adam, 1), count_rank_states(sgd, 1)
    assert a["optimizer_bytes"] == 12 * a["params"] and s["optimizer_bytes"] == 8 * s["params"]
    pa, ps = (predict_layout(c, 1, "H100-80GB")["memory_bytes"]["optimizer"] for c in (adam, sgd))
    assert ps == pytest.approx(pa * 8 / 12, rel=1e-12)
    muon = tiny_config("llama", bf16=True, optimizer="muon").validate(1)
    m = count_rank_states(muon, 1)  # Muon: 8 bytes on its weights, 12 on the rest
    pm = predict_layout(muon, 1, "H100-80GB")["memory_bytes"]["optimizer"]
    assert 8 * m["params"] < m["optimizer_bytes"] < 12 * m["params"]
    assert pm == pytest.approx(m["optimizer_bytes"], rel=1e-12)
