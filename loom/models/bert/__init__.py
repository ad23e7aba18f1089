"""BERT: plain model (:mod:`.model`), plan and initializers (:mod:`.parallelize`), forward
step (masked-LM and sentence-order losses), samples (:mod:`loom.data.bert_dataset`), Hugging
Face import (:mod:`.hf`)."""

# The family itself (FAMILY: model, plan, forward step: torch) is in .family; its config rules
# and layer kinds (torch-free: validation and the planner read them) in .config. Nothing is
# imported here, so reading the config rules imports no torch.
