"""What loom's fused linear cross-entropy (:mod:`loom.parallel.cross_entropy`) holds: its chunk
rule and its memory, per rank and micro-batch; pure functions (no torch) for the loss itself, the
planner (:mod:`loom.planner.memory_runtime`) and the closed-loop benchmark.

Symbols: ``N`` tokens entering the output layer on this rank (``s b / c``: with sequence
parallelism the input is all-gathered first), ``h`` hidden size, ``v = Vp/t`` the rank's
vocabulary rows. The functions take numbers or numpy arrays.
"""

from __future__ import annotations

import numpy as np

MIN_CHUNK_ELEMENTS = 1 << 22  # 4 Mi logits = 16 MiB fp32: keeps the chunk GEMMs efficient
MIN_CHUNK_TOKENS = 128
MAX_CHUNKS = 8  # chunks a call is cut into at most, while a chunk's logits fit CAP_CHUNK_ELEMENTS
CAP_CHUNK_ELEMENTS = 1 << 25  # 32 Mi logits = 128 MiB fp32
GEMM_CHUNK_TOKENS = 4096  # tokens a chunk's GEMMs need to run near peak on a GPU (H200, below)
GEMM_CHUNK_ELEMENTS = 1 << 29  # ... while the chunk's logits stay within 512 Mi (2 GiB fp32)


def default_chunk_tokens(num_tokens, hidden_size, local_vocab):
    """Tokens per chunk, clamped to ``[1, N]``: the largest of
    - enough that the chunk's logits hold ``max(N h, 2^22)`` elements, i.e. as many as the
      hidden states ``[N, h]`` (Liger's rule) but at least 4 Mi (16 MiB fp32);
    - ``MIN_CHUNK_TOKENS`` = 128 tokens, so the GEMMs keep a useful height;
    - ``N / MAX_CHUNKS`` (8 chunks) while the chunk's logits stay within
      ``CAP_CHUNK_ELEMENTS`` (32 Mi, 128 MiB fp32): the first rule alone cuts every call into
      ``v / h`` chunks (42 for V 32000, h 768), about 20 kernel launches each, and on one H200
      a GPT-2-small-shaped model spent 33-46 ms of host time per step in the loss forward
      alone, more than the plain PyTorch loop's whole step (``python3 -m
      benchmarks.gpu_profile --sizes small --speed``). Models with ``N h >= 32 Mi`` keep the
      first rule's chunks;
    - ``GEMM_CHUNK_TOKENS`` = 4096 tokens while their logits fit ``GEMM_CHUNK_ELEMENTS`` (512 Mi,
      2 GiB fp32; 2048 tokens at V 262144): each chunk reads and writes the fp32 ``dL/dw``
      ``[v, h]`` once, so short chunks are memory-bound. On one H200 (bf16, forward + backward,
      ``python3 -m benchmarks.cross_entropy_gpu``, ``benchmarks/results/cross_entropy_h200.jsonl``):
      at N 16384, h 4096, V 128256 the first rules' 524-token chunks took 124.8 ms, 4096 tokens
      94.5 ms (``F.linear`` + ``F.cross_entropy`` on the full logits: 101.8 ms, 29 GiB against
      6.3 GiB); at N 32768, h 1024, V 50304, 39.5 ms against 27.9 ms (plain 35.0 ms).
    Measured on this CPU (``linear_cross_entropy`` forward + backward, N = 2048, h = 256,
    1 thread): at V = 8192, 512-token chunks take 345 ms against 363 ms for 1024 and 391 ms for
    an earlier rule's 1024 without the reused buffer; at V = 131072, 128 tokens take 6.4 s
    against 8.3 s for 32. Returns an int for scalar inputs, an array otherwise."""
    n = np.asarray(num_tokens, dtype=np.float64)
    v = np.maximum(np.asarray(local_vocab, np.float64), 1)
    elements = np.maximum(n * np.asarray(hidden_size, dtype=np.float64), MIN_CHUNK_ELEMENTS)
    few = np.minimum(np.ceil(n / MAX_CHUNKS), np.floor(CAP_CHUNK_ELEMENTS / v))
    gemm = np.minimum(GEMM_CHUNK_TOKENS, np.floor(GEMM_CHUNK_ELEMENTS / v))
    tokens = np.maximum(np.maximum(MIN_CHUNK_TOKENS, np.ceil(elements / v)),
                        np.maximum(few, gemm))
    out = np.maximum(1.0, np.minimum(n, tokens))
    return int(out) if out.ndim == 0 else out


def saved_bytes(num_tokens, hidden_size, local_vocab):
    """Bytes the loss saves for its backward beyond references to its inputs: ``dL/dx``
    ``[N, h]``, ``dL/dw`` ``[v, h]`` and the log-sum-exp ``[N]``, all fp32:
    ``4 N h + 4 v h + 4 N``."""
    n = np.asarray(num_tokens, dtype=np.float64)
    return 4.0 * (n * hidden_size + np.asarray(local_vocab, np.float64) * hidden_size + n)


def forward_transient_bytes(num_tokens, hidden_size, local_vocab, gemm_bytes: int):
    """Peak bytes the forward holds for one chunk and frees before returning: the reused fp32
    logits buffer ``[n, v]`` (``n`` = :func:`default_chunk_tokens`) and, when the GEMMs run in a
    16-bit dtype (``gemm_bytes`` 2), the ``[n, v]`` GEMM output or the gradient's 16-bit copy
    beside it: ``(4 + 2) n v``; ``4 n v`` in fp32."""
    n = default_chunk_tokens(num_tokens, hidden_size, local_vocab)
    extra = 2.0 if gemm_bytes < 4 else 0.0
    return (4.0 + extra) * np.asarray(n, np.float64) * local_vocab
