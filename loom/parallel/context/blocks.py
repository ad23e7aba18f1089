"""Blockwise causal attention with log-sum-exp, the arithmetic of ring attention
(:mod:`loom.parallel.context.ring`): one block of keys at a time, exact merging (the online
softmax of Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022, whose backward
``dS = P (dP - D)``, ``D = rowsum(dO O)`` recomputes each block's probabilities from the final
log-sum-exp).

A block's work is planned from global positions (:func:`plan_block`): the queries are cut into
tiles of at most ``tile`` rows (``tile x s_k`` scores per head at once); per tile the key
columns it cannot see are skipped, those it sees wholly need no mask, the square where query
and key positions coincide is plain causal (top-left aligned), and anything else (a sliding
window's edge) gets an explicit mask. Pieces run on PyTorch's fused CPU attention kernel
(``_scaled_dot_product_flash_attention_for_cpu`` and its backward, which take and return the
log-sum-exp) when the core's math allows it (no soft-capping, no dropout, ``d_v <= d_qk`` with
values zero-padded), else on plain tensor ops with the backward by recomputation through
autograd. Shapes: ``q5 [b, g, r, s_q, d]`` (query heads grouped by their K/V group, GQA),
``k [b, g, s_k, d]``, ``v [b, g, s_k, d_v]``; outputs fp32 (fp64 stays fp64).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

NEG = float("-inf")

TILE = 1024
"""Query rows per piece: bounds the scores held at once to ``TILE x s_k`` per head."""


@dataclass(frozen=True)
class CoreMath:
    """What blockwise attention needs of the core it replaces: ``scale`` (default
    ``d_qk ** -0.5``), ``window`` (key j visible from position p when ``0 <= p - j < window``),
    ``softcap`` (``tanh(x / cap) cap`` on the scores), ``dropout``, ``rng`` (the per-TP-rank
    generator), ``tile`` (query rows per piece)."""

    scale: Optional[float] = None
    window: Optional[int] = None
    softcap: Optional[float] = None
    dropout: float = 0.0
    rng: Any = None
    tile: int = TILE


@dataclass
class Piece:
    """One query tile against some key columns of a block: ``cols`` ranges of key indices;
    ``causal``: the square diagonal (query i sees keys <= i); ``mask`` ``[s_q, s_k_sel]``."""

    q: slice
    cols: list
    causal: bool = False
    mask: Optional[torch.Tensor] = None


def _segments(pos: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """Runs of consecutive positions: ``(start, end, first position, last position)``."""
    p = pos.tolist()
    out, start = [], 0
    for i in range(1, len(p) + 1):
        if i == len(p) or p[i] != p[i - 1] + 1:
            out.append((start, i, p[start], p[i - 1]))
            start = i
    return out


def _tiles(runs, tile: int):
    for start, end, p0, _ in runs:
        for i in range(start, end, tile):
            j = min(i + tile, end)
            yield i, j, p0 + (i - start), p0 + (j - 1 - start)


def _kind(qs, ks, window: Optional[int]) -> str:
    """'skip' (no key visible), 'full' (every key visible) or 'mask' for a query and key run."""
    q_lo, q_hi, k_lo, k_hi = qs[2], qs[3], ks[2], ks[3]
    if q_hi < k_lo or (window is not None and q_lo - k_hi >= window):
        return "skip"
    if q_lo >= k_hi and (window is None or q_hi - k_lo < window):
        return "full"
    return "mask"


def plan_block(q_pos: torch.Tensor, k_pos: torch.Tensor, window: Optional[int],
               tile: int) -> list[Piece]:
    """The pieces of one block (module docstring): queries at ``q_pos [s_q]``, keys at
    ``k_pos [s_k]`` (global positions)."""
    pieces = []
    k_runs = _segments(k_pos)
    for qs in _tiles(_segments(q_pos), tile):
        full, masked, causal = [], [], None
        for ks in k_runs:
            kind = _kind(qs, ks, window)
            if kind == "full":
                full.append((ks[0], ks[1]))
            elif kind == "mask" and window is None and ks[2] <= qs[2] and qs[3] <= ks[3]:
                first = ks[0] + qs[2] - ks[2]  # the key index of the tile's first position
                if first > ks[0]:
                    full.append((ks[0], first))
                causal = (first, first + qs[1] - qs[0])
            elif kind == "mask":
                masked.append((ks[0], ks[1]))
        rows = slice(qs[0], qs[1])
        if full:
            pieces.append(Piece(rows, full))
        if causal:
            pieces.append(Piece(rows, [causal], causal=True))
        if masked:
            kp = torch.cat([k_pos[a:b] for a, b in masked])
            rel = q_pos[rows, None] - kp[None, :]
            mask = (rel >= 0) & (rel < window) if window is not None else rel >= 0
            pieces.append(Piece(rows, masked, mask=mask))
    return pieces


def _take(k: torch.Tensor, pc: Piece) -> torch.Tensor:
    if len(pc.cols) == 1:
        return k[:, :, pc.cols[0][0]:pc.cols[0][1]]
    return torch.cat([k[:, :, a:b] for a, b in pc.cols], dim=2)


def _put(dk: torch.Tensor, pc: Piece, gk: torch.Tensor) -> None:
    i = 0
    for a, b in pc.cols:
        dk[:, :, a:b] += gk[:, :, i:i + b - a]
        i += b - a


def _bool_mask(pc: Piece, device) -> Optional[torch.Tensor]:
    if pc.causal:
        n = pc.q.stop - pc.q.start
        return torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return pc.mask


def _scores(q5, k, m: CoreMath) -> torch.Tensor:
    """``q5 [b, g, r, sq, d] x k [b, g, sk, d] -> [b, g, r, sq, sk]`` (scaled, soft-capped)."""
    s = torch.matmul(q5, k.unsqueeze(2).transpose(-1, -2)) * (m.scale or q5.shape[-1] ** -0.5)
    if m.softcap is not None:
        s = torch.tanh(s / m.softcap) * m.softcap
    return s


def _drop_mask(shape, p: float, seed: int, device) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return (torch.rand(shape, generator=gen, device=device) >= p) / (1.0 - p)


def fused(m: CoreMath, q5: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether pieces run on the fused CPU kernel (module docstring)."""
    return (m.softcap is None and m.dropout == 0 and q5.device.type == "cpu"
            and v.shape[-1] <= q5.shape[-1])


