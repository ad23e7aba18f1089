"""Activation recomputation (Korthikanti et al. 2022, sec. 5) as wrappers that keep every name.

``--recompute-granularity full`` keeps only each selected layer's input and recomputes the layer
in backward; ``selective`` recomputes only the attention core (softmax, dropout, the s^2
activations): the modules marked :class:`~loom.parallel.interface.SelectiveRecompute`. A call
given a :class:`~loom.parallel.interface.NeverRecompute` argument (a generation KV cache) is
never recomputed. The wrappers replace a module instance's ``forward`` (``torch.utils.checkpoint``,
non-reentrant) instead of wrapping the module in another one, so a run with recompute has
exactly the parameter names, initial weights and checkpoints of a run without it.

Which layers (Megatron's ``--recompute-method`` / ``--recompute-num-layers N``): ``uniform``
divides the chunk's layers into groups of N and keeps only each group's input; ``block``
recomputes the first N layers of each chunk and keeps the rest's activations.

Dropout masks replay exactly: the default generator is restored by ``checkpoint`` and the
per-TP-rank generator (:class:`~loom.parallel.random.RNGTracker`) by :func:`checkpointed`. So
does state a module keeps across calls (:class:`~loom.parallel.interface.RecomputeReplay`: the
MoE router's ``global_aux_loss`` running load): the first run records what it read, the
recomputation takes it back instead of updating the state a second time.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from loom.parallel.interface import NeverRecompute, RecomputeReplay, SelectiveRecompute
from loom.parallel.random import RNGTracker


def checkpointed(fn: Callable, tracker: RNGTracker, module: nn.Module,
                 scope: Sequence[nn.Module] = ()) -> Callable:
    """``fn`` run under activation checkpointing while ``module`` trains with gradients; the
    per-TP-rank generator state at the first run is restored for the recomputation, and the
    :class:`~loom.parallel.interface.RecomputeReplay` modules inside ``module`` and ``scope``
    (the other layers ``fn`` runs) replay what their first run recorded."""
    replaying = [m for top in (module, *scope) for m in top.modules()
                 if isinstance(m, RecomputeReplay)]

    def run(*args, **kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return fn(*args, **kwargs)
        if any(isinstance(a, NeverRecompute) for a in (*args, *kwargs.values())):
            return fn(*args, **kwargs)  # generation with a KV cache is never recomputed
        saved = None if tracker.state is None else tracker.state.clone()
        calls = [0]
        logs: list[list] = [[] for _ in replaying]  # this call's records, one list per module

        def replay(*a):
            calls[0] += 1
            first = calls[0] == 1
            for m, log in zip(replaying, logs):
                m.replay_mode, m.replay_log = ("record", log) if first else ("replay", list(log))
            try:
                if first or saved is None:
                    return fn(*a, **kwargs)
                current, tracker.state = tracker.state, saved.clone()
                try:
                    return fn(*a, **kwargs)
                finally:
                    tracker.state = current
            finally:
                for m in replaying:
                    m.replay_mode, m.replay_log = None, None
        return checkpoint(replay, *args, use_reentrant=False)
    return run


def _pass_through(x, *args, **kwargs):
    return x


def apply_recompute(chunk: nn.Module, granularity: Optional[str], tracker: RNGTracker,
                    method: str = "uniform", num_layers: int = 1) -> None:
    """Install recomputation on ``chunk`` (its transformer layers are ``chunk.layers``, a
    ModuleDict in order). Raises ValueError for an unknown granularity or method."""
    if granularity is None:
        return
    if granularity == "selective":
        for m in chunk.modules():
            if isinstance(m, SelectiveRecompute):
                m.forward = checkpointed(m.forward, tracker, m)
        return
    if granularity != "full":
        raise ValueError(f"--recompute-granularity must be full or selective, got {granularity}")
    layers = list(chunk.layers.values())
    n = max(1, num_layers)
    if method == "block":
        for layer in layers[:n]:
            layer.forward = checkpointed(layer.forward, tracker, layer)
    elif method == "uniform":
        for start in range(0, len(layers), n):
            group = layers[start:start + n]
            forwards = [layer.forward for layer in group]

            def run_group(x, *args, _forwards=forwards, **kwargs):
                for f in _forwards:
                    x = f(x, *args, **kwargs)
                return x
            group[0].forward = checkpointed(run_group, tracker, group[0], group[1:])
            for layer in group[1:]:  # computed by the group's first layer
                layer.forward = _pass_through
    else:
        raise ValueError(f"--recompute-method must be uniform or block, got {method}")
