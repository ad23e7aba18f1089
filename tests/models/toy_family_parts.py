"""The parts the two toy families of tests/models share (test_model_family.py's ``ToyLM``,
test_toy_family.py's ``MlpLM``): the residual MLP block, the parallel plan and the
initializers. Plain ``nn`` math and loom's public plan and init API, nothing of ``loom/``
changed. A plain module beside the tests, not a test file."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from loom.config import ModelConfig
from loom.models.family import StageSpec
from loom.models.init import by_pattern, normal_init, ones_init, vocab_padded_init, zeros_init
from loom.parallel.plan import (ColwiseParallel, PlanContext, RowwiseParallel,
                                VocabEmbeddingParallel, VocabHeadParallel)


class Block(nn.Module):
    def __init__(self, h: int, f: int):
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, f)
        self.fc2 = nn.Linear(f, h)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def toy_plan(cfg: ModelConfig, stage: StageSpec, ctx: PlanContext) -> list:
    return [("embed", VocabEmbeddingParallel(cfg.vocab_size)),
            ("layers.*.fc1", ColwiseParallel()),
            ("layers.*.fc2", RowwiseParallel()),
            ("out", ColwiseParallel(vocab=True)),
            ("head", VocabHeadParallel(cfg.vocab_size))]


def toy_init(cfg: ModelConfig):
    vocab = vocab_padded_init(normal_init(0.02), cfg.vocab_size)
    return by_pattern([("*.bias", zeros_init), ("*norm.weight", ones_init),
                       ("embed.weight", vocab), ("out.weight", vocab),
                       ("*", normal_init(0.02))])
