"""Two of issue 27's tracebacks are one line now: a prompt longer than the model's learned
positions (a ConfigError naming the flags and the largest valid --max-new-tokens, before any
forward pass) and a model that cannot be allocated (``loom train`` exits 1 with one line
naming --dry-run and ``loom plan``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from loom.config import ModelConfig
from loom.errors import ConfigError


def test_prompt_longer_than_positions_is_refused_with_the_fix():
    from loom.inference.generate import generate
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    cfg = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8,
                      vocab_size=50, make_vocab_size_divisible_by=8)
    model = build_model(get_family("gpt"), cfg, ParallelMesh.single()).eval()
    with pytest.raises(ConfigError, match=r"--max-position-embeddings 8: .*at most 2"):
        generate(model, [1, 2, 3, 4, 5, 6], 5)
    with pytest.raises(ConfigError, match="at most 0"):
        generate(model, list(range(1, 11)), 1)
    assert len(generate(model, [1, 2, 3, 4, 5, 6], 2)) == 2  # what fits still runs


@pytest.mark.parametrize("hidden", [2 ** 20, 2 ** 40])  # allocator refusal; size overflow
def test_a_model_that_cannot_be_allocated_is_one_line(hidden):
    run = subprocess.run(
        [sys.executable, "-m", "loom", "train", "--mock-data", "--vocab-size", "100",
         "--num-layers", "1", "--hidden-size", str(hidden), "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-3",
         "--no-progress-bar"], capture_output=True, text=True, timeout=120,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    lines = [x for x in run.stderr.splitlines() if x.strip()]
    assert run.returncode == 1, run.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert lines[0].startswith("loom train: error: out of memory") and "--dry-run" in lines[0]
