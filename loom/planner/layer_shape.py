"""What a model family declares of its transformer layers beyond the shape fields
(``ModelFamily.layer_shape``, :class:`loom.models.family.LayerShape`), for every planner
formula: whether the MLP is gated and which norms a layer holds (the gemma3 family's
``gemma_post_norms`` and ``gemma_qk_norm`` are read there). Read from the family's torch-free
config module (pricing imports no torch)."""

from __future__ import annotations

from loom.config import ModelConfig
from loom.models import FamilyRegistry
from loom.planner.gdn import gdn_share


def gated_mlp(model: ModelConfig) -> bool:
    """Whether a transformer layer's MLP is gated (FC1 ``2f`` wide: ``--swiglu``,
    ``--quick-geglu``, Gemma's GeGLU)."""
    return FamilyRegistry().layer_shape(model).gated_mlp


def layer_norm_params(model: ModelConfig) -> int:
    """Parameters of one layer's norms (count): ``norms x h`` weights (and biases with
    LayerNorm), plus ``2 d`` for per-head query and key norms on the attention layers (not
    Gated DeltaNet layers: the per-layer mean, :mod:`loom.planner.gdn`; not multi-latent
    attention, whose latent norms are its own: :func:`loom.planner.mla.mla_attention_params`)."""
    shape = FamilyRegistry().layer_shape(model)
    per = 2 if model.normalization == "LayerNorm" else 1
    qk = 2 * model.head_dim * (1 - gdn_share(model)) \
        if shape.qk_norms and not model.multi_latent_attention else 0
    return per * (shape.norms * model.hidden_size + qk)
