"""DeepSeek Sparse Attention (loom/models/gpt/dsa.py): the lightning indexer's scores against a
hand computation and its top-k against transformers' DeepSeek-V3.2 indexer, the indexer loss
against Megatron-Core's ``compute_dsa_indexer_loss``, DSA with top-k >= s equal to dense MLA,
Megatron's gradient flow (the indexer trained by its loss only, the model not through the
indexer), and the config's one-line refusals. The TP=2 + SP and PP=2 parity rows:
tests/parallel/test_dsa_parity.py."""

from __future__ import annotations

import types

import pytest
import torch

from loom.errors import ConfigError
from loom.models import get_family
from loom.models.gpt.dsa import DSAIndexer, indexer_loss, topk_mask
from loom.models.gpt.mla import mla_rope
from loom.models.gpt.model import forward_step
from loom.parallel.mesh import ParallelMesh
from loom.parallel.parallelize import build_model
from testkit.config import tiny_config, tiny_model
from testkit.numerics import PARITY_RTOL

MLA = dict(num_query_groups=None, multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=12,
           qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, disable_bias_linear=True,
           rope_type="rope")
DSA = dict(experimental_attention_variant="dsa", dsa_indexer_n_heads=4, dsa_indexer_head_dim=8,
           dsa_indexer_topk=3, dsa_indexer_loss_coeff=0.1)


def _model(seed=3, **kw):
    return build_model(get_family("gpt"), tiny_model("llama", MLA, DSA, kw),
                       ParallelMesh.single(), seed=seed)


def _indexer_inputs(cfg, s=10, b=2):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(s, b, cfg.hidden_size, generator=g)
    qr = torch.randn(s, b, cfg.q_lora_rank, generator=g)
    return x, qr, mla_rope(cfg, torch.arange(s))


def test_indexer_scores_match_a_hand_computation():
    cfg = tiny_model("llama", MLA, DSA)
    torch.manual_seed(0)
    ix = DSAIndexer(cfg)
    x, qr, (cos, sin) = _indexer_inputs(cfg)
    scores = ix(x, qr, (cos, sin))
    s, b, n, d, dr = x.shape[0], x.shape[1], 4, 8, 4

    def rope(v, t):  # halves of the first dr channels, the rest passes
        a, c = v[:dr // 2], v[dr // 2:dr]
        rot = torch.cat([-c, a])
        return torch.cat([v[:dr] * cos[t] + rot * sin[t], v[dr:]])

    for bi in range(b):
        for t in range(s):
            k_t = [rope(ix.k_norm(ix.linear_wk.weight @ x[j, bi]), j) for j in range(s)]
            q = (ix.linear_wq_b.weight @ qr[t, bi]).view(n, d)
            w = ix.linear_weights_proj.weight @ x[t, bi] / (n * d) ** 0.5
            for j in range(s):
                want = sum(w[h] * torch.relu(rope(q[h], t) @ k_t[j]) for h in range(n)) \
                    if j <= t else float("-inf")
                assert torch.allclose(scores[bi, t, j], torch.as_tensor(want), rtol=1e-5,
                                      atol=1e-7), (bi, t, j)
    # the Hadamard rotation is orthogonal: the same scores without it
    ix.rotate = False
    assert torch.allclose(ix(x, qr, (cos, sin)), scores, rtol=1e-5, atol=1e-7)
    ix.relu = False
    assert not torch.allclose(ix(x, qr, (cos, sin)), scores)
    mask = topk_mask(scores, 3)
    assert mask.sum(-1).tolist() == [[1, 2] + [3] * (s - 2)] * b  # causal rows with < 3 keys
    assert not (mask & ~torch.isfinite(scores)).any()
    picked = scores.masked_fill(~mask, float("inf")).amin(-1)
    left = scores.masked_fill(mask, float("-inf")).amax(-1)
    assert (picked >= left).all()  # the picked keys are the highest-scoring ones


def test_indexer_topk_matches_transformers_deepseek_v32():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer
    cfg = tiny_model("llama", MLA, DSA, dsa_indexer_k_norm_epsilon=1e-6)
    torch.manual_seed(0)
    ix = DSAIndexer(cfg)
    hc = transformers.DeepseekV32Config(hidden_size=cfg.hidden_size, index_n_heads=4,
                                        index_head_dim=8, index_topk=3, q_lora_rank=16,
                                        qk_rope_head_dim=4)
    theirs = DeepseekV32Indexer(hc, 0)
    for a, b in (("wq_b", "linear_wq_b"), ("wk", "linear_wk"), ("k_norm", "k_norm"),
                 ("weights_proj", "linear_weights_proj")):
        getattr(theirs, a).load_state_dict(getattr(ix, b).state_dict())
    x, qr, (cos, sin) = _indexer_inputs(cfg)
    s = x.shape[0]
    causal = torch.ones(s, s, dtype=torch.bool).tril()[None]
    idx = theirs(x.transpose(0, 1), qr.transpose(0, 1), (cos[None], sin[None]), causal, None)
    ours = topk_mask(ix(x, qr, (cos, sin)), 3)
    want = torch.zeros_like(ours).scatter_(-1, idx.long(), True)
    assert torch.equal(ours[:, 2:], want[:, 2:])  # rows with >= 3 causal keys


def test_indexer_loss_matches_megatron_core():
    mc = pytest.importorskip("megatron.core.transformer.experimental_attention_variant.dsa")
    cfg = tiny_model("llama", MLA, DSA)
    torch.manual_seed(0)
    x, qr, rope = _indexer_inputs(cfg)
    scores = DSAIndexer(cfg)(x, qr, rope)
    s, b = x.shape[:2]
    q, k = torch.randn(2, b, 4, s, 12).unbind(0)
    valid = torch.isfinite(scores)
    tp1 = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 1))
    for sparse in (False, True):
        mask = topk_mask(scores.detach(), 3)
        idx = scores.detach().masked_fill(~mask, float("-inf")).topk(3, -1).indices
        idx = torch.where(mask.gather(-1, idx), idx, idx[..., :1])  # fill rows with < 3 keys
        want = mc.compute_dsa_indexer_loss(scores.clone(), idx, q.permute(2, 0, 1, 3),
                                           k.permute(2, 0, 1, 3), 12 ** -0.5, 0.1, sparse, tp1)
        got = 0.1 * indexer_loss(scores, q, k, 12 ** -0.5, mask if sparse else valid)
        assert torch.allclose(got, want, rtol=PARITY_RTOL), (sparse, got, want)


