"""Parity rows of Qwen3-Next's attention (tests/models/test_qwen3_next.py has the math against
transformers): TP=2 + SP equals one rank, loss and every gradient over 3 steps (fp32, rtol
1e-5), for the gated attention output alone and for Gated DeltaNet layers between gated
attention layers; one spawned 2-rank world for both (Megatron-Core's own GatedDeltaNet against
loom's: tests/models/test_megatron_reference.py)."""

from __future__ import annotations

import pytest

from loom.config import LoomConfig
from testkit import run_distributed
from testkit.config import PARITY_ADAM_EPS, tiny_config

from parity_helpers import step_mismatches, trainer_steps

GDN = dict(experimental_attention_variant="gated_delta_net", linear_attention_freq="2",
           linear_conv_kernel_dim=3, linear_key_head_dim=8, linear_value_head_dim=6,
           linear_num_key_heads=2, linear_num_value_heads=4)
CASES = {"gate": {}, "gdn": GDN}


def make_cfg(kind: str, tp: int) -> LoomConfig:
    return tiny_config(
        "llama", dict(group_query_attention=True, kv_channels=8, ffn_hidden_size=48,
                      make_vocab_size_divisible_by=32,  # Vp 128 at t = 1 and 2
                      attention_output_gate=True), CASES[kind],
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1, global_batch_size=4,
        train_iters=10, adam_eps=PARITY_ADAM_EPS, world=tp)


def world2() -> dict:
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    out = {}
    for kind in CASES:
        ref = trainer_steps(Trainer(make_cfg(kind, 1), mesh=ParallelMesh.single()), 3)
        mesh = ParallelMesh.build(tp=2, dp=1)
        tr = Trainer(make_cfg(kind, 2), mesh=mesh)
        par = trainer_steps(tr, 3)
        chunk = tr.model_chunks[0]
        out[kind] = {
            "errors": step_mismatches(par, ref, mesh), "compared": sum(len(s[1]) for s in par),
            "kinds": [type(layer.self_attention).__name__ for layer in chunk.layers.values()],
            "shapes": {n: tuple(p.shape) for n, p in chunk.named_parameters()
                       if n.startswith(("layers.0.self_attention.",
                                        "layers.1.self_attention.linear_qkv"))}}
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(2, world2)


def test_tp2_sp_parity_gated_attention(results):
    for rank in results:
        r = rank["gate"]
        assert r["kinds"] == ["SelfAttention"] * 2
        # the gate is active: [Q; G; K; V] = (4 + 4 + 2 + 2) heads x 8 / t rows
        assert r["shapes"]["layers.1.self_attention.linear_qkv.weight"] == (48, 32)
        assert not r["errors"], r["errors"][:5]
        assert r["compared"] > 20, r


def test_tp2_sp_parity_gated_delta_net(results):
    for rank in results:
        r = rank["gdn"]
        assert r["kinds"] == ["GatedDeltaNet", "SelfAttention"]  # freq 2: layer 0 GDN
        assert r["shapes"]["layers.0.self_attention.A_log"] == (2,)  # nv / t heads
        # the convolution's channels (16 + 16 + 24) / t
        assert r["shapes"]["layers.0.self_attention.conv1d.weight"] == (28, 1, 3)
        assert not r["errors"], r["errors"][:5]
        assert r["compared"] > 20, r

