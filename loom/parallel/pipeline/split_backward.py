"""A stage's backward split in two (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", sec. 2):
B, the gradient of the stage input (what the previous stage waits for), and W, the gradients
of the weights (which nobody waits for, so a schedule can defer it into a bubble).

The algorithm is ``torch.distributed.pipelining``'s ``stage_backward_input`` /
``stage_backward_weight`` (its graph helpers ``construct_reverse_graph`` and
``get_param_groups`` are reused from there): B runs autograd from the stage output to the
stage input only, keeping the graph, and records the gradient arriving at every "split" node
(a node on the input-to-output path that a weight also feeds, e.g. the ``mm`` of a linear
layer); W restarts autograd at those nodes with the recorded gradients and runs it to the
weights only. Two differences from torch's functions:

- W accumulates through the weights' own ``AccumulateGrad`` nodes (``torch.autograd.backward``
  with ``inputs=weights``), so post-accumulate-grad hooks fire: the DP gradient buffer's buckets
  (:mod:`loom.parallel.grad_buffer`) see each gradient when W produces it, as in a fused backward;
- B takes an output whose storage was freed after sending (Megatron's
  ``deallocate_output_tensor``), by calling the engine directly as the fused backward does.

When B has no stage input (the first stage: token ids), :func:`backward_input` computes
nothing and W runs the whole backward; when some weight is not reached through a split node,
B runs the whole backward and W nothing. Both are exact whatever the graph.
Activation recomputation (``torch.utils.checkpoint``, non-reentrant) recomputes a layer's
forward in B and again in W (each backward call unpacks its own recomputed tensors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining._backward import (_get_grad_fn_or_grad_acc,
                                                    construct_reverse_graph, get_param_groups)


def _run(outputs: Sequence, grads: Sequence, *, keep_graph: bool, inputs: Sequence = (),
         accumulate: bool = True):
    """The autograd engine without the shape check of ``tensor.backward`` (the output's data
    may have been freed; its graph is intact)."""
    return torch.autograd.Variable._execution_engine.run_backward(
        tuple(outputs), tuple(grads), keep_graph, False, tuple(inputs), True, accumulate)


@dataclass
class Deferred:
    """What W needs: the split nodes' recorded gradients per parameter group, or (``fused``)
    the whole backward from ``out`` with ``grad``."""

    groups: list = field(default_factory=list)
    weights: dict = field(default_factory=dict)  # AccumulateGrad node -> parameter
    out: Optional[torch.Tensor] = None
    grad: Optional[torch.Tensor] = None

    @property
    def fused(self) -> bool:
        return self.out is not None


def backward_input(out: torch.Tensor, grad: Optional[torch.Tensor], x: Optional[torch.Tensor],
                   params: Sequence[torch.nn.Parameter]) -> Deferred:
    """B: set ``x.grad`` (shape of ``x``, the stage input ``[s, b, h]``) from the stage output
    ``out`` and its gradient ``grad`` (None: ``out`` is the scalar loss). Returns what
    :func:`backward_weight` needs; the weights get no gradient here, but those feeding a
    custom ``autograd.Function`` (whose backward may run only once: it runs here). Run it with
    the gradient buffers' reductions deferred (``GradBuffer.deferred``)."""
    seed = torch.ones_like(out) if grad is None else grad
    if x is None:
        return Deferred(out=out, grad=seed)
    out_fn = _get_grad_fn_or_grad_acc(out)
    weights = {}
    for p in params:
        if p.requires_grad:
            weights[_get_grad_fn_or_grad_acc(p)] = p
    reverse = construct_reverse_graph([out_fn])
    groups = get_param_groups([_get_grad_fn_or_grad_acc(x)], list(weights), reverse)
    covered = set().union(*(g["params"] for g in groups)) if groups else set()
    if any(node in reverse and node not in covered for node in weights):
        _run([out], [seed], keep_graph=False)  # a weight off the input path: all of it now
        return Deferred()
    # W runs the groups latest-created first, as a fused backward meets them: the same order
    # on every rank (sets of nodes iterate by address), so gradient buckets complete, and
    # launch their collectives, in the same order on every DP rank
    for g in groups:
        g["intermediates"] = sorted(g["intermediates"], key=lambda n: -n._sequence_nr())
    groups.sort(key=lambda g: -g["intermediates"][0]._sequence_nr())
    # a custom autograd.Function may not run its backward twice (e.g. the fused linear
    # cross-entropy scales its saved gradients in place): its weights get their gradients in B
    now = [g for g in groups if any(hasattr(n, "_forward_cls") for n in g["intermediates"])]
    later = [g for g in groups if all(g is not e for e in now)]
    handles = []
    try:
        for g in later:
            g["grads"] = [None] * len(g["intermediates"])
            for i, node in enumerate(g["intermediates"]):
                def record(grad_outputs, g=g, i=i):
                    g["grads"][i] = grad_outputs
                handles.append(node.register_prehook(record))
        eager = [weights[n] for g in now for n in g["params"]]
        _run([out], [seed], keep_graph=True, inputs=[x] + eager)  # accumulates x.grad
    finally:
        for h in handles:
            h.remove()
    return Deferred(groups=later, weights=weights)


def backward_weight(state: Deferred) -> None:
    """W: accumulate the weights' gradients (``param.grad``, through ``AccumulateGrad`` so
    post-accumulate-grad hooks run) from what :func:`backward_input` recorded. The graph is
    kept while ``state`` lives (groups may share nodes) and freed with it."""
    if state.fused:
        _run([state.out], [state.grad], keep_graph=False)
        state.out = state.grad = None
        return
    for g in state.groups:
        edges, grads = [], []
        for grad_outputs, node in zip(g["grads"], g["intermediates"]):
            for i, gr in enumerate(grad_outputs or ()):
                if gr is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(gr)
        handles = []
        if len(g["intermediates"]) > 1:  # a split node below another gets its recorded
            # gradient, not the one W would propagate to it again (no double counting)
            for grad_outputs, node in zip(g["grads"], g["intermediates"]):
                handles.append(node.register_prehook(lambda _, saved=grad_outputs: saved))
        try:
            if edges:
                torch.autograd.backward(edges, grads, retain_graph=True,
                                        inputs=[state.weights[n] for n in g["params"]])
        finally:
            for h in handles:
                h.remove()
    state.groups = []
