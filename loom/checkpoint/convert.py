"""``loom checkpoint convert``: loom checkpoints to and from Hugging Face safetensors for the
GPT-2 and LLaMA layouts, so a model trained in loom leaves it (``--to-hf``: ``config.json`` +
``model.safetensors``, loadable by ``transformers``' ``from_pretrained``) and a Hugging Face
model can be trained further (``--from-hf``: a loom checkpoint at iteration 0, no optimizer
state, that ``loom train --load`` resumes at any layout).
"""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import torch

from loom.errors import ConfigError


def to_hf(ckpt_path: str, out_dir: str, step=None) -> str:
    """Write ``out_dir/config.json`` and ``model.safetensors`` from a loom checkpoint; returns
    ``out_dir``. Raises ConfigError for a missing checkpoint or a layout HF cannot express."""
    from safetensors.torch import save_file

    from loom.checkpoint.io import open_checkpoint, read_common
    from loom.checkpoint.safety import resolve_checkpoint
    from loom.config import LoomConfig
    from loom.interop.export import hf_config, loom_to_hf
    ckpt = ckpt_path if os.path.exists(os.path.join(ckpt_path, "common.pt")) else \
        resolve_checkpoint(ckpt_path, step)
    if ckpt is None:
        raise ConfigError(f"{ckpt_path}: no checkpoint there")
    cfg = LoomConfig.from_flat(read_common(ckpt)["config"], ignore_retired=True).model
    config = hf_config(cfg)
    index = open_checkpoint(ckpt)
    full, _, _ = index.load(index.names)
    sd = loom_to_hf(full, cfg)
    if config["tie_word_embeddings"]:
        sd.pop("lm_head.weight", None)  # tied: transformers re-ties it on load
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous().clone() for k, v in sd.items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(config, fh, indent=1)
    tok = os.path.join(ckpt, "tokenizer.json")
    if os.path.exists(tok):
        shutil.copyfile(tok, os.path.join(out_dir, "tokenizer.json"))
    return out_dir


def from_hf(hf_dir: str, out_dir: str) -> str:
    """A loom checkpoint (iteration 0) in ``out_dir`` from a Hugging Face GPT-2, LLaMA or BERT
    directory (``config.json`` + ``model.safetensors``); returns the checkpoint path."""
    from safetensors.torch import load_file

    from loom.checkpoint.io import save_checkpoint
    from loom.config import LoomConfig
    from loom.interop.hf import (gpt2_config, gpt2_to_loom, llama_config, llama_to_loom,
                                 load_full_state_dict)
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    from loom.parallel.random import RNGTracker
    try:
        with open(os.path.join(hf_dir, "config.json")) as fh:
            hf = json.load(fh)
        sd = load_file(os.path.join(hf_dir, "model.safetensors"))
    except OSError as e:
        raise ConfigError(f"--from-hf {hf_dir}: {e.strerror or e} ({e.filename})") from None
    kind = hf.get("model_type")
    if kind not in ("gpt2", "llama", "bert"):
        raise ConfigError(f"--from-hf {hf_dir}: model_type {kind!r}; gpt2, llama and bert "
                          f"convert")
    hf.setdefault("n_inner", None)
    hf.setdefault("tie_word_embeddings", kind == "gpt2")
    ns = SimpleNamespace(**hf)
    if kind == "bert":  # BertForMaskedLM / BertForPreTraining -> post-LN loom BERT
        from loom.interop.hf_bert import bert_config, bert_to_loom
        cfg = bert_config(ns, binary_head="cls.seq_relationship.weight" in sd)
        full = bert_to_loom(sd, cfg)
    else:
        cfg = gpt2_config(ns) if kind == "gpt2" else llama_config(ns)
        full = (gpt2_to_loom if kind == "gpt2" else llama_to_loom)(sd, cfg)
    mesh = ParallelMesh.single()
    tracker = RNGTracker(mesh.device)
    tracker.seed(0)
    model = build_model(get_family(cfg.model_type), cfg, mesh, tracker, seed=None)
    load_full_state_dict(model, {n: full[n] for n, _ in model.named_parameters()})
    optimizer = torch.optim.AdamW(model.parameters())
    tok = os.path.join(hf_dir, "tokenizer.json")
    return save_checkpoint(out_dir, 0, [model], optimizer, None, mesh, tracker,
                           consumed_samples=0, config=LoomConfig(model=cfg).to_flat(),
                           tokenizer_file=tok if os.path.exists(tok) else None)
