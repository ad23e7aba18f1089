"""Zero-shot evaluation of a checkpoint (``loom evaluate``), with Megatron-LM's ``tasks/``
semantics: ``perplexity`` (sliding window, token- and word-level perplexity, as Megatron reports
WikiText-103) and ``cloze`` (LAMBADA accuracy). Tasks are registered per model family
(:mod:`loom.evaluation.registry`); the checkpoint loads at any TP/PP layout and every micro-batch
runs through the pipeline schedules' ``forward_only`` (:mod:`loom.evaluation.runner`).
"""
