"""Pipeline model parallelism (PTD-P, Narayanan et al. 2021): stages, schedules, p2p.

API used by the trainer:

- :func:`build_pipeline_chunks` (cfg, mesh, tracker) -> this rank's model chunk(s)
- :func:`get_schedule` (name) -> ``fn(model_chunks, batches, reducers, mesh, cfg) -> loss``
  for ``gpipe``, ``1f1b``, ``interleaved``
- :func:`allreduce_embedding_grads` (model_chunks, mesh): tied embeddings, first <-> last stage
- :func:`forward_only` (model_chunks, batches, mesh, cfg): evaluation loss
- :func:`last_stats`: peak in-flight micro-batches and bubble (idle) time of the last run

:mod:`loom.parallel.pipeline.layout` (layer split, ``validate_pipeline``) imports no torch, so
the names here are imported lazily.
"""

from __future__ import annotations

_EXPORTS = {
    "build_pipeline_chunks": "model", "allreduce_embedding_grads": "model",
    "tied_embedding_weight": "model",
    "get_schedule": "schedules", "forward_only": "schedules", "last_stats": "schedules",
    "run_ops": "schedules", "PipelineStats": "schedules",
    "validate_pipeline": "layout", "chunk_layers": "layout", "virtual_stage_layers": "layout",
    "stage_layer_counts": "layout",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib
        mod = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(mod, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
