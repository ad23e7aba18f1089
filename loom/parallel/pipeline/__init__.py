"""Pipeline model parallelism (PTD-P, Narayanan et al. 2021): stages, schedules, p2p.

- :mod:`.layout` (torch-free): which layers each (virtual) stage holds, validation
- :mod:`.schedules`: GPipe, 1F1B and interleaved 1F1B over the family's forward step
  (``get_schedule``, ``forward_only``, ``ScheduleResult``, ``PipelineStats``)
- :mod:`.model`: the tied-embedding gradient all-reduce
- :mod:`.timeline`: the per-rank Chrome-trace recorder
"""
