"""QK-clip (--qk-clip, Kimi K2's MuonClip) and --log-max-attention-logit against independent
hand computations: the per-head maximum scaled logit from explicit loops over the unmasked
(query, key) pairs, and the clipped weights from the unclipped run's weights times the factors
Megatron-Core's ``SelfAttention.clip_qk`` defines (per query group: eta = min(tau / max, 1),
Q rows x eta^alpha, K rows x eta^(1 - alpha)). Megatron-Core's own maximum needs Transformer
Engine (``return_max_logit``), absent on CPU, so the loops are the reference. The 2-rank row
(TP = 2): tests/parallel/test_model_caps_parity.py's ``qkclip`` case."""

from __future__ import annotations

import json
import math

import pytest
import torch

from loom.models.attention import (DotProductAttention, SinkWindowAttention,
                                   document_causal_mask, max_attention_logits)
from loom.parallel.mesh import ParallelMesh
from loom.training.qk_clip import attention_layers
from testkit.config import tiny_config

pytestmark = pytest.mark.fast


def hand_max(q, k, scale, sees) -> list[float]:
    """Per head h, max over b, i, j with ``sees(b, i, j)`` of ``scale * sum_c q[b,h,i,c]
    k[b,h // (a/g),j,c]``, by loops."""
    b, a, s_q, d = q.shape
    rep = a // k.shape[1]
    out = []
    for h in range(a):
        best = -math.inf
        for n in range(b):
            for i in range(s_q):
                for j in range(k.shape[2]):
                    if sees(n, i, j):
                        dot = sum(float(q[n, h, i, c]) * float(k[n, h // rep, j, c])
                                  for c in range(d))
                        best = max(best, dot * scale)
        out.append(best)
    return out


def test_max_logit_equals_hand_computation():
    """Causal GQA (4 heads, 2 groups), a document mask, a sliding window with sinks, and the
    core's record: the maximum over two micro-batches, only in training."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 6, 3, generator=g), torch.randn(2, 2, 6, 3, generator=g)
    scale = 1 / math.sqrt(3)
    want = hand_max(q, k, scale, lambda n, i, j: j <= i)
    assert max_attention_logits(q, k, None, causal=True).tolist() == pytest.approx(want, 1e-5)
    unmasked = hand_max(q, k, scale, lambda n, i, j: True)
    assert unmasked != pytest.approx(want, 1e-5)  # the mask mattered
    starts = torch.tensor([[0, 0, 0, 3, 3, 3], [0, 0, 2, 2, 2, 2]])
    docs = hand_max(q, k, 0.7, lambda n, i, j: int(starts[n, i]) <= j <= i)
    got = max_attention_logits(q, k, 0.7, document_causal_mask(starts))
    assert got.tolist() == pytest.approx(docs, 1e-5)

    core = DotProductAttention()
    core.record_max_logit = True
    q2 = torch.randn(2, 4, 6, 3, generator=g)
    core(q, k, k)
    core(q2, k, k)
    both = [max(a, b) for a, b in zip(want, hand_max(q2, k, scale, lambda n, i, j: j <= i))]
    assert core.max_logit.tolist() == pytest.approx(both, 1e-5)
    core.eval()
    core.max_logit = None
    core(q, k, k)
    assert core.max_logit is None  # evaluation records nothing

    window = SinkWindowAttention(0.0, 4, "off-by-one", window=2)
    window.record_max_logit = True
    window(q, k, k)
    near = hand_max(q, k, scale, lambda n, i, j: 0 <= i - j <= 2)
    assert window.max_logit.tolist() == pytest.approx(near, 1e-5)


def _trainer(**kw):
    from loom.training.trainer import Trainer
    cfg = tiny_config("llama", global_batch_size=4, **kw).validate(1)
    return Trainer(cfg, mesh=ParallelMesh.single())


def _step(tr):
    """One step; the per-head maxima recorded by its forwards (before the clip resets them)."""
    tr.forward_backward(tr.batches(tr.train_ds, tr.consumed_samples))
    layers = attention_layers(tr.model_chunks) if tr.parts.qk_clip is not None else []
    maxima = [layer.core_attention.max_logit.clone() for layer in layers]
    tr.optimizer_step()
    tr.consumed_samples += tr.global_batch
    return maxima


def _weights(tr) -> dict:
    return {n: p.detach().float().clone() for c in tr.model_chunks
            for n, p in c.named_parameters()}


def expected_factors(maxima, tau, alpha, a=4, g=2, d=8) -> torch.Tensor:
    """Row factors of [Q (a d); K (g d); V (g d)] from per-head maxima [a]."""
    groups = maxima.view(g, a // g).amax(1).tolist()
    eta = [min(tau / m, 1.0) for m in groups]
    rows = [eta[h // (a // g)] ** alpha for h in range(a) for _ in range(d)]
    rows += [eta[j] ** (1 - alpha) for j in range(g) for _ in range(d)]
    return torch.tensor(rows + [1.0] * (g * d), dtype=torch.float64)


@pytest.mark.parametrize("precision", [{}, {"bf16": True}])
def test_clip_scales_query_and_key_rows(precision):
    """After the step, each layer's linear_qkv equals the unclipped run's times the factors
    from its recorded maxima (bf16: the fp32 masters of the distributed optimizer, the weights
    their bf16 rounding); V rows and every other parameter equal; a threshold above every
    logit changes nothing."""
    ref = _trainer(**precision)
    ref_max = _step(ref)
    assert ref.parts.qk_clip is None  # no flag: nothing recorded
    tau = 0.02
    tr = _trainer(qk_clip=True, qk_clip_threshold=tau, qk_clip_alpha=0.3, **precision)
    maxima = _step(tr)
    assert not ref_max and len(maxima) == 2
    want, got = _weights(ref), _weights(tr)
    clipped = 0
    for i, m in enumerate(maxima):
        name = f"layers.{i}.self_attention.linear_qkv.weight"
        f = expected_factors(m.double(), tau, 0.3)
        clipped += int((f < 1).sum())
        expect = want[name].double() * f[:, None]
        if precision:  # the master is the clipped fp32 weight, the parameter its rounding
            rg = next(r for r in tr.optimizer.ranges if r.name.endswith(name))
            ref_rg = next(r for r in ref.optimizer.ranges if r.name.endswith(name))
            master = ref_rg.master.double().view_as(expect) * f[:, None]
            assert torch.allclose(rg.master.double().view_as(expect), master, rtol=1e-6,
                                  atol=0)
            expect = master.to(torch.bfloat16).double()
        assert torch.allclose(got[name].double(), expect, rtol=1e-6, atol=0), name
        assert torch.equal(got[name][-16:], want[name][-16:])  # V rows
    assert clipped > 0  # the clip acted
    assert all(torch.equal(got[n], want[n]) for n in want if "linear_qkv.weight" not in n)

    high = _trainer(qk_clip=True, qk_clip_threshold=1e9, **precision)
    _step(high)
    assert all(torch.equal(v, want[n]) for n, v in _weights(high).items())


def test_log_max_attention_logit(tmp_path):
    """--log-max-attention-logit: each iteration's record (and --log-json line) carries the
    maximum over layers and heads of the hand-computed logits of the step's forwards; the
    weights equal the run without the flag."""
    from loom.training.trainer import Trainer
    seen: list[float] = []

    def hook(core, args, out):
        q, k = args[0].detach(), args[1].detach()
        if core.training:
            seen.append(max(max_attention_logits(q, k, None, causal=True).tolist()))
    path = tmp_path / "log.jsonl"
    run = dict(global_batch_size=4, train_iters=2, eval_iters=0, log_interval=1)
    cfg = tiny_config("llama", log_max_attention_logit=True, log_json=str(path),
                      **run).validate(1)
    tr = Trainer(cfg, mesh=ParallelMesh.single())
    for layer in attention_layers(tr.model_chunks):
        layer.core_attention.register_forward_hook(hook)
    per_step: list[float] = []
    for _ in range(2):
        seen.clear()
        rec = tr.train_step()
        per_step.append(max(seen))
        assert rec["max_attention_logit"] == pytest.approx(per_step[-1], rel=1e-6)
    ref = Trainer(tiny_config("llama", **run).validate(1),
                  mesh=ParallelMesh.single())
    for _ in range(2):
        ref.train_step()
    assert all(torch.equal(v, _weights(ref)[n]) for n, v in _weights(tr).items())
    tr2 = Trainer(cfg, mesh=ParallelMesh.single())
    tr2.train()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    logged = [r["max_attention_logit"] for r in lines if r.get("kind") == "train"]
    assert logged == pytest.approx(per_step, rel=1e-6)
