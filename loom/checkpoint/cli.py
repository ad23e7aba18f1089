"""``loom checkpoint inspect DIR``: what a checkpoint holds, without building a model;
``loom checkpoint convert --to-hf DIR OUT`` / ``--from-hf HF_DIR OUT`` (:mod:`.convert`),
``--to-megatron LOOM_CKPT --save OUT`` / ``--from-megatron DIR --save OUT [model flags]``
(:mod:`.megatron.convert`), ``--from-torchtitan FILE.toml STEP_DIR OUT``.

A Megatron-LM / Megatron-Core checkpoint is named as such (:mod:`.megatron.inspect`: its format,
iteration, the TP / PP it was saved at, its tensors under Megatron's keys); a directory that is
neither loom's nor a readable Megatron checkpoint gets one line saying what it is
(:func:`loom.checkpoint.megatron.locate.diagnose`).

Prints the iteration, the parallel layout it was saved at, consumed samples, every parameter
under its layout-free name with its global (unsharded) shape, dtype and size, the totals, the
model config, and whether every file still matches its checksum (``manifest.json``; a damaged
file is named and the exit status is 1); ``--json`` for the same as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Literal, Optional

from loom.config.fields import opt
from loom.errors import ConfigError


@dataclass
class CheckpointOptions:
    """How ``loom checkpoint`` reads and writes."""

    to_hf: bool = opt(False, "convert: write a Hugging Face model directory (config.json, "
                             "generation_config.json, tokenizer files, safetensors shards + "
                             "index) that transformers and lm-evaluation-harness load as it is; "
                             "every family: GPT-2, LLaMA, Qwen2, Mixtral, Qwen2-MoE, Qwen3-MoE, "
                             "DeepSeek-V3, gpt-oss, Gemma 3, BERT, Mamba-2 / Nemotron-H")
    from_hf: bool = opt(False, "convert: read a Hugging Face directory of any of those model "
                               "types, or a Gemma 3 GGUF file, into a loom checkpoint "
                               "(tokenizer included)")
    to_megatron: bool = opt(False, "convert: write a Megatron-LM checkpoint root (iter_N/ in "
                                   "the torch_dist format + latest_checkpointed_iteration.txt) "
                                   "that Megatron-Core's dist_checkpointing.load and "
                                   "Megatron-LM's --load read; the vocabulary is padded for "
                                   "--tensor-model-parallel-size (default 1)")
    from_megatron: bool = opt(False, "convert: read a Megatron-LM / Megatron-Core checkpoint "
                                     "(torch_dist or torch format, any TP/PP/EP) into a loom "
                                     "checkpoint; the model is its saved args' unless model "
                                     "flags are given here (listed by --help-all)")
    from_torchtitan: Optional[str] = opt(
        None, "convert: read a torchtitan checkpoint (a DCP step-N directory, model-only or "
              "full) of the Llama 2 / 3 / 4, Qwen3, Qwen3-MoE, DeepSeek-V3 or gpt-oss model "
              "this torchtitan job config (FILE.toml) describes into a loom checkpoint",
        metavar="FILE.toml")
    dtype: Literal["fp32", "bf16"] = opt("fp32", "--to-hf: the weights' dtype")
    max_shard_size: str = opt("5GB", "--to-hf: largest safetensors file, as transformers' "
                                     "max_shard_size (5GB, 500MB, 2GiB or bytes); a larger "
                                     "export is split into model-0000x-of-0000N.safetensors "
                                     "with model.safetensors.index.json", metavar="SIZE")
    json: bool = opt(False, "inspect: print one JSON object")
    overwrite: bool = opt(False, "convert: replace files already in the output directory "
                                 "(default: refuse; never into a training checkpoint directory)")


WAYS = ("to_hf", "from_hf", "to_megatron", "from_megatron")
"""The directions of ``convert`` (one at a time)."""
SHOWN_FIELDS = ("ckpt_step", "save", "tensor_model_parallel_size")
"""Config fields ``loom checkpoint`` uses beside the model's (``--from-megatron``)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``loom checkpoint ACTION DIR [OUT]``: the positionals, its options and the config
    fields it takes (``--ckpt-step``, ``--save``, ``--tensor-model-parallel-size``, the model's
    flags for ``--from-megatron``), declared where ``loom train`` declares them."""
    from loom.config import add_config_arguments
    from loom.config.args import add_options
    parser.allow_abbrev = False
    parser.add_argument("action", choices=["inspect", "convert"],
                        help="inspect: list the checkpoint; convert: to or from Hugging Face "
                             "(--to-hf / --from-hf) or Megatron-LM (--to-megatron / "
                             "--from-megatron)")
    parser.add_argument("dir", help="checkpoint directory (as given to --save), or one iter_N/; "
                                    "with --from-hf the Hugging Face directory")
    parser.add_argument("out", nargs="?", help="convert: the output directory (or --save OUT)")
    add_options(parser, CheckpointOptions, "checkpoint")
    # the model flags of --from-megatron, --save, the target TP: the same declarations as
    # loom train's (shown: SHOWN_FIELDS; the model's and the rest: --help-all)
    add_config_arguments(parser, common=SHOWN_FIELDS, shown=set(SHOWN_FIELDS),
                         config_file=False)


def natural_key(name: str) -> list:
    """Sort key of a parameter name with its numbers compared as numbers: ``layers.2.`` before
    ``layers.10.``."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part)
            for part in re.split(r"(\d+)", name)]


