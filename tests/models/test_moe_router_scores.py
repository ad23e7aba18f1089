"""``--moe-router-score-function sqrtsoftplus`` (Megatron-LM d98e8a6,
``megatron/core/transformer/moe/moe_utils.py::topk_routing_with_score_function``: scores
``sqrt(softplus(logits))`` in fp32, chosen by top-k (plus the expert bias when given), the top-k
normalized to sum 1 for k > 1; the auxiliary loss on the scores normalized over all experts).
Megatron-Core 0.16.1, the installed reference, predates it, so the reference is that function's
arithmetic written out here with other ops (``log1p(exp(x))``, a sort)."""

from __future__ import annotations

import math

import pytest
import torch

from loom.errors import ConfigError
from loom.models.moe_router import route
from testkit.config import tiny_config


def _reference(logits, k, bias=None):
    scores = torch.log1p(torch.exp(logits)).sqrt()
    order = torch.sort(scores + (0 if bias is None else bias), dim=-1, descending=True).indices
    experts = order[:, :k]
    top = scores.gather(1, experts)
    return experts, top / (top.sum(-1, keepdim=True) + 1e-20) if k > 1 else top


@pytest.mark.parametrize("k,bias", [(1, False), (2, False), (3, True)])
def test_sqrtsoftplus_routing_is_megatrons(k, bias):
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(16, 8, generator=g, dtype=torch.float64)
    b = torch.randn(8, generator=g, dtype=torch.float64) if bias else None
    r = route(logits, k, "sqrtsoftplus", aux_coeff=0.0, expert_bias=b)
    experts, weights = _reference(logits, k, b)
    assert torch.equal(r.experts.sort(-1).values, experts.sort(-1).values)
    order = r.experts.argsort(-1)
    torch.testing.assert_close(r.weights.gather(1, order),
                               weights.gather(1, experts.argsort(-1)), rtol=1e-12, atol=0)
    sigmoid = route(logits, k, "sigmoid", aux_coeff=0.0, expert_bias=b)
    assert not torch.allclose(sigmoid.weights, r.weights)  # another score function ran
    if bias:  # the bias changes the choice, never the weights' values
        plain = route(logits, k, "sqrtsoftplus", aux_coeff=0.0)
        assert not torch.equal(plain.experts.sort(-1).values, r.experts.sort(-1).values)


def test_aux_loss_uses_the_normalized_scores():
    """Switch's loss ``coeff E / (T k) sum_e n_e P_e`` with P the scores normalized over all E
    (Megatron's ``compute_routing_scores_for_aux_loss``)."""
    logits = torch.randn(32, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    r = route(logits, 2, "sqrtsoftplus", aux_coeff=0.1)
    scores = torch.log1p(torch.exp(logits)).sqrt()
    probs = scores / scores.sum(-1, keepdim=True)
    n = torch.nn.functional.one_hot(probs.topk(2, -1).indices, 8).sum((0, 1)).double()
    want = 0.1 * 8 / (32 * 2) * float((n * probs.sum(0)).sum()) / 32
    assert float(r.aux_loss) == pytest.approx(want, rel=1e-9) and math.isfinite(want)


def test_expert_bias_takes_sqrtsoftplus_and_softmax():
    """Megatron d98e8a6 allows the aux-loss-free bias with sigmoid or sqrtsoftplus scores; loom
    also with softmax, as torchtitan's router has it (the bias added to the probabilities)."""
    flags = dict(num_experts=8, moe_router_topk=2, moe_router_enable_expert_bias=True)
    tiny_config("moe", moe_router_score_function="sqrtsoftplus", **flags).validate(1)
    cfg = tiny_config("moe", moe_router_score_function="softmax", **flags).validate(1)
    from loom.training.script_checks import start_notes
    assert any("with softmax scores: the bias is added to the probabilities" in n
               for n in start_notes(cfg, {}))  # said once at start: Megatron refuses the pair


def _torchtitan_router(logits, k, bias, route_norm, route_scale=1.0, groups=None, limited=None):
    """torchtitan v0.2.2's ``TokenChoiceTopKRouter.forward`` with softmax scores, written out
    with other ops (a sort, a loop over tokens): the choice by probabilities + bias, node-
    limited to the ``limited`` groups of the highest top-2 sums, the weights the unbiased
    probabilities, normalized over the k when ``route_norm``, times ``route_scale``."""
    scores = torch.exp(logits - logits.logsumexp(-1, keepdim=True))
    choice = scores + bias
    experts = []
    for row in choice:
        if groups:
            per = row.view(groups, -1)
            best = torch.sort(per, -1, descending=True).values[:, :2].sum(-1)
            keep = torch.sort(best, descending=True).indices[:limited]
            row = torch.full_like(per, float("-inf")).index_copy(0, keep, per[keep]).view(-1)
        experts.append(torch.sort(row, descending=True).indices[:k])
    experts = torch.stack(experts)
    top = scores.gather(1, experts)
    if route_norm:
        top = top / (top.sum(-1, keepdim=True) + 1e-20)
    return experts, top * route_scale


@pytest.mark.parametrize("route_norm,groups", [(True, None), (False, None), (False, (4, 2))])
def test_softmax_with_expert_bias_is_torchtitans_router(route_norm, groups):
    """torchtitan's softmax routers (DeepSeek 16B: no renormalization, Megatron's
    --moe-router-pre-softmax; Qwen3-MoE: renormalized, Megatron's default softmax; DeepSeek
    236B: node-limited) with its load-balancing bias: the same experts and weights."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 16, generator=g, dtype=torch.float64)
    bias = torch.randn(16, generator=g, dtype=torch.float64) * 0.05  # moves some choices
    G, limited = groups or (None, None)
    r = route(logits, 4, "softmax", pre_softmax=not route_norm, expert_bias=bias,
              num_groups=G, group_topk=limited, scaling_factor=2.5)
    experts, weights = _torchtitan_router(logits, 4, bias, route_norm, 2.5, G, limited)
    assert torch.equal(r.experts.sort(-1).values, experts.sort(-1).values)
    order = r.experts.argsort(-1), experts.argsort(-1)
    torch.testing.assert_close(r.weights.gather(1, order[0]), weights.gather(1, order[1]),
                               rtol=1e-12, atol=1e-15)
    unbiased = route(logits, 4, "softmax", pre_softmax=not route_norm, num_groups=G,
                     group_topk=limited)
    assert not torch.equal(unbiased.experts.sort(-1).values, r.experts.sort(-1).values)