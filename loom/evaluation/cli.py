"""``loom evaluate --load CKPT --task perplexity|cloze|mlm --eval-data FILE``: zero-shot
evaluation of a checkpoint (Megatron-LM's ``tasks/zeroshot_gpt`` semantics; BERT's masked-LM
accuracy), or ``--lm-eval-tasks NAMES``: lm-evaluation-harness tasks scored by the checkpoint
itself (:mod:`loom.evaluation.lm_harness`), on one process or under
torchrun at any ``--tensor-model-parallel-size`` x ``--pipeline-model-parallel-size`` (the
remaining ranks split the samples as data-parallel replicas).

Every check (flags, checkpoint, model type against the task, layout, tokenizer, the whole
evaluation file) runs on every rank before a process group starts; bad input is one line
``loom evaluate: error: ...`` and exit status 2. The result is a readable table and one JSON
line, printed by rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from typing import Literal, Optional

from loom.config.fields import opt
from loom.errors import ConfigError
from loom.evaluation.registry import get_task

Task = Literal["perplexity", "cloze", "mlm"]  # loom.evaluation.registry.task_names()


@dataclass
class EvaluateOptions:
    """What to evaluate (Megatron's names where ``tasks/main.py`` has them)."""

    task: Optional[Task] = opt(
        None, "perplexity: token- and word-level perplexity of a text (Megatron's "
              "WIKITEXT103); cloze: last-word accuracy on a LAMBADA-format jsonl file "
              "(Megatron's LAMBADA); mlm (BERT): masked-LM accuracy, loss and perplexity of "
              "held-out text (this or --lm-eval-tasks)")
    eval_data: Optional[str] = opt(
        None, "perplexity, mlm: a text file (read whole), a .jsonl file (--json-key) or an "
              "indexed dataset prefix; cloze: a .jsonl file of {\"text\": ...} lines "
              "(required with --task)")
    lm_eval_tasks: Optional[str] = opt(
        None, "instead of --task: lm-evaluation-harness tasks, comma-separated (e.g. "
              "wikitext,hellaswag), scored by the checkpoint at this layout without exporting "
              "(log-likelihood tasks; generation tasks: export with `loom checkpoint convert "
              "--to-hf`)", metavar="NAMES")
    lm_eval_include_path: Optional[str] = opt(
        None, "--lm-eval-tasks: a directory of your own task YAML files", metavar="DIR")
    lm_eval_limit: Optional[int] = opt(None, "--lm-eval-tasks: at most N documents per task",
                                       ge=1)
    json_key: str = opt("text", "the field of a .jsonl line holding the text")
    overlapping_eval: Optional[int] = opt(
        None, "perplexity: windows start STRIDE tokens apart and each after the first scores "
              "only its last STRIDE tokens, 1 <= STRIDE <= --seq-length (default: "
              "--seq-length, no overlap)", ge=1, metavar="STRIDE")
    strict_lambada: bool = opt(False, "cloze: predict the last whitespace word (all its "
                                      "tokens), not only the last token (Megatron's flag)")


USED_FIELDS = ("load", "ckpt_step", "seq_length", "seed", "mask_prob",
               "micro_batch_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "model_type",
               "tokenizer_type", "tokenizer_model", "vocab_file", "merge_file")
"""The config fields ``loom evaluate`` takes (declared once, in loom.config): the checkpoint,
the window length (default: the checkpoint's), the masking seed and share (BERT), the batch,
the layout, and a tokenizer instead of the checkpoint's; ``--model-type`` refuses a checkpoint
of another family."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``loom evaluate`` flags: its options and the config fields it uses."""
    from loom.config.args import add_fields, add_options
    add_options(parser, EvaluateOptions, "evaluate")
    add_fields(parser, USED_FIELDS, "checkpoint, layout, tokenizer")


def _check_values(args: argparse.Namespace) -> None:
    from loom.config.args import field_defaults
    from loom.config.validate import check_bounds
    if args.load is None:
        raise ConfigError("--load is required: the checkpoint directory")
    field_defaults(args, tuple(f for f in USED_FIELDS if f not in ("model_type",
                                                                    "seq_length")),
                   micro_batch_size=4)  # windows per forward pass (training requires it)
    args.json_key = args.json_key or "text"
    args.strict_lambada = bool(args.strict_lambada)
    for name in ("overlapping_eval", "lm_eval_limit"):
        check_bounds(name, getattr(args, name), EvaluateOptions.__dataclass_fields__[name]
                     .metadata)
    if (args.task is None) == (args.lm_eval_tasks is None):
        raise ConfigError("give --task perplexity|cloze|mlm (with --eval-data) or "
                          "--lm-eval-tasks NAMES, one of the two")
    if args.task is not None and args.eval_data is None:
        raise ConfigError(f"--task {args.task} needs --eval-data PATH")


def _check_lm_eval(args: argparse.Namespace, family):
    """--lm-eval-tasks: lm-eval installed, a causal family, every task name known; returns
    lm-eval's TaskManager (only the --lm-eval-include-path tasks indexed when every name is
    one of them: indexing lm-eval's own ~15,000 takes seconds)."""
    if "perplexity" not in family.evaluation_tasks:
        raise ConfigError(f"--lm-eval-tasks scores causal language models; a "
                          f"{family.name} checkpoint is not one")
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise ConfigError("--lm-eval-tasks needs lm-evaluation-harness: pip install "
                          "'lm-eval[hf]'") from None
    if args.lm_eval_include_path and not os.path.isdir(args.lm_eval_include_path):
        raise ConfigError(f"--lm-eval-include-path {args.lm_eval_include_path}: no such "
                          f"directory")
    names = [t.strip() for t in args.lm_eval_tasks.split(",") if t.strip()]
    manager = None
    if args.lm_eval_include_path:
        manager = TaskManager(include_path=args.lm_eval_include_path, include_defaults=False)
    if manager is None or set(names) - set(manager.all_tasks):
        manager = TaskManager(include_path=args.lm_eval_include_path)
    unknown = [t for t in names if t not in manager.all_tasks]
    if unknown or not names:
        raise ConfigError(f"--lm-eval-tasks {args.lm_eval_tasks}: unknown task(s) "
                          f"{', '.join(unknown) or '(none given)'}; `lm_eval ls tasks` lists "
                          f"them, --lm-eval-include-path adds your own")
    return manager


def _tokenizer(args: argparse.Namespace, ckpt: str):
    from loom.data.tokenizer import Tokenizer, build_tokenizer
    if args.tokenizer_type:
        return build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file,
                               args.tokenizer_model)
    path = os.path.join(ckpt, "tokenizer.json")
    if not os.path.isfile(path):
        raise ConfigError(f"--load {args.load}: {ckpt} has no tokenizer.json (trained on "
                          f"--mock-data?); give --tokenizer-type and its files")
    from loom.checkpoint.integrity import verify_read
    verify_read(ckpt, ["tokenizer.json"])
    return Tokenizer.load(path)


