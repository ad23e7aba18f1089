"""``loom generate --load DIR --prompts TEXT ...``: text from a checkpoint, on one rank or TP ranks.

The checkpoint (saved at any TP/PP layout) is loaded at ``--tensor-model-parallel-size``
(default 1) with the tokenizer stored beside it. The flags are Megatron-LM's inference flags
(:mod:`loom.inference.options`, with their defaults: ``--top_k 1`` greedy,
``--num-tokens-to-generate 30``) and any flag of Megatron's training command line, as
Megatron's inference scripts take them: the model's shape flags must agree with the checkpoint
(or are taken from it with ``--use-checkpoint-args``), the rest is said once to have no effect
on generation; what loom cannot honour is refused in one line before anything loads.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Optional

from loom.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``loom generate`` flags: its options, the config fields (those it uses shown by
    ``--help``, every other by ``--help-all``) and the rest of Megatron's command line."""
    from loom.config import add_config_arguments
    from loom.config.args import add_options
    from loom.config.flag_args import add_megatron_only_arguments
    from loom.inference.options import USED_FIELDS, GenerateOptions
    add_options(parser, GenerateOptions, "generate")
    add_config_arguments(parser, common=USED_FIELDS, shown=set(USED_FIELDS), config_file=False)
    add_megatron_only_arguments(parser, rows=generate_rows(), parsers=("inference",))


def generate_rows():
    """The flag table as ``loom generate`` reads it (:mod:`loom.inference.options`)."""
    from loom.config.flag_table import rows_with
    from loom.inference.options import GENERATE_OVERRIDES, INFERENCE_ROWS
    return rows_with(INFERENCE_ROWS, GENERATE_OVERRIDES)


def _given_fields(args: argparse.Namespace) -> dict:
    from loom.config.args import field_metadata
    from loom.config.core import field_section
    from loom.config.flag_table import check_field_value
    from loom.config.validate import check_bounds
    given = {k: v for k, v in vars(args).items() if k in field_section() and v is not None}
    for k, v in given.items():
        check_field_value(k, v)
        check_bounds(k, v, field_metadata(k))
    return given


def _check_flags(args: argparse.Namespace) -> tuple:
    """Refuse bad ``loom generate`` flags before any file is read; ConfigError names the flag.
    Returns ``(GenerateOptions, the config fields given, lines to say at start)``."""
    from loom.config.args import options_from_args
    from loom.config.flag_args import megatron_given
    from loom.config.flag_table import no_effect_report, resolve_megatron_only
    from loom.inference.options import GenerateOptions
    rows = generate_rows()
    notes = [no_effect_report(resolve_megatron_only(megatron_given(args), rows), rows,
                              "loom generate")]
    opts = options_from_args(args, GenerateOptions)
    if opts.top_p > 1:
        raise ConfigError(f"--top-p / --top_p {opts.top_p} must lie in [0, 1] (0: off)")
    given = _given_fields(args)
    if given.get("pipeline_model_parallel_size", 1) > 1:
        raise ConfigError("--pipeline-model-parallel-size: loom generate runs the whole model on "
                          "each rank (any checkpoint layout loads): give 1, and "
                          "--tensor-model-parallel-size to split it")
    if not given.get("load"):
        raise ConfigError("--load is required: the checkpoint directory to generate from")
    if opts.prompts is None and opts.prompt_file is None:
        raise ConfigError("--prompts (or --prompt) TEXT or --prompt-file FILE.jsonl is required")
    if opts.prompts is not None and not all(opts.prompts):
        raise ConfigError("--prompts / --prompt: an empty prompt; give the text to continue")
    return opts, given, notes


