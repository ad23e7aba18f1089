"""Pipeline model parallelism (PTD-P, Narayanan et al. 2021): stages, schedules, p2p.

- :mod:`.placement` (torch-free): which layers each (virtual) stage holds (the rules and their
  validation live in :mod:`loom.config.pipeline`)
- :mod:`.schedules`: GPipe, 1F1B and interleaved 1F1B over the family's forward step
  (``get_schedule``, ``forward_only``, ``ScheduleResult``, ``PipelineStats``)
- :mod:`.zero_bubble`: the zero-bubble op lists (ZB-H1, ``--pipeline-schedule zero-bubble``;
  ZB-V, ``zbv``, and where its V puts the loss: ``loss_stage``), :mod:`.split_backward`: a backward split into B (input gradient)
  and W (weight gradients), :mod:`.bubble`: each schedule's bubble and activation memory
  (torch-free, for the planner)
- :mod:`.shared_embedding`: the tied-embedding gradient all-reduce over the first and last
  stages (a local sum when both copies are on one stage, as under ZB-V)
- :mod:`.timeline`: the per-rank Chrome-trace recorder
"""