def prepare(args: argparse.Namespace, ckpt: Optional[str] = None):
    """Every check before a process group: returns ``(checkpoint dir, LoomConfig, Task (with
    --lm-eval-tasks: lm-eval's TaskManager holding them), tokenizer)``; ``args.seq_length`` is
    resolved. ``ckpt``: the checkpoint already chosen (and held:
    :func:`loom.checkpoint.holds.agreed_checkpoint`), else ``--load``'s. Raises ConfigError
    naming the flag."""
    from loom.checkpoint.io import read_common
    from loom.checkpoint.safety import check_checkpoint_files, resolve_checkpoint
    from loom.config import LoomConfig
    from loom.evaluation.runner import check_layout, keep_trained_vocabulary
    from loom.models import FamilyRegistry, get_family
    from loom.training.cli import world_size_from_env
    _check_values(args)
    if not os.path.isdir(args.load):
        raise ConfigError(f"--load {args.load}: no such checkpoint directory")
    ckpt = ckpt or resolve_checkpoint(args.load, args.ckpt_step)
    if ckpt is None:
        raise ConfigError(f"--load {args.load}: no checkpoint there (no "
                          f"latest_checkpointed_iteration.txt); train with --save first")
    check_checkpoint_files(ckpt)
    flat = read_common(ckpt).get("config") or {}
    family = flat.get("model_type") or "gpt"
    if args.model_type and args.model_type != family:
        raise ConfigError(f"--model-type {args.model_type}: the checkpoint {ckpt} holds a "
                          f"{family} model; drop --model-type or load a {args.model_type} "
                          f"checkpoint")
    try:
        fam = get_family(family)
    except ValueError:
        raise ConfigError(f"--load {args.load}: model type {family} is not known to this loom "
                          f"(known: {', '.join(FamilyRegistry().names())})") from None
    if args.lm_eval_tasks is not None:
        task = _check_lm_eval(args, fam)  # lm-eval's TaskManager
    else:
        task = get_task(fam, args.task, f" (the checkpoint {ckpt} holds a {family} model)")
    cfg = LoomConfig.from_flat(flat, ignore_retired=True)
    cfg.model.hidden_dropout = cfg.model.attention_dropout = 0.0
    args.seq_length = args.seq_length or cfg.model.seq_length
    cfg.model.seq_length = args.seq_length
    if args.overlapping_eval is not None and args.overlapping_eval > args.seq_length:
        raise ConfigError(f"--overlapping-eval {args.overlapping_eval} exceeds --seq-length "
                          f"{args.seq_length}: tokens between windows would go unscored")
    check_layout(cfg, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                 world_size_from_env())
    keep_trained_vocabulary(cfg, ckpt, args.tensor_model_parallel_size)
    tok = _tokenizer(args, ckpt)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} ids but the model only "
                          f"{cfg.model.vocab_size}: give the tokenizer the model was trained with")
    return ckpt, cfg, task, tok


