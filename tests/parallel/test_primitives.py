"""Each parallel primitive against an unsharded reference, so a regression names its layer:
mesh rank groups, the parameter registry (shard / unshard / vocabulary re-padding / strict
shapes), every plan style at TP=2 (column, row, vocab embedding, vocab head, SP regions),
the context-parallel attention core, and the bucketed ``GradBuffer``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loom.models.attention import DotProductAttention
from loom.models.init import normal_init
from loom.parallel.mesh import rank_groups
from loom.parallel.registry import ParamMeta, ShardSpec, full_from_shards, local_shard
from testkit import run_distributed
from testkit.numerics import UNIT_ATOL


# -- pure functions (no process group) ---------------------------------------------------------------

def test_rank_groups_megatron_order():
    sizes = {"tp": 2, "cp": 1, "dp": 2, "pp": 2}
    def groups(axes):
        return sorted(rank_groups(sizes, axes))
    assert groups(["tp"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups(["dp"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups(["pp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups(["tp", "pp"]) == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_registry_shard_roundtrip_with_segments():
    full = torch.arange(24.0).view(12, 2)  # fused blocks of 4 and 8 rows
    meta = ParamMeta(full_shape=(12, 2), init=normal_init(1.0), shard=ShardSpec(0, (4, 8)))
    shards = [local_shard(full, meta, r, 2) for r in range(2)]
    assert torch.equal(shards[0], torch.cat([full[0:2], full[4:8]]))
    assert torch.equal(full_from_shards(shards, meta.shard), full)


def test_registry_repads_vocabulary_only():
    meta = ParamMeta(full_shape=(8, 3), init=normal_init(1.0), shard=ShardSpec(0), vocab_dim=0)
    saved = torch.ones(6, 3)
    padded = local_shard(saved, meta, 0, 1)
    assert padded.shape == (8, 3) and padded[6:].abs().sum() == 0
    with pytest.raises(ValueError, match=r"layers.0.w: saved shape \(6, 4\)"):
        local_shard(torch.ones(6, 4), meta, 0, 1, "layers.0.w")
    strict = ParamMeta(full_shape=(8, 3), init=normal_init(1.0))
    with pytest.raises(ValueError, match="expects"):
        local_shard(saved, strict, 0, 1)


def test_attention_core_causal_by_position():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    core = DotProductAttention()
    full = core(q, k, v)
    # queries 2 and 5 alone, at their global positions, see exactly keys <= position
    part = core(q[:, :, [2, 5]], k, v, torch.tensor([2, 5]))
    assert torch.allclose(part, full[:, :, [2, 5]], atol=1e-6)


# -- plan styles and collectives at TP=2 / CP=2 / DP=2 -------------------------------------------------

def _style(style, module, mesh):
    from loom.parallel.plan import PlanContext
    from loom.parallel.random import RNGTracker
    tracker = RNGTracker(mesh.device)
    tracker.seed(0)
    new, fields = style.apply(module, PlanContext(mesh, tracker, sequence_parallel=False))
    return new, fields


def styles_world() -> dict:
    import torch.distributed as dist

    from loom.parallel.context.attention import ContextParallelAttention
    from loom.parallel.context.split import local_positions, slice_for_cp
    from loom.parallel.grad_buffer import GradBuffer
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.plan import (ColwiseParallel, RowwiseParallel,
                                    VocabEmbeddingParallel, VocabHeadParallel)
    from loom.parallel.sequence import (gather_from_sequence_parallel_region,
                                        scatter_to_sequence_parallel_region)
    mesh = ParallelMesh.build(tp=2)
    r, out = mesh.tp_rank, {}
    torch.manual_seed(0)  # the reference modules are identical on every rank
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 2, 8, generator=g)
    # ColwiseParallel with fused segments (3, 5) -> rows split per segment
    ref = nn.Linear(8, 16)
    meta_ref = nn.Linear(8, 16, device="meta")
    col, fields = _style(ColwiseParallel(segments=(6, 10)), meta_ref, mesh)
    meta = ParamMeta(full_shape=fields["weight"]["full_shape"], init=None,
                     shard=fields["weight"]["shard"])
    with torch.no_grad():
        col.weight.copy_(local_shard(ref.weight, meta, r, 2))
        col.bias.copy_(local_shard(ref.bias, ParamMeta((16,), None, meta.shard), r, 2))
    out["colwise"] = float((col(x) - local_shard(ref(x).transpose(0, 2), ParamMeta(
        (16, 2, 5), None, ShardSpec(0, (6, 10))), r, 2).transpose(0, 2)).abs().max())
    # RowwiseParallel: full output on every rank
    ref = nn.Linear(16, 8)
    row, fields = _style(RowwiseParallel(), nn.Linear(16, 8, device="meta"), mesh)
    with torch.no_grad():
        row.weight.copy_(ref.weight.chunk(2, dim=1)[r])
        row.bias.copy_(ref.bias)
    xin = torch.randn(5, 2, 16, generator=g)
    out["rowwise"] = float((row(xin.chunk(2, dim=-1)[r]) - ref(xin)).abs().max())
    # VocabEmbeddingParallel embedding
    emb_ref = nn.Embedding(16, 4)
    emb, _ = _style(VocabEmbeddingParallel(vocab_size=13), nn.Embedding(16, 4, device="meta"), mesh)
    with torch.no_grad():
        emb.weight.copy_(emb_ref.weight.chunk(2, dim=0)[r])
    ids = torch.randint(0, 13, (2, 5), generator=g)
    out["vocab_embedding"] = float((emb(ids) - emb_ref(ids)).abs().max())
    # VocabHeadParallel: loss and input gradient equal F.cross_entropy on full logits
    head, _ = _style(VocabHeadParallel(vocab_size=13), nn.Identity(), mesh)
    w = torch.randn(16, 8, generator=g)
    w[13:] = 0
    hx = x.clone().requires_grad_(True)
    labels = torch.randint(0, 13, (2, 5), generator=g)
    loss = head(hx, w.chunk(2, dim=0)[r], labels)
    loss.sum().backward()
    rx = x.clone().requires_grad_(True)
    ref_loss = F.cross_entropy(F.linear(rx, w)[..., :13].reshape(-1, 13), labels.t().reshape(-1),
                               reduction="none").view(5, 2).t()
    ref_loss.sum().backward()
    out["vocab_head"] = max(float((loss - ref_loss).abs().max()),
                            float((hx.grad - rx.grad).abs().max()))
    # sequence-parallel scatter / gather round trip (forward and backward)
    sx = torch.randn(4, 2, 3, generator=g, requires_grad=True)
    local = scatter_to_sequence_parallel_region(sx, mesh.groups["tp"])
    back = gather_from_sequence_parallel_region(local, mesh.groups["tp"])
    out["sp_scatter"] = float((local - sx.detach().chunk(2)[r]).abs().max())
    out["sp_gather"] = float((back - sx.detach()).abs().max())
    # context-parallel attention core: this rank's query chunks at global positions
    cp_mesh = ParallelMesh.build(cp=2)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(3))
    full = DotProductAttention()(q, k, v)
    cr = cp_mesh.coords["cp"]
    core = ContextParallelAttention(DotProductAttention(), cp_mesh.groups["cp"])
    mine = core(*(slice_for_cp(t, cr, 2, dim=2) for t in (q, k, v)), local_positions(8, cr, 2))
    out["cp_core"] = float((mine - slice_for_cp(full, cr, 2, dim=2)).abs().max())
    # GradBuffer: bucketed average over DP equals the mean of every rank's gradient
    dp_mesh = ParallelMesh.build(dp=2)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p)
    reducer = GradBuffer(model.parameters(), dp_mesh.groups["dp_cp"], bucket_size=10)
    data = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(7))
    model(data[dp_mesh.dp_rank]).sum().backward()
    reducer.finish_grad_sync()
    ref_model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ref_model.load_state_dict(model.state_dict())
    (ref_model(data[0]).sum() + ref_model(data[1]).sum()).div(2).backward()
    out["reducer"] = max(float((p.grad - q_.grad).abs().max())
                         for p, q_ in zip(model.parameters(), ref_model.parameters()))
    out["reducer_buckets"] = len(reducer.buckets)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def styles():
    return run_distributed(2, styles_world)


@pytest.mark.parametrize("name", ["colwise", "rowwise", "vocab_embedding", "vocab_head",
                                  "sp_scatter", "sp_gather", "cp_core", "reducer"])
def test_primitive_matches_unsharded_reference(styles, name):
    for rank in styles:
        assert rank[name] < UNIT_ATOL, (name, rank[name])


def test_reducer_used_several_buckets(styles):
    assert all(rank["reducer_buckets"] > 1 for rank in styles)
