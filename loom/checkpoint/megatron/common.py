"""A located Megatron checkpoint as loom's checkpoint readers see one: :func:`read_common` (the
``common.pt`` loom keeps: iteration, consumed samples, the model config), :func:`open_index`
(the tensors, :class:`~.index.MegatronIndex`; :func:`loom.checkpoint.reader.load_checkpoint`
resumes from it: weights, Adam states where they map, the iteration; the learning-rate
schedule continues from the iteration with this run's flags; Megatron's generators are not
loom's, so they start fresh) and :func:`optimizer_refusal`.
"""

from __future__ import annotations

import os
from typing import Optional

from loom.checkpoint.megatron.args import args_of, consumed_samples, layout, model_fields, \
    model_flags
from loom.checkpoint.megatron.locate import Found, format_of, locate
from loom.errors import ConfigError


def found_at(ckpt_dir: str) -> Optional[Found]:
    """The checkpoint directory ``ckpt_dir`` (one iteration) as a Megatron checkpoint, or None
    when it is not one."""
    fmt = format_of(ckpt_dir)
    return None if fmt is None else locate(ckpt_dir) or Found(ckpt_dir, fmt, None, ckpt_dir)


def _store(found: Found):
    from loom.checkpoint.megatron.stores import open_store
    return open_store(found.path, found.format)


def _is_hybrid(args, keys) -> bool:
    if args is not None and (getattr(args, "hybrid_override_pattern", None) or
                             getattr(args, "is_hybrid_model", False)):
        return True
    return any(".mixer." in k for k in keys)


def read_common(found: Found, store=None) -> dict:
    """loom's ``common.pt`` view: ``iteration`` (0 for ``release`` and a bare Megatron-Core
    checkpoint without one), ``consumed_samples`` (``args.consumed_train_samples``, else 0),
    ``config`` (the flat model flags of its saved args, ``{}`` without args), ``scheduler``
    None, and ``megatron``: its format, the layout it was saved at, whether and why its
    optimizer state maps. A checkpoint loom wrote (``--ckpt-format torch_dist``,
    ``convert --to-megatron``) keeps loom's own flat config, schedule state and data
    identities under ``loom``: those are returned instead."""
    store = store if store is not None else _store(found)
    common = store.common if isinstance(store.common, dict) else {}
    args = args_of(common)
    iteration = common.get("iteration", found.iteration)
    ok, why = store.optimizer_layout()
    own = common.get("loom") if isinstance(common.get("loom"), dict) else {}
    config = own.get("config") or model_flags(args, model_fields(),
                                              _is_hybrid(args, store.listing()))
    saved_layout = layout(args)
    if store.format == "torch":
        saved_layout.update(tp=store.tp, pp=store.pp, ep=store.ep)
    return {"iteration": int(iteration) if isinstance(iteration, (int, float)) else 0,
            "consumed_samples": own.get("consumed_samples", consumed_samples(args) or 0),
            "config": config, "scheduler": own.get("scheduler"), "data": own.get("data"),
            "has_args": args is not None or bool(own),
            "megatron": {"format": store.format, "layout": saved_layout,
                         "optimizer_maps": ok, "optimizer": why}}


def model_config(found: Found, cfg=None, store=None):
    """``cfg`` (a ModelConfig), else the one the checkpoint's saved args describe. Raises
    ConfigError for a checkpoint without args when no config is given."""
    if cfg is not None:
        return cfg
    common = read_common(found, store)
    if not common["has_args"]:
        raise ConfigError(f"Megatron checkpoint {found.path} holds no saved args (a bare "
                          f"Megatron-Core checkpoint): give the model flags (--num-layers, "
                          f"--hidden-size, --num-attention-heads, ...)")
    from loom.config import LoomConfig
    return LoomConfig.from_flat(common["config"], ignore_retired=True).model


def open_index(found: Found, cfg=None):
    """:class:`~.index.MegatronIndex` of ``found`` for a model of ``cfg`` (default: the saved
    args')."""
    from loom.checkpoint.megatron.index import MegatronIndex
    store = _store(found)
    return MegatronIndex(found, model_config(found, cfg, store), store)


def optimizer_refusal(found: Found) -> Optional[str]:
    """The one-line reason ``loom train --load`` needs ``--no-load-optim`` / ``--finetune``
    for this checkpoint, or None when its Adam states map to loom's."""
    info = read_common(found)["megatron"]
    if info["optimizer_maps"]:
        return None
    return (f"--load {found.root}: a Megatron {info['format']} checkpoint whose optimizer state "
            f"loom cannot take: {info['optimizer']}. Give --no-load-optim (its weights and "
            f"iteration, fresh Adam states) or --finetune (its weights only, from iteration 0)")


def describe_dir(path: str) -> str:
    """For messages: ``Megatron torch_dist checkpoint DIR`` / ``... torch ...``."""
    return f"Megatron {format_of(path)} checkpoint {os.path.normpath(path)}"
