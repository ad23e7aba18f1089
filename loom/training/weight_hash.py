"""``--check-weight-hash-across-dp-replicas-interval N`` (Megatron-LM's flag, ``training.py``
and ``megatron/core/utils.py::check_param_hashes_across_dp_replicas``): every replica of a weight
must hold the same bits. Before the first iteration and after every N-th, each rank hashes each
of its parameters (SHA-1 of the fp32 values, ``hashlib``, as Megatron), all-gathers the digests
over the ranks that hold replicas of them, and compares: silent data corruption, a missed
all-gather or a rank that skipped a step shows as a mismatch, named by parameter and rank, and
the run stops (:class:`WeightHashMismatch`, on every rank, since every rank sees every digest).

The replicas compared: dense parameters over the data- and context-parallel group (``dp_cp``:
CP ranks hold the same weights too; Megatron compares over DP alone), experts on their own grid
over the expert-data-parallel group (``edp``). ZeRO-3 shards the weights, leaving no replicas:
refused by the config (:func:`loom.config.validate.validate_config`), as Megatron refuses it
with ``optim_grads_params``. Collective over those groups; the distributed optimizer's pending
parameter all-gathers are waited for first.
"""

from __future__ import annotations

import hashlib
from typing import Callable, Optional

import torch
import torch.distributed as dist

from loom.errors import WeightHashMismatch
from loom.parallel.mesh import ParallelMesh
from loom.parallel.registry import named_parameters

DIGEST_BYTES = 20  # SHA-1


def digest(t: torch.Tensor) -> torch.Tensor:
    """SHA-1 of ``t``'s values as fp32 (``[20]`` uint8): equal bits, equal digests."""
    data = t.detach().float().cpu().contiguous().numpy()
    return torch.frombuffer(bytearray(hashlib.sha1(data.tobytes()).digest()), dtype=torch.uint8)


def mismatches(chunks, mesh: ParallelMesh) -> list[str]:
    """``"name (ranks r, s differ from rank q)"`` for every parameter of ``chunks`` whose
    replicas differ (empty when all match). Collective over ``dp_cp`` and, with experts on their
    own grid, ``edp`` (every rank of them must call it)."""
    kinds: dict[str, list] = {"dp_cp": [], "edp": []}
    for name, p, meta in named_parameters(chunks):
        group = "edp" if mesh.experts_apart and meta.expert_parallel else "dp_cp"
        kinds[group].append((name, digest(p)))
    out = []
    for group_name, items in kinds.items():
        group, ranks = mesh.groups.get(group_name), mesh.ranks.get(group_name) or []
        if group is None or not items or len(ranks) < 2:
            continue
        mine = torch.stack([d for _, d in items]).to(mesh.device)
        every = [torch.empty_like(mine) for _ in ranks]
        dist.all_gather(every, mine, group=group)
        every = [e.cpu() for e in every]
        for i, (name, _) in enumerate(items):
            ref = every[0][i]
            odd = [ranks[j] for j, e in enumerate(every) if not torch.equal(e[i], ref)]
            if odd:
                out.append(f"{name} (global ranks {', '.join(map(str, odd))} differ from rank "
                           f"{ranks[0]})")
    return out


def check(chunks, mesh: ParallelMesh, optimizer, iteration: int,
          say: Optional[Callable[[str], None]] = None) -> None:
    """Wait for pending parameter all-gathers, compare the replicas (:func:`mismatches`); say
    that they match (``say``, rank 0's printer) or raise :class:`WeightHashMismatch` naming up
    to 8 of the parameters that differ. Collective."""
    from loom.training.step import finish_param_gather
    finish_param_gather(optimizer)
    bad = mismatches(chunks, mesh)
    if bad:
        more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
        raise WeightHashMismatch(
            f"weights differ across data-parallel replicas at iteration {iteration} "
            f"(--check-weight-hash-across-dp-replicas-interval): {'; '.join(bad[:8])}{more}")
    if say is not None:
        say(f" weight hashes match across data-parallel replicas at iteration {iteration}")
