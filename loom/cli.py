"""One entry point: ``loom train | preprocess | generate | plan | demo``.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args)``;
modules are imported only when their subcommand runs, so ``loom plan`` never imports torch's
distributed machinery and ``--help`` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from loom.config import ConfigError

SUBCOMMANDS = {
    "train": ("loom.training.cli", "train a model (Megatron-style flags; torchrun for many ranks)"),
    "preprocess": ("loom.data.preprocess", "tokenize .txt/.jsonl into an indexed dataset"),
    "generate": ("loom.inference.cli", "generate text from a checkpoint"),
    "plan": ("loom.planner.cli", "predict memory and speed of parallel layouts; pick the best"),
    "fetch-corpus": ("loom.data.corpus", "fetch the offline demo corpus (Wikipedia, C4, TinyStories)"),
    "demo": ("loom.demo", "fetch, tokenize, train TP=2 x DP=2 on CPU, evaluate, generate"),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="loom")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = argv[0] if argv else None
    for name, (module, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    try:
        rc = importlib.import_module(args._module).run(args)
    except ConfigError as e:
        print(f"loom {args.command}: error: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(rc or 0)
