"""Model families, each written as plain math plus a parallel plan and its hooks (see
:mod:`loom.models.family`). :func:`get_family` looks one up by name in a
:class:`FamilyRegistry`: the built-in families (:data:`FAMILY_MODULES`), plus any registered on
that registry (:func:`register_family`). Code outside ``loom/models/<family>`` asks the family
for what is family-specific instead of branching on ``--model-type``; :func:`resolve_config`
validates a config with its family's own rules (:class:`loom.config.validate.FamilyRules`)."""

from __future__ import annotations

import importlib
from functools import partial
from types import MappingProxyType
from typing import Callable, Iterable, NamedTuple, Optional

from loom.config.validate import FamilyRules
from loom.errors import ConfigError
from loom.models.family import ModelFamily



class FamilyRow(NamedTuple):
    """A built-in family's row: ``family()`` imports the module holding its ``FAMILY`` (model,
    plan, forward step: torch); ``config()`` its torch-free config module (``check``,
    ``refuse_own_flags``, ``layer_kinds``: what validation and the planner read without building
    anything). Both imported when asked."""

    family: Callable
    config: Callable


FAMILY_MODULES = MappingProxyType({  # --model-type -> its row: one line per built-in family
    "gpt": FamilyRow(lambda: importlib.import_module("loom.models.gpt.family"),
                     lambda: importlib.import_module("loom.models.gpt.config")),
    "mamba": FamilyRow(lambda: importlib.import_module("loom.models.mamba.family"),
                       lambda: importlib.import_module("loom.models.mamba.config")),
    "bert": FamilyRow(lambda: importlib.import_module("loom.models.bert.family"),
                      lambda: importlib.import_module("loom.models.bert.config")),
    "gemma3": FamilyRow(lambda: importlib.import_module("loom.models.gemma3.family"),
                        lambda: importlib.import_module("loom.models.gemma3.config")),
})


