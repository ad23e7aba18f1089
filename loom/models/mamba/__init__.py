"""The Mamba-2 / hybrid family (``--model-type mamba``): plain model (:mod:`.model`, scan in
:mod:`.ssd`), plan and initializers (:mod:`.parallelize`), Hugging Face mapping (:mod:`.hf`: Mamba2 /
Nemotron-H); the forward step is the shared language-model step
(:mod:`loom.models.language_model`, GPT's too)."""

# The family itself (FAMILY: model, plan, forward step: torch) is in .family; its config rules
# and layer kinds (torch-free: validation and the planner read them) in .config. Nothing is
# imported here, so reading the config rules imports no torch.