def _step(model, ids):
    out, loss_fn = forward_step(model, {"tokens": ids, "labels": ids, "num_microbatches": 2})
    loss, _ = loss_fn(out)
    loss.backward()
    return out.detach()


def test_topk_covering_the_sequence_is_dense_mla_and_a_smaller_one_is_not():
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    dense = build_model(get_family("gpt"), tiny_model("llama", MLA), ParallelMesh.single(), 3)
    outs = {}
    for topk in (16, 3):
        model = _model(dsa_indexer_topk=topk)
        model.load_state_dict(dense.state_dict(), strict=False)  # the indexer is DSA's own
        with torch.no_grad():
            outs[topk] = model(input_ids=ids)
    with torch.no_grad():
        want = dense(input_ids=ids)
    assert torch.equal(outs[16], want)  # the same causal softmax, bit for bit
    assert not torch.allclose(outs[3], want, rtol=1e-3, atol=1e-3)


def test_indexer_loss_trains_only_the_indexer_and_the_model_not_through_it():
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = {}
    for coeff in (0.0, 0.1):
        model = _model(dsa_indexer_loss_coeff=coeff).train()
        _step(model, ids)
        grads[coeff] = {n: p.grad for n, p in model.named_parameters()}
        att = model.layers["0"].self_attention.core_attention
        assert (~att.last_mask & torch.ones(16, 16, dtype=torch.bool).tril()).any()  # sparse
    for n, g in grads[0.1].items():
        if ".indexer." in n:
            assert grads[0.0][n] is None, n  # the LM loss does not reach the indexer
            assert g is not None and g.abs().sum() > 0, n  # its own loss does
        else:  # the indexer loss does not reach the model
            assert torch.equal(g, grads[0.0][n]), n


@pytest.mark.parametrize("change,words", [
    (dict(multi_latent_attention=False), "add --multi-latent-attention"),
    (dict(disable_bias_linear=False), "--disable-bias-linear"),
    (dict(dsa_indexer_topk=None), "needs --dsa-indexer-topk"),
    (dict(dsa_indexer_head_dim=12), "power of 2"),
    (dict(experimental_attention_variant=None), "add --experimental-attention-variant dsa"),
    (dict(context_parallel_size=2), "no context-parallel sparse attention"),
    (dict(mtp_num_layers=1), "drop --mtp-num-layers")])
def test_dsa_settings_loom_cannot_take_are_refused_in_one_line(change, words):
    with pytest.raises(ConfigError, match=words):
        tiny_config("llama", MLA, DSA, change, world=2)


def test_generation_and_hugging_face_export_are_refused_in_one_line():
    from loom.models.gpt.hf import layout_of
    model = _model().eval()
    with pytest.raises(ConfigError, match="Hugging Face export"):
        layout_of(model.cfg)
    cache = model.allocate_cache(1, 8)
    with pytest.raises(ConfigError, match="generation with --experimental-attention-variant"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long), cache=cache)
