"""The output-layer GEMM and the vocabulary-parallel cross-entropy, fused and chunked over tokens.

:func:`linear_cross_entropy` computes ``loss_i = logsumexp_v(x_i . w_v) - x_i . w_{y_i}`` for the
rows ``w`` of this rank's vocabulary shard without ever holding the logits of all tokens: tokens
are processed in chunks of ``n`` rows, and each chunk's logits ``[n, Vp/t]`` (fp32) are turned,
in place, into ``softmax - onehot`` (the logits' gradient, Megatron-LM's
``_VocabParallelCrossEntropy.backward``) right after the chunk's loss is known; the chunk's
contributions to ``dL/dx`` (``[n, h]``) and ``dL/dw`` (``[Vp/t, h]``, accumulated) are computed
in the forward; every chunk reuses one logits buffer, freed at the end. Backward only scales
them by the incoming per-token gradient. This is the "fused linear cross-entropy" of
Liger-Kernel (Hsu et al. 2024, arXiv:2410.10989, sec. 3.2) made vocabulary-parallel
(Megatron-LM's vocab-parallel cross-entropy, Shoeybi et al. 2019 sec. 3) with one collective
per chunk.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from loom.parallel.cross_entropy_cost import default_chunk_tokens
from loom.parallel.sequence import all_gather_into

GEMM_TILE_COLUMNS = 1024  # vocabulary rows per forward GEMM tile (see _logits_into)
# cuBLAS GEMMs of 16-bit inputs that write (and accumulate into) an fp32 output: aten's
# ``mm.dtype_out`` / ``addmm.dtype_out`` (``out_dtype=``; CUDA only, torch >= 2.8)
FP32_OUT_GEMM = "dtype_out" in torch.ops.aten.addmm.overloads()


def _fp32_out(t: torch.Tensor) -> bool:
    """Whether the GEMMs on ``t`` write fp32 directly: bf16 on CUDA (torch >= 2.8), the case
    measured on an H200 (``tests/cuda``' bf16 loss test, ``benchmarks.cross_entropy_gpu``);
    fp16 keeps the 16-bit products until a GPU has run it."""
    return FP32_OUT_GEMM and t.is_cuda and t.dtype == torch.bfloat16


def _compute_dtype(device: torch.device, *dtypes: torch.dtype) -> torch.dtype:
    """The GEMMs' dtype: autocast's when it is on for ``device`` (as ``F.linear`` would run),
    else the promotion of the inputs' dtypes."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


def _logits_buffer(n_tok: int, chunk: int, n_local: int, device: torch.device) -> torch.Tensor:
    """The one fp32 ``[min(chunk, N), Vp/t]`` logits buffer every chunk of a call reuses."""
    return torch.empty((max(min(chunk, n_tok), 1), n_local), dtype=torch.float32, device=device)


def _logits_into(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``out[n, Vp/t] = x[n, h] @ w[Vp/t, h]^T`` in fp32, written in column tiles of
    ``GEMM_TILE_COLUMNS`` vocabulary rows into the reused buffer ``out`` (no allocation: a fresh
    multi-MiB tensor per chunk costs page faults, ~30% of the GEMM on this CPU, and a
    ``[n, 8192]`` product runs at ~60 GFLOP/s against ~85 in 1024-column tiles)."""
    if x.dtype != torch.float32:  # 16-bit GEMM, fp32 softmax
        if _fp32_out(x):  # fp32 written by the GEMM itself: no 16-bit [n, v] copy
            return torch.mm(x, w.t(), out_dtype=torch.float32, out=out)
        out.copy_(torch.mm(x, w.t()))
        return out
    v = w.shape[0]
    if v <= GEMM_TILE_COLUMNS:
        return torch.mm(x, w.t(), out=out)
    for v0 in range(0, v, GEMM_TILE_COLUMNS):
        v1 = min(v0 + GEMM_TILE_COLUMNS, v)
        torch.mm(x, w[v0:v1].t(), out=out[:, v0:v1])
    return out


def _chunk_grad_logits(x, w, tgt, group, vocab_start, vocab_size, buf, lse=None):
    """One chunk: logits ``[n, Vp/t]`` (fp32, written into ``buf``) -> ``softmax - onehot``
    in place.

    Without ``lse``: the local softmax is taken in place (one fused row-wise kernel), the local
    log-sum-exp recovered from the largest probability (``lse_l = max - log p_max``, since
    ``p_max = 1 / sum exp(l - max)``; ``p_max >= t / Vp``, so well conditioned), and under TP
    one all-gather of ``[2, n]`` (local log-sum-exp, target logit) gives the global
    log-sum-exp; each rank rescales its probabilities by ``exp(lse_l - lse)``. Returns
    ``(loss [n], lse [n], grad_logits)``. With ``lse`` (saved log-sum-exp, backward's
    recompute) no collective is needed.
    """
    n_local = w.shape[0]
    logits = _logits_into(buf[:x.shape[0]], x, w)
    n_valid = min(max(vocab_size - vocab_start, 0), n_local)
    if n_valid < n_local:  # padded vocabulary rows never enter the softmax
        logits[:, n_valid:] = float("-inf")
    local_t = tgt - vocab_start
    owned = (local_t >= 0) & (local_t < n_local)
    local_t = local_t.masked_fill(~owned, 0).unsqueeze(1)
    minus_owned = -owned.to(logits.dtype).unsqueeze(1)
    if lse is not None:
        logits.sub_(lse.unsqueeze(1)).exp_()
        return logits.scatter_add_(1, local_t, minus_owned)
    target_logit = logits.gather(1, local_t).squeeze(1).masked_fill_(~owned, 0.0)
    if n_valid == 0:  # a shard of padding only: no probability mass here
        local_lse = torch.full_like(target_logit, float("-inf"))
        logits.zero_()
    else:
        row_max = logits.amax(dim=1)  # amax: ~4x cheaper than max(dim) with its indices
        torch._softmax(logits, 1, False, out=logits)  # in place: each row read, then written
        local_lse = row_max - logits.amax(dim=1).log()  # the largest probability is 1 / sum
    if group is None:
        lse = local_lse
    else:
        stats = torch.stack([local_lse, target_logit])
        t = dist.get_world_size(group)
        parts = torch.empty((t * 2, stats.shape[1]), dtype=stats.dtype, device=stats.device)
        all_gather_into(parts, stats, group)
        parts = parts.view(t, 2, -1)
        lse = torch.logsumexp(parts[:, 0], dim=0)
        target_logit = parts[:, 1].sum(dim=0)
        logits.mul_((local_lse - lse).exp_().unsqueeze(1))
    loss = lse - target_logit
    grad_logits = logits.scatter_add_(1, local_t, minus_owned)
    return loss, lse, grad_logits


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, group, vocab_start, vocab_size, chunk, cdt,
                need_grad):
        h = hidden.shape[-1]
        x = hidden.reshape(-1, h)
        tgt = target.reshape(-1)
        n_tok = x.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):
            xc, wc = x.to(cdt), weight.to(cdt)
            loss = torch.empty(n_tok, dtype=torch.float32, device=x.device)
            lse = torch.empty_like(loss)
            grad_x = torch.empty((n_tok, h), dtype=torch.float32, device=x.device) if need_grad \
                else None
            new = torch.empty if n_tok else torch.zeros  # no chunk: no gradient contribution
            grad_w = new(weight.shape, dtype=torch.float32, device=x.device) if need_grad else None
            buf = _logits_buffer(n_tok, chunk, weight.shape[0], x.device)
            for start in range(0, n_tok, chunk):
                end = min(start + chunk, n_tok)
                xs = xc[start:end]
                loss[start:end], lse[start:end], d = _chunk_grad_logits(
                    xs, wc, tgt[start:end], group, vocab_start, vocab_size, buf)
                if not need_grad:
                    continue
                if cdt == torch.float32:
                    torch.mm(d, wc, out=grad_x[start:end])
                    if start == 0:  # the first chunk writes dL/dw: no zeroing pass
                        torch.mm(d.t(), xs, out=grad_w)
                    else:
                        grad_w.addmm_(d.t(), xs)
                else:
                    d = d.to(cdt)
                    grad_x[start:end] = torch.mm(d, wc)
                    _weight_grad_into(grad_w, d, xs, first=start == 0)
                del d
            del buf
        if need_grad:
            ctx.save_for_backward(hidden, weight, target, lse, grad_x, grad_w)
            ctx.args = (group, vocab_start, vocab_size, chunk, cdt)
            ctx.consumed = False
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.consumed:
            raise RuntimeError("linear_cross_entropy: backward ran twice over the same forward; "
                               "its saved gradients were already scaled in place")
        ctx.consumed = True
        hidden, weight, target, lse, grad_x, grad_w = ctx.saved_tensors
        g = grad_loss.reshape(-1).float()
        uniform = bool((g == g[0]).all()) if g.numel() else True  # one host sync
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = grad_x.mul_(g[0] if uniform else g.unsqueeze(1))
            gx = gx.view(hidden.shape).to(hidden.dtype)
        if ctx.needs_input_grad[1]:
            if uniform:
                gw = grad_w.mul_(g[0])
            else:
                gw = _recompute_weight_grad(hidden, weight, target, lse, g, *ctx.args)
            gw = gw.to(weight.dtype)
        return gx, gw, None, None, None, None, None, None, None


def _weight_grad_into(grad_w: torch.Tensor, d: torch.Tensor, x: torch.Tensor, first: bool):
    """``grad_w [v, h]`` (fp32) ``= d[n, v]^T x[n, h]`` (``first``) or ``+=`` it, for 16-bit
    ``d`` and ``x``. In bf16 on CUDA (:func:`_fp32_out`) one GEMM writes or accumulates the
    fp32 result in place (cuBLAS's ``C = A B + C``): a 16-bit ``[v, h]`` product and a second
    pass over ``grad_w`` per chunk cost a quarter of the loss's time at V 128256, h 4096,
    524-token chunks on one H200 (164.7 ms against 124.8, ``python3 -m
    benchmarks.cross_entropy_gpu``), and the chunk's product is no longer rounded to 16 bits
    before it is summed. Elsewhere: the 16-bit product, then copied or added."""
    if _fp32_out(d):
        if first:
            torch.mm(d.t(), x, out_dtype=torch.float32, out=grad_w)
        else:
            torch.addmm(grad_w, d.t(), x, out_dtype=torch.float32, out=grad_w)
        return
    prod = torch.mm(d.t(), x)
    if first:
        grad_w.copy_(prod)
    else:
        grad_w.add_(prod)


def _recompute_weight_grad(hidden, weight, target, lse, g, group, vocab_start, vocab_size, chunk,
                           cdt):
    """``dL/dw = sum_i g_i (softmax_i - onehot_i)^T x_i`` for a non-uniform per-token gradient
    ``g``: the logits are recomputed chunk by chunk from the saved log-sum-exp (no collective)."""
    x = hidden.reshape(-1, hidden.shape[-1])
    tgt = target.reshape(-1)
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
    with torch.autocast(hidden.device.type, enabled=False):
        xc, wc = x.to(cdt), weight.to(cdt)
        buf = _logits_buffer(x.shape[0], chunk, weight.shape[0], x.device)
        for start in range(0, x.shape[0], chunk):
            end = min(start + chunk, x.shape[0])
            d = _chunk_grad_logits(xc[start:end], wc, tgt[start:end], group, vocab_start,
                                   vocab_size, buf, lse=lse[start:end])
            d = d.mul_(g[start:end].unsqueeze(1)).to(cdt)
            _weight_grad_into(grad_w, d, xc[start:end], first=False)
    return grad_w


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                         group: Optional[dist.ProcessGroup], vocab_start: int, vocab_size: int,
                         chunk_tokens: Optional[int] = None) -> torch.Tensor:
    """Per-token cross-entropy of ``hidden @ weight.T`` over the vocabulary split across ``group``.

    Args:
        hidden: ``[..., h]`` (e.g. ``[s, b, h]``), replicated over the TP group: the caller has
            already applied ``f`` (``copy_to_tensor_parallel_region``) or the sequence-parallel
            all-gather, so the gradient returned here is this rank's partial sum and the caller's
            collective reduces it.
        weight: ``[Vp/t, h]``, this rank's rows ``[vocab_start, vocab_start + Vp/t)`` of the
            (padded) output embedding; rows at or past ``vocab_size`` are left out of the
            softmax.
        target: ``[...]`` (``hidden.shape[:-1]``, e.g. ``[s, b]``), global token ids
            ``< vocab_size``.
        group: the TP process group, or None for one rank (no collective).
        vocab_start: first global vocabulary row held here (``tp_rank * Vp/t``).
        vocab_size: the columns the softmax spans: the true V to leave the padded rows out
            (``--exclude-padded-vocab``), Vp to keep them in (Megatron-Core's default).
        chunk_tokens: tokens per chunk; None = :func:`default_chunk_tokens`.

    Returns: the loss per token ``[...]`` (= ``target.shape``), fp32, in nats.

    Numerics: GEMMs run in autocast's dtype when autocast is on (bf16 inputs are fine), else in
    the inputs' dtype; softmax, loss and the weight gradient accumulate in fp32. The result equals
    ``F.cross_entropy(reduction="none")`` on the gathered logits ``[..., V]``.

    Communication: one ``all_gather_single`` (all-gather into one tensor) of ``[2, n]`` fp32
    per chunk on ``group`` (local log-sum-exp and target logit; each rank then forms the global
    log-sum-exp: one collective instead of Megatron's all-reduce MAX + all-reduce SUM + the
    target all-reduce); none in backward.

    Memory: peak O(n Vp/t) for one chunk's logits (fp32, modified in place into the gradient,
    plus an ``n x Vp/t`` copy in the GEMM dtype when it is not fp32), never O(N Vp/t).
    Saved for backward: ``dL/dhidden`` (fp32, the size of ``hidden``), ``dL/dweight`` (fp32,
    the size of ``weight``), the per-token log-sum-exp ``[N]`` and references to the inputs.
    The chunk size rule is :func:`default_chunk_tokens`.

    Backward: gradients are exact for any per-token ``grad_output``. When it is uniform (a mean
    or sum of the losses; one host sync checks) the saved gradients are scaled in place; otherwise
    ``dL/dhidden`` is scaled per row and ``dL/dweight`` recomputed chunk by chunk from the saved
    log-sum-exp. Backward through the same forward twice raises RuntimeError. Without autograd
    (``torch.no_grad()`` or no input requiring grad) only the loss is computed.

    Raises: ValueError on mismatched shapes or ``chunk_tokens < 1``.
    """
    if hidden.shape[-1] != weight.shape[-1] or weight.dim() != 2:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} "
                         f"do not share the hidden dimension")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"target {tuple(target.shape)} must be hidden's leading dims "
                         f"{tuple(hidden.shape[:-1])}")
    n_tok = target.numel()
    chunk = chunk_tokens or default_chunk_tokens(n_tok, hidden.shape[-1], weight.shape[0])
    if chunk < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    cdt = _compute_dtype(hidden.device, hidden.dtype, weight.dtype)
    return _LinearCrossEntropy.apply(hidden, weight, target, group, vocab_start, vocab_size,
                                     chunk, cdt, need_grad)
