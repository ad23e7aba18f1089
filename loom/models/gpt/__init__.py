"""The GPT-2 / LLaMA family: plain model (:mod:`.model`), plan and initializers
(:mod:`.parallelize`), forward step."""

from loom.models.family import ModelFamily
from loom.models.gpt import parallelize
from loom.models.gpt.model import GPTModel, forward_step  # noqa: F401

FAMILY = ModelFamily(name="gpt", build=GPTModel, plan=parallelize.plan, init=parallelize.init,
                     forward_step=forward_step)
