"""The fused, chunked output GEMM + vocab-parallel cross-entropy (:func:`linear_cross_entropy`)
against ``F.cross_entropy`` on the gathered full logits.

Loss and the gradients of hidden and weight match (fp32, rtol 1e-5 of the largest entry) at TP=1
(in process), TP=2 and TP=4 (spawned gloo worlds), for chunk sizes that do and do not divide the
token count, with a uniform (mean) and a per-token (weighted) upstream gradient; padded vocabulary
rows hold random values and must still get no probability. TP=4 with V=300 gives rank 3 a shard
that is all padding. One collective per chunk forward, none backward.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from loom.parallel.cross_entropy import default_chunk_tokens, linear_cross_entropy
from testkit import run_distributed
from testkit.numerics import PARITY_RTOL, rel_err
from testkit.config import tiny_model

S, B, H, V = 6, 5, 16, 300
CHUNKS = (None, 7, 10, 1, 64)  # N = 30: default (1 chunk), non-divisor, divisor, 1 token, > N


def inputs(t: int):
    """Full padded weight ``[Vp, h]`` (random padding rows), hidden ``[s, b, h]``, target and
    per-token weights ``[s, b]``."""
    vp = tiny_model(vocab_size=V).padded_vocab(t)
    g = torch.Generator().manual_seed(11)
    weight = torch.randn(vp, H, generator=g)
    hidden = torch.randn(S, B, H, generator=g) * 2.0
    target = torch.randint(0, V, (S, B), generator=g)
    target[0, 0], target[-1, -1] = 0, V - 1  # both ends of the vocabulary
    token_w = torch.rand(S, B, generator=g)
    return vp, weight, hidden, target, token_w


def reference(weight, hidden, target, token_w):
    w = weight.clone().requires_grad_(True)
    x = hidden.clone().requires_grad_(True)
    logits = F.linear(x, w[:V])  # gathered logits without the padding
    loss = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), reduction="none")
    loss = loss.view(S, B)
    grads = {}
    for mode in ("mean", "weighted"):
        w.grad = x.grad = None
        obj = loss.mean() if mode == "mean" else (loss * token_w).sum()
        obj.backward(retain_graph=True)
        grads[mode] = (x.grad.clone(), w.grad.clone())
    return loss.detach(), grads


def tp_case(group, rank: int, t: int) -> dict:
    """Worst relative errors over chunk sizes and upstream-gradient kinds on this TP rank."""
    vp, weight, hidden, target, token_w = inputs(t)
    per = vp // t
    ref_loss, ref_grads = reference(weight, hidden, target, token_w)
    out = {"loss": 0.0, "grad_hidden": 0.0, "grad_weight": 0.0}
    for chunk in CHUNKS:
        for mode in ("mean", "weighted"):
            w = weight[rank * per:(rank + 1) * per].clone().requires_grad_(True)
            x = hidden.clone().requires_grad_(True)
            loss = linear_cross_entropy(x, w, target, group=group, vocab_start=rank * per,
                                        vocab_size=V, chunk_tokens=chunk)
            assert loss.shape == (S, B) and loss.dtype == torch.float32
            obj = loss.mean() if mode == "mean" else (loss * token_w).sum()
            obj.backward()
            gx, gw = ref_grads[mode]
            gx_sum = x.grad.clone()  # this rank's partial sum; the caller's f all-reduces it
            if group is not None:
                dist.all_reduce(gx_sum, group=group)
            out["loss"] = max(out["loss"], rel_err(loss.detach(), ref_loss))
            out["grad_hidden"] = max(out["grad_hidden"], rel_err(gx_sum, gx))
            gw_full = torch.cat([gw, torch.zeros(vp - V, H)])  # padding rows: no gradient
            out["grad_weight"] = max(out["grad_weight"],
                                     rel_err(w.grad, gw_full[rank * per:(rank + 1) * per]))
            # padding rows [V, Vp) get exactly no gradient
            lo = max(V - rank * per, 0)
            if lo < per:
                assert float(w.grad[lo:].abs().max()) == 0.0
    return out


def collective_count(group, rank: int, t: int, chunk: int) -> dict:
    """all_gather_single calls on ``group`` forward and backward of one loss."""
    vp, weight, hidden, target, _ = inputs(t)
    per = vp // t
    calls = {"forward": 0, "backward": 0, "other": 0}
    phase = ["forward"]
    orig_ag, orig_ar = dist.all_gather_single, dist.all_reduce

    def ag(*a, **k):
        calls[phase[0]] += 1
        return orig_ag(*a, **k)

    def ar(*a, **k):
        calls["other"] += 1
        return orig_ar(*a, **k)

    dist.all_gather_single, dist.all_reduce = ag, ar
    try:
        w = weight[rank * per:(rank + 1) * per].clone().requires_grad_(True)
        x = hidden.clone().requires_grad_(True)
        loss = linear_cross_entropy(x, w, target, group=group, vocab_start=rank * per,
                                    vocab_size=V, chunk_tokens=chunk)
        phase[0] = "backward"
        loss.mean().backward()
    finally:
        dist.all_gather_single, dist.all_reduce = orig_ag, orig_ar
    return calls


def world_checks() -> dict:
    t, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(t)))
    return {"errors": tp_case(group, rank, t), "calls": collective_count(group, rank, t, 7)}


@pytest.fixture(scope="module")
def worlds():
    return {t: run_distributed(t, world_checks) for t in (2, 4)}


def test_tp1_matches_f_cross_entropy():
    errs = tp_case(None, 0, 1)
    assert max(errs.values()) < PARITY_RTOL, errs


@pytest.mark.parametrize("t", [2, 4])
def test_vocab_parallel_matches_gathered_logits(worlds, t):
    for rank, res in enumerate(worlds[t]):
        assert max(res["errors"].values()) < PARITY_RTOL, (t, rank, res["errors"])


@pytest.mark.parametrize("t", [2, 4])
def test_one_collective_per_chunk_forward_none_backward(worlds, t):
    n_chunks = math.ceil(S * B / 7)
    for res in worlds[t]:
        assert res["calls"] == {"forward": n_chunks, "backward": 0, "other": 0}, res["calls"]


def test_bf16_autocast_inputs():
    """Under bf16 autocast the GEMMs run in bf16 (as F.linear would) and the loss in fp32."""
    vp, weight, hidden, target, token_w = inputs(1)
    x_ref = hidden.clone().requires_grad_(True)
    w_ref = weight.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(x_ref, w_ref[:V])
    ref = F.cross_entropy(logits.float().reshape(-1, V), target.reshape(-1), reduction="none")
    (ref * token_w.reshape(-1)).sum().backward()
    x = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(x, w, target, group=None, vocab_start=0, vocab_size=V,
                                    chunk_tokens=7)
    assert loss.dtype == torch.float32
    (loss * token_w).sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    assert rel_err(loss.detach(), ref.view(S, B).detach()) < 2e-2
    assert rel_err(x.grad, x_ref.grad) < 3e-2
    assert rel_err(w.grad, w_ref.grad) < 3e-2
    # and the bf16 result is close to, but not the same as, the fp32 one (autocast took effect)
    fp32 = linear_cross_entropy(hidden, weight, target, group=None, vocab_start=0, vocab_size=V)
    assert 0 < rel_err(loss.detach(), fp32) < 2e-2


def test_no_grad_computes_loss_only():
    vp, weight, hidden, target, _ = inputs(1)
    ref_loss, _ = reference(weight, hidden, target, torch.ones(S, B))
    x = hidden.clone().requires_grad_(True)
    with torch.no_grad():
        loss = linear_cross_entropy(x, weight, target, group=None, vocab_start=0, vocab_size=V,
                                    chunk_tokens=7)
    assert loss.grad_fn is None and rel_err(loss, ref_loss) < PARITY_RTOL


def test_backward_twice_raises_and_bad_shapes():
    vp, weight, hidden, target, _ = inputs(1)
    x = hidden.clone().requires_grad_(True)
    loss = linear_cross_entropy(x, weight, target, group=None, vocab_start=0, vocab_size=V)
    loss.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.sum().backward()
    with pytest.raises(ValueError):
        linear_cross_entropy(x, weight[:, :-1], target, group=None, vocab_start=0, vocab_size=V)
    with pytest.raises(ValueError):
        linear_cross_entropy(x, weight, target.t(), group=None, vocab_start=0, vocab_size=V)


def test_default_chunk_rule():
    from loom.parallel.cross_entropy_cost import GEMM_CHUNK_ELEMENTS
    # 4096 tokens while their logits fit 512 Mi elements, clamped to [1, N]: GPT-2 small's
    # shape (b 8 and 16, s 1024) in 2 and 4 chunks, Llama 3 8B's at s 8192 in 2 (not 32)
    assert default_chunk_tokens(8192, 768, 32000) == 4096
    assert default_chunk_tokens(16384, 768, 32000) == 4096
    assert default_chunk_tokens(8192, 4096, 128256) == 4096
    assert default_chunk_tokens(30, 16, 384) == 30
    assert default_chunk_tokens(2048, 256, 8192) == 2048
    # Gemma 3's V 262144: 2048 tokens (2 GiB fp32 logits); past 4 Mi rows the other rules rule:
    # >= 128 tokens, logits of max(N h, 4 Mi) elements (Liger's rule), N / 8 within 32 Mi
    assert default_chunk_tokens(16384, 2560, 262144) == GEMM_CHUNK_ELEMENTS // 262144 == 2048
    assert default_chunk_tokens(2048, 256, 1 << 23) == 128
    assert default_chunk_tokens(1 << 18, 8192, 1 << 23) == ((1 << 18) * 8192) >> 23 == 256
    # the chunk's logits never exceed max(N h, 512 Mi) elements (past 128 tokens)
    for n, h, v in ((8192, 4096, 128256), (131072, 16384, 16032), (1 << 20, 8192, 202048)):
        c = default_chunk_tokens(n, h, v)
        assert c * v <= max(n * h + v, GEMM_CHUNK_ELEMENTS) or c == 128, (n, h, v, c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bytes_are_the_planners(dtype):
    """What the loss saves for backward beyond its inputs (counted by autograd's saved-tensor
    hooks) is :func:`loom.parallel.cross_entropy_cost.saved_bytes`, the planner's ``loom``
    runtime term (memory_runtime.logits_bytes): fp32 dL/dx, dL/dw and log-sum-exp, for fp32
    and 16-bit inputs alike; and no tensor of the logits' size is saved."""
    from loom.parallel.cross_entropy_cost import saved_bytes
    _, weight, hidden, target, _ = inputs(1)
    weight = weight.to(dtype).requires_grad_()
    hidden = hidden.to(dtype).requires_grad_()
    inputs_ptrs = {hidden.untyped_storage().data_ptr(), weight.untyped_storage().data_ptr(),
                   target.untyped_storage().data_ptr()}
    saved = []

    def pack(x):
        if x.untyped_storage().data_ptr() not in inputs_ptrs:
            saved.append(x.numel() * x.element_size())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss = linear_cross_entropy(hidden, weight, target, group=None, vocab_start=0,
                                    vocab_size=V, chunk_tokens=7)
    loss.sum().backward()
    n = S * B
    assert sum(saved) == saved_bytes(n, H, weight.shape[0]) == 4 * (n * H + weight.shape[0] * H + n)
    assert max(saved) < n * weight.shape[0] * 4  # never the fp32 logits [N, Vp]


