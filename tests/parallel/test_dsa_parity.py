"""Parity rows of DeepSeek Sparse Attention (loom/models/gpt/dsa.py; its math against
transformers and Megatron-Core: tests/models/test_dsa.py): TP=2 + SP and PP=2 each equal one
rank, loss and every gradient (the indexer's included) over 3 steps (fp32, rtol 1e-5), with the
sparse path active (keys the causal mask allows that the top-k drops) and the indexer loss on;
one spawned 2-rank world for both."""

from __future__ import annotations

import pytest

from loom.config import LoomConfig
from testkit import run_distributed
from testkit.config import PARITY_ADAM_EPS, tiny_config
from testkit.numerics import PARITY_RTOL

from parity_helpers import step_mismatches, trainer_steps

MLA_DSA = dict(num_query_groups=None, multi_latent_attention=True, q_lora_rank=16,
               kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
               disable_bias_linear=True, experimental_attention_variant="dsa",
               dsa_indexer_n_heads=4, dsa_indexer_head_dim=8, dsa_indexer_topk=3,
               dsa_indexer_loss_coeff=1.0)
ROWS = {"tp2_sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
        "pp2": dict(pipeline_model_parallel_size=2)}


def make_cfg(row: str, world: int) -> LoomConfig:
    return tiny_config("llama", MLA_DSA, ROWS[row] if world > 1 else {},
                       init_method_std=0.3,  # attention far from uniform: a target unlike
                       # the near-uniform initial index distribution (no cancellation)
                       make_vocab_size_divisible_by=32, global_batch_size=4, train_iters=10,
                       adam_eps=PARITY_ADAM_EPS, world=world)


def world2() -> dict:
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    out = {}
    ref = trainer_steps(Trainer(make_cfg("pp2", 1), mesh=ParallelMesh.single()), 3)
    for row in ROWS:
        mesh = ParallelMesh.build(tp=2 if row == "tp2_sp" else 1,
                                  pp=2 if row == "pp2" else 1, dp=1)
        tr = Trainer(make_cfg(row, 2), mesh=mesh)
        par = trainer_steps(tr, 3)
        cores = [layer.self_attention.core_attention for c in tr.model_chunks
                 for layer in c.layers.values()]
        out[row] = {
            "errors": step_mismatches(par, ref, mesh, PARITY_RTOL),
            "compared": sum(len(s[1]) for s in par),
            "indexer grads": sum(".indexer." in n for s in par for n in s[1]),
            "dropped": [int((~core.last_mask & core.last_mask.new_ones(
                core.last_mask.shape[-2:]).tril()).sum()) for core in cores]}
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(2, world2)


@pytest.mark.parametrize("row", list(ROWS))
def test_dsa_parity(results, row):
    for rank in results:
        r = rank[row]
        assert not r["errors"], r["errors"][:5]
        assert r["indexer grads"] >= 3 * 5, r  # every indexer parameter, every step
        assert r["compared"] > 20, r
        assert all(d > 0 for d in r["dropped"]), r  # the sparse path ran in every layer
