"""Issue 42's model capabilities against the single-process run, one spawned 2-rank world:
loss, gradient norm and every gradient within rtol 1e-5 for 3 steps (fp32, no dropout), each
row asserting its feature ran.

* ``moe``: sinkhorn routing (top-2, Megatron's S-BASE) with squared-ReLU routed and shared
  experts, a z-loss and --moe-per-layer-logging, a dense first layer; at TP=2 + SP, PP=2 and
  CP=2 (sinkhorn's column sums over the CP group). The per-layer losses equal the
  single-process ones (PP=2: each stage's layers summed over the stages).
* ``yarn``: --position-embedding-type yarn (factor 4, mscale, unrounded correction range) with
  the vocabulary padded 100 -> 128 in the softmax (Megatron's default; --make-vocab-size-
  divisible-by 32 gives Vp 128 at t = 1 and 2); at TP=2, PP=2 and CP=2.
* ``mla``: multi-latent attention with learned absolute positions (Megatron's default type);
  at TP=2 and PP=2.
* ``docs``: --reset-attention-mask and --reset-position-ids (GPT-2's learned positions; V 12,
  Vp 64 at every t, so that NullTokenizer's end-of-document id is frequent in the mock data);
  at TP=2 + SP and PP=2.
* ``qkclip``: --qk-clip (threshold 0.01, below the initial logits, alpha 0.3) on GQA (4 heads,
  2 groups); at TP=2 (each rank clips its own group's rows) and DP=2 with the distributed
  optimizer (the maxima reduced over DP, the fp32 master shards scaled and re-gathered): the
  later steps' gradients see the clipped weights, and the final weights match.
* ``llama4``: Llama 4's attention (loom/config/model_llama4.py): NoPE layers 2 and 4, the QK
  L2 norm in the RoPE layers only, chunks of 4 of the 16 positions in the RoPE layers, the
  NoPE layers' temperature from position 1 (floor scale 2); at TP=2 + SP and PP=2.

Mamba heads independent of h: tests/models/test_mamba.py (its 2-rank world)."""

from __future__ import annotations

import math

import pytest
import torch

from loom.config import LoomConfig, ModelConfig
from testkit import run_distributed

from parity_helpers import step_mismatches
from testkit.numerics import PARITY_RTOL
from testkit.config import PARITY_ADAM_EPS, tiny_config, tiny_model

STEPS = 3


def model_cfg(kind: str) -> ModelConfig:
    common = dict(num_layers=4, num_query_groups=None, make_vocab_size_divisible_by=32,
                  ffn_hidden_size=48)
    if kind == "moe":
        return tiny_model("llama", common, swiglu=False, squared_relu=True, num_experts=4,
                          moe_router_topk=2, moe_ffn_hidden_size=24,
                          moe_shared_expert_intermediate_size=16,
                          moe_layer_freq="[0,1,1,1]",
                          moe_router_load_balancing_type="sinkhorn",
                          moe_z_loss_coeff=1e-3)
    if kind == "yarn":
        return tiny_model("llama", common, position_embedding_type="yarn",
                          rotary_scaling_factor=4.0, mscale=0.9, mscale_all_dim=0.5,
                          yarn_original_max_position_embeddings=8,
                          yarn_correction_range_round_to_int=False)
    if kind == "docs":
        return tiny_model("gpt", common, vocab_size=12, padded_vocab_size=64)
    if kind == "llama4":
        return tiny_model("llama", common, no_rope_freq="[0,1,0,1]", qk_l2_norm=True,
                          qk_l2_norm_rope_layers_only=True, attention_chunk_size=4,
                          attn_temperature_floor_scale=2, attn_temperature_scale=0.5)
    if kind == "qkclip":
        return tiny_model("llama", common, num_query_groups=2, qk_clip=True,
                          qk_clip_threshold=0.01, qk_clip_alpha=0.3)
    return tiny_model("llama", common, multi_latent_attention=True,
                      position_embedding_type="learned_absolute", q_lora_rank=16,
                      kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6)


