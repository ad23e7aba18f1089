"""Model families, each written as plain math plus a parallel plan (see
:mod:`loom.models.family`). :func:`get_family` looks one up by name."""

from __future__ import annotations

import importlib

from loom.models.family import ModelFamily

FAMILY_MODULES = {"gpt": "loom.models.gpt", "mamba": "loom.models.mamba",  # --model-type -> FAMILY
                  "bert": "loom.models.bert", "gemma3": "loom.models.gemma3"}


def get_family(name: str = "gpt") -> ModelFamily:
    """The :class:`ModelFamily` registered as ``name``; raises ValueError for an unknown one."""
    if name not in FAMILY_MODULES:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILY_MODULES)}")
    return importlib.import_module(FAMILY_MODULES[name]).FAMILY
