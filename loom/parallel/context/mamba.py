"""Context parallelism for Mamba-2 layers: the sequence-sharded activations switched to
head-sharded ones around the conv and the scan (Megatron-Core's "all-to-all" Mamba CP, the
scheme of DeepSpeed-Ulysses applied to SSM heads).

A recurrence over the whole sequence cannot run on s/c tokens without the state of the tokens
before them. So each of the c CP ranks keeps its s/c tokens through the in-projection, then one
all-to-all gives every rank the whole sequence for ``H/(t c)`` of the TP rank's ``H/t`` heads;
the causal conv, the SSD scan and the ``D`` skip run there on tokens in global order (the
load-balanced chunk order of :mod:`loom.parallel.context.split` undone before, redone after),
and one all-to-all turns the scan output back to s/c tokens of all ``H/t`` heads, where the gate,
the group norm and the out-projection run as without CP. Forward: 2 all-to-alls per Mamba layer
(``x, B, C, dt`` packed in one; ``y`` back), backward 2; ``z`` never moves, as the gate is
applied after the return (Megatron moves ``z`` too, with 5 separate all-to-alls in, as its fused
kernel gates inside the scan).

Head and group layout: CP rank i takes heads ``[i H_t/c, (i+1) H_t/c)`` of its TP rank's
``H_t = H/t`` heads (``H_t`` divisible by c). Heads share B, C by group (``H_t/G_t`` heads per
group); with ``G_t >= c`` rank i takes groups ``[i G_t/c, (i+1) G_t/c)`` (``G_t`` divisible by c),
with ``G_t < c`` each group's B, C go to the ``c/G_t`` consecutive ranks holding its heads
(c divisible by ``G_t``): Megatron-Core's rules (H divisible by t c; G by t c, or c by G/t). The conv weight and bias, ``dt_bias``, ``A_log`` and ``D``
stay replicated over CP (TP-sharded as without CP); each rank slices its channels in the forward
pass, so each CP rank's gradient covers its slice alone and the usual sum over the dp x cp group
gives the full gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from loom.parallel.context.a2a import heads_to_seq, seq_to_heads
from loom.parallel.context.split import all_positions


def cp_group_layout(heads: int, groups: int, cp: int) -> tuple[int, int, int]:
    """``(heads per CP rank, groups per CP rank, copies of each group)`` for a TP rank's
    ``heads`` and ``groups`` over ``cp`` ranks (module docstring). Raises ValueError when the
    heads are not divisible by ``cp``, or neither of groups and ``cp`` divides the other."""
    if heads % cp:
        raise ValueError(f"{heads} Mamba heads per TP rank not divisible by CP size {cp}")
    if groups >= cp and groups % cp == 0:
        return heads // cp, groups // cp, 1
    if groups < cp and cp % groups == 0:
        return heads // cp, 1, cp // groups
    raise ValueError(f"{groups} Mamba groups per TP rank and CP size {cp}: one must divide "
                     f"the other")


class ContextParallelScan(nn.Module):
    """Runs a Mamba scan core (:class:`loom.models.mamba.model.MambaScan`: parameterless, the
    parameters passed in) over the CP group ``group``: same arguments and result as the core,
    on this rank's s/c tokens in the load-balanced order of
    :func:`~loom.parallel.context.split.slice_for_cp`:

    ``xbc [b, s/c, d_inner_t + 2 G_t N]``, ``dt [b, s/c, H_t]``, the TP rank's ``conv_weight
    [d_inner_t + 2 G_t N, k]``, ``conv_bias``, ``dt_bias``, ``A_log``, ``D [H_t]`` ->
    ``y [b, s/c, d_inner_t]`` (``D x`` included). No final state: generation does not run
    under CP (ValueError if ``need_state``)."""

    def __init__(self, inner: nn.Module, group):
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, xbc, dt, conv_weight, conv_bias, dt_bias, A_log, D, need_state=False):
        if need_state:
            raise ValueError("generation with a Mamba state cache does not run under context "
                             "parallelism")
        c, r = dist.get_world_size(self.group), dist.get_rank(self.group)
        P, N = self.inner.head_dim, self.inner.state_dim
        H = A_log.shape[0]
        d_inner = H * P
        G = (xbc.shape[-1] - d_inner) // (2 * N)
        h, g, rep = cp_group_layout(H, G, c)
        b, s_loc, _ = xbc.shape
        x, B, C = xbc.split([d_inner, G * N, G * N], dim=-1)
        # per destination rank j: its heads' x, its groups' B, C (copied when rep > 1), its dt
        Bj = B.reshape(b, s_loc, G, N).repeat_interleave(rep, dim=2).reshape(b, s_loc, c, g * N)
        Cj = C.reshape(b, s_loc, G, N).repeat_interleave(rep, dim=2).reshape(b, s_loc, c, g * N)
        packed = torch.cat([x.reshape(b, s_loc, c, h * P), Bj, Cj, dt.reshape(b, s_loc, c, h)],
                           dim=-1)  # [b, s/c, c, w]
        full = seq_to_heads(packed.transpose(1, 2), self.group)  # [b, 1, s, w]: rank-major
        order = all_positions(s_loc * c, c, xbc.device).reshape(-1).argsort()
        full = full[:, 0].index_select(1, order)  # tokens in global order
        xbc_r, dt_r = full.split([h * P + 2 * g * N, h], dim=-1)
        y, _ = self.inner(xbc_r, dt_r, _conv_slice(conv_weight, d_inner, G * N, h * P, g * N, r,
                                                    rep),
                          _conv_slice(conv_bias, d_inner, G * N, h * P, g * N, r, rep),
                          dt_bias[r * h:(r + 1) * h], A_log[r * h:(r + 1) * h],
                          D[r * h:(r + 1) * h])
        y = y.index_select(1, order.argsort())[:, None]  # back to the rank-major layout
        out = heads_to_seq(y, self.group)  # [b, c, s/c, h P]
        return out.permute(0, 2, 1, 3).reshape(b, s_loc, d_inner), None


def _conv_slice(p: torch.Tensor, d_inner: int, gn: int, xs: int, bcs: int, r: int,
                rep: int) -> torch.Tensor:
    """CP rank r's channels of a conv parameter ``[(x, B, C) channels, ...]``: x channels
    ``[r xs, (r+1) xs)``, B and C channels of its groups ``[(r // rep) bcs, ...)``."""
    x, B, C = p.split([d_inner, gn, gn], dim=0)
    lo = (r // rep) * bcs
    return torch.cat([x[r * xs:(r + 1) * xs], B[lo:lo + bcs], C[lo:lo + bcs]], dim=0)


def wrap_context_parallel_scan(core: nn.Module, mesh) -> nn.Module:
    """``core`` wrapped in :class:`ContextParallelScan` over the mesh's CP group; ``core``
    itself when the CP group is this rank alone."""
    group = mesh.groups.get("cp")
    return core if group is None else ContextParallelScan(core, group)
