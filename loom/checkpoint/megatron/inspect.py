"""``loom checkpoint inspect`` of a Megatron checkpoint: the same fields as loom's own
(:func:`loom.checkpoint.cli.inspect`), with the format named (``Megatron torch_dist`` /
``Megatron torch``), the TP / PP / EP it was saved at (its args; without args the TP its
embedding's chunks show, the rest unknown), every tensor under Megatron's key with its global
shape (the layer-stacked ``[L, ...]`` ones included), whether its optimizer state maps to
loom's, and its files checked (every ``.distcp`` byte range DCP's ``.metadata`` records is there).
"""

from __future__ import annotations

import math
import os

from loom.checkpoint.megatron.common import read_common
from loom.checkpoint.megatron.locate import Found
from loom.errors import ConfigError


def _files_ok(path: str) -> str:
    """``ok (...)`` or ``CORRUPTED: ...`` for a torch_dist directory's DCP files."""
    from torch.distributed.checkpoint import FileSystemReader
    try:
        storage = FileSystemReader(path).read_metadata().storage_data
    except Exception as e:  # noqa: BLE001 - a damaged index
        return f"CORRUPTED: DCP's .metadata is unreadable ({str(e).strip()[:160]})"
    need: dict[str, int] = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    bad = []
    for rel, size in sorted(need.items()):
        file = os.path.join(path, rel)
        have = os.path.getsize(file) if os.path.isfile(file) else -1
        if have < size:
            bad.append(f"{file} is {'missing' if have < 0 else f'truncated ({have} of {size} bytes)'}")
    if bad:
        return "CORRUPTED: " + "; ".join(bad)
    return f"ok ({len(need)} files hold every byte range DCP's .metadata records; Megatron " \
           f"keeps no checksums)"


def _tp_from_chunks(store) -> int | None:
    md = getattr(store, "tensors", {}).get("embedding.word_embeddings.weight")
    return len({c.offsets[0] for c in md.chunks}) if md is not None else None


def inspect_megatron(found: Found) -> dict:
    """``loom checkpoint inspect``'s dict for the Megatron checkpoint ``found``. Raises
    ConfigError (one line) when its files cannot be read."""
    from loom.checkpoint.megatron.locate import diagnose
    from loom.checkpoint.megatron.stores import open_store
    if diagnose(found.path):
        raise ConfigError(diagnose(found.path))
    integrity = _files_ok(found.path) if found.format == "torch_dist" else \
        "ok (every mp_rank_*/model_optim_rng.pt read; Megatron keeps no checksums)"
    if integrity.startswith("CORRUPTED") and "unreadable" in integrity:
        raise ConfigError(f"Megatron checkpoint {found.path}: {integrity[11:]}")
    store = open_store(found.path, found.format)
    common = read_common(found, store)
    info = common["megatron"]
    saved = info["layout"]
    if found.format == "torch_dist" and saved.get("tp") is None:
        saved = {**saved, "tp": _tp_from_chunks(store)}
    listing = {} if integrity.startswith("CORRUPTED") else store.listing()
    params = {k: {"shape": list(shape), "dtype": str(dtype).replace("torch.", ""),
                  "bytes": math.prod(shape) * dtype.itemsize}
              for k, (shape, dtype) in sorted(listing.items())
              if not k.startswith(("optimizer.", "chained_"))}
    return {"checkpoint": found.path, "iteration": common["iteration"], "layout": saved,
            "world_size": None, "format": f"Megatron {found.format}",
            "consumed_samples": common["consumed_samples"], "parameters": params,
            "total_parameters": sum(math.prod(p["shape"]) for p in params.values()),
            "total_bytes": sum(p["bytes"] for p in params.values()),
            "config": common["config"], "integrity": integrity,
            "optimizer": ("maps to loom's Adam states: " if info["optimizer_maps"] else
                          "does not map (loom train --load needs --no-load-optim or "
                          "--finetune): ") + info["optimizer"]}
