"""torchrun's agent store: the key-value store every rank of a torchrun job can reach before any
process group exists. loom uses it for the few words ranks exchange that early: a refusal
printed by rank 0 (:func:`loom.cli.refuse`) and the ``--save`` lock (:mod:`loom.checkpoint.lock`).
Torch is imported only when a store is opened, so importing this module stays cheap.
"""

from __future__ import annotations

import os

CONNECT_TIMEOUT_S = 20  # seconds a client waits for the store (and, by default, for a key)


def agent_store(timeout_s: float = CONNECT_TIMEOUT_S):
    """A ``TCPStore`` client of torchrun's agent store (``MASTER_ADDR:MASTER_PORT``) with
    ``timeout_s`` as its timeout; None outside torchrun (``TORCHELASTIC_USE_AGENT_STORE`` not
    ``True``) or when the store cannot be reached. Raises nothing."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        from datetime import timedelta

        from torch.distributed import TCPStore
        return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                        is_master=False, timeout=timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - then every rank simply decides on its own
        return None
