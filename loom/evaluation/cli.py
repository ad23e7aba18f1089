"""``loom evaluate --load CKPT --task perplexity|cloze|mlm --eval-data FILE``: zero-shot
evaluation of a checkpoint (Megatron-LM's ``tasks/zeroshot_gpt`` semantics; BERT's masked-LM
accuracy), on one process or under
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

from loom.errors import ConfigError
from loom.evaluation.registry import get_task, task_names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``loom evaluate`` flags (Megatron's names where ``tasks/main.py`` has them)."""
    parser.add_argument("--load", required=True,
                        help="checkpoint directory (as given to --save); its latest checkpoint")
    parser.add_argument("--ckpt-step", type=int, default=None,
                        help="load iteration N instead of the one the latest pointer names")
    parser.add_argument("--task", required=True, choices=task_names(),
                        help="perplexity: token- and word-level perplexity of a text "
                             "(Megatron's WIKITEXT103); cloze: last-word accuracy on a "
                             "LAMBADA-format jsonl file (Megatron's LAMBADA); mlm (BERT): "
                             "masked-LM accuracy, loss and perplexity of held-out text")
    parser.add_argument("--eval-data", required=True, metavar="PATH",
                        help="perplexity, mlm: a text file (read whole), a .jsonl file "
                             "(--json-key) or an indexed dataset prefix; cloze: a .jsonl file of "
                             "{\"text\": ...} lines")
    parser.add_argument("--json-key", default="text",
                        help="the field of a .jsonl line holding the text (default text)")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="tokens per window, >= 1 (default: the checkpoint's)")
    parser.add_argument("--overlapping-eval", type=int, default=None, metavar="STRIDE",
                        help="perplexity: windows start STRIDE tokens apart and each after the "
                             "first scores only its last STRIDE tokens, 1 <= STRIDE <= "
                             "--seq-length (default: --seq-length, no overlap)")
    parser.add_argument("--strict-lambada", action="store_true",
                        help="cloze: predict the last whitespace word (all its tokens), "
                             "not only the last token (Megatron's flag)")
    parser.add_argument("--seed", type=int, default=1234,
                        help="mlm: the seed of the masking (same seed, same masked positions; "
                             "default 1234)")
    parser.add_argument("--mask-prob", type=float, default=0.15,
                        help="mlm: fraction of each sample's tokens masked, whole words "
                             "(default 0.15, BERT's)")
    parser.add_argument("--micro-batch-size", type=int, default=4,
                        help="windows / examples per forward pass, >= 1 (default 4)")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1,
                        help="t: ranks splitting each layer (launch with torchrun)")
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                        help="p: pipeline stages (world size / (t p) data-parallel replicas)")
    parser.add_argument("--model-type", default=None,
                        help="refuse a checkpoint of another model type (e.g. gpt, mamba)")
    parser.add_argument("--tokenizer-type", default=None,
                        choices=("GPT2BPETokenizer", "HuggingFaceTokenizer"),
                        help="tokenizer instead of the checkpoint's tokenizer.json")
    parser.add_argument("--tokenizer-model", default=None,
                        help="a tokenizer.json (HuggingFaceTokenizer)")
    parser.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    parser.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")


def _check_values(args: argparse.Namespace) -> None:
    for name, value, ok, rule in (
            ("--seq-length", args.seq_length, args.seq_length is None or args.seq_length >= 1,
             ">= 1"),
            ("--overlapping-eval", args.overlapping_eval,
             args.overlapping_eval is None or args.overlapping_eval >= 1, ">= 1"),
            ("--micro-batch-size", args.micro_batch_size, args.micro_batch_size >= 1, ">= 1"),
            ("--tensor-model-parallel-size", args.tensor_model_parallel_size,
             args.tensor_model_parallel_size >= 1, ">= 1"),
            ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size,
             args.pipeline_model_parallel_size >= 1, ">= 1"),
            ("--ckpt-step", args.ckpt_step, args.ckpt_step is None or args.ckpt_step >= 0,
             ">= 0")):
        if not ok:
            raise ConfigError(f"{name} must be {rule}, got {value}")


def _tokenizer(args: argparse.Namespace, ckpt: str):
    from loom.data.tokenizer import Tokenizer, build_tokenizer
    if args.tokenizer_type:
        return build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file,
                               args.tokenizer_model)
    path = os.path.join(ckpt, "tokenizer.json")
    if not os.path.isfile(path):
        raise ConfigError(f"--load {args.load}: {ckpt} has no tokenizer.json (trained on "
                          f"--mock-data?); give --tokenizer-type and its files")
    return Tokenizer.load(path)


def prepare(args: argparse.Namespace):
    """Every check before a process group: returns ``(checkpoint dir, LoomConfig, Task,
    tokenizer)``; ``args.seq_length`` is resolved. Raises ConfigError naming the flag."""
    from loom.checkpoint.io import read_common
    from loom.checkpoint.safety import check_checkpoint_files, resolve_checkpoint
    from loom.config import LoomConfig
    from loom.evaluation.runner import check_layout
    from loom.models import FamilyRegistry, get_family
    from loom.training.cli import world_size_from_env
    _check_values(args)
    if not os.path.isdir(args.load):
        raise ConfigError(f"--load {args.load}: no such checkpoint directory")
    ckpt = resolve_checkpoint(args.load, args.ckpt_step)
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
    tok = _tokenizer(args, ckpt)
    if tok.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"the tokenizer has {tok.vocab_size} ids but the model only "
                          f"{cfg.model.vocab_size}: give the tokenizer the model was trained with")
    return ckpt, cfg, task, tok


def evaluate(args: argparse.Namespace) -> dict:
    """Run the evaluation ``args`` describes; the result (same on every rank)."""
    from loom.evaluation.runner import build_mesh, load_model, score
    ckpt, cfg, task, tok = prepare(args)
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
    result = evaluate(args)
    if os.environ.get("RANK", "0") == "0":
        print(format_table(result), flush=True)
        print(json.dumps(result), flush=True)
    return 0