def _fused_args(q5, k, v, pc: Piece):
    b, g, r, _, d = q5.shape
    qp = q5[:, :, :, pc.q].reshape(b, g * r, -1, d)
    kp, vp = _take(k, pc), _take(v, pc)
    if vp.shape[-1] < d:
        vp = F.pad(vp, (0, d - vp.shape[-1]))
    if r > 1:
        kp, vp = kp.repeat_interleave(r, dim=1), vp.repeat_interleave(r, dim=1)
    mask = None
    if pc.mask is not None:  # the kernel takes an additive mask of the queries' dtype
        mask = torch.zeros(pc.mask.shape, dtype=q5.dtype, device=q5.device)
        mask = mask.masked_fill(~pc.mask, NEG)
    return qp.contiguous(), kp.contiguous(), vp.contiguous(), mask


def _piece_forward(q5, k, v, pc: Piece, m: CoreMath, seed: int, use_fused: bool):
    """(output ``[b, g, r, s_tile, d_v]`` normalized over the piece, log-sum-exp; -inf where a
    query sees no key of the piece)."""
    b, g, r, _, d = q5.shape
    dv = v.shape[-1]
    if use_fused:
        qp, kp, vp, mask = _fused_args(q5, k, v, pc)
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qp, kp, vp, 0.0, pc.causal, attn_mask=mask, scale=m.scale)
        if pc.mask is not None:  # the kernel reports 0 for a row that sees no key
            lse = lse.masked_fill(~pc.mask.any(-1), NEG)
        return o[..., :dv].reshape(b, g, r, -1, dv), lse.reshape(b, g, r, -1)
    s = _scores(q5[:, :, :, pc.q], _take(k, pc), m)
    mask = _bool_mask(pc, s.device)
    if mask is not None:
        s = s.masked_fill(~mask, NEG)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    if m.dropout > 0:
        p = p * _drop_mask(p.shape, m.dropout, seed, p.device)
    return torch.matmul(p, _take(v, pc).unsqueeze(2)), lse


