"""``loom generate --load DIR --prompt TEXT``: text from a checkpoint, on one rank or TP ranks.

The checkpoint (saved at any TP/PP layout) is loaded at ``--tensor-model-parallel-size``
(default 1) with the tokenizer stored beside it.
"""

from __future__ import annotations

import argparse
import os

from loom.config import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--load", required=True, help="checkpoint directory (as given to --save)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)


def load_for_inference(load_dir: str, tp: int = 1):
    """(model, tokenizer) from the latest checkpoint of ``load_dir``; raises ConfigError if none."""
    from loom.checkpoint.io import _ShardIndex, latest_checkpoint, load_model_weights, read_common
    from loom.config import LoomConfig
    from loom.data.tokenizer import Tokenizer
    from loom.models.gpt import GPTModel
    from loom.parallel.mesh import ParallelMesh, init_distributed
    from loom.parallel.random import RNGTracker

    ckpt = latest_checkpoint(load_dir)
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
    tracker = RNGTracker(mesh.device)
    tracker.seed(0)
    model = GPTModel(cfg.model, mesh, tracker)
    load_model_weights(_ShardIndex(ckpt), [model], mesh)
    tok_path = os.path.join(ckpt, "tokenizer.json")
    if not os.path.exists(tok_path):
        raise ConfigError(f"--load {load_dir}: checkpoint has no tokenizer.json")
    return model, Tokenizer.load(tok_path)


def run(args: argparse.Namespace) -> int:
    from loom.inference.generate import SamplingConfig, generate
    model, tok = load_for_inference(args.load, args.tensor_model_parallel_size)
    sampling = SamplingConfig(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, seed=args.seed)
    new = generate(model, tok.encode(args.prompt), args.max_new_tokens, sampling,
                   stop_ids=[tok.eod])
    if model.mesh.rank == 0:
        print(args.prompt + tok.decode(new), flush=True)
    return 0