def check_arguments(args: argparse.Namespace, ckpt: Optional[str] = None) -> tuple:
    """Refuse bad ``loom generate`` input before anything is loaded (``ckpt``: the checkpoint
    already chosen, else ``--load``'s); ConfigError names the flag. Returns
    ``(GenerateOptions, checkpoint directory, lines to say at start)``."""
    from loom.config import ModelConfig
    from loom.inference.options import USED_FIELDS
    opts, given, notes = _check_flags(args)
    ckpt = _checkpoint(given["load"], given.get("ckpt_step"), ckpt)
    model_fields = {f for f in ModelConfig.__dataclass_fields__}
    shape = {k: v for k, v in given.items() if k in model_fields}
    if shape and not given.get("use_checkpoint_args"):
        from loom.checkpoint.io import read_common
        saved = read_common(ckpt).get("config") or {}
        for k, v in shape.items():
            if k in saved and saved[k] != v and not (isinstance(v, float) and
                                                     saved[k] == v):
                raise ConfigError(f"--{k.replace('_', '-')} {v}: the checkpoint {ckpt} holds "
                                  f"{saved[k]} (drop the flag, or give --use-checkpoint-args "
                                  f"to take the model from the checkpoint)")
    rest = sorted(f"--{k.replace('_', '-')}" for k in given if k not in USED_FIELDS and
                  k not in model_fields and k != "use_checkpoint_args")
    if shape and given.get("use_checkpoint_args"):
        notes.append("--use-checkpoint-args: the model's flags are the checkpoint's ("
                     + ", ".join(sorted(f"--{k.replace('_', '-')}" for k in shape)) + " unused)")
    if rest:
        notes.append("no effect on generation (training flags): " + ", ".join(rest))
    return opts, ckpt, [n for n in notes if n]


def _checkpoint(load: str, step: Optional[int], ckpt: Optional[str] = None) -> str:
    from loom.checkpoint.safety import check_checkpoint_files, resolve_checkpoint
    if not os.path.isdir(load):
        raise ConfigError(f"--load {load}: no such checkpoint directory; train with --save "
                          f"first")
    ckpt = ckpt or resolve_checkpoint(load, step)
    if ckpt is None:
        raise ConfigError(f"--load {load}: no checkpoint there (no "
                          f"latest_checkpointed_iteration.txt); train with --save first")
    check_checkpoint_files(ckpt)
    if not os.path.isfile(os.path.join(ckpt, "tokenizer.json")):
        raise ConfigError(f"--load {load}: {ckpt} has no tokenizer.json (trained on "
                          f"--mock-data?); generation needs a run trained with --data-path")
    return ckpt


