"""The GPT-2 / LLaMA family: plain model (:mod:`.model`), plan and initializers
(:mod:`.parallelize`), forward step, Hugging Face GPT-2 / LLaMA mapping (:mod:`.hf`)."""

# The family itself (FAMILY: model, plan, forward step: torch) is in .family; its config rules
# and layer kinds (torch-free: validation and the planner read them) in .config. Nothing is
# imported here, so reading the config rules imports no torch.
