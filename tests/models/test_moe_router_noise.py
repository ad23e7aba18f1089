"""The MoE router's noise options, single process (~3 s): ``--moe-input-jitter-eps`` against
Megatron-Core 0.16.1's ``TopKRouter.apply_input_jitter`` (the same draw, equal), on the router's
input only; ``--moe-router-force-biased`` (Megatron-LM d98e8a6's ``apply_biased_logits``, which
0.16.1 predates) by hand from the default generator. Refusals: tests/models/test_moe_routers.py.
"""

from __future__ import annotations

import torch

from testkit.config import PARITY_ADAM_EPS, tiny_config


def make_cfg(**model):
    return tiny_config("moe", {"num_experts": 8, "moe_router_topk": 4, **model},
                       global_batch_size=8, adam_eps=PARITY_ADAM_EPS)


def test_input_jitter_matches_megatron_core():
    """--moe-input-jitter-eps: loom's jitter is Megatron-Core 0.16.1's
    ``TopKRouter.apply_input_jitter`` (the same uniform draw from the same generator state,
    the same ops: equal), it reaches the router's logits only (the experts get the plain
    tokens) and the gradient flows through it; without the flag the logits differ."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe.router import TopKRouter as MegatronRouter

    from loom.models.moe import MoELayer
    from loom.models.moe_router import input_jitter
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(0))
    fake = SimpleNamespace(config=SimpleNamespace(moe_input_jitter_eps=0.1), input_jitter=None)
    torch.manual_seed(5)
    want = MegatronRouter.apply_input_jitter(fake, x)
    torch.manual_seed(5)
    got = input_jitter(x, 0.1)
    assert torch.equal(got, want) and not torch.equal(got, x)
    assert float(((got / x) - 1).abs().max()) <= 0.1 + 1e-6
    cfg = make_cfg(moe_input_jitter_eps=0.1, moe_shared_expert_intermediate_size=16).validate(1)
    layer = MoELayer(cfg.model, 0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(p.numel()))
    seen = {}

    def keep(name, pick):
        def hook(mod, args, out):  # returns None: the output stays
            seen.setdefault(name, pick(args, out))
        return hook
    layer.router.register_forward_hook(keep("router", lambda a, out: out))
    layer.dispatcher.register_forward_hook(keep("routed", lambda a, out: a[0]))
    xs = torch.randn(6, 4, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.manual_seed(7)
    layer(xs).sum().backward()
    torch.manual_seed(7)
    jittered = input_jitter(xs.detach().reshape(24, 32), 0.1)
    logits = torch.nn.functional.linear(jittered, layer.router.weight)
    assert torch.equal(seen["router"].experts, logits.topk(4, -1).indices)
    assert torch.equal(seen["routed"], xs.detach().reshape(24, 32))  # the experts: plain
    assert xs.grad is not None and layer.router.weight.grad.abs().sum() > 0
    plain = torch.nn.functional.linear(xs.detach().reshape(24, 32), layer.router.weight)
    assert not torch.allclose(plain, logits)


def test_force_biased_adds_a_shared_random_bias():
    """--moe-router-force-biased (benchmarks; Megatron-LM d98e8a6 ``apply_biased_logits``,
    not in megatron-core 0.16.1): N(0, 1) logits plus a per-expert N(0, std^2) bias, by hand
    from the default generator; std < 0 keeps one bias per router across forwards (the load
    piles on its largest entries), std > 0 draws a new one each time; the router gets the
    straight-through gradient."""
    from loom.models.moe_router import TopKRouter
    x = torch.ones(512, 32)
    for std in (-3.0, 3.0):
        router = TopKRouter(make_cfg(moe_router_force_biased=std).validate(1).model)
        torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(0))
        torch.manual_seed(11)
        first = router(x, (512, 1))
        torch.manual_seed(11)
        want = torch.randn(512, 8) + torch.randn(8) * abs(std)
        assert torch.equal(first.experts, want.topk(4, -1).indices)
        torch.manual_seed(12)
        second = router(x, (512, 1))
        torch.manual_seed(12)
        again = torch.randn(512, 8) + (torch.randn(8) * abs(std) if std > 0 else
                                       router._forced_bias)
        assert torch.equal(second.experts, again.topk(4, -1).indices)
        if std < 0:  # the kept bias: its 4 largest entries take most assignments (not half)
            top = set(router._forced_bias.topk(4).indices.tolist())
            assert sum(int(second.counts[e]) for e in top) > 0.75 * 512 * 4
        second.weights.sum().backward()
        assert router.weight.grad is not None
