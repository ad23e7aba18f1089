"""ParallelMesh: the grid of ranks with named axes and a process group per axis.

Ranks are laid out in Megatron-LM's order ``tp-cp-dp-pp`` with tp varying fastest, so a
tensor-parallel group is ``t`` consecutive ranks (one node's fast links) and a pipeline group is
the slowest axis:

    rank = tp_rank + t * (cp_rank + c * (dp_rank + d * pp_rank))

One object holds every group a training step needs, and it is passed explicitly to the layers,
the trainer and the optimizer; loom has no module-level process-group globals.

Groups: ``tp``, ``cp``, ``dp``, ``pp`` (one axis each); ``dp_cp`` (gradient reduction);
``mp`` (model parallel = tp x pp, for the gradient norm); ``embedding`` (first and last pipeline
stage, for tied input/output embeddings).

The experts re-fold the same ranks as Megatron-Core does (``parallel_state.py``: its expert
rank generator, order ``tp-ep-dp-pp`` with no CP axis): inside each pipeline stage's
``n = t c d`` consecutive ranks, stage rank ``q`` is

    q = etp_rank + u * (ep_rank + e * edp_rank)

with ``u`` the expert TP size (``--expert-tensor-parallel-size``, default t), ``e`` the EP size
and ``n / (u e)`` the expert-data-parallel size. Groups ``etp`` (u consecutive ranks: the
shards of one expert), ``ep`` (e ranks at stride u: the ranks splitting the experts; they may
differ in TP, CP and DP coordinates) and ``edp`` (the ranks holding the same expert shards,
over which expert gradients are reduced; it spans CP, and TP ranks when u < t). With u = t
and e = 1 the expert grid is the dense one (``etp`` = ``tp``, ``edp`` = ``dp_cp``).
"""

from __future__ import annotations

import datetime
import itertools
import os
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

AXES = ("tp", "cp", "dp", "pp")  # fastest first


def rank_groups(sizes: dict[str, int], axes: Sequence[str]) -> list[list[int]]:
    """Every group of ranks that varies along ``axes`` with the other axes fixed.

    ``sizes`` maps each of :data:`AXES` to its size. Pure function (no process group), so the
    planner and config validation can use it. Example: t=2, d=2 -> tp groups [[0,1],[2,3]],
    dp groups [[0,2],[1,3]].
    """
    dims = [sizes[a] for a in AXES]
    strides = [1]
    for d in dims[:-1]:
        strides.append(strides[-1] * d)
    fixed = [a for a in AXES if a not in axes]
    groups = []
    for fixed_coords in itertools.product(*[range(sizes[a]) for a in fixed]):
        base = sum(c * strides[AXES.index(a)] for a, c in zip(fixed, fixed_coords))
        members = []
        for var_coords in itertools.product(*[range(sizes[a]) for a in reversed(axes)]):
            members.append(base + sum(c * strides[AXES.index(a)]
                                      for a, c in zip(reversed(axes), var_coords)))
        groups.append(sorted(members))
    return groups


def expert_rank_groups(sizes: dict[str, int], etp: int, ep: int, kind: str) -> list[list[int]]:
    """Every ``kind`` group (``etp``, ``ep`` or ``edp``) of Megatron-Core's expert grid (the
    module docstring: stage rank ``q = etp_rank + u (ep_rank + e edp_rank)``, pipeline stages
    of ``n = t c d`` consecutive ranks). Pure. Example: t=2, d=2, u=1, e=2 -> ep groups
    [[0,1],[2,3]] (the TP groups), edp groups [[0,2],[1,3]]. Raises ValueError when u e does
    not divide n."""
    n = sizes["tp"] * sizes["cp"] * sizes["dp"]
    if n % (etp * ep):
        raise ValueError(f"expert TP {etp} x EP {ep} does not divide t c d = {n}")
    m = n // (etp * ep)
    groups = []
    for stage in range(sizes["pp"]):
        at = lambda i, k, j: stage * n + i + etp * (k + ep * j)  # noqa: E731
        if kind == "etp":
            groups += [[at(i, k, j) for i in range(etp)] for j in range(m) for k in range(ep)]
        elif kind == "ep":
            groups += [[at(i, k, j) for k in range(ep)] for j in range(m) for i in range(etp)]
        elif kind == "edp":
            groups += [[at(i, k, j) for j in range(m)] for k in range(ep) for i in range(etp)]
        else:
            raise ValueError(f"unknown expert group {kind!r}")
    return groups


