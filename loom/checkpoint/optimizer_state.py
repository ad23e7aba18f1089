"""Optimizer states by parameter name, as checkpoints store them (any layout can load them).

An optimizer that keeps its own states in another form (the distributed optimizer's fp32
master ranges, :class:`~loom.training.distributed_optimizer.DistributedOptimizer`) provides
``state_by_name(names) -> {name: {key: tensor}}`` and ``load_state_by_name(states)``; any other
is a ``torch.optim`` optimizer (or a wrapper holding one as ``.optim``) whose ``state`` is keyed
by parameter.
"""

from __future__ import annotations

import torch


def _torch_optimizer(optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optim", optimizer)


def optimizer_state_by_name(optimizer, named_params: dict) -> dict:
    """``{name: {key: tensor}}``: the Adam states (``step``, ``exp_avg``, ``exp_avg_sq``; and
    ``master_param``, the fp32 master weights, for 16-bit parameters) of ``named_params``
    (``{name: parameter}``), each at the parameter's TP-local full shape, on CPU. With the
    distributed optimizer the DP shards are all-gathered per bucket: a collective, every rank
    of the DP x CP group calls it."""
    if hasattr(optimizer, "state_by_name"):
        return optimizer.state_by_name(set(named_params))
    names = {id(p): n for n, p in named_params.items()}
    return {names[id(p)]: {k: (v.detach().cpu() if torch.is_tensor(v) else v)
                           for k, v in st.items()}
            for p, st in _torch_optimizer(optimizer).state.items() if id(p) in names}


@torch.no_grad()
def load_optimizer_state_by_name(optimizer, named_params: dict, states: dict) -> None:
    """Inverse of :func:`optimizer_state_by_name` at any layout: ``states`` maps names to
    states at this rank's TP-local shapes; each rank keeps its DP shard. A ``master_param``
    (saved by a 16-bit run) becomes an fp32 parameter's value, so an fp32 run resumes a 16-bit
    one from the exact fp32 weights. Names missing from ``states`` keep fresh states."""
    if hasattr(optimizer, "load_state_by_name"):
        optimizer.load_state_by_name(states)
        return
    local = _torch_optimizer(optimizer)
    for name, p in named_params.items():
        st = states.get(name)
        if not st:
            continue
        st = dict(st)
        master = st.pop("master_param", None)
        if master is not None:
            p.copy_(master.to(p))
        if st:
            local.state[p] = {k: v.clone().to(p.device) if torch.is_tensor(v) else v
                              for k, v in st.items()}