class FamilyRegistry:
    """Model families by name: the built-in ones (imported when first asked for) and those
    given here. Immutable: :meth:`register` returns a new registry, so there is no global
    state; pass the registry to whoever looks families up (``Trainer(..., families=...)``)."""

    def __init__(self, extra: Iterable[ModelFamily] = ()):
        self._extra = {}
        for family in extra:
            if family.name in FAMILY_MODULES or family.name in self._extra:
                raise ValueError(f"model family {family.name!r} is already registered")
            self._extra[family.name] = family

    def register(self, family: ModelFamily) -> "FamilyRegistry":
        """A registry with ``family`` added; raises ValueError for a name already taken."""
        return FamilyRegistry([*self._extra.values(), family])

    def names(self) -> list[str]:
        """Every family name: the built-in ones first, then the registered ones."""
        return [*FAMILY_MODULES, *self._extra]

    def get(self, name: str) -> ModelFamily:
        """The family registered as ``name``; raises ValueError for an unknown one."""
        if name in self._extra:
            return self._extra[name]
        if name not in FAMILY_MODULES:
            raise ValueError(f"unknown model family {name!r}; known: {', '.join(self.names())}")
        return FAMILY_MODULES[name].family().FAMILY

    def layer_kinds(self, name: str) -> Optional[Callable]:
        """Family ``name``'s ``layer_kinds`` (``model_cfg -> None | str``, what the planner
        prices) without importing its model (a built-in family's config module: no torch);
        None for a name not registered here."""
        if name in self._extra:
            return self._extra[name].layer_kinds
        return FAMILY_MODULES[name].config().layer_kinds if name in FAMILY_MODULES else None

    def layer_shape(self, model_cfg):
        """Family ``model_cfg.model_type``'s ``layer_shape`` of ``model_cfg`` (a
        :class:`~loom.models.family.LayerShape`), read as :meth:`layer_kinds` is (no torch);
        the default for a family that declares none or is not registered here."""
        from loom.models.family import transformer_layer_shape
        name = model_cfg.model_type
        if name in self._extra:
            return self._extra[name].layer_shape(model_cfg)
        module = FAMILY_MODULES[name].config() if name in FAMILY_MODULES else None
        return getattr(module, "layer_shape", transformer_layer_shape)(model_cfg)

    def cp_refusal(self, model_cfg) -> Optional[str]:
        """Why family ``model_cfg.model_type`` refuses ``--context-parallel-size`` > 1 for this
        model (its config module's ``cp_refusal``, the rule its ``check`` raises on; no torch
        imported), or None when it runs CP or the family is not registered here."""
        name = model_cfg.model_type
        if name in self._extra:
            fn = getattr(self._extra[name], "cp_refusal", None)
        else:
            fn = getattr(FAMILY_MODULES[name].config(), "cp_refusal", None) \
                if name in FAMILY_MODULES else None
        return fn(model_cfg) if fn else None

    def families(self) -> list[ModelFamily]:
        """Every family (imports the built-in ones)."""
        return [self.get(n) for n in self.names()]

    def rules(self, name: str) -> FamilyRules:
        """What the validation pass runs of family ``name``: its ``check``, every other
        family's ``refuse_own_flags`` (registry order), ``replicates_kv_heads``,
        ``document_masks`` (``ModelFamily.takes_documents``) and ``attention_logits``; raises
        ConfigError naming ``--model-type`` for an unknown name."""
        try:
            family = self.get(name)
        except ValueError:
            raise ConfigError(f"--model-type: {name!r} is not one of "
                              f"{', '.join(self.names())}") from None
        return FamilyRules(name=family.name, check=partial(_declared_then_check, family,
                                                           self.families()),
                           others=tuple(f.refuse_own_flags for f in self.families()
                                        if f.name != family.name),
                           replicates_kv_heads=family.replicates_kv_heads,
                           document_masks=family.takes_documents,
                           attention_logits=family.records_attention_logits)

    def for_hf(self, model_type: str) -> Optional[ModelFamily]:
        """The family whose Hugging Face mapping imports ``config.json``'s ``model_type``, or
        None."""
        return next((f for f in self.families() if f.hf and model_type in f.hf.model_types),
                    None)


def register_family(family: ModelFamily,
                    registry: Optional[FamilyRegistry] = None) -> FamilyRegistry:
    """A registry holding ``family`` besides those of ``registry`` (default: the built-in
    ones); raises ValueError for a name already taken. Nothing global changes."""
    return (registry or FamilyRegistry()).register(family)


def get_family(name: str = "gpt", registry: Optional[FamilyRegistry] = None) -> ModelFamily:
    """The :class:`ModelFamily` registered as ``name`` in ``registry`` (default: the built-in
    families); raises ValueError for an unknown one."""
    return (registry or FamilyRegistry()).get(name)


def _declared_then_check(family: ModelFamily, families: list, cfg, world_size: int) -> None:
    """What ``family`` declares, checked generically (``--ckpt-format torch_dist`` needs
    ``megatron_checkpoints``), then its own ``check``."""
    if cfg.training.ckpt_format == "torch_dist" and not family.megatron_checkpoints:
        names = [f.name for f in families if f.megatron_checkpoints]
        which = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
        raise ConfigError(f"--ckpt-format torch_dist (Megatron's format) is written for the "
                          f"{which} families, not --model-type {family.name}: drop it (loom's "
                          f"own loom_dcp)")
    family.check(cfg, world_size)


def resolve_config(cfg, world_size: int, registry: Optional[FamilyRegistry] = None):
    """``cfg.validate(world_size)`` (a LoomConfig, resolved on a copy) with the rules of its
    ``--model-type``'s family in ``registry`` (default: the built-in families): the family's
    ``check`` and the other families' ``refuse_own_flags`` run inside the one validation pass.
    Every command resolves its config here before any process group; raises ConfigError."""
    registry = registry or FamilyRegistry()
    return cfg.validate(world_size, registry.rules(cfg.model.model_type))