def make_cfg(kind: str, tp=1, pp=1, cp=1, sp=False, dist_opt=False) -> LoomConfig:
    return tiny_config(model=model_cfg(kind), tensor_model_parallel_size=tp,
                       use_distributed_optimizer=dist_opt,
                       pipeline_model_parallel_size=pp, context_parallel_size=cp,
                       sequence_parallel=sp, global_batch_size=4, adam_eps=PARITY_ADAM_EPS,
                       moe_per_layer_logging=kind == "moe",
                       **(dict(reset_attention_mask=True, reset_position_ids=True,
                               tokenizer_type="NullTokenizer") if kind == "docs" else {}))


def run_steps(cfg, mesh):
    """Per step: loss, gradients (with their ParamMeta), grad norm, the per-layer MoE losses
    (the trainer's ``layer_metrics``, a collective); and what the routers chose."""
    import torch.nn.functional as F

    from loom.training.trainer import Trainer
    tr = Trainer(cfg, mesh=mesh)
    routed = {"tokens": 0, "balanced": 0}

    def seen(router, args, out):  # plain top-k of the router logits vs sinkhorn's choice
        plain = F.linear(args[0].float(), router.weight.float()).topk(out.experts.shape[1]).indices
        routed["tokens"] += out.experts.shape[0]
        routed["balanced"] += int((plain.sort(1).values != out.experts.sort(1).values)
                                  .any(1).sum())
    for c in tr.model_chunks:
        for n, m in c.named_modules():
            if n.endswith("mlp.router"):
                m.register_forward_hook(seen)
    out = []
    for _ in range(STEPS):
        batches = tr.batches(tr.train_ds, tr.consumed_samples)
        routed["documents"] = routed.get("documents", 0) + sum(
            int((b["document_starts"] > 0).sum()) for b in batches if "document_starts" in b)
        loss = tr.global_loss(tr.forward_backward(batches))
        grads = {n: (p.grad.detach().clone(), tr.registry[n])  # (the distributed optimizer's
                 for c in tr.model_chunks for n, p in c.named_parameters()  # are in buffers)
                 if p.requires_grad and p.grad is not None}
        layers = tr.parts.layer_metrics()
        out.append((loss, grads, tr.optimizer_step(), layers))
        tr.consumed_samples += tr.global_batch
    return tr, out, routed


def features(tr, kind: str, routed: dict) -> dict:
    from loom.models.activation import squared_relu
    from loom.models.attention import rope_cos_sin
    from loom.models.gpt.mla import MLASelfAttention
    mods = [m for c in tr.model_chunks for m in c.modules()]
    chunk = tr.model_chunks[0]
    out = {"routed": routed}
    if kind == "moe":
        out["squared_relu"] = sum(getattr(m, "act", None) is squared_relu for m in mods)
    if kind == "yarn":
        pos = torch.arange(16)
        cos = chunk.layer_inputs(pos, None, {})[0][0]
        out["yarn"] = float((cos - rope_cos_sin(pos, 8, 10000.0)[0]).abs().max())
        heads = [m for m in mods if type(m).__name__ in ("VocabParallelLMHead", "LMHead")]
        out["softmax_columns"] = [(h.vocab_size, tr.model_chunks[-1].output_weight().shape[0])
                                  for h in heads]
    if kind == "qkclip":  # the largest logit of the last step, and the final weights
        out["max_logit"] = tr.max_attention_logit
        out["qkv"] = {n: p.detach().clone() for c in tr.model_chunks
                      for n, p in c.named_parameters() if n.endswith("linear_qkv.weight")}
    if kind == "llama4":
        out["llama4"] = (sum(getattr(m, "chunk", None) == 4 for m in mods),
                         sum(getattr(m, "temperature", None) is not None for m in mods),
                         sum(type(m).__name__ == "L2Norm" for m in mods))
    if kind == "mla":
        out["mla"] = sum(isinstance(m, MLASelfAttention) for m in mods)
        emb = getattr(chunk, "embedding", None)
        out["table"] = emb is not None and emb.position_embeddings is not None
    return out


def mismatches(par: list, ref: list, mesh) -> list[str]:
    """:func:`parity_helpers.step_mismatches`, and the per-layer MoE losses (rtol)."""
    out = step_mismatches(par, ref, mesh, PARITY_RTOL)
    for step, (got, want) in enumerate(zip(par, ref)):
        if set(got[3]) != set(want[3]):
            out.append(f"step {step}: per-layer keys {sorted(got[3])} != {sorted(want[3])}")
        out += [f"step {step}: {k} {v} != {want[3][k]}" for k, v in got[3].items()
                if k in want[3] and not math.isclose(v, want[3][k], rel_tol=PARITY_RTOL)]
    return out


