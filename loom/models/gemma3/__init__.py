"""The Gemma 3 (text) family: plain model (:mod:`.model`), plan and initializers
(:mod:`.parallelize`), forward step. Weights come from Hugging Face or a GGUF file through
``loom checkpoint convert --from-hf`` (mapping in :mod:`.hf`)."""

# The family itself (FAMILY: model, plan, forward step: torch) is in .family; its config rules
# and layer kinds (torch-free: validation and the planner read them) in .config. Nothing is
# imported here, so reading the config rules imports no torch.
