"""A resume trains on the data the checkpoint was trained on (torch-free but for reading
``common.pt``).

Every checkpoint records, in ``common.pt``'s ``data``, the identity of each dataset it was
trained on (``{flag: {prefix: {"content": hash of the .bin and .idx checksums, "tokenizer":
the tokenizer's checksum}}}``, from ``meta.json``'s ``files``:
:func:`loom.data.checks.dataset_identity`); its config holds ``--split`` and ``--seed``. A
resume whose datasets, split or seed differ is refused, naming what changed (the trained
documents would move into validation, the sample order would change, or the same ids would now
mean other text), unless ``--override-data-change``; ``--finetune`` starts a new run and is
not checked.
"""

from __future__ import annotations

import os
from typing import Optional

from loom.errors import ConfigError


def data_identities(data_cfg) -> dict:
    """``{flag: {prefix: identity or None}}`` of every dataset ``data_cfg`` (a DataConfig)
    names; empty for ``--mock-data``. Reads each ``meta.json`` (no data file)."""
    from loom.data.blended import data_prefixes
    from loom.data.checks import _read_meta, dataset_identity
    out: dict = {}
    if getattr(data_cfg, "mock_data", False):
        return out
    for flag, prefix in data_prefixes(data_cfg):
        out.setdefault(flag, {})[prefix] = dataset_identity(_read_meta(prefix) or {})
    return out


DATA_FILES = (".bin", ".idx", ".meta.json")  # what a dataset's identity rests on


def data_files(data_cfg) -> dict:
    """``{(flag, prefix): {ext: (inode, size, mtime_ns) or None}}`` of every dataset
    ``data_cfg`` names: what :func:`changed_data` compares (no file is read)."""
    from loom.data.blended import data_prefixes
    out = {}
    if getattr(data_cfg, "mock_data", False):
        return out
    for flag, prefix in data_prefixes(data_cfg):
        stamps = {}
        for ext in DATA_FILES:
            try:
                st = os.stat(prefix + ext)
                stamps[ext] = (st.st_ino, st.st_size, st.st_mtime_ns)
            except OSError:
                stamps[ext] = None
        out[(flag, prefix)] = stamps
    return out


def changed_data(opened: dict) -> list[tuple[str, str]]:
    """``(flag, prefix)`` of the datasets of ``opened`` (:func:`data_files` when the data was
    opened) whose files were replaced or modified since."""
    out = []
    for (flag, prefix), stamps in opened.items():
        for ext, then in stamps.items():
            try:
                st = os.stat(prefix + ext)
                now = (st.st_ino, st.st_size, st.st_mtime_ns)
            except OSError:
                now = None
            if now != then:
                out.append((flag, prefix))
                break
    return out


def data_differences(saved_common: dict, cfg) -> list[str]:
    """What differs between the checkpoint's data (``saved_common``: its ``common.pt``) and
    ``cfg``'s (a LoomConfig): ``--split``, ``--seed``, and each dataset's content and
    tokenizer."""
    saved_cfg = saved_common.get("config") or {}
    out = []
    for flag, now in (("split", cfg.data.split), ("seed", cfg.training.seed)):
        if flag in saved_cfg and saved_cfg[flag] != now:
            out.append(f"--{flag} {saved_cfg[flag]} in the checkpoint, {now} here")
    saved: Optional[dict] = saved_common.get("data")
    if not saved:
        return out
    now_ids = data_identities(cfg.data)
    out += _blend_differences(saved_cfg, saved, cfg.data, now_ids)
    for flag in sorted(set(saved) | set(now_ids)):
        old, new = saved.get(flag, {}), now_ids.get(flag, {})
        old_c = {v["content"] for v in old.values() if v}
        new_c = {v["content"] for v in new.values() if v}
        if old_c and new_c and old_c != new_c:
            same_prefix = set(old) == set(new)
            out.append(f"{flag} {' '.join(new) or '(none)'}: "
                       + ("its files changed since the checkpoint was trained on them"
                          if same_prefix else f"other data than the checkpoint's "
                                              f"({' '.join(old)})"))
        old_t = {v["tokenizer"] for v in old.values() if v and v.get("tokenizer")}
        new_t = {v["tokenizer"] for v in new.values() if v and v.get("tokenizer")}
        if old_t and new_t and old_t != new_t:
            out.append(f"{flag} {' '.join(new)}: tokenized with another tokenizer than the "
                       f"checkpoint's data (the same ids would mean other text)")
    return out


BLEND_FIELDS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")


def _blend(text, ids: dict, flag: str) -> list[tuple]:
    """``[(weight rounded, dataset)]`` of a ``--data-path`` value, a dataset named by its
    content identity when known (else its absolute prefix); weights None: by size."""
    from loom.data.blended import parse_blend
    out = []
    for w, prefix in parse_blend(text, flag) or []:
        ident = ids.get(prefix)
        out.append((None if w is None else round(w, 9),
                    ident["content"] if ident else os.path.abspath(prefix)))
    return out


def _blend_differences(saved_cfg: dict, saved: dict, data_cfg, now_ids: dict) -> list[str]:
    """A blend of the same datasets in another order or with other weights: the sample order
    changes (each blended sample is chosen by the weights and the dataset's position)."""
    out = []
    for field in BLEND_FIELDS:
        flag = "--" + field.replace("_", "-")
        then_text, now_text = saved_cfg.get(field), getattr(data_cfg, field, None)
        if then_text is None or now_text is None:
            continue
        try:
            then = _blend(then_text, saved.get(flag, {}), flag)
        except ConfigError:
            continue  # a value this loom cannot parse: the content check still runs
        now = _blend(now_text, now_ids.get(flag, {}), flag)
        if then != now and sorted(d for _, d in then) == sorted(d for _, d in now):
            out.append(f"{flag}: the blend differs from the checkpoint's (there: {then_text}; "
                       f"here: {now_text}): the order of the samples would change")
    return out


def check_same_data(cfg, ckpt_dir: str) -> None:
    """Refuse resuming ``ckpt_dir`` on other data, split or seed (see the module docstring);
    ConfigError naming each difference and the fix. Under ``--phase-transition-iterations`` a
    checkpoint of a transition starts a new data phase: its data is not required (Megatron's
    data phases), but the global batch is (a phase's position is its iterations x B)."""
    ck = cfg.checkpoint
    if ck.finetune:
        return
    from loom.checkpoint.reader import read_common
    from loom.config.evaluation import PHASES_FLAG, parse_iterations
    common = read_common(ckpt_dir)
    phases = parse_iterations(cfg.data.phase_transition_iterations, PHASES_FLAG)
    if phases:
        then, now = (common.get("config") or {}).get("global_batch_size"), \
            cfg.require_derived().global_batch_size
        if then is not None and then != now:
            raise ConfigError(f"--load {ck.load}: {PHASES_FLAG} needs the global batch of the "
                              f"checkpoint {ckpt_dir} ({then}; {now} here): give "
                              f"--global-batch-size {then}")
        if common.get("iteration") in phases:
            return
    if ck.override_data_change:
        return
    diff = data_differences(common, cfg)
    if diff:
        raise ConfigError(f"--load {ck.load}: the checkpoint {ckpt_dir} was trained on other "
                          f"data: " + "; ".join(diff) + ". Give the checkpoint's values, or "
                          "--override-data-change to continue on this data (or --finetune)")