def world2(cases) -> list[dict]:
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.registry import local_shard
    refs, results, weights = {}, [], {}
    for kind, layout in cases:
        if kind not in refs:
            ref_tr, refs[kind], _ = run_steps(make_cfg(kind).validate(1), ParallelMesh.single())
            weights[kind] = {n: p.detach().clone() for c in ref_tr.model_chunks
                             for n, p in c.named_parameters()}
        cfg = make_cfg(kind, **layout).validate(2)
        p = cfg.parallel
        mesh = ParallelMesh.build(tp=p.tensor_model_parallel_size,
                                  pp=p.pipeline_model_parallel_size, cp=p.context_parallel_size)
        tr, par, routed = run_steps(cfg, mesh)
        errors, compared = mismatches(par, refs[kind], mesh), sum(len(s[1]) for s in par)
        if kind == "qkclip":  # the clipped weights, against the single-process run's
            for c in tr.model_chunks:
                for n, p in c.named_parameters():
                    w = local_shard(weights[kind][n], tr.registry[n], *mesh.shard_of(tr.registry[n]))
                    compared += 1
                    if not torch.allclose(p.detach(), w, rtol=PARITY_RTOL, atol=1e-7):
                        errors.append(f"weight {n} differs by {(p.detach() - w).abs().max()}")
        results.append({"case": (kind, layout), "errors": errors,
                        "compared": compared, "layers": par[-1][3],
                        "features": features(tr, kind, routed), "stage": mesh.pp_rank})
    return results


CASES = [("moe", dict(tp=2, sp=True)), ("moe", dict(pp=2)), ("moe", dict(cp=2)),
         ("yarn", dict(tp=2)), ("yarn", dict(pp=2)), ("yarn", dict(cp=2)),
         ("mla", dict(tp=2)), ("mla", dict(pp=2)), ("docs", dict(tp=2, sp=True)),
         ("docs", dict(pp=2)), ("qkclip", dict(tp=2)), ("qkclip", dict(dist_opt=True)),
         ("llama4", dict(tp=2, sp=True)), ("llama4", dict(pp=2))]


@pytest.fixture(scope="module")
def results():
    return run_distributed(2, world2, CASES, timeout=900, start_method="fork")


@pytest.mark.parametrize("i", range(len(CASES)))
def test_model_capability_parity(results, i):
    kind, layout = CASES[i]
    for rank in results:
        r = rank[i]
        assert r["case"] == (kind, layout)
        assert not r["errors"], r["errors"][:5]
        assert r["compared"] > (20 if kind == "qkclip" else 30), r
        f = r["features"]
        if kind == "moe":
            assert f["squared_relu"] >= 5 and f["routed"]["balanced"] > 0, f
            keys = {f"moe/z_loss_layer_{i}" for i in (1, 2, 3)}
            assert set(r["layers"]) == keys and min(r["layers"].values()) > 0, r["layers"]
        if kind == "yarn":
            assert f["yarn"] > 1e-3, f
            assert len(f["softmax_columns"]) == (r["stage"] == 1 if layout.get("pp") else 1)
            for columns, rows in f["softmax_columns"]:  # all 128 / t padded rows in the softmax
                assert columns is None and rows == 128 // layout.get("tp", 1), f
        if kind == "mla":
            assert f["mla"] >= 2 and (f["table"] or r["stage"] == 1), f
        if kind == "qkclip":  # the clip acted (the logits stay above the threshold)
            assert f["max_logit"] > 0.01 and len(f["qkv"]) == 4, f["max_logit"]
        if kind == "llama4":  # per rank's layers: 2 RoPE (chunked, 2 norms each), 2 NoPE
            layers = 2 if layout.get("pp") else 4
            assert f["llama4"] == (layers // 2, layers // 2, layers), f
        if kind == "docs":  # tokens after an end-of-document token were masked
            assert f["routed"]["documents"] > 10, f
