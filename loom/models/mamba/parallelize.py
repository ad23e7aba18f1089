"""How the Mamba / hybrid model is parallelized: its plan and its initializers.

Tensor parallelism as Megatron-LM splits a Mamba-2 layer: the in-projection is column-parallel
with each fused block ``(z, x, B, C, dt)`` split over TP (rank r holds heads
``[r H/t, (r+1) H/t)`` and groups ``[r G/t, (r+1) G/t)``; heads stay with their group because
``H/G`` heads share a group); the conv, the scan, ``A_log``, ``D``, ``dt_bias`` and the gated
norm (normalized per group) run on those heads alone; the out-projection is row-parallel. One
all-reduce forward (out-projection ``g``) and one backward (in-projection ``f``) per Mamba
layer, like an MLP; a Mamba + MLP pair costs 2 + 2, like a transformer layer. Context
parallelism: the mixer's scan core runs on the whole sequence of ``H/(t c)`` heads between two
all-to-alls over CP (:mod:`loom.parallel.context.mamba`). Attention and MLP
layers of a hybrid stack, the embedding, output layer and sequence parallelism use the shared
decoder plan unchanged (:mod:`loom.models.parallelize`, GPT's too).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from loom.config import ModelConfig
from loom.models.family import StageSpec
from loom.models.init import (a_log_init, by_pattern, conv_init, linear_inits, ones_init,
                              zeros_init)
from loom.models.mamba.model import mamba_sizes
from loom.models.parallelize import decoder_init, decoder_plan
from loom.parallel.mamba_styles import ChannelParallelParams, ContextParallelMambaScan
from loom.parallel.plan import ColwiseParallel, PlanContext, RowwiseParallel

DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 1e-1, 1e-4  # mamba_ssm's dt initialization range


def plan(cfg: ModelConfig, stage: StageSpec, ctx: PlanContext) -> list:
    """``[(module pattern, style)]``: the shared decoder plan (attention, MLP, vocabulary, SP)
    plus the Mamba mixers'."""
    z = mamba_sizes(cfg)
    return decoder_plan(cfg, stage, ctx) + [
        ("layers.*.mixer.in_proj", ColwiseParallel(segments=z["in_segments"])),
        ("layers.*.mixer.conv1d", ChannelParallelParams((("weight", z["conv_segments"]),
                                                         ("bias", z["conv_segments"])))),
        ("layers.*.mixer", ChannelParallelParams((("A_log", None), ("D", None),
                                                  ("dt_bias", None)))),
        ("layers.*.mixer.norm", ChannelParallelParams((("weight", None),))),
        ("layers.*.mixer.scan", ContextParallelMambaScan()),
        ("layers.*.mixer.out_proj", RowwiseParallel()),
    ]  # the pre-mixer norm is "layers.*.input_layernorm": sequence-parallel by the shared plan


def dt_bias_init(shape, g):
    """softplus^-1 of ``dt ~ exp(U[log 1e-3, log 1e-1])`` floored at 1e-4 (mamba_ssm)."""
    u = torch.rand(shape, generator=g)
    dt = torch.exp(u * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN)).clamp(min=DT_FLOOR)
    return dt + torch.log(-torch.expm1(-dt))


def init(cfg: ModelConfig) -> Callable:
    """``name -> InitFn``: the Mamba parameters as mamba_ssm initializes them, the
    out-projection scaled like Megatron's output projections (1/sqrt(L) in a hybrid stack,
    1/sqrt(2L) without ``--hybrid-override-pattern``: :func:`loom.models.init.linear_inits`; Xavier-uniform under
    ``--init-method-xavier-uniform``), the rest as the shared decoder
    (:func:`loom.models.parallelize.decoder_init`)."""
    mamba = by_pattern([
        ("*.mixer.A_log", a_log_init),
        ("*.mixer.D", ones_init),
        ("*.mixer.dt_bias", dt_bias_init),
        ("*.mixer.conv1d.weight", conv_init),
        ("*.mixer.conv1d.bias", zeros_init),
        ("*.mixer.out_proj.weight", linear_inits(cfg).output),
    ])
    decoder = decoder_init(cfg)

    def lookup(name: str):
        try:
            return mamba(name)
        except KeyError:
            return decoder(name)
    return lookup
