"""Gemma 3's :class:`~loom.models.family.ModelFamily` value, ``FAMILY`` (its registry row in
:mod:`loom.models` imports this module; its config hooks come from :mod:`.config`)."""

from loom.models.family import Generation, ModelFamily
from loom.models.gemma3 import config, parallelize
from loom.models.gemma3.hf import HF
from loom.models.gemma3.model import Gemma3Model, forward_step  # noqa: F401

FAMILY = ModelFamily(name="gemma3", build=Gemma3Model, plan=parallelize.plan,
                     init=parallelize.init, forward_step=forward_step,
                     generation=Generation(bos_token="<bos>"), hf=HF,  # trained with <bos> first
                     check=config.check, refuse_own_flags=config.refuse_own_flags,
                     replicates_kv_heads=True, layer_kinds=config.layer_kinds,
                     layer_shape=config.layer_shape)
