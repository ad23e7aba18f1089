"""The Mamba-2 / hybrid family (``--model-type mamba``): plain model (:mod:`.model`, scan in
:mod:`.ssd`), plan and initializers (:mod:`.parallelize`), Hugging Face mapping (:mod:`.hf`: Mamba2 /
Nemotron-H); the forward step is the shared language-model step
(:mod:`loom.models.language_model`, GPT's too)."""

from loom.models.family import Generation, ModelFamily
from loom.models.language_model import forward_step
from loom.models.mamba import config, parallelize
from loom.models.mamba.hf import HF
from loom.models.mamba.model import MambaModel

FAMILY = ModelFamily(name="mamba", build=MambaModel, plan=parallelize.plan,
                     init=parallelize.init, forward_step=forward_step, generation=Generation(),
                     evaluation_tasks=("perplexity", "cloze"), hf=HF,
                     megatron_checkpoints=True, check=config.check,
                     refuse_own_flags=config.refuse_own_flags, layer_kinds=config.layer_kinds)
