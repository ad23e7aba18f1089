"""Activation bytes one transformer layer saves for its backward, measured on loom's real modules.

What autograd keeps between a layer's forward and its backward is the set of tensors handed to
``torch.autograd.graph.saved_tensors_hooks``' pack hook (every ``save_for_backward``, every
``SavedVariable``; ``torch.utils.checkpoint``'s stored inputs included, its recomputed
region's saves hidden by its own inner hooks) whose holders are still alive when the forward
returns. :func:`saved_bytes` counts them once per storage (a view of a saved tensor adds
nothing; a parameter, or a view of one, is a model state and is not counted).

:func:`layer_saved_bytes` builds a chunk of ``n`` and of ``n + 1`` layers (no embedding, no
output layer) on the ranks' real parallel plan and returns the difference: the bytes per
layer, with what a chunk saves once (the RoPE tables, the chunk input) cancelled. Tensor,
sequence and context parallelism run as rank 0 of a ``t x c`` world on torch's ``fake``
process-group backend (collectives are no-ops that keep their output shapes: the *sizes* of
what rank 0 saves are exact, its values are not), inside :func:`fake_world`, which tears the
default group down again. The planner's formulas (:mod:`loom.planner.activations`) are
checked against these numbers in ``tests/planner/test_planner_layer_memory.py``.

    OMP_NUM_THREADS=1 python -m benchmarks.layer_memory [--sites]

The MLA (``loom/models/gpt/mla.py``) and Mamba-2 (``loom/models/mamba``) layers are measured
the same way (:func:`mla_model`, :func:`mamba_model`); :func:`saved_sites` names the loom line
that saved each storage.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace
from typing import Optional

import torch

from loom.config import LoomConfig, ModelConfig


def saved_bytes(fn, params=()) -> tuple[int, list]:
    """``(bytes, rows)``: the distinct storages autograd still holds for backward when ``fn()``
    has returned (each once, whatever views of it are saved; a storage saved in a branch of the
    graph that is dropped during the forward is released again), parameters' storages
    (``params``) excluded: :class:`benchmarks.planner_vs_measured.SavedBytes`' live count.
    ``rows``: ``(nbytes, shape, dtype)`` of each held storage's first saved view."""
    from benchmarks.planner_vs_measured import SavedBytes, _storage_key
    counter = SavedBytes(skip=[_storage_key(p) for p in params])
    shapes: dict = {}

    def pack(t):
        key = _storage_key(t)
        if key:
            shapes.setdefault(key[0], (tuple(t.shape), t.dtype))
        return counter.pack(t)

    with torch.autograd.graph.saved_tensors_hooks(pack, counter.unpack):
        out = fn()
    rows = [(n, *shapes[k]) for k, n in counter.size.items()]
    held = counter.live
    del out
    return held, rows


