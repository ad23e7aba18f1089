"""HBM traffic of loom's element-wise work per layer, counted from the code (issue 47: which
term of the step disagrees on an H200, and by how much).

The planner prices a layer's element-wise time as ``k x`` the bytes it saves for backward
(:func:`loom.planner.activations.activation_bytes_per_layer`, ``"none"``) over the HBM
bandwidth, three times per step (forward, and twice in backward): ``3 k A / BW``
(:mod:`loom.planner.timing`, ``layer_times``; ``k`` = ``mem_traffic``, 2.49 fitted on Megatron
runs whose norms, SwiGLU and RoPE are fused kernels). Here a ``TorchDispatchMode`` records the
bytes every ATen op of loom's real layer reads and writes (its tensor inputs and outputs; views
move nothing; the GEMMs and the fused attention kernel are the compute term's and are left out)
in one forward and backward of a chunk of 2 layers and of 1 layer (no embedding, no loss: the
difference is one layer), in bf16 as ``--bf16`` runs them, on CPU (the same ATen ops as on a
GPU but for the attention kernel's name). ``k_code = bytes / (3 A)`` is the traffic factor
loom's eager layer implies.

    OMP_NUM_THREADS=1 python -m benchmarks.elementwise_bytes     # ~1 min, one JSON line per shape
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from loom.config import ModelConfig

COMPUTE = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product", "_flash_attention",
           "_efficient_attention", "_cudnn_attention")
NO_TRAFFIC = ("_unsafe_view",)  # a view that torch does not tag as one
# make gpu-check's shapes (benchmarks/gpu_check.py FULL, WIDE, SMALL) at a short sequence: the
# bytes of every op here are linear in s b (the fused attention's are the compute term's)
SHAPES = {"full": dict(num_layers=2, hidden_size=2048, num_attention_heads=16,
                       num_query_groups=4, ffn_hidden_size=8192),
          "wide": dict(num_layers=2, hidden_size=4096, num_attention_heads=32,
                       num_query_groups=8, ffn_hidden_size=14336),
          "small": dict(num_layers=2, hidden_size=1024, num_attention_heads=16,
                        num_query_groups=16, ffn_hidden_size=2816)}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


class TrafficCount(TorchDispatchMode):
    """Bytes read + written by every non-view, non-compute ATen op, by op name."""

    def __init__(self):
        super().__init__()
        self.bytes: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not func.is_view and not name.startswith(COMPUTE) and name not in NO_TRAFFIC:
            self.bytes[name] += _nbytes(args) + _nbytes(list((kwargs or {}).values())) + \
                _nbytes(out)
        return out


def chunk_traffic(model: ModelConfig, n_layers: int, s: int, b: int) -> Counter:
    """Element-wise bytes of one forward + backward of a chunk of ``n_layers`` layers."""
    from benchmarks.layer_memory import _build, _positions
    from loom.parallel.mesh import ParallelMesh
    torch.manual_seed(0)
    chunk = _build(model, list(range(n_layers)), ParallelMesh.single(), False, "p2p", None,
                   "uniform", 1, torch.bfloat16)
    x = torch.randn(s, b, model.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    out = chunk(hidden_states=x, position_ids=_positions(s, 1))
    grad = torch.randn_like(out)
    with TrafficCount() as count:
        out = chunk(hidden_states=x, position_ids=_positions(s, 1))
        out.backward(grad)
    return count.bytes


def layer_traffic(shape: str, s: int = 32, b: int = 1) -> dict:
    """One layer's element-wise bytes (2 layers - 1), the planner's saved bytes ``A`` of that
    layer (flash attention, no recompute, t = 1) and ``k_code = bytes / (3 A)``."""
    from benchmarks.layer_memory import resolve
    from loom.planner.activations import activation_bytes_per_layer
    from loom.planner.layout import make_layouts
    model = resolve(ModelConfig.llama(vocab_size=32000, seq_length=s, max_position_embeddings=s,
                                      hidden_dropout=0.0, attention_dropout=0.0,
                                      **SHAPES[shape]), s, b, bf16=True)
    two, one = chunk_traffic(model, 2, s, b), chunk_traffic(model, 1, s, b)
    per_op = {k: two[k] - one[k] for k in two if two[k] != one[k]}
    total = sum(per_op.values())
    L = make_layouts([dict(tp=1, pp=1, dp=1, mbs=b, recompute="none", zero=0)])
    act = float(activation_bytes_per_layer(model, s, L, flash_attention=True)["none"][0])
    top = sorted(per_op.items(), key=lambda kv: -kv[1])[:8]
    return {"shape": shape, "s": s, "b": b, "bytes_per_layer": total, "saved_A": act,
            "k_code": round(total / (3 * act), 2),
            "top_ops": {k: round(v / total, 3) for k, v in top}}


def main(argv=None) -> None:
    for shape in (argv if argv is not None else sys.argv[1:]) or list(SHAPES):
        print(json.dumps(layer_traffic(shape)), flush=True)


if __name__ == "__main__":
    main()
