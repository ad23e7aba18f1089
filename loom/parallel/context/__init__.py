"""Context parallelism: the sequence split over the c ranks of the CP group.

Causal load balance (Megatron-LM / Llama 3): the sequence is cut into 2c chunks and CP rank r
holds chunks r and 2c-1-r, so every rank has the same amount of causal-attention work (early
chunks attend to little, late chunks to much). Each rank computes Q, K, V for its own s/c
tokens; the trainer gives each micro-batch its ``position_ids`` (:func:`local_positions`) and
the plan wraps the attention core in :class:`ContextParallelAttention`, which attends by one of
Megatron-LM's ``--cp-comm-type`` (per layer):

- ``allgather``: keys and values all-gathered over the CP group (the form used to train
  Llama 3, Dubey et al. 2024 sec. 3.3.2); the local queries attend to the full sequence under a
  mask from global positions; backward reduce-scatters the K/V gradients. Per layer
  ``2 (c-1)/c s b g d`` elements each way; every rank holds the whole K/V.
- ``p2p``: ring attention (:mod:`loom.parallel.context.ring`), K/V ``O(s/c)`` per rank.
- ``a2a``: all-to-all from sequence to head sharding (:mod:`loom.parallel.context.a2a`).
- ``a2a+p2p``: a2a inside groups of A consecutive CP ranks, ring across the B groups
  (``--hierarchical-context-parallel-sizes A B``; the mesh's ``cp_a2a`` / ``cp_p2p`` groups).

The modules: :mod:`~loom.parallel.context.split` (the chunks and positions),
:mod:`~loom.parallel.context.attention` (the per-layer dispatch), :mod:`~loom.parallel.context.ring`,
:mod:`~loom.parallel.context.a2a`, :mod:`~loom.parallel.context.blocks` (the per-block attention
arithmetic ring and a2a share), :mod:`~loom.parallel.context.cost` (bytes and K/V memory of each
type: pure, for the planner), :mod:`~loom.parallel.context.mamba` (Mamba layers: all-to-all from
sequence to head sharding around the conv and scan, whatever ``--cp-comm-type`` says).
"""
