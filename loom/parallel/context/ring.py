"""Ring attention: context parallelism by point-to-point K/V passing (Megatron-LM's
``--cp-comm-type p2p``; Liu et al. 2023, "Ring Attention with Blockwise Transformers"; the
blockwise online softmax of Milakov & Gimelshein 2018 / FlashAttention, Dao et al. 2022).

The c ranks of a ring each hold the queries, keys and values of their own tokens. In c steps
every rank sees every key/value block: at step i rank r computes its queries against the block
of rank ``(r - i) mod c`` while that block travels on to rank r + 1 (``isend`` / ``irecv``
posted before the block's attention and waited after it: communication overlapped with compute).
Per block the attention returns its normalized output and the log-sum-exp of its scores; blocks
merge exactly (``lse = log(exp(lse_1) + exp(lse_2))``, outputs weighted by
``exp(lse_i - lse)``). Backward goes around the ring again: each block's probabilities are
recomputed from the saved global log-sum-exp (FlashAttention's backward, ``dS = P (dP - D)``,
``D = rowsum(dO O)``; PyTorch's fused CPU kernel and its backward where the core's math allows,
else plain tensor ops) and the block's key/value gradient travels with the block, arriving home
after one last hop. Memory per rank: the local K/V plus one block in flight, ``O(s/c)``.

The mask is built from global positions, so any token layout works (the causal load-balanced
two chunks of :mod:`loom.parallel.context`, or the a2a groups' tokens of ``a2a+p2p``); the
block arithmetic (:mod:`loom.parallel.context.blocks`) skips key runs a query tile cannot see
(with the two-chunk layout every step after the first computes half a block).

The attention core's math is read from the core it replaces (:func:`core_math`,
:class:`~loom.parallel.context.blocks.CoreMath`: scale, sliding window, soft-cap, dropout and
its generator). Keys may have fewer heads than queries (GQA: head h uses
group ``h // (a / g)``) and values a different head dim than queries and keys (MLA).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from loom.parallel.context.blocks import (NEG, CoreMath, block_backward, block_forward,
                                          plan_block)


def core_math(inner) -> CoreMath:
    """The math of attention core ``inner`` (``DotProductAttention``, Gemma 3's core, ...).
    Raises ValueError for a bidirectional core (ring attention here is causal)."""
    if not getattr(inner, "causal", True):
        raise ValueError("ring context parallelism needs a causal attention core")
    scale = getattr(inner, "scale", None)
    if scale is None:
        scale = getattr(inner, "softmax_scale", None)
    return CoreMath(scale, getattr(inner, "window", None), getattr(inner, "softcap", None),
                    float(getattr(inner, "dropout", 0.0) or 0.0), getattr(inner, "rng", None))


class _Ring:
    """Point-to-point exchange of one flat buffer around the ring: send to the next rank,
    receive from the previous one (``dist.isend`` / ``dist.irecv``; NCCL batches the pair)."""

    def __init__(self, group):
        self.group = group
        if group is None:  # a ring of one: nothing travels
            self.n, self.me = 1, 0
            return
        n, r = dist.get_world_size(group), dist.get_rank(group)
        self.n, self.me = n, r
        self.next = dist.get_global_rank(group, (r + 1) % n)
        self.prev = dist.get_global_rank(group, (r - 1) % n)

    def start(self, buf: torch.Tensor):
        recv = torch.empty_like(buf)
        if dist.get_backend(self.group) == "nccl":
            ops = [dist.P2POp(dist.isend, buf, self.next, self.group),
                   dist.P2POp(dist.irecv, recv, self.prev, self.group)]
            return recv, dist.batch_isend_irecv(ops)
        return recv, [dist.isend(buf, self.next, group=self.group),
                      dist.irecv(recv, self.prev, group=self.group)]

    @staticmethod
    def wait(reqs) -> None:
        for req in reqs:
            req.wait()


def _pack(*ts):
    return torch.cat([t.reshape(-1) for t in ts])


def _unpack(buf, like):
    out, i = [], 0
    for t in like:
        out.append(buf[i:i + t.numel()].view_as(t))
        i += t.numel()
    return out


class RingAttention(torch.autograd.Function):
    """``apply(q, k, v, positions, group, math, seed)``: ``q [b, a, s_q, d]``, ``k [b, g, s_k,
    d]``, ``v [b, g, s_k, d_v]`` of this rank's tokens, ``positions [n, s_k]`` the global
    positions of every ring member's tokens (row ``dist.get_rank(group)`` is this rank's, also
    the queries') -> ``[b, a, s_q, d_v]``. Forward: ``n - 1`` isend/irecv pairs of K/V;
    backward: ``n - 1`` of K/V (ahead, overlapped) and ``n`` of their gradients (the last
    brings each rank's own home)."""

    @staticmethod
    def forward(ctx, q, k, v, positions, group, m: CoreMath, seed: int):
        ring = _Ring(group)
        n, me = ring.n, ring.me
        b, a, sq, d = q.shape
        g = k.shape[1]
        dt = torch.promote_types(q.dtype, torch.float32)  # fp32 math (fp64 stays fp64)
        q5 = q.to(dt).reshape(b, g, a // g, sq, d)
        kf, vf = k.to(dt), v.to(dt)
        out = q5.new_zeros(b, g, a // g, sq, v.shape[-1])
        lse = q5.new_full((b, g, a // g, sq), NEG)
        buf = _pack(kf, vf)
        for i in range(n):
            if i < n - 1:  # the next block travels while this one is computed
                recv, reqs = ring.start(buf)
            ck, cv = _unpack(buf, (kf, vf))
            src = (me - i) % n
            pieces = plan_block(positions[me], positions[src], m.window, m.tile)
            block_forward(q5, ck, cv, pieces, m, seed + 1_000_003 * src, out, lse)
            if i < n - 1:
                ring.wait(reqs)
                buf = recv
        ctx.save_for_backward(q, k, v, out, lse, positions)
        ctx.group, ctx.m, ctx.seed = group, m, seed
        return out.reshape(b, a, sq, -1).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, positions = ctx.saved_tensors
        m, seed = ctx.m, ctx.seed
        ring = _Ring(ctx.group)
        n, me = ring.n, ring.me
        b, a, sq, d = q.shape
        g = k.shape[1]
        q5 = q.to(out.dtype).reshape(b, g, a // g, sq, d)
        d_out = grad.to(out.dtype).reshape(out.shape)
        delta = (d_out * out).sum(-1)
        kf, vf = k.to(out.dtype), v.to(out.dtype)
        dq = torch.zeros_like(q5)
        kv, dkv = _pack(kf, vf), kf.new_zeros(kf.numel() + vf.numel())
        for i in range(n):
            if i < n - 1:  # the next block travels while this one's gradients are computed
                recv_kv, reqs_kv = ring.start(kv)
            ck, cv = _unpack(kv, (kf, vf))
            cdk, cdv = _unpack(dkv, (kf, vf))
            src = (me - i) % n
            pieces = plan_block(positions[me], positions[src], m.window, m.tile)
            block_backward(q5, ck, cv, pieces, m, seed + 1_000_003 * src, d_out, out, lse, delta,
                           dq, cdk, cdv)
            if n > 1:  # the block's gradient follows it; after the last step it is home
                recv_d, reqs_d = ring.start(dkv)
                ring.wait(reqs_d)
                dkv = recv_d
            if i < n - 1:
                ring.wait(reqs_kv)
                kv = recv_kv
        dk, dv = _unpack(dkv, (kf, vf))
        return (dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                None, None, None, None)


def ring_attention(q, k, v, positions: torch.Tensor, group, m: CoreMath) -> torch.Tensor:
    """Causal attention of this rank's queries over every ring member's keys (see
    :class:`RingAttention` for shapes). The dropout seed is drawn once per call from the
    core's generator (or torch's default) so backward regenerates the same masks."""
    seed = 0
    if m.dropout > 0:
        fork = m.rng.fork() if m.rng is not None else contextlib.nullcontext()
        with fork:
            seed = int(torch.randint(0, 2 ** 40, (1,), device=q.device).item())
    return RingAttention.apply(q, k, v, positions, group, m, seed)
