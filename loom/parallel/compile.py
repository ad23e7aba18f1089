"""``--compile``: regional ``torch.compile`` of every transformer layer (torchtitan's
per-block compilation), in place.

Each module under a chunk's ``layers`` is compiled with :meth:`torch.nn.Module.compile`, which
keeps the module (and so every parameter name, the registry and checkpoints) unchanged and
compiles its ``__call__``. Inductor fuses each layer's local math (norms, GeLU / SwiGLU,
residual adds, dropout, RoPE, the elementwise parts of attention) into generated kernels on CPU
(C++, needs a compiler: checked before any process group by ``loom.config.validate``) and CUDA
(Triton); the GEMMs stay library calls. loom's tensor-, sequence- and context-parallel
collectives are ``torch.autograd.Function``s calling ``torch.distributed``: Dynamo traces them
or breaks the graph around them, so the collectives and their order are unchanged and every
parallelism composes (tested: ``tests/parallel/test_compile.py``). Under compilation their
forward returns a copy of the collective's result (torch 2.11 otherwise lost their gradients:
see :class:`~loom.parallel.mappings.ConjugateCollective`). Recomputation wrappers are compiled
with the layer. The embedding and the output layer + fused loss are not compiled (the chunked
cross-entropy is already one pass per chunk).

All layers share one code object, so one compilation serves every layer of a chunk with the
same shapes (recompiles appear only for new shapes). Compiled fp32 math reorders reductions
(fused LayerNorm/RMSNorm), so results match eager to ~1e-5 relative, not bit for bit.
"""

from __future__ import annotations

from torch import nn


def compile_layers(chunk: nn.Module) -> int:
    """Compile each module of ``chunk.layers`` (an ``nn.ModuleDict`` keyed by global layer
    index) in place; returns how many were compiled (0 for a chunk without layers)."""
    layers = getattr(chunk, "layers", None)
    if layers is None:
        return 0
    for layer in layers.values():
        layer.compile()
    return len(layers)
