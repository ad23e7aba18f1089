"""Pipeline model parallelism (PTD-P, Narayanan et al. 2021): stages, schedules, p2p.

- :mod:`.placement` (torch-free): which layers each (virtual) stage holds (the rules and their
  validation live in :mod:`loom.config.pipeline`)
- :mod:`.schedules`: GPipe, 1F1B and interleaved 1F1B over the family's forward step
  (``get_schedule``, ``forward_only``, ``ScheduleResult``, ``PipelineStats``)
- :mod:`.shared_embedding`: the tied-embedding gradient all-reduce over the first and last
  stages
- :mod:`.timeline`: the per-rank Chrome-trace recorder
"""
