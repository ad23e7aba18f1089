"""Which parameters weight decay reaches (loom/training/param_groups.py):

* Megatron's rule, and ``--apply-wd-to-qk-layernorm`` (Qwen3-Next's: the query / key norms
  decayed too), equal to megatron-core's own ``get_standard_config_overrides`` on every
  parameter of a loom model with biases and QK norms;
* ``--weight-decay-norms-and-biases``: every parameter, as torchtitan's optimizer (``torch.optim.
  AdamW`` over ``model.parameters()``) decays them, and a torchtitan config sets it;
* active: one AdamW step with zero gradients shrinks exactly the decayed parameters by
  ``1 - lr wd``;
* ``--no-decoupled-weight-decay``: the original Adam, ``torch.optim.Adam`` with the L2 term in
  the gradient (Megatron-Core's ``decoupled_weight_decay=False``), step for step; a torchtitan
  config with ``[optimizer] name = "Adam"`` sets it."""

from __future__ import annotations

import pytest
import torch

from loom.config import LoomConfig
from loom.errors import ConfigError


def _config(**training) -> LoomConfig:
    flat = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                max_position_embeddings=16, vocab_size=64, micro_batch_size=1, lr=1e-2,
                min_lr=1e-2, train_iters=4, mock_data=True, qk_layernorm=True,
                weight_decay=0.1, lr_decay_style="constant", **training)
    return LoomConfig.from_flat(flat).validate(1)


def _model(cfg):
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    return build_model(get_family(cfg.model.model_type), cfg.model, ParallelMesh.single(), seed=0)


def _decayed(cfg) -> dict:
    from loom.training.optimizer import decoupled_group
    from loom.training.param_groups import group_plan
    plan = group_plan(cfg.training, cfg.model, decoupled_group(cfg.training))
    return {n: plan.kind_of(n, p, False).decay for n, p in _model(cfg).named_parameters()}


@pytest.mark.parametrize("qk", [False, True])
def test_megatrons_rule_is_megatron_cores(qk):
    from megatron.core.optimizer import get_standard_config_overrides
    from megatron.core.optimizer.optimizer_config import OptimizerConfig
    cfg = _config(apply_wd_to_qk_layernorm=qk)
    overrides = get_standard_config_overrides(OptimizerConfig(apply_wd_to_qk_layernorm=qk))
    model = _model(cfg)
    ours = _decayed(cfg)
    names = {n for n, _ in model.named_parameters()}
    assert any(".bias" in n for n in names) and any("q_layernorm" in n for n in names)
    for n, p in model.named_parameters():
        mult = 1.0
        for key, over in overrides.items():
            if key.matches(p, n) and "wd_mult" in over:
                mult = over["wd_mult"]
        assert ours[n] == (mult == 1.0), (n, qk)
    assert ours["layers.0.self_attention.q_layernorm.weight"] is qk
    assert not ours["layers.0.input_layernorm.weight"]


def test_decay_of_every_parameter_is_torchtitans():
    from loom.config.torchtitan import torchtitan_fields
    cfg = _config(weight_decay_norms_and_biases=True)
    assert all(_decayed(cfg).values())
    assert torchtitan_fields({"model": {"name": "llama3"}})["weight_decay_norms_and_biases"]
    with pytest.raises(ConfigError, match="--weight-decay-norms-and-biases with "
                                          "--apply-layernorm-1p"):
        _config(weight_decay_norms_and_biases=True, apply_layernorm_1p=True)


@pytest.mark.parametrize("flag", ["", "apply_wd_to_qk_layernorm", "weight_decay_norms_and_biases"])
def test_one_step_decays_what_the_rule_says(flag):
    """AdamW with zero gradients: a decayed parameter becomes p (1 - lr wd), the others stay."""
    from loom.training.optimizer import build_optimizer
    cfg = _config(**({flag: True} if flag else {}))
    model = _model(cfg)
    decayed = _decayed(cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt = build_optimizer(model, cfg.training, model_cfg=cfg.model)
    opt.step()
    lr, wd = cfg.training.lr, cfg.training.weight_decay
    for n, p in model.named_parameters():
        want = before[n] * (1 - lr * wd) if decayed[n] else before[n]
        torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=0, msg=n)
    assert any(decayed.values())
    assert all(decayed.values()) == (flag == "weight_decay_norms_and_biases")


def test_coupled_weight_decay_is_torch_adam():
    from loom.config.torchtitan import torchtitan_fields
    from loom.training.optimizer import build_optimizer
    cfg = _config(decoupled_weight_decay=False)
    model = _model(cfg)
    decayed = _decayed(cfg)
    ref = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    t = cfg.training
    torch_adam = torch.optim.Adam(
        [{"params": [ref[n] for n in ref if decayed[n]], "weight_decay": t.weight_decay},
         {"params": [ref[n] for n in ref if not decayed[n]], "weight_decay": 0.0}],
        lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    opt = build_optimizer(model, t, model_cfg=cfg.model)
    assert type(opt).__name__ == "Adam"
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        for n, p in model.named_parameters():
            p.grad = torch.randn(p.shape, generator=g) * 0.01
            ref[n].grad = p.grad.clone()
        opt.step()
        torch_adam.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref[n].detach(), rtol=1e-6, atol=1e-7, msg=n)
    flat = torchtitan_fields({"model": {"name": "llama3"}, "optimizer": {"name": "Adam"}})
    assert flat["decoupled_weight_decay"] is False
    for bad, match in ((dict(optimizer="sgd"), "--optimizer sgd has its own"),):
        with pytest.raises(ConfigError, match=match):
            _config(decoupled_weight_decay=False, **bad)