def load_for_inference(load_dir: str, tp: int = 1, step: Optional[int] = None,
                       ckpt: Optional[str] = None):
    """(model, tokenizer) from the latest checkpoint of ``load_dir`` (or ``iter_{step}``, or
    the checkpoint ``ckpt`` already chosen); raises ConfigError if none, or if the ``latest``
    pointer is broken."""
    from loom.checkpoint.io import latest_checkpoint, load_model_weights, open_checkpoint, read_common
    from loom.config import LoomConfig
    from loom.data.tokenizer import Tokenizer
    from loom.models import FamilyRegistry, get_family
    from loom.parallel.mesh import ParallelMesh, init_distributed
    from loom.parallel.parallelize import build_model

    ckpt = ckpt or latest_checkpoint(load_dir, step)
    if ckpt is None:
        raise ConfigError(f"--load {load_dir}: no checkpoint there (no "
                          f"latest_checkpointed_iteration.txt); train with --save first")
    cfg = LoomConfig.from_flat(read_common(ckpt)["config"], ignore_retired=True)
    cfg.model.hidden_dropout = cfg.model.attention_dropout = 0.0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 or tp > 1:
        device = init_distributed()
        mesh = ParallelMesh.build(tp=tp, dp=world // tp, device=device)
    else:
        mesh = ParallelMesh.single()
    family = get_family(cfg.model.model_type)
    if family.generation is None:
        able = [f.name for f in FamilyRegistry().families() if f.generation]
        raise ConfigError(f"--load {load_dir}: a {family.name} checkpoint does not generate "
                          f"text (the family has no generation); `loom generate` needs one "
                          f"of {', '.join(able)}")
    model = build_model(family, cfg.model, mesh, seed=None)
    load_model_weights(open_checkpoint(ckpt), [model], mesh)
    tok_path = os.path.join(ckpt, "tokenizer.json")
    if not os.path.exists(tok_path):
        raise ConfigError(f"--load {load_dir}: checkpoint has no tokenizer.json")
    from loom.checkpoint.integrity import verify_read
    verify_read(ckpt, ["tokenizer.json"])
    return model, Tokenizer.load(tok_path)


def read_prompts(opts) -> list[str]:
    """``--prompts``, or the ``text`` of each line of ``--prompt-file`` (the first
    ``--prompt-file-num-truncate``). Raises ConfigError naming the file for a bad line."""
    if opts.prompts is not None:
        return list(opts.prompts)
    out = []
    try:
        with open(opts.prompt_file, encoding="utf-8") as fh:
            for i, line in enumerate(fh, 1):
                if line.strip():
                    try:
                        out.append(str(json.loads(line)["text"]))
                    except (ValueError, KeyError, TypeError):
                        raise ConfigError(f"--prompt-file {opts.prompt_file}:{i}: not a JSON "
                                          f"object with a \"text\" field") from None
                if opts.prompt_file_num_truncate and len(out) >= opts.prompt_file_num_truncate:
                    break
    except OSError as e:
        raise ConfigError(f"--prompt-file {opts.prompt_file}: {e.strerror}") from None
    if not out:
        raise ConfigError(f"--prompt-file {opts.prompt_file}: no prompts in it")
    return out


def stop_at_words(new: list[int], tok, stop_words) -> list[int]:
    """``new`` cut after the first token whose text completes one of ``stop_words``
    (``--stop-words``: the generation ends there, the word kept)."""
    if not stop_words:
        return new
    for k in range(1, len(new) + 1):
        if any(w in tok.decode(new[:k]) for w in stop_words):
            return new[:k]
    return new


def run(args: argparse.Namespace) -> int:
    from loom.checkpoint.holds import agreed_checkpoint
    _check_flags(args)  # bad flags refused before a checkpoint is chosen and held
    if not os.path.isdir(args.load):
        raise ConfigError(f"--load {args.load}: no such checkpoint directory; train with --save "
                          f"first")
    ckpt, hold = agreed_checkpoint(args.load, args.ckpt_step)  # never pruned while read
    try:
        return _generate(args, ckpt)
    finally:
        if hold is not None:
            hold.release()


def _generate(args: argparse.Namespace, ckpt: Optional[str]) -> int:
    opts, ckpt, notes = check_arguments(args, ckpt)
    from loom.inference.generate import SamplingConfig, generate
    from loom.models import get_family
    rank0 = os.environ.get("RANK", "0") == "0"
    for line in notes:
        if rank0:
            print(f"loom generate: {line}", flush=True)
    prompts = read_prompts(opts)
    tp = args.tensor_model_parallel_size or 1
    model, tok = load_for_inference(args.load, tp, args.ckpt_step, ckpt)
    from loom.config import TrainingConfig
    seed = TrainingConfig().seed if args.seed is None else args.seed  # the one --seed default
    sampling = SamplingConfig(greedy=opts.greedy or opts.top_k == 1,
                              temperature=opts.temperature, top_k=opts.top_k,
                              top_p=opts.top_p or 1.0, seed=seed)
    bos_token = get_family(model.cfg.model_type).generation.bos_token
    bos = tok.hf.token_to_id(bos_token) if bos_token else None
    stop = [tok.eod] if opts.termination_id is None else [opts.termination_id]
    results = []
    for i, prompt in enumerate(prompts):
        ids = tok.encode(prompt)
        if bos is not None:  # e.g. Gemma, trained with <bos> first
            ids = [bos] + ids
        logprobs: Optional[dict] = {} if opts.return_log_probs or opts.top_n_logprobs else None
        new = generate(model, ids, opts.num_tokens_to_generate, sampling, stop_ids=stop,
                       logprobs=logprobs, top_n=opts.top_n_logprobs)
        new = stop_at_words(new, tok, opts.stop_words or ())
        text = tok.decode(new)
        if model.mesh.rank == 0:
            print(prompt + text, flush=True)
        if i % opts.output_every_n_results == 0:
            kept = {k: v[:len(new)] if k != "prompt_log_probs" else v
                    for k, v in (logprobs or {}).items()}
            results.append({"id": i, "input_prompt": prompt, "generated_text": text,
                            "generated_tokens": new, **kept})
    if opts.output_path and model.mesh.rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(opts.output_path)), exist_ok=True)
        with open(opts.output_path, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)
    return 0
