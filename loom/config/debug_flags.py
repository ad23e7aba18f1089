"""Rules of Megatron's debugging flags (:class:`~loom.config.script_fields.DebugScriptFields`,
``--deterministic-mode``; ``--optimizer``'s refused values are rows of the flag table), checked
inside the one validation pass (:func:`loom.config.script_flags.resolve_script_flags`). Torch-free.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional

from loom.errors import ConfigError

DETERMINISM_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"}
"""What ``--deterministic-mode`` sets in the environment when not already set (Megatron-LM's
``megatron/training/determinism.py``: cuBLAS's fixed workspace, NCCL's ring algorithm)."""

DETERMINISTIC_VALUES = {"CUBLAS_WORKSPACE_CONFIG": (":4096:8", ":16:8")}
"""Values accepted when already set (NVIDIA's two deterministic cuBLAS workspaces)."""

DETERMINISTIC_NCCL_ALGOS = ("Ring", "CollnetDirect", "CollnetChain", "^NVLS")
"""``NCCL_ALGO`` tokens Megatron-LM accepts under ``--deterministic-mode`` (not Tree)."""


def parse_ranks(text: Optional[str], world_size: int) -> list[int]:
    """``--profile-ranks "0 3"`` -> ``[0, 3]``; ``[]`` (every rank) when not given.

    Raises ConfigError for a word that is not a rank of ``world_size``."""
    ranks = []
    for word in (text or "").replace(",", " ").split():
        if not word.isdigit() or int(word) >= world_size:
            raise ConfigError(f"--profile-ranks {text}: {word!r} is not a global rank of this "
                              f"run (0..{world_size - 1})")
        ranks.append(int(word))
    return ranks


def check_determinism_env(env: Mapping[str, str]) -> None:
    """Refuse an environment whose cuBLAS workspace or NCCL algorithm would make
    ``--deterministic-mode`` runs differ (Megatron's ``apply_determinism_env`` rules)."""
    for name, accepted in DETERMINISTIC_VALUES.items():
        if env.get(name) not in (None, *accepted):
            raise ConfigError(f"--deterministic-mode: {name}={env[name]} is not a deterministic "
                              f"setting: unset it or use one of {', '.join(accepted)}")
    algo = env.get("NCCL_ALGO")
    if algo is not None:
        tokens = [w.strip() for w in algo.split(",") if w.strip()]
        if not tokens or any(w not in DETERMINISTIC_NCCL_ALGOS for w in tokens):
            raise ConfigError(f"--deterministic-mode: NCCL_ALGO={algo} is not reproducible "
                              f"(Tree's reduction order can change between runs): unset it or "
                              f"use {', '.join(DETERMINISTIC_NCCL_ALGOS)}")


def check_debug_flags(cfg: Any, world_size: int) -> None:
    """A non-empty ``--profile`` window, ``--profile-ranks`` inside the world, and
    (``--deterministic-mode``) a deterministic environment. Raises ConfigError naming the
    flag."""
    t, lg = cfg.training, cfg.logging
    if lg.profile and lg.profile_step_end <= lg.profile_step_start:
        raise ConfigError(f"--profile-step-end {lg.profile_step_end} must exceed "
                          f"--profile-step-start {lg.profile_step_start}")
    parse_ranks(lg.profile_ranks, world_size)
    if t.deterministic_mode:
        check_determinism_env(os.environ)