def merge(out, lse, blk_out, blk_lse) -> None:
    """Online-softmax merge of a partial result into the running ``(out, lse)`` (in place)."""
    new = torch.logaddexp(lse, blk_lse)
    safe = torch.where(torch.isinf(new), 0.0, new)
    out.mul_(torch.exp(lse - safe).unsqueeze(-1)).add_(
        blk_out * torch.exp(blk_lse - safe).unsqueeze(-1))
    lse.copy_(new)


def block_forward(q5, k, v, pieces: list[Piece], m: CoreMath, seed: int, out, lse) -> None:
    """Merge one block's attention into the running ``out [b, g, r, s_q, d_v]`` and
    ``lse [b, g, r, s_q]`` (in place). ``seed``: the block's dropout masks."""
    use_fused = fused(m, q5, v)
    for j, pc in enumerate(pieces):
        o, l_ = _piece_forward(q5, k, v, pc, m, seed + j, use_fused)
        merge(out[:, :, :, pc.q], lse[:, :, :, pc.q], o, l_)


def block_backward(q5, k, v, pieces: list[Piece], m: CoreMath, seed: int, d_out, out, lse,
                   delta, dq, dk, dv) -> None:
    """Add one block's gradients into ``dq`` (like ``q5``), ``dk``, ``dv`` (like k, v), given
    ``d_out``, the final ``out`` and ``lse``, and ``delta = rowsum(d_out out)``."""
    use_fused = fused(m, q5, v)
    b, g, r, _, d = q5.shape
    d_v = v.shape[-1]
    safe = torch.where(torch.isinf(lse), 0.0, lse)
    for j, pc in enumerate(pieces):
        if use_fused:
            qp, kp, vp, mask = _fused_args(q5, k, v, pc)
            pad = (0, d - d_v)
            go = F.pad(d_out[:, :, :, pc.q], pad).reshape(b, g * r, -1, d).contiguous()
            op = F.pad(out[:, :, :, pc.q], pad).reshape(b, g * r, -1, d).contiguous()
            gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                go, qp, kp, vp, op, lse[:, :, :, pc.q].reshape(b, g * r, -1).contiguous(),
                0.0, pc.causal, attn_mask=mask, scale=m.scale)
            gq = gq.reshape(b, g, r, -1, d)
            gk, gv = gk.reshape(b, g, r, -1, d).sum(2), gv.reshape(b, g, r, -1, d).sum(2)
            gv = gv[..., :d_v]
        else:
            with torch.enable_grad():
                qp = q5[:, :, :, pc.q].detach().requires_grad_()
                kp = _take(k, pc).detach().requires_grad_()
                vp = _take(v, pc).detach().requires_grad_()
                s = _scores(qp, kp, m)
                mask = _bool_mask(pc, s.device)
                if mask is not None:
                    s = s.masked_fill(~mask, NEG)
                p = torch.exp(s - safe[:, :, :, pc.q].unsqueeze(-1))
                pd = p * _drop_mask(p.shape, m.dropout, seed + j, p.device) \
                    if m.dropout > 0 else p
                f = (d_out[:, :, :, pc.q] * torch.matmul(pd, vp.unsqueeze(2))).sum() \
                    - (delta[:, :, :, pc.q].unsqueeze(-1) * p).sum()
                gq, gk, gv = torch.autograd.grad(f, (qp, kp, vp))
        dq[:, :, :, pc.q] += gq
        _put(dk, pc, gk)
        _put(dv, pc, gv)
