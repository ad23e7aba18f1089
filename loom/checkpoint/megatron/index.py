"""A Megatron checkpoint as loom's readers answer for theirs (:class:`MegatronIndex`: ``names``,
``parameters()``, ``has_optimizer_state(name)``, ``load(names, optim_names, rng_rank)`` with
full tensors under loom's names), so :func:`loom.checkpoint.reader.load_model_weights` and the
converters use it unchanged.

Which tensors exist comes from the loom model the checkpoint is read into (its
:class:`~loom.config.ModelConfig`, built on the meta device): each loom name is looked up at
the Megatron keys :func:`~loom.checkpoint.megatron.names.sources` lists, the first present wins,
and is brought into loom's layout (:mod:`~loom.checkpoint.megatron.layout`). A name found at
none is missing (an error naming it at load); a Megatron weight no loom name reads is refused
(:meth:`MegatronIndex.unread`), so nothing of the checkpoint is dropped silently. Adam states
(``exp_avg``, ``exp_avg_sq``, SGD's and Muon's ``momentum_buffer``, the fp32 master weights as
loom's ``master_param``, ``step`` from ``common.pt``) come with the same mapping when the checkpoint's optimizer layout maps
(:meth:`~loom.checkpoint.megatron.stores.DistStore.optimizer_layout`).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch

from loom.checkpoint.megatron import layout
from loom.checkpoint.megatron.args import args_of, zero_centered_gains
from loom.checkpoint.megatron.names import (Source, attention_kind, gdn_of, is_norm_gain,
                                            kind_of, layer_pattern, sources)
from loom.checkpoint.megatron.stores import MASTER_STATES, open_store
from loom.errors import ConfigError

OPTIMIZER_STATES = ("exp_avg", "exp_avg_sq", "momentum_buffer")
"""Parameter-shaped optimizer states read by name (Adam's; SGD's and Muon's momentum)."""


def expected_parameters(cfg) -> dict:
    """``{name: ParamMeta}`` of the whole unsharded loom model of ``cfg``, built on the meta
    device (no storage: a model of any size)."""
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    from loom.parallel.registry import named_parameters
    meta = torch.device("meta")
    with meta:
        model = build_model(get_family(cfg.model_type), cfg, ParallelMesh.single(meta), seed=None)
    return {n: m for n, _, m in named_parameters([model])}


def _step_of(common) -> Optional[float]:
    """Adam's step count in ``common.pt``'s optimizer entry (``common_step`` of the
    non-distributed optimizer, ``step`` of the distributed one's param groups)."""
    if isinstance(common, dict):
        for k, v in common.items():
            if k in ("common_step", "step") and (torch.is_tensor(v) or isinstance(v, (int, float))):
                return float(v)
            found = _step_of(v)
            if found is not None:
                return found
    elif isinstance(common, (list, tuple)):
        for v in common:
            found = _step_of(v)
            if found is not None:
                return found
    return None


class MegatronIndex:
    """The loom view of the Megatron checkpoint ``found`` (:class:`~.locate.Found`) for a model
    of ``cfg`` (``ModelConfig``)."""

    def __init__(self, found, cfg, store=None):
        self.found, self.cfg = found, cfg
        self.path = found.path
        self.store = store if store is not None else open_store(found.path, found.format)
        self.metas = expected_parameters(cfg)
        heads, groups = cfg.num_attention_heads, cfg.num_kv_groups
        self.heads, self.groups = heads, groups
        pattern = layer_pattern(cfg)
        self.where: dict[str, Source] = {}
        for name in self.metas:
            for src in sources(name, attention_kind(name, pattern, cfg.multi_latent_attention,
                                                    gdn_of(cfg))):
                keys = [src.key + p for p in src.parts] or [src.key]
                if all(self.store.covers(k, src.index) for k in keys):
                    self.where[name] = src
                    break
        self.optim_ok, self.optim_layout = self.store.optimizer_layout()
        # zero-centred norm gains (--apply-layernorm-1p): as the saved args say, else as the
        # model flags given for a bare Megatron-Core checkpoint say
        args = args_of(self.store.common)
        self.gain_one = zero_centered_gains(args) if args is not None else \
            bool(getattr(cfg, "apply_layernorm_1p", False))

    @property
    def names(self) -> list[str]:
        return list(self.where)

    def missing(self) -> list[str]:
        """loom parameters the checkpoint lacks."""
        return [n for n in self.metas if n not in self.where]

    def unread(self) -> list[str]:
        """Megatron weights no loom parameter reads (optimizer states and ``_extra_state``
        aside, and the other layer spec's spelling of a tensor read): a checkpoint of another
        model, or a part loom lacks."""
        pattern = layer_pattern(self.cfg)
        used = {src.key + p for n in self.where for src in sources(
            n, attention_kind(n, pattern, self.cfg.multi_latent_attention, gdn_of(self.cfg)))
            for p in (src.parts or ("",))}  # (another spelling of a tensor read: an alias)
        return sorted(k for k in self.store.listing() if k not in used
                      and not k.startswith(("optimizer.", "chained_")) and "_extra_state" not in k
                      and not k.endswith(("._amax", ".local_tokens_per_expert")))

    def check_complete(self) -> None:
        """Raise ConfigError naming the loom parameters the checkpoint lacks and the Megatron
        weights loom would drop."""
        missing, unread = self.missing(), self.unread()
        if missing or unread:
            parts = []
            if missing:
                parts.append(f"it lacks {len(missing)} parameter(s) of this model "
                             f"({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''})")
            if unread:
                parts.append(f"it holds {len(unread)} tensor(s) this model has no place for "
                             f"({', '.join(unread[:4])}{' ...' if len(unread) > 4 else ''})")
            raise ConfigError(f"Megatron checkpoint {self.path} does not match the model: "
                              + "; ".join(parts) + ". Give the model flags it was trained with "
                              "(or --use-checkpoint-args)")

    def has_optimizer_state(self, name: str) -> bool:
        src = self.where.get(name)
        key = src.key + (src.parts[0] if src.parts else "") if src else None
        return bool(self.optim_ok and src and any(self.store.optimizer_key(state, key)
                                                  for state in OPTIMIZER_STATES))

    def _spec(self, key_to_name: dict):
        """``spec_of(key)`` for :meth:`TorchStore.read`: loom's ShardSpec (QKV: Megatron's
        interleaved rows split contiguously) and loom's full shape."""
        from loom.parallel.registry import ShardSpec

        def spec_of(key):
            name = key_to_name.get(key)
            if name is None:
                return None, None
            meta = self.metas[name]
            spec = meta.shard
            if spec is not None and kind_of(name) == "qkv":
                spec = ShardSpec(0, None)
            full = tuple(meta.full_shape)
            if kind_of(name) == "conv" and len(full) == 2:
                full = (full[0], 1, full[1])
            return spec, full
        return spec_of

    def _fetch(self, names: Iterable[str], key_of, values: bool = True) -> dict[str, torch.Tensor]:
        """``{name: loom tensor}`` from the keys ``key_of(model key)`` (the weights themselves,
        or an optimizer state's) of each name's source; ``values``: they are weights (a
        zero-centred norm gain, ``--apply-layernorm-1p``, becomes loom's 1 + w)."""
        plan, key_to_name = {}, {}
        for n in names:
            src = self.where[n]
            keys = [key_of(src.key + p) for p in (src.parts or ("",))]
            plan[n] = (src, keys)
            key_to_name.update({k: n for k in keys})
        got = self.store.read([(k, src.index) for src, keys in plan.values() for k in keys],
                              self._spec(key_to_name))
        out = {}
        for n, (src, keys) in plan.items():
            pieces = [got[(k, src.index)] for k in keys]
            t = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
            out[n] = layout.to_loom(t.clone(), kind_of(n), self.heads, self.groups,
                                    getattr(self.cfg, "attention_output_gate", False))
            if values and self.gain_one and is_norm_gain(n):
                out[n] = out[n] + 1
        return out

    def parameters(self) -> dict[str, dict]:
        """``name -> {shape, dtype}`` (loom's layout), without reading a tensor."""
        out = {}
        for n, src in self.where.items():
            keys = [src.key + p for p in (src.parts or ("",))]
            shapes = [self.store.shape(k)[len(src.index):] for k in keys]
            shape = [sum(s[0] for s in shapes), *shapes[0][1:]]
            if kind_of(n) == "conv" and len(shape) == 3:
                shape = [shape[0], shape[2]]
            out[n] = {"shape": shape, "dtype": self.store.dtype(keys[0])}
        return out

    def load(self, names: Iterable[str], optim_names: Iterable[str] = (),
             rng_rank: Optional[int] = None) -> tuple[dict, dict, None]:
        """(full weights by loom name, Adam states by name, None: Megatron's generators are not
        loom's). Raises KeyError for a name the checkpoint lacks."""
        names, optim_names = list(names), list(optim_names)
        for n in names + optim_names:
            if n not in self.where:
                raise KeyError(f"parameter {n} not in Megatron checkpoint {self.path} "
                               f"(looked for {sources(n)[0].key})")
        model = self._fetch(names, lambda k: k)
        optim: dict[str, dict] = {n: {} for n in optim_names}
        if optim_names:
            step = _step_of(self.store.common.get("optimizer"))
            for state in OPTIMIZER_STATES + MASTER_STATES:
                have = [n for n in optim_names if self.store.optimizer_key(
                    state, self.where[n].key + (self.where[n].parts or ("",))[0])]
                got = self._fetch(have, lambda k, s=state: self.store.optimizer_key(s, k),
                                  values=state in MASTER_STATES)
                for n, t in got.items():
                    optim[n]["master_param" if state in MASTER_STATES else state] = t
            for n in optim_names:
                if step is not None and optim[n]:
                    optim[n]["step"] = torch.tensor(step)
        self.store.forget()
        return model, optim, None
