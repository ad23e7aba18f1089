"""Forward and backward over the micro-batches of one global batch, without a pipeline.

The pipeline package provides the same signature for GPipe / 1F1B / interleaved schedules; the
trainer picks one with :func:`loom.training.step.get_forward_backward_func`.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch

from loom.parallel.data import GradientReducer


def forward_backward_no_pipelining(model_chunks: Sequence[torch.nn.Module], batches: Sequence[dict],
                                   reducers: Sequence[GradientReducer], **_) -> torch.Tensor:
    """Run every micro-batch forward and backward; reduce gradients on the last.

    ``batches``: m dicts with ``tokens``/``labels`` ``[b, s]``. Each micro-batch's mean token loss
    is divided by m, so the accumulated gradient is that of the mean over the global batch (the
    DP average in the reducer completes it). Returns the mean loss of this rank's micro-batches
    (detached scalar).
    """
    (model,), (reducer,) = model_chunks, reducers
    m = len(batches)
    total = torch.zeros((), dtype=torch.float32, device=batches[0]["tokens"].device)
    for j, batch in enumerate(batches):
        ctx = reducer.no_sync() if j < m - 1 else contextlib.nullcontext()
        with ctx:
            loss = model(batch["tokens"], batch["labels"]).mean() / m
            loss.backward()
        total += loss.detach().float()  # stays on the device: no host sync per micro-batch
    return total.cpu()


def get_forward_backward_func(pipeline_size: int, schedule: str) -> Callable:
    """The schedule for ``--pipeline-model-parallel-size`` and ``--pipeline-schedule``."""
    if pipeline_size == 1:
        return forward_backward_no_pipelining
    from loom.parallel.pipeline import get_schedule  # noqa: WPS433 - optional heavy import
    return get_schedule(schedule)