@contextlib.contextmanager
def fake_world(world_size: int):
    """A default process group of ``world_size`` ranks in this one process, this process rank 0
    (torch's ``fake`` backend: collectives return at once, buffers keep their shapes);
    destroyed on exit. ``world_size`` 1: no group at all."""
    import torch.distributed as dist
    if world_size == 1:
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        raise RuntimeError("fake_world needs a process without a default process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def measure_in_worlds(cases, world_of, measure) -> dict:
    """``{case: measure(case)}`` for every case, each measured inside :func:`fake_world` of
    ``world_of(case)`` ranks, every world built once (1, 2, 4, then any larger size)."""
    cases = list(cases)
    out = {}
    for world in sorted({world_of(c) for c in cases}):
        with fake_world(world):
            for case in cases:
                if world_of(case) == world:
                    out[case] = measure(case)
    return out


def resolve(model: ModelConfig, seq_length: int, micro_batch: int = 1, **training) -> ModelConfig:
    """``model`` completed by loom's validation (derived widths, kinds), for one rank."""
    cfg = LoomConfig(model=replace(model, seq_length=seq_length))
    cfg.training.micro_batch_size, cfg.training.lr, cfg.training.train_iters = micro_batch, 1e-4, 1
    return cfg.validate(1).model


def _build(model: ModelConfig, layers: list, mesh, sp: bool, cp_comm_type: str, recompute,
           method: str, num_layers: int, dtype):
    from loom.models import get_family
    from loom.models.family import StageSpec
    from loom.parallel.parallelize import build_chunk
    from loom.parallel.random import RNGTracker
    from loom.parallel.recompute import apply_recompute
    tracker = RNGTracker(mesh.device)
    tracker.seed(0)
    chunk = build_chunk(get_family(model.model_type), model, StageSpec(layers, False, False), mesh,
                        tracker, sequence_parallel=sp, cp_comm_type=(cp_comm_type,))
    apply_recompute(chunk, recompute, tracker, method, num_layers)
    return chunk.to(dtype).train()


def layer_saved_bytes(model: ModelConfig, seq_length: int, micro_batch: int = 1, *, tp: int = 1,
                      sp: bool = False, cp: int = 1, cp_comm_type: str = "p2p",
                      recompute: Optional[str] = None, method: str = "uniform",
                      num_layers: int = 1, dtype=torch.float32, base_layers: int = 1,
                      extra_layers: int = 1, rows: bool = False, etp: Optional[int] = None):
    """Bytes one layer of ``model`` saves for backward per micro-batch of ``micro_batch``
    sequences of ``seq_length`` tokens on rank 0 of TP ``tp`` (sequence parallel ``sp``) x CP
    ``cp`` (``cp_comm_type``), with ``--recompute-granularity recompute`` (None, selective,
    full; ``method`` / ``num_layers`` as ``--recompute-method`` / ``--recompute-num-layers``),
    parameters and activations in ``dtype``: (chunk(``base_layers + extra_layers`` layers) -
    chunk(``base_layers``)) / ``extra_layers`` (a uniform group of N layers: both multiples of
    N). Call it inside :func:`fake_world` of ``tp x cp`` ranks when either is > 1.
    ``rows``: also return the saved storages of the larger chunk. ``etp``: an MoE model's
    expert TP size (``--expert-tensor-parallel-size``, dividing ``tp``; default ``tp``)."""
    from loom.parallel.mesh import ParallelMesh
    mesh = ParallelMesh.single() if tp * cp == 1 else ParallelMesh.build(tp=tp, cp=cp, etp=etp)
    s_local = seq_length // cp // (tp if sp else 1)
    got = []
    for n in (base_layers, base_layers + extra_layers):
        torch.manual_seed(0)
        chunk = _build(model, list(range(n)), mesh, sp, cp_comm_type, recompute, method,
                       num_layers, dtype)
        x = torch.randn(s_local, micro_batch, model.hidden_size, dtype=dtype, requires_grad=True)
        pos = _positions(seq_length, cp)
        got.append(saved_bytes(lambda: chunk(hidden_states=x, position_ids=pos),
                               chunk.parameters()))
    per_layer = (got[1][0] - got[0][0]) / extra_layers
    return (per_layer, got[1][1]) if rows else per_layer


def moe_ep_layer_saved(model: ModelConfig, seq_length: int, micro_batch: int = 1, *, ep: int,
                       tp: int = 1, etp: Optional[int] = None, sp: bool = False,
                       dtype=torch.float32) -> dict:
    """One MoE layer's saved bytes on *this* rank of a real (gloo) world of ``t d`` ranks at
    EP ``ep`` (expert TP ``etp``, default ``tp``), where the fake process group of
    :func:`fake_world` cannot measure: the all-to-all's row counts and the all-gathered routing
    are data. Measured as :func:`layer_saved_bytes` (chunk of 2 layers - chunk of 1), every
    rank's tokens drawn from its own seed so that the ranks receive different rows. Returns
    ``{"bytes": per-layer bytes, "rows": the rows this rank's experts ran in that layer}``
    (``rows / (S k u / t)`` is this rank's load over the mean, the ``imbalance`` of
    :func:`loom.planner.layer_bytes.loom_moe_mlp_terms`). Call it on every rank of an
    initialized default process group (e.g. ``testkit.run_distributed``)."""
    import torch.distributed as dist
    from loom.parallel.mesh import ParallelMesh
    mesh = ParallelMesh.build(tp=tp, ep=ep, etp=etp)
    s_local = seq_length // (tp if sp else 1)
    got, rows = [], []
    for n in (1, 2):
        torch.manual_seed(0)
        chunk = _build(model, list(range(n)), mesh, sp, "p2p", None, "uniform", 1, dtype)
        seen: list = []
        for layer in chunk.layers.values():
            d = layer.mlp.dispatcher

            def counted(x, *args, _run=d.run_experts, **kw):
                seen.append(x.shape[0])
                return _run(x, *args, **kw)
            d.run_experts = counted
        torch.manual_seed(1000 + dist.get_rank() // tp)  # the TP group shares its tokens
        x = torch.randn(s_local, micro_batch, model.hidden_size, dtype=dtype, requires_grad=True)
        got.append(saved_bytes(lambda: chunk(hidden_states=x, position_ids=_positions(
            seq_length, 1)), chunk.parameters())[0])
        rows.append(seen[-1])
    return {"bytes": got[1] - got[0], "rows": rows[1]}


def saved_sites(model: ModelConfig, seq_length: int, micro_batch: int = 1, *, tp: int = 1,
                sp: bool = False, recompute: Optional[str] = None, dtype=torch.float32) -> list:
    """``[(nbytes, shape, dtype, site)]``, largest first: the storages a one-layer chunk of
    ``model`` still holds for backward when its forward returns (as :func:`saved_bytes`
    counts them), each with the loom source line (``path:line code``) that first saved it:
    how :mod:`loom.planner.layer_bytes`' terms were read off the code. No CP; call it inside
    :func:`fake_world` of ``tp`` ranks when ``tp > 1``."""
    import traceback
    from benchmarks.planner_vs_measured import SavedBytes, _storage_key
    from loom.parallel.mesh import ParallelMesh
    mesh = ParallelMesh.single() if tp == 1 else ParallelMesh.build(tp=tp, cp=1)
    torch.manual_seed(0)
    chunk = _build(model, [0], mesh, sp, "p2p", recompute, "uniform", 1, dtype)
    x = torch.randn(seq_length // (tp if sp else 1), micro_batch, model.hidden_size,
                    dtype=dtype, requires_grad=True)
    counter = SavedBytes(skip=[_storage_key(p) for p in chunk.parameters()])
    site: dict = {}

    def pack(t):
        key = _storage_key(t)
        if key and key[0] not in site:
            frames = [f for f in traceback.extract_stack()[:-1]
                      if "/loom/" in f.filename and "benchmarks" not in f.filename]
            where = (f"{frames[-1].filename.split('/loom/')[-1]}:{frames[-1].lineno} "
                     f"{(frames[-1].line or '').strip()[:60]}") if frames else "?"
            site[key[0]] = (tuple(t.shape), t.dtype, where)
        return counter.pack(t)

    with torch.autograd.graph.saved_tensors_hooks(pack, counter.unpack):
        out = chunk(hidden_states=x, position_ids=_positions(seq_length, 1))
    rows = [(n, *site[k]) for k, n in counter.size.items() if counter.refs[k] > 0]
    del out
    return sorted(rows, key=lambda r: -r[0])


def mla_model(**kw) -> ModelConfig:
    """A tiny MLA model (h 32, 4 heads, q-lora 16, kv-lora 12, dn 8, dr 4, dv 6, latent norms;
    ``kw`` overrides), the shape of ``tests/planner/test_planner_layer_memory.py``."""
    return ModelConfig.llama(**{**dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, ffn_hidden_size=48,
        num_query_groups=None, multi_latent_attention=True, qk_layernorm=True, q_lora_rank=16,
        kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, hidden_dropout=0.0,
        attention_dropout=0.0), **kw})


def mamba_model(**kw) -> ModelConfig:
    """A tiny Mamba-2 stack (h 32, H 8 heads of P 8, G 2, N 4, conv 4, chunk 8; ``kw``
    overrides), the shape of ``tests/planner/test_planner_layer_memory.py``."""
    return ModelConfig.llama(**{**dict(
        model_type="mamba", num_layers=2, hybrid_override_pattern="MM", hidden_size=32,
        vocab_size=128, num_attention_heads=4, num_query_groups=None, ffn_hidden_size=None,
        mamba_head_dim=8, mamba_state_dim=4, mamba_num_groups=2, mamba_chunk_size=8,
        hidden_dropout=0.0, attention_dropout=0.0), **kw})


def _positions(s: int, cp: int) -> torch.Tensor:
    """Rank 0's token positions under CP's load-balanced split (chunks 0 and 2c - 1)."""
    if cp == 1:
        return torch.arange(s)
    n = s // (2 * cp)
    return torch.cat([torch.arange(0, n), torch.arange(s - n, s)])


def main(argv=None) -> None:
    """Per-layer bytes of a tiny Llama, MLA and Mamba-2 layer per recompute mode and dtype;
    ``--sites``: the saved storages of each, with the loom line that saved them."""
    import argparse
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_known_args(argv)[1]
    torch.set_num_threads(1)
    models = {"llama": (resolve(ModelConfig.llama(num_layers=2, hidden_size=64,
                                                  num_attention_heads=4, ffn_hidden_size=96,
                                                  vocab_size=128, hidden_dropout=0.0,
                                                  attention_dropout=0.0), 32), 32),
              "mla": (resolve(mla_model(), 16), 16), "mamba": (resolve(mamba_model(), 16), 16)}
    for name, (m, s) in models.items():
        for rc in (None, "selective", "full"):
            for dtype in (torch.float32, torch.bfloat16):
                print(json.dumps({"layer": name, "recompute": rc, "dtype": str(dtype),
                                  "bytes": layer_saved_bytes(m, s, 2, recompute=rc,
                                                             dtype=dtype)}))
        if "--sites" in args:
            for row in saved_sites(m, s, 2, dtype=torch.bfloat16):
                print(f"  {row[0]:8d} {str(row[1]):20s} {str(row[2])[6:]:9s} {row[3]}")


if __name__ == "__main__":
    main()
