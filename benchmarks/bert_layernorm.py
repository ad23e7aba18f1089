"""The layer-norm finding of Megatron-LM's BERT (Shoeybi et al. 2019, sec. 5.3, fig. 7), small:
a deep BERT with the original post-LN residual order vs Megatron's pre-LN order, the same
learning rate, warm-up and data, on the demo corpus (``loom fetch-corpus``: Wikipedia, C4,
TinyStories), 1 CPU rank, fp32.

A WordPiece (lower case, ``--vocab`` ids) is trained on the corpus and the corpus preprocessed
with it; then each order trains ``--iters`` iterations of masked-LM + sentence-order
prediction (``--bert-binary-head``) and the held-out Wikipedia articles are evaluated at the
end. Writes ``OUT/bert_layernorm.json`` (per-iteration masked-LM loss, SOP loss and gradient
norm of both runs, the configuration, the final validation losses) and
``OUT/bert_layernorm.png`` (the two masked-LM loss curves).

    OMP_NUM_THREADS=1 python -m benchmarks.bert_layernorm [--layers 24]
        [--hidden 128] [--seq 64] [--iters 200] [--lr 1e-3] [--warmup 20] [--out runs/bert_layernorm]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch


def prepare_data(work: str, vocab: int) -> tuple[str, str]:
    """Train/valid prefixes of the demo corpus under ``work`` (built once)."""
    from loom.data.corpus import fetch_demo_corpus
    from loom.data.preprocess import preprocess
    from loom.data.tokenizer import build_tokenizer
    corpus = fetch_demo_corpus()
    train, valid = os.path.join(work, "train"), os.path.join(work, "valid")
    if not os.path.isfile(valid + ".meta.json"):
        os.makedirs(work, exist_ok=True)
        inputs = [str(corpus[k]) for k in ("wiki_train", "c4", "tinystories")]
        tok = build_tokenizer("BertWordPieceLowerCase", vocab_size=vocab, train_files=inputs)
        preprocess(inputs, train, tok, append_eod=True, tokenizer_type="BertWordPieceLowerCase")
        preprocess([str(corpus["wiki_heldout"])], valid, tok, append_eod=True,
                   tokenizer_type="BertWordPieceLowerCase")
    return train, valid


def unigram_entropy(prefix: str) -> float:
    """Entropy (nats) of the corpus' token frequencies, [PAD] [UNK] [CLS] [SEP] [MASK] (ids
    0-4) left out: the masked-LM loss of a model that ignores the context."""
    import numpy as np
    from loom.data.indexed import IndexedDataset
    ds = IndexedDataset(prefix)
    toks = np.concatenate([ds.get(i) for i in range(ds.num_documents)]).astype(np.int64)
    p = np.bincount(toks[toks > 4]).astype(np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


def run(post: bool, args, train: str, valid: str) -> dict:
    from loom.config import LoomConfig, ModelConfig
    from loom.data.preprocess import read_meta
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    model = ModelConfig(model_type="bert", num_layers=args.layers, hidden_size=args.hidden,
                        num_attention_heads=args.heads, seq_length=args.seq,
                        vocab_size=read_meta(train)["vocab_size"], post_layernorm=post,
                        bert_binary_head=True, hidden_dropout=0.1, attention_dropout=0.1)
    cfg = LoomConfig(model=model)
    t = cfg.training
    t.micro_batch_size, t.train_iters, t.lr = args.batch, args.iters, args.lr
    t.lr_warmup_iters, t.min_lr, t.lr_decay_style = args.warmup, args.lr / 10, "linear"
    t.adam_beta2, t.weight_decay, t.clip_grad, t.seed = 0.999, 0.01, 1.0, args.seed
    cfg.data.data_path, cfg.data.valid_data_path, cfg.data.split = train, valid, "100,0,0"
    cfg.logging.eval_iters = 4
    cfg = cfg.validate(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    trainer = Trainer(cfg, mesh=ParallelMesh.single(device))
    recs, t0 = [], time.perf_counter()
    for i in range(args.iters):
        r = trainer.train_step()
        recs.append({k: r[k] for k in ("iteration", "loss", "mlm_loss", "sop_loss", "grad_norm",
                                       "lr", "step_time_s")})
        if (i + 1) % 25 == 0:
            print(f"  {'post' if post else 'pre'}-LN it {i + 1}: mlm {r['mlm_loss']:.3f} "
                  f"sop {r['sop_loss']:.3f} grad norm {r['grad_norm']:.2f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    ev = trainer.evaluate()
    return {"records": recs, "valid_loss": ev["valid_loss"] if ev else None,
            "seconds": time.perf_counter() - t0,
            "parameters": sum(p.numel() for p in trainer.params)}


def smooth(xs: list[float], w: int = 10) -> list[float]:
    return [sum(xs[max(0, i - w + 1):i + 1]) / len(xs[max(0, i - w + 1):i + 1])
            for i in range(len(xs))]


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for name, color in (("pre-LN", "tab:blue"), ("post-LN", "tab:red")):
        recs = result["runs"][name]["records"]
        it = [r["iteration"] for r in recs]
        mlm = [r["mlm_loss"] for r in recs]
        ax[0].plot(it, mlm, color=color, alpha=0.25)
        ax[0].plot(it, smooth(mlm), color=color, label=f"{name} (10-iteration mean)")
        ax[1].plot(it, [r["grad_norm"] for r in recs], color=color, label=name)
    c = result["config"]
    ax[0].axhline(math.log(c["vocab_size"]), color="gray", ls=":", label="ln V")
    if c.get("unigram_entropy"):
        ax[0].axhline(c["unigram_entropy"], color="black", ls="--", lw=0.8,
                      label="unigram entropy")
    ax[0].set(xlabel="iteration", ylabel="masked-LM loss (nats)",
              title=f"BERT {c['layers']} layers, h {c['hidden']}: lr {c['lr']:g}, "
                    f"warm-up {c['warmup']}")
    ax[1].set(xlabel="iteration", ylabel="gradient norm (pre-clip)", yscale="log",
              title="gradient norm")
    ax[0].legend()
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default="runs/bert_layernorm")
    ap.add_argument("--replot", action="store_true", help="redraw OUT's PNG from its JSON")
    args = ap.parse_args()
    if args.replot:
        with open(os.path.join(args.out, "bert_layernorm.json")) as f:
            result = json.load(f)
        plot(result, os.path.join(args.out, "bert_layernorm.png"))
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    train, valid = prepare_data(os.path.join(args.out, "data"), args.vocab)
    from loom.data.preprocess import read_meta
    result = {"config": {**vars(args), "vocab_size": read_meta(train)["vocab_size"],
                         "train_tokens": read_meta(train)["num_tokens"],
                         "unigram_entropy": unigram_entropy(train)}, "runs": {}}
    for post in (False, True):
        name = "post-LN" if post else "pre-LN"
        print(f"{name}: {args.layers} layers, h {args.hidden}, {args.iters} iterations", flush=True)
        result["runs"][name] = run(post, args, train, valid)
    for name, r in result["runs"].items():
        mlm = [x["mlm_loss"] for x in r["records"]]
        r["summary"] = {"first_10": sum(mlm[:10]) / len(mlm[:10]),
                        "last_20": sum(mlm[-20:]) / len(mlm[-20:]),
                        "min": min(mlm), "valid_loss": r["valid_loss"],
                        "max_grad_norm": max(x["grad_norm"] for x in r["records"])}
        print(f"{name}: mlm loss first 10 {r['summary']['first_10']:.3f} -> last 20 "
              f"{r['summary']['last_20']:.3f}; validation (mlm + sop) {r['valid_loss']:.3f}; "
              f"{r['seconds']:.0f} s")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bert_layernorm.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(args.out, "bert_layernorm.png"))
    print(f"wrote {args.out}/bert_layernorm.json and .png")


if __name__ == "__main__":
    main()
