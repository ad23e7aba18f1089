"""``loom checkpoint convert --to-hf``: a loom checkpoint (any TP / PP / EP layout) as a
Hugging Face model directory that ``transformers``' ``from_pretrained``, ``generate`` and
lm-evaluation-harness take as it is:

* ``config.json`` of the family's ``transformers`` class (``family.hf.export_config``) with
  ``dtype`` and the tokenizer's ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id``;
* ``generation_config.json`` (the same ids; generative families);
* ``tokenizer.json`` (the checkpoint's) and ``tokenizer_config.json`` naming its special tokens
  (:meth:`loom.data.tokenizer.Tokenizer.special_tokens`);
* the weights as (sharded) safetensors (:mod:`loom.checkpoint.safetensors_shards`), in
  ``--dtype`` fp32 or bf16, ``--max-shard-size`` bytes per file at most.

Streaming: the weights are never all in memory. The family's mapping ``from_loom(full,
model_cfg)`` is a function of full loom tensors; it is first run on meta tensors (shapes only,
no data) to learn every Hugging Face name and shape and plan the files, then once per tensor
group (each decoder layer, each MTP depth, the rest) with that group's tensors read from the
checkpoint (:meth:`DcpIndex.load` of those names: every TP shard of each, joined) and every
other tensor on the meta device; what comes out as a real tensor belongs to that group and is
written at once, then freed. An output that mixed two groups would fail loudly (torch refuses
to combine real and meta tensors) rather than come out wrong.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Iterator, Mapping

import torch

from loom.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
DEFAULT_MAX_SHARD_SIZE = "5GB"  # transformers' save_pretrained default before v5


class GroupView(Mapping):
    """Full loom tensors by name where ``real`` holds them, else ``metas``' meta tensors of the
    saved shapes (vocabulary padding included; :func:`meta_tensors`)."""

    def __init__(self, metas: dict, real: Mapping[str, torch.Tensor]):
        self.metas, self.real = metas, real

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.real[name] if name in self.real else self.metas[name]

    def __contains__(self, name) -> bool:
        return name in self.metas

    def __iter__(self) -> Iterator[str]:
        return iter(self.metas)

    def __len__(self) -> int:
        return len(self.metas)


def meta_tensors(specs: dict) -> dict:
    """``name -> meta tensor`` of a checkpoint's ``{name: {shape, dtype}}`` (no data)."""
    return {n: torch.empty(s["shape"], dtype=s["dtype"], device="meta") for n, s in specs.items()}


def tensor_group(name: str) -> tuple:
    """The group a loom parameter is converted with: ``("", i)`` for decoder layer i,
    ``("mtp.", k)`` for MTP depth k, ``("rest", 0)`` for the embeddings, norms and heads."""
    m = re.match(r"(mtp\.)?layers\.(\d+)\.", name)
    return (m.group(1) or "", int(m.group(2))) if m else ("rest", 0)


def groups_of(names) -> dict:
    """``{group: [names]}`` in first-seen order (:func:`tensor_group`)."""
    out: dict = {}
    for n in names:
        out.setdefault(tensor_group(n), []).append(n)
    return out


def _write_json(obj: dict, path: str) -> None:
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp{os.getpid()}")
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)


def token_files(ckpt: str, model_cfg, family) -> dict:
    """The special-token ids ``config.json`` carries (``bos_token_id``, ...) and the
    ``tokenizer_config.json`` of the checkpoint's ``tokenizer.json`` (``{}`` without one):
    ``{"ids": {...}, "tokenizer_config": {...}}``."""
    path = os.path.join(ckpt, "tokenizer.json")
    if not os.path.exists(path):
        return {}
    from loom.data.tokenizer import Tokenizer
    tok = Tokenizer.load(path)
    generative = family.generation is not None
    roles = tok.special_tokens(family.generation.bos_token if generative else None, generative)
    ids = {f"{role[:-len('_token')]}_token_id": tok.hf.token_to_id(t)
           for role, t in roles.items() if role in ("bos_token", "eos_token", "pad_token")}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **roles,
              "model_max_length": model_cfg.max_positions, "clean_up_tokenization_spaces": False}
    return {"ids": ids, "tokenizer_config": config}


def export(ckpt: str, out_dir: str, model_cfg, family, dtype: str = "fp32",
           max_shard_size=DEFAULT_MAX_SHARD_SIZE) -> list[str]:
    """Write the Hugging Face directory of checkpoint ``ckpt`` (its model config
    ``model_cfg``, of ``family``) into ``out_dir`` (checked by the caller); returns the file
    names written. Raises ConfigError for a layout the family's HF class cannot express
    (before any weight is read) or a bad ``dtype`` / ``max_shard_size``."""
    from loom.checkpoint.io import open_checkpoint
    from loom.checkpoint.safetensors_shards import INDEX, SINGLE, ShardWriter, parse_size, \
        plan_shards
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: give one of {', '.join(DTYPES)}")
    limit, torch_dtype = parse_size(max_shard_size), DTYPES[dtype]
    hf = family.hf
    config = dict(hf.export_config(model_cfg))  # refuses what HF cannot express, first
    index = open_checkpoint(ckpt)
    metas = meta_tensors(index.parameters())
    planned = hf.from_loom(GroupView(metas, {}), model_cfg)
    if config.get("tie_word_embeddings"):
        planned.pop("lm_head.weight", None)  # tied: transformers ties it again on load
    shapes = {name: tuple(t.shape) for name, t in planned.items()}
    os.makedirs(out_dir, exist_ok=True)
    writer = ShardWriter(out_dir, plan_shards(shapes, torch_dtype, limit), torch_dtype)
    try:
        for names in groups_of(metas).values():
            full, _, _ = index.load(names)
            for name, tensor in hf.from_loom(GroupView(metas, full), model_cfg).items():
                if name in shapes and not tensor.is_meta:
                    writer.write(name, tensor)
            del full
        files = writer.finish()
    except BaseException:
        writer.abort()
        raise
    tokens = token_files(ckpt, model_cfg, family)
    stale = [SINGLE, INDEX] + [f for f in os.listdir(out_dir)
                               if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f)]
    if not tokens:  # an earlier export's tokenizer would describe another model
        stale += ["tokenizer.json", "tokenizer_config.json"]
    for f in set(stale) - set(files):  # an earlier export's files (--overwrite)
        if os.path.exists(os.path.join(out_dir, f)):
            os.remove(os.path.join(out_dir, f))
    config.update(tokens.get("ids", {}), dtype=DTYPE_NAMES[torch_dtype])
    _write_json(config, os.path.join(out_dir, "config.json"))
    files.append("config.json")
    if family.generation is not None:
        generation = {"_from_model_config": True, **tokens.get("ids", {})}
        _write_json(generation, os.path.join(out_dir, "generation_config.json"))
        files.append("generation_config.json")
    if tokens:
        tmp = os.path.join(out_dir, f".tokenizer.json.tmp{os.getpid()}")
        shutil.copyfile(os.path.join(ckpt, "tokenizer.json"), tmp)
        os.replace(tmp, os.path.join(out_dir, "tokenizer.json"))
        _write_json(tokens["tokenizer_config"], os.path.join(out_dir, "tokenizer_config.json"))
        files += ["tokenizer.json", "tokenizer_config.json"]
    return files
