"""Quantized Hugging Face checkpoints -> full-precision tensors, before a family's mapping reads
them (``loom checkpoint convert --from-hf``): loom trains in full precision, and many models
ship their weights quantized on the Hub.

* ``quant_method: fp8`` (DeepSeek-V3 / V3.1 / R1, Kimi K2, the ``-FP8`` releases of Qwen3 and
  GLM-4.5): each quantized ``W [r, c]`` (``float8_e4m3fn``) has a ``weight_scale_inv`` grid
  ``[ceil(r / br), ceil(c / bc)]`` for ``weight_block_size [br, bc]`` (one scale without a
  block size), and ``W_full[i, j] = W[i, j] * scale[i // br, j // bc]`` (DeepSeek-V3's
  ``inference/fp8_cast_bf16.py``; transformers' ``FineGrainedFP8Config(dequantize=True)``).
* ``quant_method: mxfp4`` (gpt-oss): each expert tensor is ``<name>_blocks [E, r, G, 16]``
  (two e2m1 values per byte) with ``<name>_scales [E, r, G]`` (an e8m0 exponent per block of
  32), decoded by ``transformers.integrations.mxfp4.convert_moe_packed_tensors`` into the
  layout transformers holds (``[E, c, r]``).

The full tensors take the dtype of the checkpoint's unquantized floating tensors (bf16 for
DeepSeek's). Any other ``quant_method`` is refused naming it.
"""

from __future__ import annotations

from typing import Mapping

import torch

from loom.errors import ConfigError

METHODS = ("fp8", "mxfp4")
SCALES = ("_scale_inv", "_scales")


def _dtype(sd: Mapping[str, torch.Tensor]) -> torch.dtype:
    """The dtype holding most elements among the state dict's unquantized floating tensors
    (scales left out; fp32 without one)."""
    counts: dict = {}
    for name, t in sd.items():
        if t.is_floating_point() and t.element_size() >= 2 and not name.endswith(SCALES):
            counts[t.dtype] = counts.get(t.dtype, 0) + t.numel()
    return max(counts, key=counts.get) if counts else torch.float32


def fp8_dequantize(w: torch.Tensor, scale_inv: torch.Tensor, block, dtype: torch.dtype
                   ) -> torch.Tensor:
    """``W [r, c]`` (fp8) times its scale grid ``[ceil(r / br), ceil(c / bc)]`` expanded over
    ``block = (br, bc)`` (None: one scale for the tensor) -> ``[r, c]`` in ``dtype``."""
    full = w.to(torch.float32)
    scale = scale_inv.to(torch.float32)
    if block is None or scale.numel() == 1:
        return (full * scale).to(dtype)
    r, c = full.shape[-2:]
    br, bc = block
    scale = scale.repeat_interleave(br, dim=-2)[..., :r, :].repeat_interleave(bc, dim=-1)
    return (full * scale[..., :c]).to(dtype)


def dequantize(hf: dict, sd: dict, where: str) -> dict:
    """``sd`` with its quantized tensors replaced by full-precision ones, as the
    ``quantization_config`` of ``hf`` (a ``config.json`` dict; the state dict as it is
    without one) says. ConfigError naming ``where`` for another ``quant_method`` or a weight
    whose scales are missing."""
    qc = hf.get("quantization_config")
    if not qc:
        return sd
    method = qc.get("quant_method")
    if method not in METHODS:
        raise ConfigError(f"{where}: quantization_config quant_method {method!r}: loom imports "
                          f"full-precision weights and dequantizes {' and '.join(METHODS)} "
                          f"only; dequantize the checkpoint first")
    dtype = _dtype(sd)
    out = dict(sd)
    if method == "fp8":
        block = qc.get("weight_block_size")
        for name in [k for k in sd if k.endswith(".weight_scale_inv")]:
            weight = name[:-len("_scale_inv")]
            if weight not in sd:
                raise ConfigError(f"{where}: {name} scales no tensor ({weight} is missing)")
            out[weight] = fp8_dequantize(sd[weight], out.pop(name), block, dtype)
        left = [k for k, t in out.items() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
        if left:
            raise ConfigError(f"{where}: {left[0]} is fp8 without a weight_scale_inv beside it")
        return out
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    for name in [k for k in sd if k.endswith("_blocks")]:
        base = name[:-len("_blocks")]
        if base + "_scales" not in sd:
            raise ConfigError(f"{where}: {name} has no {base}_scales beside it")
        out[base] = convert_moe_packed_tensors(out.pop(name), out.pop(base + "_scales"),
                                               dtype=dtype)
    return out
