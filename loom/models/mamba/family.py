"""Mamba's :class:`~loom.models.family.ModelFamily` value, ``FAMILY`` (its registry row in
:mod:`loom.models` imports this module; its config hooks come from :mod:`.config`)."""

from loom.models.family import Generation, ModelFamily
from loom.models.language_model import forward_step
from loom.models.mamba import config, parallelize
from loom.models.mamba.hf import HF
from loom.models.mamba.model import MambaModel

FAMILY = ModelFamily(name="mamba", build=MambaModel, plan=parallelize.plan,
                     init=parallelize.init, forward_step=forward_step, generation=Generation(),
                     evaluation_tasks=("perplexity", "cloze"), hf=HF,
                     megatron_checkpoints=True, check=config.check,
                     refuse_own_flags=config.refuse_own_flags, layer_kinds=config.layer_kinds,
                     records_attention_logits=True)