@dataclass
class ParallelMesh:
    """A rank's view of the parallel layout.

    Attributes: ``sizes`` (axis -> size), ``coords`` (axis -> this rank's index), ``groups``
    (name -> ``ProcessGroup`` or None when the group is this rank alone, in which case every
    collective on it is skipped), ``ranks`` (name -> global ranks of this rank's group),
    ``device``.
    """

    sizes: dict[str, int]
    rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    groups: dict[str, Optional[dist.ProcessGroup]] = field(default_factory=dict)
    ranks: dict[str, list[int]] = field(default_factory=dict)
    ep_size: int = 1  # e: expert-parallel ranks (Megatron's expert grid, the module docstring)
    etp_size: int = 1  # u: expert TP, dividing t (1: experts whole; t: sharded like the MLP)
    timeout: Optional[datetime.timedelta] = None  # of every group made here (None: torch's)

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def single(cls, device: str | torch.device = "cpu") -> "ParallelMesh":
        """A one-rank mesh (the single-process reference); needs no process group."""
        mesh = cls(sizes={a: 1 for a in AXES}, rank=0, device=torch.device(device))
        for name in ("tp", "cp", "dp", "pp", "dp_cp", "mp", "embedding", "etp", "ep", "edp"):
            mesh.groups[name] = None
            mesh.ranks[name] = [0]
        return mesh

    @classmethod
    def build(cls, tp: int = 1, pp: int = 1, cp: int = 1, dp: Optional[int] = None,
              device: Optional[torch.device] = None, ep: int = 1,
              etp: Optional[int] = None,
              timeout: Optional[datetime.timedelta] = None,
              hierarchical_cp: Optional[tuple[int, int]] = None) -> "ParallelMesh":
        """Create every group on an initialized default process group. ``ep`` / ``etp``: the
        experts' grid (``--expert-model-parallel-size``, ``--expert-tensor-parallel-size``,
        default t; the module docstring): every expert sharded over ``etp`` ranks, the experts
        split over ``ep`` ranks, which may differ in TP, CP and DP coordinates.
        ``timeout``: the collectives' timeout of every group (``--distributed-timeout-minutes``;
        ``new_group`` does not inherit the default group's, it falls back to torch's 30 min).
        ``hierarchical_cp``: ``(A, B)`` of ``--hierarchical-context-parallel-sizes`` (a2a+p2p):
        also the groups ``cp_a2a`` (A consecutive CP ranks) and ``cp_p2p`` (the B ranks with the
        same index in their a2a group).

        ``dist.new_group`` is collective over all ranks, so every rank creates every group in
        the same order and keeps the ones it belongs to.

        Raises ValueError if the world size is not ``t * c * d * p``, ``etp x ep`` does not
        divide ``t c d`` (Megatron's rule), or ``etp`` does not divide t (loom's: an expert's
        shards are on ranks that hold the same tokens, :mod:`loom.parallel.expert`).
        """
        world = dist.get_world_size()
        if dp is None:
            dp = world // (tp * pp * cp)
        if tp * pp * cp * dp != world:
            raise ValueError(f"world size {world} != t {tp} x c {cp} x d {dp} x p {pp}")
        sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
        rank = dist.get_rank()
        mesh = cls(sizes=sizes, rank=rank, device=device or torch.device("cpu"), timeout=timeout)
        mesh.etp_size, mesh.ep_size = (tp if etp is None else etp), ep
        if tp % mesh.etp_size:
            raise ValueError(f"expert tensor-parallel size {etp} must divide t = {tp}")
        if (tp * cp * dp) % (mesh.etp_size * ep):
            raise ValueError(f"expert TP {mesh.etp_size} x EP {ep} does not divide t c d = "
                             f"{tp * cp * dp}")
        named = {"tp": ["tp"], "cp": ["cp"], "dp": ["dp"], "pp": ["pp"],
                 "dp_cp": ["cp", "dp"], "mp": ["tp", "pp"]}
        for name, axes in named.items():
            for members in rank_groups(sizes, axes):
                mesh._maybe_keep(name, members)
        if mesh.experts_apart:  # Megatron's expert grid (module docstring)
            for name in ("etp", "ep", "edp"):
                for members in expert_rank_groups(sizes, mesh.etp_size, ep, name):
                    mesh._maybe_keep(name, members)
        else:  # the dense grid: the same groups
            for name, same in (("etp", "tp"), ("edp", "dp_cp")):
                mesh.groups[name], mesh.ranks[name] = mesh.groups[same], mesh.ranks[same]
            mesh.groups["ep"], mesh.ranks["ep"] = None, [rank]
        if hierarchical_cp is not None:  # a2a+p2p context parallelism
            a2a, ring = hierarchical_cp
            if a2a * ring != cp:
                raise ValueError(f"hierarchical CP sizes {a2a} x {ring} != c {cp}")
            for members in rank_groups(sizes, ["cp"]):
                for i in range(ring):
                    mesh._maybe_keep("cp_a2a", members[i * a2a:(i + 1) * a2a])
                for j in range(a2a):
                    mesh._maybe_keep("cp_p2p", members[j::a2a])
        # Embedding group: first and last stage of each pipeline (one rank when p = 1).
        for members in rank_groups(sizes, ["pp"]):
            emb = sorted({members[0], members[-1]})
            mesh._maybe_keep("embedding", emb)
        return mesh

    def _maybe_keep(self, name: str, members: list[int]) -> None:
        pg = dist.new_group(members, timeout=self.timeout) if len(members) > 1 else None
        if self.rank in members:
            self.groups[name] = pg
            self.ranks[name] = members

    # -- coordinates -----------------------------------------------------------------------------
    @property
    def coords(self) -> dict[str, int]:
        out, r = {}, self.rank
        for a in AXES:
            out[a] = r % self.sizes[a]
            r //= self.sizes[a]
        return out

    def size(self, name: str) -> int:
        """Size of a group (axis or combination), e.g. ``size("dp_cp")``."""
        return len(self.ranks[name])

    @property
    def tp_size(self) -> int:
        return self.sizes["tp"]

    @property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def dp_size(self) -> int:
        return self.sizes["dp"]

    @property
    def dp_rank(self) -> int:
        return self.coords["dp"]

    @property
    def expert_coords(self) -> dict[str, int]:
        """``etp``, ``ep``, ``edp``: this rank's place in the expert grid (module docstring)."""
        q = self.rank % (self.sizes["tp"] * self.sizes["cp"] * self.sizes["dp"])
        u, e = self.etp_size, self.ep_size
        return {"etp": q % u, "ep": q // u % e, "edp": q // (u * e)}

    @property
    def ep_rank(self) -> int:
        """This rank's index in its expert-parallel group: its experts are the ``ep_rank``-th
        E/e of them."""
        return self.expert_coords["ep"]

    @property
    def etp_rank(self) -> int:
        """This rank's shard of its experts (0 .. u-1)."""
        return self.expert_coords["etp"]

    @property
    def experts_apart(self) -> bool:
        """Whether the experts have a grid of their own (EP > 1 or expert TP != t): their
        gradients are then reduced over ``edp``, not with the dense ones over ``dp_cp``."""
        return self.ep_size > 1 or self.etp_size != self.sizes["tp"]

    def shard_of(self, meta) -> tuple[int, int]:
        """``(rank, size)`` of the group a parameter is sharded over (a
        :class:`~loom.parallel.registry.ParamMeta`): an expert's over ``etp``, any other over
        ``tp`` (the arguments of :func:`~loom.parallel.registry.local_shard`)."""
        if getattr(meta, "expert_parallel", False):
            return self.etp_rank, self.etp_size
        return self.tp_rank, self.tp_size

    def shard_group(self, meta) -> str:
        """The name of the group :meth:`shard_of` refers to (``etp`` or ``tp``)."""
        return "etp" if getattr(meta, "expert_parallel", False) else "tp"

    def counts_for_norm(self, meta) -> bool:
        """Whether this rank's gradient of a parameter enters the global norm within its
        stage's model-parallel group: :meth:`ParamMeta.counts_for_norm` at this rank's index in
        the group the parameter is sharded over (:meth:`shard_of`)."""
        return meta.counts_for_norm(self.shard_of(meta)[0])

    @property
    def pp_size(self) -> int:
        return self.sizes["pp"]

    @property
    def pp_rank(self) -> int:
        return self.coords["pp"]

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def __repr__(self) -> str:
        c = self.coords
        return (f"ParallelMesh(rank={self.rank}, " + ", ".join(
            f"{a}={c[a]}/{self.sizes[a]}" for a in AXES) + f", device={self.device})")


FLIGHT_RECORDER_ENTRIES = 2000  # collectives kept per rank (PyTorch's own default is 0: off)


def flight_recorder_env(env: dict) -> dict:
    """Switch NCCL's flight recorder on in ``env`` (``os.environ``) unless the user configured
    it: ``TORCH_NCCL_TRACE_BUFFER_SIZE`` (entries kept) and ``TORCH_NCCL_DUMP_ON_TIMEOUT`` (dump
    when a collective times out). Must run before the NCCL process group is created. Returns
    the variables it set."""
    wanted = {"TORCH_NCCL_TRACE_BUFFER_SIZE": str(FLIGHT_RECORDER_ENTRIES),
              "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    added = {k: v for k, v in wanted.items() if k not in env}
    env.update(added)
    return added


def default_backend(device: torch.device) -> str:
    """NCCL on CUDA, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} in the environment is not an integer") from None


def rendezvous_store(rank: int, world_size: int) -> dist.Store:
    """The store a process group starts on, keyed so that a restarted round never reads the
    addresses of the previous one.

    - One process (``world_size == 1``): an in-process ``HashStore`` (no port to pick).
    - Under torchrun (``TORCHELASTIC_RESTART_COUNT`` set): a ``TCPStore`` client of the agent's
      store at ``MASTER_ADDR:MASTER_PORT`` (or, without ``TORCHELASTIC_USE_AGENT_STORE=True``,
      a store rank 0 hosts there), wrapped in a ``PrefixStore`` keyed by the restart count, so
      ``torchrun --max-restarts`` rounds rendezvous afresh (gloo's full mesh otherwise connects
      to the dead round's addresses).
    - Otherwise (another launcher): None, and ``env://`` is used.
    """
    if world_size == 1:
        return dist.HashStore()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if restart is None:
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        store = dist.TCPStore(host, port, world_size, is_master=False)
    else:
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, multi_tenant=True)
    return dist.PrefixStore(f"loom/restart_{restart}/", store)


def init_distributed(device: Optional[str] = None, backend: Optional[str] = None,
                     timeout_minutes: Optional[float] = None) -> torch.device:
    """Initialize the default process group from torchrun's environment; return the device.

    ``device``: ``cpu`` or ``cuda`` (default: cuda when available); ``backend``: ``nccl`` or
    ``gloo`` (default: :func:`default_backend`). Single-process runs (no ``WORLD_SIZE``, or 1)
    start a 1-rank group on an in-process store, so the same code path runs everywhere and no
    port is used; under torchrun the group starts on :func:`rendezvous_store`, which makes
    ``--max-restarts`` work on gloo. ``timeout_minutes``: collectives' timeout
    (``--distributed-timeout-minutes``). Raises ValueError for malformed ``RANK``/``WORLD_SIZE``.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        local = _env_int("LOCAL_RANK", 0)
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    if not dist.is_initialized():
        rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
        store = rendezvous_store(rank, world)
        kwargs = {"store": store, "rank": rank, "world_size": world} if store is not None else {}
        if timeout_minutes is not None:  # --distributed-timeout-minutes
            kwargs["timeout"] = datetime.timedelta(minutes=timeout_minutes)
        backend = backend or default_backend(dev)
        if backend == "nccl":
            flight_recorder_env(os.environ)
        dist.init_process_group(backend=backend,
                                device_id=dev if dev.type == "cuda" else None, **kwargs)
    return dev
