"""The selective state-space recurrence of Mamba-2 and its chunked (SSD) evaluation, in plain
PyTorch (Dao & Gu 2024, "Transformers are SSMs", sec. 6 and Listing 1 ``ssd_minimal``).

Per head (H heads of P channels; B, C shared by the heads of one of G groups, state size N):

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T        h_t: [P, N]      (eq. 1, discretized)
    y_t = h_t C_t                                      y_t: [P]

:func:`ssd_chunked` evaluates it in chunks of Q positions with matmuls only: the quadratic
("attention-like") form inside each chunk, the chunk-final states, a recurrence over the s/Q
chunk states, and each chunk's output from the state entering it (the four steps of sec. 6,
fig. 5). Work is O(s Q N P) instead of O(s^2); every step is an einsum, so it runs on CPU and
GPU without custom kernels. :func:`ssd_step` is one step of the recurrence (decoding, and the
naive reference :func:`ssd_sequential` the tests compare against).

Shapes: ``x [b, s, H, P]``, ``dt [b, s, H]`` (after softplus, > 0), ``A [H]`` (< 0),
``B, C [b, s, G, N]`` with H divisible by G (head i reads group ``i // (H / G)``), state
``[b, H, P, N]``. The skip term ``D x`` is left to the caller.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def segsum(a: torch.Tensor) -> torch.Tensor:
    """``out[..., i, j] = sum_{j < k <= i} a[..., k]`` for ``j <= i``, ``-inf`` above the
    diagonal; ``a [..., T] -> [..., T, T]``. Summed from masked copies (not as a difference of
    cumulative sums) so it is exact in fp32 (Listing 1's stable ``segsum``)."""
    T = a.shape[-1]
    x = a[..., None].expand(*a.shape, T)  # x[..., k, j] = a[k]
    strict = torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device), diagonal=-1)
    x = x.masked_fill(~strict, 0.0).cumsum(dim=-2)
    lower = torch.tril(torch.ones(T, T, dtype=torch.bool, device=a.device), diagonal=0)
    return x.masked_fill(~lower, float("-inf"))


def _heads(bc: torch.Tensor, heads: int) -> torch.Tensor:
    """``[b, s, G, N] -> [b, s, H, N]``: each group's B or C repeated for its H/G heads."""
    return bc.repeat_interleave(heads // bc.shape[2], dim=2)


def ssd_chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                C: torch.Tensor, chunk_size: int,
                initial_state: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``y [b, s, H, P]`` and the final state ``[b, H, P, N]`` of the recurrence (module
    docstring) by the chunked SSD algorithm (Dao & Gu 2024, sec. 6, Listing 1).

    s need not be a multiple of ``chunk_size``: the tail is padded with ``dt = 0`` (decay 1,
    no input), which leaves the state unchanged and is dropped from ``y``.
    """
    b, s, H, P = x.shape
    Q = chunk_size
    pad = (-s) % Q
    if pad:
        x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
        dt = F.pad(dt, (0, 0, 0, pad))
    c = (s + pad) // Q
    X = (x * dt[..., None]).view(b, c, Q, H, P)  # dt_t x_t
    Bh = _heads(B, H).view(b, c, Q, H, -1)
    Ch = _heads(C, H).view(b, c, Q, H, -1)
    a = (dt * A).view(b, c, Q, H).permute(0, 3, 1, 2)  # [b, H, c, Q]: log decays dt_t A
    a_cum = a.cumsum(dim=-1)
    # 1. inside each chunk: y_l = sum_{m <= l} C_l.B_m exp(sum_{m<k<=l} a_k) X_m
    L = torch.exp(segsum(a))  # [b, H, c, Q, Q]
    y_diag = torch.einsum("bclhn,bcmhn,bhclm,bcmhp->bclhp", Ch, Bh, L, X)
    # 2. state at each chunk's end from its own inputs
    decay_to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [b, H, c, Q]
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", Bh, decay_to_end, X)
    # 3. recurrence over chunks: state entering chunk z
    if initial_state is None:
        initial_state = torch.zeros_like(states[:, 0])
    states = torch.cat([initial_state[:, None].to(states.dtype), states], dim=1)
    decay_chunk = torch.exp(segsum(F.pad(a_cum[..., -1], (1, 0))))  # [b, H, c+1, c+1]
    states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)
    entering, final = states[:, :-1], states[:, -1]
    # 4. each position's output from the state entering its chunk
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", Ch, entering, torch.exp(a_cum))
    y = (y_diag + y_off).reshape(b, c * Q, H, P)[:, :s]
    return y, final


def ssd_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
             B: torch.Tensor, C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One position of the recurrence: ``state [b, H, P, N]``, ``x [b, H, P]``, ``dt [b, H]``,
    ``B, C [b, G, N]`` -> ``(y [b, H, P], new state)`` (eq. 1 with zero-order-hold-free
    discretization ``A_bar = exp(dt A)``, ``B_bar = dt B``, as Mamba-2 uses)."""
    H = x.shape[1]
    Bh = B.repeat_interleave(H // B.shape[1], dim=1)  # [b, H, N]
    Ch = C.repeat_interleave(H // C.shape[1], dim=1)
    decay = torch.exp(dt * A)[..., None, None]
    state = state * decay + (dt[..., None] * x)[..., None] * Bh[:, :, None, :]
    return torch.einsum("bhpn,bhn->bhp", state, Ch), state


def ssd_sequential(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, initial_state: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive reference: :func:`ssd_step` over positions one by one. Same arguments and
    results as :func:`ssd_chunked` (without the chunk size); O(s) sequential steps."""
    b, s, H, P = x.shape
    state = initial_state if initial_state is not None else x.new_zeros(b, H, P, B.shape[-1])
    ys = []
    for i in range(s):
        y, state = ssd_step(state, x[:, i], dt[:, i], A, B[:, i], C[:, i])
        ys.append(y)
    return torch.stack(ys, dim=1), state
