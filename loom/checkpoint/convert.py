"""``loom checkpoint convert``: loom checkpoints to and from Hugging Face for every family's
``transformers`` layout (each family's mapping: ``loom/models/<family>/hf.py``), so a model
trained in loom leaves it (``--to-hf``: a directory ``from_pretrained`` and lm-evaluation-
harness load as it is, :mod:`loom.checkpoint.hf_export`) and a Hugging Face model (or a
Gemma 3 GGUF file) can be trained further (``--from-hf``: a loom checkpoint at iteration 0 with
the model's ``tokenizer.json``, no optimizer state, that ``loom train --load`` resumes at any
layout). ``--from-torchtitan FILE.toml``: :mod:`loom.checkpoint.torchtitan`, through the Hugging
Face names and :func:`save_import`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import torch

from loom.errors import ConfigError


def to_hf(ckpt_path: str, out_dir: str, step=None, overwrite: bool = False,
          dtype: str = "fp32", max_shard_size="5GB") -> str:
    """Write the Hugging Face directory of a loom checkpoint (saved at any layout) into
    ``out_dir`` (:func:`loom.checkpoint.hf_export.export`: config, generation config,
    tokenizer files, safetensors in ``dtype`` sharded at ``max_shard_size``, streamed one
    tensor group at a time); returns ``out_dir``. Raises ConfigError for a missing checkpoint,
    a family or layout HF cannot express, an ``out_dir`` inside a training checkpoint
    directory, or a non-empty ``out_dir`` without ``overwrite`` (checked before anything is
    read or written)."""
    from loom.checkpoint.hf_export import DTYPES, export
    from loom.checkpoint.integrity import verify_read
    from loom.checkpoint.io import latest_checkpoint, read_common
    from loom.checkpoint.megatron.common import found_at
    from loom.checkpoint.safety import check_checkpoint_files
    from loom.checkpoint.safetensors_shards import parse_size
    from loom.checkpoint.targets import check_output_dir
    from loom.config import LoomConfig
    from loom.models import get_family
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: give one of {', '.join(DTYPES)}")
    parse_size(max_shard_size)  # refused before anything is read
    check_output_dir(out_dir, f"--to-hf output {out_dir}", overwrite)
    ckpt = ckpt_path if os.path.exists(os.path.join(ckpt_path, "common.pt")) else \
        latest_checkpoint(ckpt_path, step)  # (a Megatron-LM checkpoint too)
    if ckpt is None:
        raise ConfigError(f"{ckpt_path}: no checkpoint there")
    if found_at(ckpt) is None:  # loom's: verified (a Megatron directory: read by its reader)
        check_checkpoint_files(ckpt)  # the shards are verified as they are read
        if os.path.exists(os.path.join(ckpt, "tokenizer.json")):
            verify_read(ckpt, ["tokenizer.json"])
    flat = read_common(ckpt)["config"]
    if not flat:  # a bare Megatron-Core checkpoint: no saved args
        raise ConfigError(f"{ckpt}: no model config saved with it (a bare Megatron-Core "
                          f"checkpoint): convert it with --from-megatron and the model flags "
                          f"first")
    cfg = LoomConfig.from_flat(flat, ignore_retired=True).model
    family = get_family(cfg.model_type)  # its mapping: loom.models.<family>.hf
    if family.hf is None or family.hf.export_config is None:
        raise ConfigError(f"{ckpt}: a {cfg.model_type} model has no Hugging Face layout to "
                          f"convert to")
    export(ckpt, out_dir, cfg, family, dtype, max_shard_size)
    return out_dir


def _read_json(path: str, hf_dir: str):
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as e:
        raise ConfigError(f"--from-hf {hf_dir}: {e.strerror or e} ({path})") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"--from-hf {hf_dir}: {path} is not valid JSON ({e})") from None


def _load_safetensors(path: str, hf_dir: str) -> dict:
    from safetensors.torch import load_file
    try:
        return load_file(path)
    except OSError as e:
        raise ConfigError(f"--from-hf {hf_dir}: {e.strerror or e} ({path})") from None
    except Exception as e:  # noqa: BLE001 - safetensors' own error type: a damaged file
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ConfigError(f"--from-hf {hf_dir}: {path} is not a readable safetensors file "
                          f"({why})") from None


def _read_hf_dir(hf_dir: str) -> tuple[dict, dict]:
    """``(config.json, state dict)`` of a Hugging Face directory: ``model.safetensors`` or the
    shards named by ``model.safetensors.index.json``. ConfigError naming the file that is
    missing, not JSON (an object, for ``config.json``) or not safetensors."""
    config = os.path.join(hf_dir, "config.json")
    hf = _read_json(config, hf_dir)
    if not isinstance(hf, dict):
        raise ConfigError(f"--from-hf {hf_dir}: {config} is not a JSON object (a Hugging Face "
                          f"config maps names to values)")
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.exists(index) and not os.path.exists(os.path.join(hf_dir, "model.safetensors")):
        weight_map = _read_json(index, hf_dir)
        if not isinstance(weight_map, dict) or not isinstance(weight_map.get("weight_map"), dict):
            raise ConfigError(f"--from-hf {hf_dir}: {index} holds no weight_map object")
        sd = {}
        for f in sorted(set(map(str, weight_map["weight_map"].values()))):
            sd.update(_load_safetensors(os.path.join(hf_dir, f), hf_dir))
    else:
        sd = _load_safetensors(os.path.join(hf_dir, "model.safetensors"), hf_dir)
    return hf, sd


def from_hf(src: str, out_dir: str, overwrite: bool = False) -> str:
    """A loom checkpoint (iteration 0) in ``out_dir`` from a Hugging Face directory
    (``config.json`` + safetensors, one file or shards) of a ``model_type`` some family's
    mapping reads, or a Gemma 3 GGUF file (or a directory holding one); the tokenizer (``tokenizer.json``, or the GGUF's) is saved with it. Returns
    the checkpoint path. Raises ConfigError for another model type or a non-Gemma-3 GGUF, and,
    before reading anything, for an ``out_dir`` inside a training checkpoint directory (even
    with ``overwrite``; an earlier import, iteration 0 alone, may be replaced) or a non-empty
    ``out_dir`` without ``overwrite``."""
    import tempfile

    from loom.checkpoint.targets import check_output_dir
    check_output_dir(out_dir, f"--from-hf output {out_dir}", overwrite, allow_import=True)

    from loom.interop.gguf import find_gguf, read_gguf
    from loom.models import FamilyRegistry
    if not os.path.exists(src):
        raise ConfigError(f"--from-hf {src}: no such file or directory")
    families = FamilyRegistry()
    with tempfile.TemporaryDirectory() as tmp:
        gguf = find_gguf(src)
        tok = os.path.join(tmp if gguf else src, "tokenizer.json")
        hf, sd = read_gguf(gguf, tok, [f.hf for f in families.families() if f.hf]) if gguf \
            else _read_hf_dir(src)
        kind = hf.get("model_type")
        family = families.for_hf(kind)  # the family's mapping: loom.models.<family>.hf
        if family is None:
            known = [t for f in families.families() if f.hf for t in f.hf.model_types]
            raise ConfigError(f"--from-hf {src}: model_type {kind!r}; {', '.join(known)} "
                              f"convert")
        from loom.interop.hf_quant import dequantize
        sd = dequantize(hf, sd, f"--from-hf {src}")
        cfg, full = family.hf.to_loom(hf, sd, f"--from-hf {src}")
        del sd
        return save_import(family, cfg, full, out_dir, tok if os.path.exists(tok) else None)


def save_import(family, cfg, full: dict, out_dir: str, tokenizer_file,
                 resume: Optional[dict] = None) -> str:
    """A loom checkpoint (iteration 0, no schedule) of ``family``'s model ``cfg`` holding the
    full (unsharded) tensors ``full`` under loom's names; returns its path. ``resume``
    (``{"iteration", "consumed_samples", "step", "exp_avg": {name: tensor}, "exp_avg_sq":
    ...}``): at that iteration instead, with those AdamW states (each parameter's ``step``
    the optimizer's step count); ``loom train --load`` then continues the schedule there."""
    from loom.checkpoint.io import save_checkpoint
    from loom.interop.hf import load_full_state_dict
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    from loom.parallel.random import RNGTracker
    mesh = ParallelMesh.single()
    tracker = RNGTracker(mesh.device)
    tracker.seed(0)
    model = build_model(family, cfg, mesh, tracker, seed=None)
    load_full_state_dict(model, {n: full[n] for n, _ in model.named_parameters()})
    full.clear()
    optimizer = torch.optim.AdamW(model.parameters())
    resume = resume or {}
    for name, p in model.named_parameters():
        if name in resume.get("exp_avg", {}):
            optimizer.state[p] = {"step": torch.tensor(float(resume["step"])),
                                  "exp_avg": resume["exp_avg"][name].float().reshape(p.shape),
                                  "exp_avg_sq": resume["exp_avg_sq"][name].float()
                                  .reshape(p.shape)}
    # no scheduler state: an import has none, a resumed one continues at its iteration
    return save_checkpoint(out_dir, resume.get("iteration", 0), [model], optimizer, None, mesh,
                           tracker, consumed_samples=resume.get("consumed_samples", 0),
                           config=dataclasses.asdict(cfg), tokenizer_file=tokenizer_file)