def evaluate(args: argparse.Namespace, ckpt: Optional[str] = None) -> dict:
    """Run the evaluation ``args`` describes (on ``ckpt``, else ``--load``'s checkpoint); the
    result (same on every rank; with --lm-eval-tasks its ``results`` only on local rank 0, as
    lm-eval returns them)."""
    from loom.evaluation.runner import build_mesh, load_model, score
    ckpt, cfg, task, tok = prepare(args, ckpt)
    if args.lm_eval_tasks is not None:  # task: lm-eval's TaskManager
        from loom.evaluation.lm_harness import run_tasks
        mesh = build_mesh(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
        model = load_model(ckpt, cfg, mesh)
        start = time.perf_counter()
        out = run_tasks(model, tok, args, task)  # None but on local rank 0 (lm-eval's rule)
        return {"task": "lm-eval", "checkpoint": ckpt, "iteration": model.iteration,
                "model_type": cfg.model.model_type, "lm_eval": out,
                "results": out and out["results"], "seq_length": args.seq_length,
                "layout": {"tp": mesh.tp_size, "pp": mesh.pp_size, "dp": mesh.dp_size},
                "eval_time_s": round(time.perf_counter() - start, 3)}
    samples, info = task.samples(args, tok)
    mesh = build_mesh(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)
    model = load_model(ckpt, cfg, mesh)
    start = time.perf_counter()
    sums = score(model, task, samples, args.micro_batch_size)
    elapsed = time.perf_counter() - start
    return {"task": task.name, "checkpoint": ckpt, "iteration": model.iteration,
            "model_type": cfg.model.model_type, **info, **task.report(sums, info),
            "layout": {"tp": mesh.tp_size, "pp": mesh.pp_size, "dp": mesh.dp_size},
            "eval_time_s": round(elapsed, 3)}


def format_table(result: dict) -> str:
    """The result as aligned ``name  value`` rows under a title line."""
    lay = result["layout"]
    title = (f"loom evaluate: {result['task']} of {result['checkpoint']} ({result['model_type']}, "
             f"iteration {result['iteration']}) at TP={lay['tp']} x PP={lay['pp']} x "
             f"DP={lay['dp']}")
    rows = [(k, v) for k, v in result.items()
            if k not in ("task", "checkpoint", "iteration", "model_type", "layout")]
    width = max(len(k) for k, _ in rows)

    def fmt(v) -> str:
        if isinstance(v, float):
            return f"{v:.6g}" if abs(v) < 1e6 else f"{v:.6e}"
        return "n/a" if v is None else str(v)
    return "\n".join([title] + [f"  {k:<{width}}  {fmt(v)}" for k, v in rows])


def run(args: argparse.Namespace) -> int:
    from loom.checkpoint.holds import agreed_checkpoint
    _check_values(args)
    if not os.path.isdir(args.load):
        raise ConfigError(f"--load {args.load}: no such checkpoint directory")
    ckpt, hold = agreed_checkpoint(args.load, args.ckpt_step)  # never pruned while read
    try:
        result = evaluate(args, ckpt)
    finally:
        if hold is not None:
            hold.release()
    if os.environ.get("RANK", "0") == "0":
        if "lm_eval" in result:  # lm-eval's own table, then the results as one JSON line
            from lm_eval.utils import make_table
            lay = result["layout"]
            print(f"loom evaluate: lm-eval tasks of {result['checkpoint']} at TP={lay['tp']} x "
                  f"PP={lay['pp']} x DP={lay['dp']}\n{make_table(result.pop('lm_eval'))}",
                  flush=True)
        else:
            print(format_table(result), flush=True)
        print(json.dumps(result, default=str), flush=True)
    return 0
