"""The fused SwiGLU (:func:`loom.models.activation.swiglu`) equals ``silu(gate) * up`` with
autograd's gradients bit for bit (fp32 and bf16), and saves only its input ``[..., 2f]`` for
backward where the unfused graph also keeps the SiLU output ``[..., f]`` (counted with
``saved_tensors_hooks``, once per storage; the count tells the two apart)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loom.models.activation import swiglu


def _unfused(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def _saved_bytes(fn, y: torch.Tensor) -> int:
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(y)
    return sum(storages.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_equals_unfused_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(0)
    y = torch.randn(6, 2, 16, generator=g).to(dtype).requires_grad_(True)
    grad = torch.randn(6, 2, 8, generator=g).to(dtype)
    out, ref = swiglu(y), _unfused(y)
    (got,) = torch.autograd.grad(out, y, grad)
    (want,) = torch.autograd.grad(ref, y, grad)
    assert torch.equal(out, ref) and torch.equal(got, want)


def test_swiglu_saves_only_its_input():
    y = torch.randn(6, 2, 16, dtype=torch.bfloat16, requires_grad=True)
    y_bytes = y.numel() * y.element_size()
    assert _saved_bytes(swiglu, y) == y_bytes
    assert _saved_bytes(_unfused, y) == y_bytes + y_bytes // 2  # + the SiLU output
