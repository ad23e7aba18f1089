"""The planner :class:`~loom.planner.layout.Options` of a published run: what its software did
that ``loom train`` does not (each source module sets the rest: overlap, gradient bytes, ...).

``legacy_interleaved_warmup``: every published source was measured, and the constants fitted,
with the interleaved schedule's warm-up of Megatron-LM before 2024-11: at ``m = p`` each rank
runs all ``m v`` forwards first (removed by Megatron-LM merge request !2117, commit
4295be1a6c, 2024-11-01; ``loom train`` and Megatron-Core 0.16 warm up ``2 (p - r - 1) +
(v - 1) p``). NAR, KOR, SHO, MegaScale and Megatron-Core r0.8.0's H100 tables predate it; the
other sources (torchtitan, llm-foundry, Llama 3) keep the rule they were fitted with, which
only matters for their interleaved rows at ``m = p``.
"""

from __future__ import annotations

from loom.planner.layout import Options


def source_options(**kw) -> Options:
    """``Options(**kw)`` with the published runs' interleaved warm-up (module docstring)."""
    return Options(**{"legacy_interleaved_warmup": True, **kw})
