"""The planner's research, outside the shipped package (issue 46): the published tables with
their provenance (:mod:`.published`, :mod:`.validation`: NAR, KOR, SHO, Megatron-Core H100,
BLOOM, OPT-175B, torchtitan, llm-foundry, Llama 3, Megatron-Bridge), their predictions at the
published layouts, and the fit of the planner's constants with its leave-one-source-out check
(:mod:`.fit`). ``loom plan`` ships only the fitted values (loom/planner/constants.py); these
modules reproduce them (``python -m benchmarks.planner_fit``, ``benchmarks.planner_validation``,
``benchmarks.planner_published``; tests/planner/test_planner_loso.py and friends)."""
