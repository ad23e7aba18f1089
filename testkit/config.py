"""The tests' one config builder: :func:`tiny_config` (a :class:`LoomConfig`) and
:func:`tiny_model` (its :class:`ModelConfig`), with the pinned settings tests share.

A test states only what differs from the tiny run below, by flag name, flat (the names are
unique across the sections, as in ``LoomConfig.from_flat``)::

    tiny_config("llama", PRE_ISSUE_21, tensor_model_parallel_size=2, world=2)

``family`` picks the model's preset and its tiny shape (:data:`FAMILIES`); the positional
dicts (bundles such as :data:`PRE_ISSUE_21`) are applied in order, then the keywords: a later
value wins. Model fields go to the preset's constructor (as ``ModelConfig.llama(**kw)`` would
get them), the other fields to their section. tests/unit/test_testkit_guard.py refuses test
files that build a config any other way in a helper.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Optional

from loom.config import LoomConfig, ModelConfig, field_section
from loom.models import resolve_config

TINY_SHAPE: dict = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                        vocab_size=100, hidden_dropout=0.0, attention_dropout=0.0)
"""The shape every family starts from: L 2, h 32, a 4 (head dim 8; a and h split over t = 2
and 4), s 16 (splits over c = 2 into 4 chunks of 4 for the load-balanced halves), V 100 (Vp
128 with Megatron's ``--make-vocab-size-divisible-by`` 128), no dropout (runs compared from
the same seed draw no random masks). Forward and backward of such a model take ~1 ms on CPU."""

FAMILIES: dict[str, tuple[Callable[..., ModelConfig], dict]] = {
    "gpt": (ModelConfig.gpt2, {}),
    "llama": (ModelConfig.llama, dict(num_query_groups=2)),
    "mixtral": (ModelConfig.mixtral, {}),  # Megatron's Mixtral defaults (the planner's MoE)
    "moe": (ModelConfig.llama, dict(
        num_query_groups=2, seq_length=8, padded_vocab_size=104, num_experts=4,
        moe_router_topk=2, moe_ffn_hidden_size=24, moe_aux_loss_coeff=0.01,
        moe_z_loss_coeff=0.001)),
    "mamba": (ModelConfig.llama, dict(
        model_type="mamba", num_layers=4, num_query_groups=2, ffn_hidden_size=64,
        padded_vocab_size=104, mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2,
        mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=5)),
}
"""``{family: (ModelConfig preset, its fields over TINY_SHAPE)}``. gpt: GPT-2's layout
(LayerNorm, learned positions, GeLU). llama: RMSNorm, RoPE, SwiGLU, GQA with 2 query groups
(2 KV heads: one per rank at t = 2). moe: llama with every MLP (Megatron's default
``--moe-layer-freq``) 4 experts of width 24, top-2, aux and z losses (tests/models/test_moe.py's;
s 8, Vp 104 fixed so that every t has the same padded columns). mamba: a Mamba-2 stack (h 32,
d_inner 64 = 8 heads of P 8 in 2 groups, N 8, conv 4, chunk 5, which does not divide s 16);
give ``hybrid_override_pattern`` for a hybrid."""

PARITY_SHAPE: dict = dict(hidden_size=64, vocab_size=300, padded_vocab_size=384)
"""The parallel parity rows' width and vocabulary: h 64, V 300 with Vp 384 fixed
(``--padded-vocab-size``): the padded columns are in the softmax by default (Megatron's), so
every compared t needs the same ones (V padded to a multiple of 128 t is 384 at t = 1, 512
at t = 2)."""

TINY_RUN: dict = dict(mock_data=True, micro_batch_size=2, lr=1e-3, train_iters=100)
"""The run every tiny config starts from: mock data, b 2, lr 1e-3 (Megatron requires
``--lr`` and ``--train-iters``; 100 iterations make the LR schedule's first steps nearly
flat for tests that step a few times)."""

PRE_ISSUE_21: dict = dict(lr=3e-4, train_iters=100, adam_beta2=0.95, lr_decay_style="cosine")
"""loom's defaults before issue 21 (which made them Megatron's: ``--adam-beta2`` 0.999,
``--lr-decay-style`` linear, ``--lr`` and ``--train-iters`` required), pinned by the tests
written before it so that their numbers did not move."""

MEGATRON_DROPOUT: dict = dict(hidden_dropout=0.1, attention_dropout=0.1)
"""Megatron's default dropout (``--hidden-dropout``, ``--attention-dropout``), for tests
whose config kept it (TINY_SHAPE has none)."""

PARITY_ADAM_EPS = 1e-4
"""``--adam-eps`` of parity runs that compare after optimizer steps. Adam's first steps are
~lr * sign(g): with eps 1e-8 a gradient entry that is ~1e-10 of rounding noise moves by ~lr in
one run and not in the other (TP reordering noise in near-zero gradients, e.g. the padded
vocabulary columns; 1e-6 still let it reach 1.5e-5 of a gradient by step 3, issue 42). eps 1e-4
keeps the comparison about the parallel math, not amplified float noise."""


def _split(flat: dict) -> tuple[dict, dict]:
    """``flat`` into (model fields, {section: fields}); an unknown name raises TypeError."""
    where = field_section()
    unknown = sorted(set(flat) - set(where))
    if unknown:
        raise TypeError(f"tiny_config: no such field(s): {', '.join(unknown)}")
    model = {k: v for k, v in flat.items() if where[k] == "model"}
    sections: dict = {}
    for k, v in flat.items():
        if where[k] != "model":
            sections.setdefault(where[k], {})[k] = v
    return model, sections


def tiny_model(family: str = "gpt", *bundles: dict, **fields: Any) -> ModelConfig:
    """The family's tiny :class:`ModelConfig` (:data:`TINY_SHAPE` plus :data:`FAMILIES`'
    fields), then ``bundles`` and ``fields`` (model fields only), through the family's preset."""
    preset, own = FAMILIES[family]
    kw = {**TINY_SHAPE, **own}
    for b in bundles:
        kw.update(b)
    kw.update(fields)
    model, other = _split(kw)
    if other:
        raise TypeError(f"tiny_model: not model fields: {sorted(other)}")
    return preset(**model)


def tiny_config(family: str = "gpt", *bundles: dict, model: Optional[ModelConfig] = None,
                world: Optional[int] = None, **flat: Any) -> LoomConfig:
    """A tiny :class:`LoomConfig`: :data:`TINY_RUN` and the family's :func:`tiny_model`, then
    ``bundles`` (dicts of flag names, in order), then ``flat``; a later value wins.

    ``model``: start from this ModelConfig (copied) instead of the family's; model fields in
    ``bundles``/``flat`` then replace its values. ``world``: return
    ``loom.models.resolve_config(cfg, world)`` (the resolved config, the family's own rules
    included), else the unresolved one.
    """
    kw = dict(TINY_RUN)
    for b in bundles:
        kw.update(b)
    kw.update(flat)
    model_kw, sections = _split(kw)
    if model is None:
        m = tiny_model(family, **model_kw)
    else:
        m = dataclasses.replace(copy.deepcopy(model), **model_kw)
    cfg = LoomConfig(model=m)
    for name, values in sections.items():
        for k, v in values.items():
            setattr(getattr(cfg, name), k, v)
    return cfg if world is None else resolve_config(cfg, world)
