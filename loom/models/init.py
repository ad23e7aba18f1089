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
