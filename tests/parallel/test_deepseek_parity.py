"""Issue 24's parity rows: multi-latent attention (with YaRN) at TP=2, TP=2 + SP, CP=2 and PP=2
(multi-token prediction with two depths in the TP=2 and CP=2 rows), and the "done when" model: a tiny DeepSeek-style model with every issue-24 flag (MLA + YaRN,
multi-token prediction, sigmoid router with the aux-loss-free expert bias, group-limited
routing, top-k scaling factor, seq_aux_loss, fp32 router, dense first layer, shared expert,
grouped GEMM, alltoall dispatcher) at EP=2, EP=2 x TP=2 + SP and EP=2 x PP=2, and torchtitan's
softmax router with the expert bias (its DeepSeek 16B flavor's) at EP=2. Each row trains 3
steps (fp32, no dropout) next to the single-process run of the same seed: loss, gradient norm
and every gradient within rtol 1e-5, the expert biases (updated from the global load) equal,
and each row asserts its features ran (MLA modules and the TP region of the shared RoPE key, the
MTP loss in the metrics, a moved expert bias, the dispatcher and grouped GEMM in place). One
spawned 4-rank world runs every row.
"""

from __future__ import annotations

import copy

import torch

from loom.config import LoomConfig, ModelConfig
from testkit import run_distributed

from parity_helpers import step_mismatches
from testkit.numerics import PARITY_RTOL
from testkit.config import PARITY_ADAM_EPS, tiny_config, tiny_model

STEPS = 3


def model_cfg(kind: str) -> ModelConfig:
    """``mla``: dense LLaMA-style layers with MLA + YaRN (low-rank queries, latent norms);
    ``mla_q``: a full query projection, no latent norms, MTP D=2; ``deepseek``: every issue-24
    flag."""
    common = dict(num_layers=4, num_query_groups=None, padded_vocab_size=104,
                  ffn_hidden_size=48, multi_latent_attention=True,
                  qk_layernorm=kind != "mla_q",
                  q_lora_rank=None if kind == "mla_q" else 16, kv_lora_rank=12, qk_head_dim=8,
                  qk_pos_emb_head_dim=4, v_head_dim=6, rope_type="yarn",
                  rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0,
                  yarn_original_max_position_embeddings=8)
    if kind == "mla_q":  # + MTP (two depths): at TP=2 and across the CP chunks
        return tiny_model("llama", common, mtp_num_layers=2)
    if kind not in ("deepseek", "softmax_bias"):
        return tiny_model("llama", common)
    if kind == "softmax_bias":  # torchtitan's DeepSeek 16B router: softmax, no renormalization,
        # its load-balancing bias on the probabilities (loom/config/torchtitan.py)
        return tiny_model("llama", common, num_experts=8, moe_router_topk=4,
                          moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=32,
                          moe_layer_freq="([0]*1+[1]*3)", moe_router_score_function="softmax",
                          moe_router_pre_softmax=True, moe_router_enable_expert_bias=True,
                          moe_router_bias_update_rate=0.01, moe_router_dtype="fp32",
                          moe_token_dispatcher_type="alltoall")
    return tiny_model(
        "llama", common, mtp_num_layers=1, mtp_loss_scaling_factor=0.3, num_experts=8,
        moe_router_topk=4, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
        moe_layer_freq="([0]*1+[1]*3)", moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01,
        moe_router_num_groups=4, moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5,
        moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-3,
        moe_router_dtype="fp32", moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True)


def make_cfg(kind: str, tp=1, pp=1, cp=1, ep=1, sp=False) -> LoomConfig:
    return tiny_config(model=model_cfg(kind), tensor_model_parallel_size=tp,
                       pipeline_model_parallel_size=pp, context_parallel_size=cp,
                       expert_model_parallel_size=ep, sequence_parallel=sp,
                       global_batch_size=8, adam_eps=PARITY_ADAM_EPS)


def run_steps(cfg, mesh):
    from loom.training.trainer import Trainer
    tr = Trainer(cfg, mesh=mesh)
    out = []
    for _ in range(STEPS):
        loss = tr.global_loss(tr.forward_backward(tr.batches(tr.train_ds, tr.consumed_samples)))
        grads = {n: (p.grad.detach().clone(), tr.registry[n])
                 for c in tr.model_chunks for n, p in c.named_parameters() if p.requires_grad}
        out.append((loss, grads, tr.optimizer_step(), dict(tr.last_metrics)))
        tr.consumed_samples += tr.global_batch
    return tr, out


