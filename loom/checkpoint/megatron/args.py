"""What a Megatron checkpoint says about itself: its pickled files read without Megatron
installed (:func:`load_pickle`), and the model flags of its saved ``args`` as loom's flat config
(:func:`model_flags`: loom's flags are Megatron's names, so most fields copy across).

Megatron-LM pickles its ``argparse.Namespace`` (``args``) into ``common.pt`` (torch_dist) or each
``model_optim_rng.pt`` (torch), with a few of Megatron's own classes inside (enums such as
``AttnBackend``, the rerun state machine's state). loom reads them with an allowlist: tensors
and storages, numpy arrays (the saved generator states), the standard containers,
``argparse.Namespace``; any other class becomes an inert stand-in (:class:`Foreign`) that keeps
its arguments, so nothing of Megatron is imported and no other code runs while reading.
"""

from __future__ import annotations

import dataclasses
import pickle
import types
from typing import Any, Optional

from loom.errors import ConfigError

_MODULES = ("torch", "numpy", "collections", "argparse", "_codecs", "copyreg", "datetime",
            "pathlib", "enum")
_BUILTINS = {"set", "frozenset", "slice", "range", "complex", "bytearray", "bytes", "list",
             "dict", "tuple", "str", "int", "float", "bool", "object", "type"}


class Foreign:
    """A stand-in for a class outside the allowlist (``name``: where it was defined); keeps the
    constructor arguments (``args``) and pickled state (``state``)."""

    name = "?"

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state):
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.name}{self.args!r}>"


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        top = module.split(".")[0]
        if top in _MODULES or (module == "builtins" and name in _BUILTINS):
            return super().find_class(module, name)
        return type(name, (Foreign,), {"name": f"{module}.{name}"})


_PICKLE = types.SimpleNamespace(Unpickler=_Unpickler, load=lambda f, **kw: _Unpickler(f, **kw).load(),
                                __name__="loom_megatron_pickle")


def load_pickle(path: str) -> Any:
    """``torch.load`` of a Megatron file through the allowlist above (CPU tensors). Raises
    ConfigError naming the file when it is unreadable (one line)."""
    import torch
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PICKLE)
    except Exception as e:  # noqa: BLE001 - any unpickling error means a damaged file
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"Megatron checkpoint file {path} is unreadable ({why[:200]}); it was "
                          f"truncated or is not a Megatron file") from None


def _plain(value) -> bool:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return True
    return isinstance(value, (list, tuple)) and all(isinstance(v, (int, float, str))
                                                    for v in value)


# Megatron-LM's dest names whose meaning is loom's field under another name or sense.
def _renamed(args: Any) -> dict:
    out = {}
    if hasattr(args, "add_bias_linear"):
        out["disable_bias_linear"] = not args.add_bias_linear
    if getattr(args, "group_query_attention", None) is False:
        out["num_query_groups"] = None  # Megatron keeps a default it does not use
    if getattr(args, "vocab_size", None) is None and getattr(args, "padded_vocab_size", None):
        out["vocab_size"] = int(args.padded_vocab_size)  # the tokenizer's V is not saved
    if zero_centered_gains(args):  # Megatron-LM's dest: layernorm_zero_centered_gamma
        out["apply_layernorm_1p"] = True
    if getattr(args, "num_experts", None) in (0,):
        out["num_experts"] = None
    for key in ("moe_layer_freq", "linear_attention_freq", "no_rope_freq"):  # int or list: text
        value = getattr(args, key, None)
        if isinstance(value, list):
            out[key] = "[" + ",".join(str(int(v)) for v in value) + "]"
        elif isinstance(value, int) and not isinstance(value, bool):
            out[key] = str(value)
    return out


# Megatron-LM flags that change what the saved weights mean, which loom's layers lack.
UNSUPPORTED = {"rotary_interleaved": "RoPE on interleaved pairs"}


def zero_centered_gains(args) -> bool:
    """Whether the checkpoint's norm weights are zero-centred gains (``--apply-layernorm-1p``:
    gain = 1 + w), which loom reads as 1 + w (its norms multiply by their weight, the gain)."""
    return bool(getattr(args, "apply_layernorm_1p", False) or
                getattr(args, "layernorm_zero_centered_gamma", False))


def model_flags(args: Any, model_fields: list[str], hybrid: bool) -> dict:
    """The flat loom values of the model fields ``model_fields`` (``ModelConfig``'s) that
    Megatron's saved ``args`` (a Namespace) holds, with ``model_type`` ``mamba`` for a hybrid
    (Mamba) checkpoint, else ``gpt``. Values that are not plain (a Megatron enum, a function)
    are left out: loom's default or the flag given applies; so are
    ``--apply-residual-connection-post-layernorm`` (Megatron-Core's layers ignore it) and
    ``--fp32-residual-connection`` (a run's precision)."""
    if args is None:
        return {}
    for flag in UNSUPPORTED:
        if getattr(args, flag, False):
            raise ConfigError(f"a Megatron checkpoint trained with --{flag.replace('_', '-')} "
                              f"({UNSUPPORTED[flag]}): loom has no such layer, so its weights "
                              f"would mean something else")
    skip = {"model_type", "padded_vocab_size",
            # Megatron-Core's layers never read it: the weights are the plain pre-LN layer's
            "apply_residual_connection_post_layernorm",
            "fp32_residual_connection"}  # the saving run's precision, not the weights'
    out = {f: getattr(args, f) for f in model_fields
           if f not in skip and hasattr(args, f) and _plain(getattr(args, f))}
    out.update(_renamed(args))
    out = {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}
    out["model_type"] = "mamba" if hybrid else "gpt"
    return {k: v for k, v in out.items() if k in model_fields}


def args_of(common: Optional[dict]) -> Optional[Any]:
    """The saved ``args`` Namespace of a ``common.pt`` / ``model_optim_rng.pt`` dict, or None."""
    if not isinstance(common, dict):
        return None
    args = common.get("args")
    return args if args is not None and hasattr(args, "__dict__") else None


def consumed_samples(args: Any) -> Optional[int]:
    """``args.consumed_train_samples`` (Megatron-LM's count at the save), or None."""
    value = getattr(args, "consumed_train_samples", None)
    return int(value) if isinstance(value, (int, float)) else None


def layout(args: Any) -> dict:
    """``{tp, pp, ep, vpp}`` the checkpoint was saved at, from its args (missing: None)."""
    get = (lambda k: getattr(args, k, None)) if args is not None else (lambda k: None)
    return {"tp": get("tensor_model_parallel_size"), "pp": get("pipeline_model_parallel_size"),
            "ep": get("expert_model_parallel_size"),
            "vpp": get("virtual_pipeline_model_parallel_size")}


def model_fields() -> list[str]:
    """The names of ``ModelConfig``'s fields."""
    from loom.config import ModelConfig
    return [f.name for f in dataclasses.fields(ModelConfig)]
