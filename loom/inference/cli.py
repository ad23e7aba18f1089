"""``loom generate --load DIR --prompt TEXT``: text from a checkpoint, on one rank or TP ranks.

The checkpoint (saved at any TP/PP layout) is loaded at ``--tensor-model-parallel-size``
(default 1) with the tokenizer stored beside it.
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

from loom.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``loom generate`` flags."""
    parser.add_argument("--load", required=True,
                        help="checkpoint directory (as given to --save); its latest checkpoint")
    parser.add_argument("--ckpt-step", type=int, default=None,
                        help="load iteration N instead of the one the latest pointer names")
    parser.add_argument("--prompt", required=True, help="text to continue (non-empty)")
    parser.add_argument("--max-new-tokens", type=int, default=64,
                        help="tokens to generate after the prompt, >= 1 (default 64)")
    parser.add_argument("--greedy", action="store_true", help="take the most likely token")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="divide the logits by this before sampling, > 0 (default 1.0)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="sample among the k most likely tokens; 0 = all (default 0)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="nucleus sampling: the smallest set of tokens with this much "
                             "probability, in (0, 1] (default 1.0)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed, >= 0 (default 0)")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1,
                        help="t: ranks splitting the model (launch t ranks with torchrun)")


def _check_values(args: argparse.Namespace) -> None:
    """Refuse bad values of the flags (before any file is read); ConfigError names the flag."""
    if not args.prompt:
        raise ConfigError("--prompt is empty: give the text to continue")
    for name, value, ok, rule in (
            ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, ">= 1"),
            ("--temperature", args.temperature, args.temperature > 0, "> 0"),
            ("--top-k", args.top_k, args.top_k >= 0, ">= 0"),
            ("--top-p", args.top_p, 0 < args.top_p <= 1, "in (0, 1]"),
            ("--seed", args.seed, args.seed >= 0, ">= 0"),
            ("--tensor-model-parallel-size", args.tensor_model_parallel_size,
             args.tensor_model_parallel_size >= 1, ">= 1"),
            ("--ckpt-step", args.ckpt_step, args.ckpt_step is None or args.ckpt_step >= 0,
             ">= 0")):
        if not ok:
            raise ConfigError(f"{name} must be {rule}, got {value}")


def check_arguments(args: argparse.Namespace, ckpt: Optional[str] = None) -> None:
    """Refuse bad ``loom generate`` values before anything is loaded (``ckpt``: the checkpoint
    already chosen, else ``--load``'s); ConfigError names the flag."""
    _check_values(args)
    from loom.checkpoint.safety import check_checkpoint_files, resolve_checkpoint
    if not os.path.isdir(args.load):
        raise ConfigError(f"--load {args.load}: no such checkpoint directory; train with --save "
                          f"first")
    ckpt = ckpt or resolve_checkpoint(args.load, args.ckpt_step)
    if ckpt is None:
        raise ConfigError(f"--load {args.load}: no checkpoint there (no "
                          f"latest_checkpointed_iteration.txt); train with --save first")
    check_checkpoint_files(ckpt)
    if not os.path.isfile(os.path.join(ckpt, "tokenizer.json")):
        raise ConfigError(f"--load {args.load}: {ckpt} has no tokenizer.json (trained on "
                          f"--mock-data?); generation needs a run trained with --data-path")


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


def run(args: argparse.Namespace) -> int:
    from loom.checkpoint.holds import agreed_checkpoint
    _check_values(args)
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
    check_arguments(args, ckpt)
    from loom.inference.generate import SamplingConfig, generate
    from loom.models import get_family
    model, tok = load_for_inference(args.load, args.tensor_model_parallel_size, args.ckpt_step,
                                    ckpt)
    sampling = SamplingConfig(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, seed=args.seed)
    ids = tok.encode(args.prompt)
    bos_token = get_family(model.cfg.model_type).generation.bos_token
    bos = tok.hf.token_to_id(bos_token) if bos_token else None
    if bos is not None:  # e.g. Gemma, trained with <bos> first
        ids = [bos] + ids
    new = generate(model, ids, args.max_new_tokens, sampling, stop_ids=[tok.eod])
    if model.mesh.rank == 0:
        print(args.prompt + tok.decode(new), flush=True)
    return 0