def inspect(path: str, step=None) -> dict:
    """``{iteration, layout, world_size, consumed_samples, parameters: {name: {shape, dtype,
    bytes}} (sorted by name, numbers as numbers), total_parameters, total_bytes, config}``, and
    ``optimizer`` / ``rng`` when it was saved without them (``--no-save-optim``,
    ``--no-save-rng``). Raises ConfigError for a directory that holds no checkpoint."""
    from loom.checkpoint.io import open_checkpoint, read_common
    from loom.checkpoint.megatron.locate import diagnose, locate
    from loom.checkpoint.safety import resolve_checkpoint
    found = locate(path, step)
    if found is not None:
        from loom.checkpoint.megatron.inspect import inspect_megatron
        return inspect_megatron(found)
    if diagnose(path):
        raise ConfigError(diagnose(path))
    try:
        ckpt = path if os.path.exists(os.path.join(path, "common.pt")) else \
            resolve_checkpoint(path, step)
    except ConfigError:
        pointed = _pointed(path)
        if pointed and diagnose(pointed):
            raise ConfigError(diagnose(pointed)) from None
        raise
    if ckpt is None:
        raise ConfigError(f"{path}: no checkpoint there (no latest_checkpointed_iteration.txt)")
    integrity = _integrity(ckpt)
    damaged = integrity.startswith(("CORRUPTED", "MISSING"))
    try:  # reported, not refused: a damaged checkpoint is described as far as it can be
        with open(os.path.join(ckpt, "metadata.json")) as fh:
            meta = json.load(fh)
        common = read_common(ckpt, verify=not damaged)
    except (OSError, ValueError) as e:
        if not damaged:
            raise
        meta, common = {}, {"iteration": f"unreadable ({str(e).splitlines()[0][:100]})"}
    try:  # a file known damaged is not read (DCP would log its traceback)
        saved = {} if damaged else open_checkpoint(ckpt).parameters()
    except Exception as e:  # noqa: BLE001 - a damaged file: say so in one line
        if not damaged:
            why = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            integrity = f"CORRUPTED: its tensors cannot be read ({why[:200]})"
        saved = {}
    params = {name: {"shape": list(p["shape"]), "dtype": str(p["dtype"]).replace("torch.", ""),
                     "bytes": math.prod(p["shape"]) * p["dtype"].itemsize}
              for name, p in sorted(saved.items(), key=lambda kv: natural_key(kv[0]))}
    info = {"checkpoint": ckpt, "iteration": common["iteration"], "layout": meta.get("layout"),
            "world_size": meta.get("world_size"), "format": meta.get("format"),
            "consumed_samples": common.get("consumed_samples"), "parameters": params,
            "total_parameters": sum(math.prod(p["shape"]) for p in params.values()),
            "total_bytes": sum(p["bytes"] for p in params.values()),
            "config": common.get("config", {}), "integrity": integrity}
    for key, flag, load in (("optimizer", "--no-save-optim", "--no-load-optim"),
                            ("rng", "--no-save-rng", "--no-load-rng")):
        if (info["config"] or {}).get(flag[2:].replace("-", "_")):  # what a resume must say
            info[key] = f"none (saved with {flag}: resume with {load} or --finetune)"
    return info


def _pointed(root: str):
    """The directory the ``latest`` pointer of ``root`` names (None when there is none)."""
    from loom.paths import LATEST
    try:
        with open(os.path.join(root, LATEST), encoding="utf-8") as fh:
            text = fh.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return os.path.join(root, f"iter_{int(text):07d}") if text.isdigit() else None


def _integrity(ckpt: str) -> str:
    """``ok (N files match manifest.json)``, ``MISSING manifest.json`` (a current-format
    checkpoint whose manifest is gone), ``CORRUPTED: ...`` naming each damaged, missing or
    unlisted file, or ``unchecked`` for a checkpoint of a format saved before loom kept
    checksums (its version named)."""
    from loom.checkpoint.integrity import MANIFEST, manifest_problems
    from loom.checkpoint.safety import dcp_storage, integrity_note, needed_files
    note = integrity_note(ckpt)
    if note is not None:
        return f"unchecked ({note})"
    if not os.path.isfile(os.path.join(ckpt, MANIFEST)):
        return f"MISSING {MANIFEST}: every loom-checkpoint-v3 checkpoint has one (deleted?)"
    try:
        needed = needed_files(ckpt, dcp_storage(ckpt)) if \
            os.path.exists(os.path.join(ckpt, ".metadata")) else []
    except ConfigError as e:
        return f"CORRUPTED: {e}"
    problems = manifest_problems(ckpt, needed)
    if problems:
        return "CORRUPTED: " + "; ".join(problems)
    with open(os.path.join(ckpt, MANIFEST), encoding="utf-8") as fh:
        return f"ok ({len(json.load(fh)['files'])} files match {MANIFEST})"


