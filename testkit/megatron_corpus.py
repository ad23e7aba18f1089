"""The functional-test corpus of Megatron-LM d98e8a6 (tests/unit/megatron_corpus.json, written by
``benchmarks/megatron_corpus.py``) as loom command lines, and the capabilities other branches
are adding (issue 42): shared by tests/unit/test_megatron_corpus.py (every case through
``loom train --dry-run``) and tests/integration/test_megatron_corpus_training.py (a sample
trained on 2 CPU ranks).

Placeholders (see the generator's docstring): ``{DATA}`` becomes ``--mock-data`` (for a
``--fim-data`` case, which needs text to cut, a small real dataset: :func:`fim_dataset`), a
tokenizer ``{TOKENIZER:V}`` becomes ``--vocab-size V`` (what a run reads from it before the
data), the directories temporary ones (``{LOAD}`` an empty directory, as Megatron's CI
``--load`` holds no checkpoint of the run), and the entry script ``--model-type``.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

CORPUS = json.loads((Path(__file__).resolve().parents[1] / "tests" / "unit" /
                     "megatron_corpus.json").read_text())
COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
ENTRY_MODEL_TYPE = {"examples/bert/pretrain_bert.py": "bert", "pretrain_hybrid.py": "mamba",
                    "megatron/elastification/pretrain_hybrid_flex.py": "mamba",
                    "pretrain_bert.py": "bert", "pretrain_mamba.py": "mamba"}  # (earlier
# releases' entry scripts)
TRAINING = [c for c in CORPUS["cases"] if c["mode"] != "inference"]
INFERENCE = [c for c in CORPUS["cases"] if c["mode"] == "inference"]

# The capabilities other branches implement (issue 42), refused until they merge: flag ->
# (capability, values it covers or None for any value other than Megatron's default, the value
# that stands in when simulating it implemented, or None to drop the flag). When a branch
# merges, its flags are accepted: delete its entries (the corpus test says which) and the
# accepted share rises. Empty since modelcaps, traincaps, reliability and megackpt merged.
PENDING: dict = {}
PENDING_RULES: dict = {}  # refusals of validation rules a pending branch relaxes (message ->
#                           capability)


def dry_run(argv: list[str], world: int) -> tuple[int, str]:
    """``loom train --dry-run --world-size world *argv`` in this process: ``(exit status,
    stderr)``."""
    import contextlib
    import io
    from loom.cli import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(["train", "--dry-run", "--world-size", str(world), *argv])
            code = 0
        except SystemExit as e:
            code = e.code or 0
    return code, err.getvalue().strip()


def inference_world(root: Path) -> Path:
    """Under ``root``: a tiny GPT checkpoint with a word-level tokenizer (``{CKPT}``) and a
    prompt file (``{FILE}``), what the inference cases read; ``root``."""
    import json as _json
    from tokenizers import Tokenizer, models, pre_tokenizers
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    from testkit.config import tiny_config
    words = ["[UNK]", "<|endoftext|>"] + [f"w{i}" for i in range(40)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(root / "tok.json"))
    cfg = tiny_config("llama", num_query_groups=None, vocab_size=42, micro_batch_size=1,
                      train_iters=1, world=1)
    Trainer(cfg, mesh=ParallelMesh.single()).save(
        str(root / "ckpt"), tokenizer_file=str(root / "tok.json"))
    (root / "file").write_text("".join(_json.dumps({"text": f"w{i} w{i + 1}"}) + "\n"
                                       for i in range(3)))
    return root


def through_generate(case: dict, argv: list[str]) -> tuple[int, str]:
    """An inference case through ``loom generate``: ``(0, "")`` accepted (and generated, on
    one rank), or ``(2, the one refusal line)``; a case of t > 1 ranks gets every check of
    ``loom generate`` before it would start the process group."""
    import argparse
    import contextlib
    import io
    from loom.cli import main
    from loom.errors import ConfigError
    from loom.inference.cli import add_arguments, check_arguments
    tp = int(argv[argv.index("--tensor-model-parallel-size") + 1]) \
        if "--tensor-model-parallel-size" in argv else 1
    if tp == 1:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(["generate", *argv]) or 0
            except SystemExit as e:
                code = e.code or 0
        return code, err.getvalue().strip()
    p = argparse.ArgumentParser(prog="loom generate", exit_on_error=False)
    add_arguments(p)
    try:
        check_arguments(p.parse_args(argv))
        return 0, ""
    except ConfigError as e:
        return 2, f"loom generate: error: {e}"


def groups(words: list[str]) -> list[list[str]]:
    """``--a 1 --b`` -> ``[["--a", "1"], ["--b"]]``."""
    out: list[list[str]] = []
    for w in words:
        if w.startswith("--"):
            out.append([w])
        else:
            out[-1].append(w)
    return out


def argv_of(case: dict, tmp: Path, vocab: bool = True) -> list[str]:
    """The case's command line (placeholders resolved, under ``tmp``); ``vocab``: a tokenizer
    file stands for ``--vocab-size V`` (training; ``loom generate`` reads the checkpoint's)."""
    words = case["argv"]
    given = {w for w in words if w.startswith("--")}
    out: list[str] = []
    size = None
    for flag, *values in groups(words):
        text = " ".join(values)
        if text == "{DATA}":
            if "--fim-data" in given:
                out += [flag, fim_dataset(tmp)]
            elif "--mock-data" not in given:
                out.append("--mock-data")
            continue
        m = re.fullmatch(r"\{TOKENIZER(?::(\d+))?\}", text)
        if m:
            if vocab and m.group(1) and "--vocab-size" not in given and size is None:
                size = m.group(1)
                out += ["--vocab-size", size]
            continue
        for key, sub in (("SAVE", "save"), ("LOAD", "load"), ("TB", "tb"), ("CACHE", "cache"),
                         ("OUT", "out"), ("CKPT", "ckpt"), ("FILE", "file")):
            values = [v.replace("{" + key + "}", str(tmp / sub)) for v in values]
        out += [flag, *[v.replace("{NAME}", "run") for v in values]]
    if vocab and "--mock-data" in out and "--vocab-size" not in out:
        out += ["--vocab-size", "50257"]
    if case["entry"] in ENTRY_MODEL_TYPE:
        out += ["--model-type", ENTRY_MODEL_TYPE[case["entry"]]]
    return out


def fim_dataset(tmp: Path) -> str:
    """The prefix of a small dataset under ``tmp`` (written once: 40 documents of ~1,500
    characters, a byte-level BPE of 300 ids plus Megatron's default FIM tokens), enough for
    --seq-length 1024 windows in each part of --split 949,50,1."""
    prefix = tmp / "fim" / "data"
    if not Path(f"{prefix}.idx").exists():
        from loom.data.preprocess import preprocess
        from loom.data.tokenizer import Tokenizer, train_byte_level_bpe
        prefix.parent.mkdir(parents=True, exist_ok=True)
        docs = [" ".join(f"def f{d}_{i}(x): return x * {i} + {d}" for i in range(50))
                for d in range(40)]
        tok = train_byte_level_bpe(docs, 300)
        tok.hf.add_special_tokens(["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"])
        tok = Tokenizer(tok.hf, eod=tok.eod)
        src = prefix.parent / "docs.jsonl"
        src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        preprocess([str(src)], str(prefix), tok)
    return str(prefix)


def pending_in(argv: list[str]) -> set[str]:
    """The pending capabilities a command line uses."""
    out = set()
    for flag, *values in groups(argv):
        if flag in PENDING:
            what, covered, _ = PENDING[flag]
            if covered is None or " ".join(values) in covered:
                out.add(what)
    return out


def with_pending_implemented(argv: list[str]) -> list[str]:
    """The command line as it reads once the pending capabilities merge: their flags dropped,
    or their values replaced by loom's (a stand-in: the rest of the flags are what is tested)."""
    out: list[str] = []
    for flag, *values in groups(argv):
        if flag in PENDING:
            _, covered, stand_in = PENDING[flag]
            if covered is None or " ".join(values) in covered:
                if stand_in is None:
                    continue
                values = [stand_in]
        out += [flag, *values]
    return out


def scaled(argv: list[str], tiny: dict) -> list[str]:
    """``argv`` with the values of the flags of ``tiny`` replaced (``None``: the flag dropped;
    a flag ``tiny`` names that ``argv`` lacks is not added)."""
    out: list[str] = []
    for flag, *values in groups(argv):
        if flag in tiny:
            if tiny[flag] is None:
                continue
            values = shlex.split(tiny[flag])
        out += [flag, *values]
    return out


def parse_train(argv: list[str]):
    """``loom train``'s parse of ``argv`` (argparse errors raised, not exited)."""
    import argparse

    from loom.training.cli import add_arguments
    parser = argparse.ArgumentParser(prog="loom train", exit_on_error=False)
    add_arguments(parser)
    return parser.parse_args(argv)


def train_all(jobs: dict) -> dict:
    """In each rank of a spawned world: every ``{name: argv}`` job in turn through ``loom
    train``'s checks and trainer; ``{name: losses or the error}``."""
    import time

    import torch.distributed as dist

    from loom.training.cli import prepare
    from loom.training.trainer import Trainer
    out = {}
    for name, argv in jobs.items():
        t0 = time.monotonic()
        try:
            cfg = prepare(parse_train(argv))
            out[name] = [r["loss"] for r in Trainer(cfg).train()]
            print(f"{name}: trained in {time.monotonic() - t0:.1f} s", flush=True)
        except BaseException as e:  # noqa: BLE001 - reported per job
            out[name] = f"{type(e).__name__}: {e}"
        dist.barrier()
    return out
