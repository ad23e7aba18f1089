"""The step-by-step comparison the parity rows of tests/parallel share (a plain module beside
them, not a test file: pytest puts this folder on ``sys.path`` and spawned ranks inherit it)."""

from __future__ import annotations

import math
from testkit.numerics import rel_err


def step_mismatches(par: list, ref: list, mesh, rtol: float = 1e-5) -> list[str]:
    """Per step of ``par`` against ``ref`` (each step ``(loss, {name: (grad, ParamMeta)},
    grad norm, ...)``): loss and gradient norm (relative tolerance), each gradient against the
    reference's shard of it (max error relative to the largest entry)."""
    from loom.parallel.registry import local_shard
    out = []
    for step, (got, want) in enumerate(zip(par, ref)):
        out += [f"step {step}: {what} {a} != {b}" for what, a, b in
                (("loss", got[0], want[0]), ("grad norm", got[2], want[2]))
                if not math.isclose(a, b, rel_tol=rtol)]
        for name, (g, meta) in got[1].items():
            w = local_shard(want[1][name][0], meta, *mesh.shard_of(meta))
            err = rel_err(g, w)
            if err > rtol:
                out.append(f"step {step}: grad {name} relative error {err:.2e}")
    return out


def trainer_steps(tr, steps: int) -> list:
    """``steps`` training steps of the Trainer ``tr`` run piecewise (not ``train_step``), each
    ``(global loss, {name: (gradient, ParamMeta)}, clipped gradient norm)``: what
    :func:`step_mismatches` compares."""
    out = []
    for _ in range(steps):
        loss = tr.global_loss(tr.forward_backward(tr.batches(tr.train_ds, tr.consumed_samples)))
        grads = {n: (p.grad.detach().clone(), tr.registry[n])
                 for c in tr.model_chunks for n, p in c.named_parameters() if p.requires_grad}
        out.append((loss, grads, tr.optimizer_step()))
        tr.consumed_samples += tr.global_batch
    return out