def run(args: argparse.Namespace) -> int:
    from dataclasses import asdict
    from loom.checkpoint.holds import take_hold
    from loom.config.args import options_from_args
    vars(args).update(asdict(options_from_args(args, CheckpointOptions)))  # defaults, checked
    hold = None
    direct = os.path.exists(os.path.join(args.dir, "common.pt"))  # one iter_N/ given
    if not (args.action == "convert" and (args.from_hf or args.from_megatron)) and \
            not direct and \
            os.path.isdir(args.dir):
        _, hold = take_hold(args.dir, args.ckpt_step)  # never pruned while read
    try:
        return _run(args)
    finally:
        if hold is not None:
            hold.release()


def _run(args: argparse.Namespace) -> int:
    if args.ckpt_step is not None and args.ckpt_step < 0:
        raise ConfigError(f"--ckpt-step must be >= 0, got {args.ckpt_step}")
    ways = [w for w in WAYS if getattr(args, w)]
    if len(ways) > 1:
        raise ConfigError(" and ".join("--" + w.replace("_", "-") for w in ways)
                          + ": convert goes one way; give one")
    if args.action == "convert":
        done = _convert(args)
        print(f"wrote {done}")
        if args.to_hf and not os.path.exists(os.path.join(done, "tokenizer.json")):
            print("note: no tokenizer files and no bos/eos ids were written: the checkpoint "
                  "holds no tokenizer.json (trained on --mock-data?)")
        return 0
    info = inspect(args.dir, args.ckpt_step)
    bad = int(info["integrity"].startswith(("CORRUPTED", "MISSING")))  # 1: do not load it
    if not info["parameters"] and not bad:
        raise ConfigError(f"{info['checkpoint']} holds no tensor loom can read: not a loom or "
                          f"Megatron checkpoint, or a damaged one")
    if args.json:
        print(json.dumps(info, indent=1, default=str))
        return bad
    ranks = f" ({info['world_size']} ranks)" if info["world_size"] else ""
    print(f"{info['checkpoint']}: iteration {info['iteration']}, {info['format']}, saved at "
          f"{info['layout']}{ranks}, {info['consumed_samples']} samples consumed")
    width = max(len(n) for n in info["parameters"]) if info["parameters"] else 10
    for name, p in info["parameters"].items():
        print(f"  {name:<{width}}  {'x'.join(map(str, p['shape'])):>14}  {p['dtype']:>8}  "
              f"{p['bytes'] / 2**20:9.3f} MiB")
    print(f"{len(info['parameters'])} tensors, {info['total_parameters']:,} parameters, "
          f"{info['total_bytes'] / 2**20:.1f} MiB of weights")
    cfg = info["config"]
    keys = ("model_type", "num_layers", "hidden_size", "num_attention_heads",
            "num_query_groups", "ffn_hidden_size", "vocab_size", "seq_length", "num_experts")
    print("model: " + ", ".join(f"{k}={cfg.get(k)}" for k in keys if k in cfg))
    print(f"checksums: {info['integrity']}")
    if info.get("optimizer"):
        print(f"optimizer state: {info['optimizer']}")
    if info.get("rng"):
        print(f"generator state: {info['rng']}")
    return bad


def _convert(args: argparse.Namespace) -> str:
    """``loom checkpoint convert``: the written directory."""
    out = args.out or args.save
    if not out or not (args.to_hf or args.from_hf or args.to_megatron or args.from_megatron
                       or args.from_torchtitan):
        raise ConfigError("convert needs --to-hf, --from-hf, --to-megatron, --from-megatron or "
                          "--from-torchtitan FILE.toml and an output directory: loom checkpoint "
                          "convert --to-hf CKPT_DIR OUT_DIR (or --save OUT_DIR)")
    if args.from_torchtitan:
        from loom.checkpoint.torchtitan import from_torchtitan
        return from_torchtitan(args.dir, out, args.from_torchtitan, args.overwrite)
    if args.to_megatron or args.from_megatron:
        from loom.checkpoint.megatron.convert import from_megatron, to_megatron
        if args.to_megatron:
            return to_megatron(args.dir, out, args.ckpt_step, args.overwrite,
                               args.tensor_model_parallel_size or 1)
        return from_megatron(args.dir, out, vars(args), args.ckpt_step, args.overwrite)
    from loom.checkpoint.convert import from_hf, to_hf
    return to_hf(args.dir, out, args.ckpt_step, args.overwrite, args.dtype,
                 args.max_shard_size) if args.to_hf else from_hf(args.dir, out, args.overwrite)
