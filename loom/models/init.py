"""Initializers of full (unsharded) tensors: ``fn(shape, generator) -> tensor``.

A model family maps each parameter name to one of these; the parallel plan stores it in the
parameter registry and :func:`loom.parallel.registry.initialize` applies it with a generator
seeded by the parameter's name, so every layout starts from the same weights.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

InitFn = Callable[[tuple, torch.Generator], torch.Tensor]


def normal_init(std: float) -> InitFn:
    """N(0, std^2) (Megatron's ``init_method_normal``)."""
    return lambda shape, g: torch.empty(shape).normal_(0.0, std, generator=g)


def scaled_normal_init(std: float, num_layers: int, multiplier: float = 2.0) -> InitFn:
    """N(0, (std / sqrt(multiplier L))^2) for output projections (Megatron's
    ``scaled_init_method_normal``, multiplier 2: GPT-2 paper sec. 2.3; 1 for a hybrid model,
    Megatron-Core's ``TransformerConfig.is_hybrid_model``)."""
    return normal_init(std / math.sqrt(multiplier * num_layers))


def xavier_uniform_init(shape, g):
    """``U(-a, a)``, ``a = sqrt(6 / (fan_in + fan_out))`` with ``fan_out, fan_in = shape[-2:]``
    of a ``[out, in]`` weight (Glorot & Bengio 2010, eq. 16; ``torch.nn.init.xavier_uniform_``,
    Megatron's ``--init-method-xavier-uniform``). Raises ValueError for fewer than 2
    dimensions (no fans)."""
    if len(shape) < 2:
        raise ValueError(f"Xavier initialization needs a matrix, got shape {tuple(shape)}")
    bound = math.sqrt(6.0 / (shape[-1] + shape[-2]))
    return torch.empty(shape).uniform_(-bound, bound, generator=g)


class LinearInits(NamedTuple):
    """Megatron's three initializers (``TransformerConfig``): ``hidden`` (``init_method``),
    ``output`` (``output_layer_init_method``: attention's and the MLP's output projections),
    ``embedding`` (``embedding_init_method``: word and position tables)."""

    hidden: InitFn
    output: InitFn
    embedding: InitFn


def linear_inits(cfg: Any, hidden_std: Optional[float] = None) -> LinearInits:
    """The :class:`LinearInits` of model config ``cfg``: N(0, s^2) with s = ``hidden_std``
    (default ``--init-method-std``; muP passes its width-scaled std), output projections
    N(0, s^2 / (2 L)) (N(0, s^2 / L) in a hybrid stack, ``--hybrid-override-pattern``: Megatron
    sets ``is_hybrid_model`` from the pattern, ``megatron/training/argument_utils.py``), embeddings N(0, ``--embedding-init-method-std``^2) (default
    ``--init-method-std``, unscaled); ``--init-method-xavier-uniform``: :func:`xavier_uniform_init`
    for the first two, and for the embeddings unless ``--embedding-init-method-std`` gives them
    another std (``ModelConfig.embedding_std``; :mod:`loom.config.model_variants`)."""
    std = cfg.init_method_std if hidden_std is None else hidden_std
    if cfg.init_method_xavier_uniform:
        hidden = output = xavier_uniform_init
    else:
        hybrid = getattr(cfg, "hybrid_override_pattern", None) is not None
        hidden = normal_init(std)
        output = scaled_normal_init(std, cfg.num_layers, 1.0 if hybrid else 2.0)
    e = cfg.embedding_std
    return LinearInits(hidden, output, hidden if e is None else normal_init(e))


def vocab_padded_init(init_fn: InitFn, vocab_size: int) -> InitFn:
    """``init_fn`` on the true ``[V, ...]`` rows, zeros on the padding rows ``[V, Vp)``, so the
    weights do not depend on the padded size (hence on t)."""
    def init(shape, g):
        w = init_fn((vocab_size, *shape[1:]), g)
        return torch.cat([w, torch.zeros(shape[0] - vocab_size, *shape[1:])], dim=0)
    return init


def zeros_init(shape, g):
    return torch.zeros(shape)


def ones_init(shape, g):
    return torch.ones(shape)


def a_log_init(shape, g):
    """``log(A0)``, ``A0 ~ U[1, 16]`` per head (mamba_ssm's and Megatron's GatedDeltaNet's
    ``A_init_range``; the decay rate is ``-exp(A_log)``)."""
    return torch.empty(shape).uniform_(1.0, 16.0, generator=g).log()


def conv_init(shape, g):
    """PyTorch's Conv1d default bound ``1/sqrt(k)`` (fan-in of a depthwise kernel of width
    k, the last dimension)."""
    bound = 1.0 / math.sqrt(shape[-1])
    return torch.empty(shape).uniform_(-bound, bound, generator=g)


def by_pattern(rules: Sequence[tuple[str, InitFn]]) -> Callable[[str], InitFn]:
    """``name -> InitFn`` from ``(fnmatch pattern, init)`` rules; the first match wins.
    Raises KeyError naming a parameter that no rule covers."""
    def lookup(name: str) -> InitFn:
        for pattern, fn in rules:
            if fnmatch.fnmatchcase(name, pattern):
                return fn
        raise KeyError(f"no initializer rule matches parameter {name}")
    return lookup


def trunc_normal_init(std: float, a: float = -2.0, b: float = 2.0) -> InitFn:
    """N(0, std^2) redrawn outside ``[a, b]`` (absolute bounds; ``torch.nn.init.
    trunc_normal_``, whose defaults +-2 torchtitan's ``trunc_normal_`` keeps)."""
    return lambda shape, g: torch.nn.init.trunc_normal_(torch.empty(shape), 0.0, std, a, b,
                                                        generator=g)


def _glu_rows(gate: InitFn, up: InitFn) -> InitFn:
    """A fused gated-MLP ``linear_fc1 [2f, h]``: the gate rows ``[0, f)`` from ``gate``, the up
    (linear) rows ``[f, 2f)`` from ``up``."""
    def init(shape, g):
        half = (shape[0] // 2, *shape[1:])
        return torch.cat([gate(half, g), up(half, g)], dim=0)
    return init


def torchtitan_init(cfg: Any) -> Callable[[str], InitFn]:
    """``name -> InitFn`` of ``--torchtitan-init``: torchtitan v0.2.2's ``init_weights`` of its
    Llama 3 / Qwen3 / DeepSeek-V3 / Llama 4 models and ``torchtitan/models/moe/moe.py`` on
    loom's parameter names (``layers.<l>.`` is the global layer index ``l``):

    * ``embedding.word_embeddings``: N(0, 1) (``nn.init.normal_``); tied to the output, the
      output's init (torchtitan re-initializes the shared tensor as the output);
    * ``output_layer``: N(0, 1 / h) cut at 3 std;
    * in layer ``l``, with ``s_l = 0.02 / sqrt(2 (l + 1))`` (its ``depth_init``): the attention
      output ``linear_proj``, every MLP's (dense, routed or shared expert) down ``linear_fc2``
      and up half of ``linear_fc1``, the router: N(0, s_l^2); every other attention projection
      and the gate half of ``linear_fc1``: N(0, 0.02^2); each cut at +-2 (absolute);
    * norms one, biases and the load-balancing bias zero;
    * gpt-oss (``--softmax-type learnable``; ``torchtitan/models/gpt_oss/model/``): every
      tensor of layer ``l`` N(0, s_l^2), weights, biases and sinks alike, but the norms and the
      router's bias (zero: torchtitan's ``init_weights`` leaves it as the module was built).

    Raises KeyError naming a parameter no rule covers."""
    h = cfg.hidden_size
    out = trunc_normal_init(h ** -0.5, -3 * h ** -0.5, 3 * h ** -0.5)
    emb = (lambda shape, g: torch.empty(shape).normal_(0.0, 1.0, generator=g)) \
        if cfg.untie_embeddings_and_output_weights else out
    base = trunc_normal_init(0.02)
    gpt_oss = cfg.softmax_type == "learnable"
    fixed = by_pattern([
        ("embedding.word_embeddings.weight", vocab_padded_init(emb, cfg.vocab_size)),
        ("output_layer.weight", vocab_padded_init(out, cfg.vocab_size)),
        ("*.router.expert_bias", zeros_init), ("*.router.bias", zeros_init),
        ("*norm.weight", ones_init),
        *([] if gpt_oss else [("*.bias", zeros_init)]),
    ])

    def lookup(name: str) -> InitFn:
        try:
            return fixed(name)
        except KeyError:
            pass
        parts = name.split(".")
        if parts[0] != "layers" or not parts[1].isdigit():
            raise KeyError(f"no torchtitan initializer rule matches parameter {name}")
        depth = trunc_normal_init(0.02 / math.sqrt(2 * (int(parts[1]) + 1)))
        if gpt_oss:
            return depth
        if parts[-1] != "weight":
            raise KeyError(f"no torchtitan initializer rule matches parameter {name}")
        if parts[2] == "self_attention":
            return depth if parts[-2] == "linear_proj" else base
        if parts[2] == "mlp" and parts[-2] == "linear_fc1":
            return _glu_rows(base, depth)
        if parts[2] == "mlp" and parts[-2] in ("linear_fc2", "router"):
            return depth
        raise KeyError(f"no torchtitan initializer rule matches parameter {name}")
    return lookup
