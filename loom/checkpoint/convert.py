"""``loom checkpoint convert``: loom checkpoints to and from Hugging Face safetensors for the
GPT-2, LLaMA and Gemma 3 layouts, so a model trained in loom leaves it (``--to-hf``:
``config.json`` + ``model.safetensors``, loadable by ``transformers``' ``from_pretrained``)
and a Hugging Face model (or a Gemma 3 GGUF file) can be trained further (``--from-hf``: a loom
checkpoint at iteration 0 with the model's ``tokenizer.json``, no optimizer state, that
``loom train --load`` resumes at any layout).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import torch

from loom.errors import ConfigError


def _replace_file(write, path: str) -> None:
    """``write(tmp)`` then rename over ``path``: a replaced export is never half-written."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def to_hf(ckpt_path: str, out_dir: str, step=None, overwrite: bool = False) -> str:
    """Write ``out_dir/config.json`` and ``model.safetensors`` from a loom checkpoint; returns
    ``out_dir``. Raises ConfigError for a missing checkpoint, a layout HF cannot express, an
    ``out_dir`` inside a training checkpoint directory, or a non-empty ``out_dir`` without
    ``overwrite`` (checked before anything is read or written)."""
    from safetensors.torch import save_file

    from loom.checkpoint.io import latest_checkpoint, open_checkpoint, read_common
    from loom.checkpoint.targets import check_output_dir
    from loom.config import LoomConfig
    from loom.models import get_family
    check_output_dir(out_dir, f"--to-hf output {out_dir}", overwrite)
    ckpt = ckpt_path if os.path.exists(os.path.join(ckpt_path, "common.pt")) else \
        latest_checkpoint(ckpt_path, step)  # (a Megatron-LM checkpoint too)
    if ckpt is None:
        raise ConfigError(f"{ckpt_path}: no checkpoint there")
    flat = read_common(ckpt)["config"]
    if not flat:  # a bare Megatron-Core checkpoint: no saved args
        raise ConfigError(f"{ckpt}: no model config saved with it (a bare Megatron-Core "
                          f"checkpoint): convert it with --from-megatron and the model flags "
                          f"first")
    cfg = LoomConfig.from_flat(flat, ignore_retired=True).model
    hf = get_family(cfg.model_type).hf  # the family's mapping: loom.models.<family>.hf
    if hf is None or hf.export_config is None:
        raise ConfigError(f"{ckpt}: a {cfg.model_type} model has no Hugging Face layout to "
                          f"convert to")
    config = hf.export_config(cfg)  # refuses a layout HF cannot express before reading
    index = open_checkpoint(ckpt)
    full, _, _ = index.load(index.names)
    sd = hf.from_loom(full, cfg)
    if config["tie_word_embeddings"]:
        sd.pop("lm_head.weight", None)  # tied: transformers re-ties it on load
    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: v.contiguous().clone() for k, v in sd.items()}
    _replace_file(lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}),
                  os.path.join(out_dir, "model.safetensors"))

    def write_config(tmp: str) -> None:
        with open(tmp, "w") as fh:
            json.dump(config, fh, indent=1)
    _replace_file(write_config, os.path.join(out_dir, "config.json"))
    tok = os.path.join(ckpt, "tokenizer.json")
    if os.path.exists(tok):
        _replace_file(lambda tmp: shutil.copyfile(tok, tmp), os.path.join(out_dir, "tokenizer.json"))
    return out_dir


def _read_hf_dir(hf_dir: str) -> tuple[dict, dict]:
    """``(config.json, state dict)`` of a Hugging Face directory: ``model.safetensors`` or the
    shards named by ``model.safetensors.index.json``."""
    from safetensors.torch import load_file
    try:
        with open(os.path.join(hf_dir, "config.json")) as fh:
            hf = json.load(fh)
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.exists(index) and not os.path.exists(os.path.join(hf_dir, "model.safetensors")):
            with open(index) as fh:
                files = sorted(set(json.load(fh)["weight_map"].values()))
            sd = {}
            for f in files:
                sd.update(load_file(os.path.join(hf_dir, f)))
        else:
            sd = load_file(os.path.join(hf_dir, "model.safetensors"))
    except OSError as e:
        raise ConfigError(f"--from-hf {hf_dir}: {e.strerror or e} ({e.filename})") from None
    return hf, sd


def from_hf(src: str, out_dir: str, overwrite: bool = False) -> str:
    """A loom checkpoint (iteration 0) in ``out_dir`` from a Hugging Face GPT-2, LLaMA or
    Gemma 3 directory (``config.json`` + safetensors), or a Gemma 3 GGUF file (or a directory
    holding one); the tokenizer (``tokenizer.json``, or the GGUF's) is saved with it. Returns
    the checkpoint path. Raises ConfigError for another model type or a non-Gemma-3 GGUF, and,
    before reading anything, for an ``out_dir`` inside a training checkpoint directory (even
    with ``overwrite``; an earlier import, iteration 0 alone, may be replaced) or a non-empty
    ``out_dir`` without ``overwrite``."""
    import tempfile

    from loom.checkpoint.targets import check_output_dir
    check_output_dir(out_dir, f"--from-hf output {out_dir}", overwrite, allow_import=True)

    from loom.checkpoint.io import save_checkpoint
    from loom.interop.gguf import find_gguf, read_gguf
    from loom.interop.hf import load_full_state_dict
    from loom.models import FamilyRegistry
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    from loom.parallel.random import RNGTracker
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
        cfg, full = family.hf.to_loom(hf, sd, f"--from-hf {src}")
        mesh = ParallelMesh.single()
        tracker = RNGTracker(mesh.device)
        tracker.seed(0)
        model = build_model(family, cfg, mesh, tracker, seed=None)
        load_full_state_dict(model, {n: full[n] for n, _ in model.named_parameters()})
        del full, sd
        optimizer = torch.optim.AdamW(model.parameters())
        # the model section only: an imported model has no training schedule to resume
        return save_checkpoint(out_dir, 0, [model], optimizer, None, mesh, tracker,
                               consumed_samples=0, config=dataclasses.asdict(cfg),
                               tokenizer_file=tok if os.path.exists(tok) else None)