def features(tr) -> dict:
    """What ran: MLA layers, the replaced RoPE-key region, MTP modules, the dispatcher, grouped
    GEMM, expert biases that moved."""
    from loom.models.gpt.mla import MLASelfAttention
    mods = [m for c in tr.model_chunks for m in c.modules()]
    named = [(n, m) for c in tr.model_chunks for n, m in c.named_modules()]
    return {"mla": sum(isinstance(m, MLASelfAttention) for m in mods),
            "region": sorted({type(m).__name__ for n, m in named
                              if n.endswith("k_pos_emb_region")}),
            "mtp": sum(n.startswith("mtp.layers.") and n.count(".") == 2 for n, _ in named),
            "cp": sorted({m.comm_type for m in mods if type(m).__name__ ==
                          "ContextParallelAttention"}),
            "dispatchers": sorted({getattr(m.dispatcher, "kind", "local") for m in mods
                                   if hasattr(m, "dispatcher")}),
            "runners": sorted({m.dispatcher.run_experts.__name__ for m in mods
                               if hasattr(m, "dispatcher")}),
            "bias_moved": sum(int(p.detach().abs().sum() > 0) for c in tr.model_chunks
                              for n, p in c.named_parameters() if n.endswith("expert_bias"))}


def mismatches(par: list, ref: list, mesh) -> list[str]:
    """Per step: loss and gradient norm (rtol), each gradient against the reference's shard
    (max error relative to the largest entry)."""
    return step_mismatches(par, ref, mesh, PARITY_RTOL)


def parity(cases) -> list[dict]:
    import torch.distributed as dist

    from loom.parallel.mesh import ParallelMesh
    world, refs, results = dist.get_world_size(), {}, []
    for kind, layout in cases:
        cfg = make_cfg(kind, **layout).validate(world)
        if kind not in refs:
            refs[kind] = run_steps(make_cfg(kind).validate(1), ParallelMesh.single())
        ref_tr, ref = refs[kind]
        p = cfg.parallel
        mesh = ParallelMesh.build(tp=p.tensor_model_parallel_size,
                                  pp=p.pipeline_model_parallel_size,
                                  cp=p.context_parallel_size, ep=p.expert_model_parallel_size)
        tr, par = run_steps(cfg, mesh)
        errors = mismatches(par, ref, mesh)
        compared = sum(len(step[1]) for step in par)
        ref_params = {n: p for c in ref_tr.model_chunks for n, p in c.named_parameters()}
        for c in tr.model_chunks:
            for n, prm in c.named_parameters():
                if n.endswith("expert_bias") and not torch.allclose(prm, ref_params[n],
                                                                    rtol=PARITY_RTOL, atol=1e-7):
                    errors.append(f"{n} {prm.tolist()} != {ref_params[n].tolist()}")
        results.append({"case": (kind, layout), "errors": errors, "compared": compared,
                        "features": features(tr), "last": mesh.is_last_stage,
                        "mtp_logged": "mtp loss" in par[-1][3],
                        "tp": mesh.tp_size})
    return results


CASES = [("mla_q", dict(tp=2)), ("mla", dict(tp=2, sp=True)), ("mla_q", dict(cp=2)),
         ("mla", dict(pp=2)), ("deepseek", dict(ep=2)), ("deepseek", dict(ep=2, tp=2, sp=True)),
         ("deepseek", dict(ep=2, pp=2)), ("softmax_bias", dict(ep=2))]


def test_mla_and_deepseek_parity_four_ranks():
    results = run_distributed(4, parity, CASES, timeout=600)
    for rank, per_rank in enumerate(results):
        assert len(per_rank) == len(CASES)
        for r in per_rank:
            kind, layout = r["case"]
            assert r["compared"] > 0
            assert not r["errors"], f"rank {rank} {r['case']}: " + "; ".join(r["errors"][:4])
            f = r["features"]
            assert f["mla"] > 0  # multi-latent attention ran
            if r["tp"] > 1:  # the shared key entered the TP region
                assert f["region"] == ["_TensorParallelInput"], f
            assert bool(f["cp"]) == ("cp" in layout), f  # MLA's core ran over the CP group
            if kind in ("mla_q", "deepseek") and r["last"]:
                assert f["mtp"] == (2 if kind == "mla_q" else 1) and r["mtp_logged"], (f, r)
            if kind == "softmax_bias":
                assert f["bias_moved"] > 0, f  # the bias moved, and routes softmax choices
            if kind == "deepseek":
                assert f["dispatchers"] == ["alltoall"], f
                assert f["runners"] == ["run_experts_grouped"], f
                assert f["bias_moved"] > 0, f  # aux-loss-free bias updated (and equal: above)