@pytest.mark.parametrize("scale", [1.0, 40.0])
def test_vocab_tiles_and_extreme_logits(monkeypatch, scale):
    """V = 2500 crosses the forward GEMM's 1024-column tiles (last tile partial); ``scale`` 40
    gives logits of several hundred, so most probabilities (targets included) underflow in fp32:
    the loss must stay finite and exact (``lse`` comes from the row maximum, not from the
    target's probability). Reference: ``F.cross_entropy`` in fp64."""
    import loom.parallel.cross_entropy as ce
    monkeypatch.setattr(ce, "GEMM_TILE_COLUMNS", 1024)
    g = torch.Generator().manual_seed(5)
    v, n, h = 2500, 37, 16
    weight = torch.randn(v, h, generator=g)
    hidden = torch.randn(n, h, generator=g) * scale
    target = torch.randint(0, v, (n,), generator=g)
    x = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    loss = linear_cross_entropy(x, w, target, group=None, vocab_start=0, vocab_size=v,
                                chunk_tokens=16)
    loss.mean().backward()
    x64 = hidden.double().requires_grad_(True)
    w64 = weight.double().requires_grad_(True)
    ref = F.cross_entropy(x64 @ w64.t(), target, reduction="none")
    ref.mean().backward()
    assert torch.isfinite(loss).all()
    if scale > 1:
        assert ref.max() > 200  # the case the old target-probability route could not represent
    # logits of ~500 carry fp32 rounding of 500 * 2^-24 = 3e-5 into exp(): any fp32
    # softmax is that far from fp64 there
    tol = PARITY_RTOL if scale == 1 else 1e-4
    assert rel_err(loss.detach().double(), ref.detach()) < tol
    assert rel_err(x.grad.double(), x64.grad) < tol
    assert rel_err(w.grad.double(), w64.grad) < tol
