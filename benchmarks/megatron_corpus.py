"""Transcribe Megatron-LM's functional-test cases into loom test data.

Usage::

    git -C MIRROR archive HEAD | tar -x -C /tmp/mlm        # a Megatron-LM checkout (d98e8a6)
    python -m benchmarks.megatron_corpus /tmp/mlm [--out tests/unit/megatron_corpus.json]

Reads every ``tests/functional_tests/test_cases/{gpt,moe,bert,hybrid}/*/model_config.yaml`` and
turns its ``MODEL_ARGS`` into the command line Megatron's CI launches
(``tests/functional_tests/shell_test_utils/_run_training.sh``: ``true`` -> the bare flag, a value
in ``( )`` or with spaces -> one quoted word, a value in ``[ ]`` -> its words), with the CI's
directories replaced by placeholders:

- ``{DATA}``: a dataset prefix or blend (``--data-path``, ``--train-data-path``, ...);
- ``{TOKENIZER:V}`` / ``{TOKENIZER}``: a tokenizer file whose vocabulary has V entries (the one
  thing a dry run needs from it), or a second file of the same tokenizer (merges);
- ``{SAVE}``, ``{LOAD}``, ``{TB}``, ``{CACHE}``, ``{OUT}``: the directories of checkpoints written
  and read, TensorBoard, the index cache, other outputs;
- ``{CKPT}``: a pretrained checkpoint the case reads (``--load`` of an inference case,
  ``--pretrained-checkpoint``), ``{FILE}``: another input file (prompts, a config), ``{NAME}``: a
  run name.

``--releases MIRROR TAG ...`` transcribes the cases of earlier releases instead (each tag
archived from the Megatron-LM git directory ``MIRROR``), keeps the training and inference cases
whose command line (with entry script and world size) is in no earlier-listed release nor in the main corpus
(``--corpus``), names each ``TAG:case`` and writes ``tests/unit/megatron_corpus_earlier.json``:
held-out data for loom's table of flags that later releases dropped. The older CI runner
``eval``-ed the command line, so a few values there carry shell escapes (``Et*3\\|...``); they are
kept as written.

The entry script and the world size (nodes x GPUs) come from the CI recipes
(``tests/test_utils/recipes/{h100,gb200}/*.yaml``, H100 first; ``recipe`` names it), or the
case's own ``MODEL_ENV_VARS``; a case no recipe runs gets one node of 8 GPUs (more when its
model-parallel sizes need them). ``MODE`` is ``pretraining``
unless the case says ``inference`` or ``rl``. The output is one JSON object
``{"commit", "cases": [{"name", "family", "mode", "entry", "world_size", "recipe", "argv"}]}``.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import shlex
import subprocess

import yaml

FAMILIES = ("gpt", "moe", "bert", "hybrid")
DEFAULT_ENTRY = {"gpt": "pretrain_gpt.py", "moe": "pretrain_gpt.py",
                 "bert": "examples/bert/pretrain_bert.py", "hybrid": "pretrain_hybrid.py"}

# Vocabulary sizes of the tokenizer files the cases read (by file name): what a dry run needs.
VOCAB = (("bpe/vocab.json", 50257),           # GPT-2 BPE
         ("vocab.txt", 30522),                # BERT WordPiece (lower case)
         ("nemotron_2_256k.model", 256000),
         ("multiMixV8.gpt4o_nc_sd.500000.128k.vocab.json", 131072),  # TikTokenizer
         ("qwen3-8b-dist/tokenizer", 151936))


def _recipes(root: str) -> dict[str, dict]:
    """``{test case: {"entry", "world_size", "recipe"}}`` from the CI recipes (H100 first)."""
    out: dict[str, dict] = {}
    for platform in ("h100", "gb200"):
        for path in sorted(glob.glob(os.path.join(root, "tests/test_utils/recipes", platform,
                                                  "*.yaml"))):
            with open(path, encoding="utf-8") as fh:
                recipe = yaml.safe_load(fh)
            spec = recipe.get("spec", {})
            m = re.search(r"TRAINING_SCRIPT_PATH=([^\"\s]+)", str(spec.get("script", "")))
            entry = m.group(1) if m else None

            def walk(products, nodes, gpus):
                for p in products or []:
                    n, g = p.get("nodes", nodes), p.get("gpus", gpus)
                    for case in p.get("test_case", []):
                        out.setdefault(case, {"entry": entry, "world_size": int(n) * int(g),
                                              "recipe": os.path.relpath(path, root)})
                    walk(p.get("products"), n, g)
            walk(recipe.get("products"), spec.get("nodes", 1), spec.get("gpus", 8))
    return out


def _items(node) -> list:
    """``[(key node, value node)]`` of a mapping node, YAML merge keys (``<<: *BASE``) inlined
    first and overridden by the mapping's own keys (what yq's ``explode`` does)."""
    merged, own = [], []
    for k, v in node.value:
        if k.tag == "tag:yaml.org,2002:merge":
            for base in (v.value if isinstance(v, yaml.SequenceNode) else [v]):
                merged += _items(base)
        else:
            own.append((k, v))
    keys = {k.value for k, _ in own}
    return [(k, v) for k, v in merged if k.value not in keys] + own


def _raw_args(path: str, key: str = "MODEL_ARGS") -> list[tuple[str, str]]:
    """``[(flag, value text)]`` of a case's ``MODEL_ARGS`` as written (YAML scalars
    unconverted, so ``4.5e-4`` stays ``4.5e-4``)."""
    with open(path, encoding="utf-8") as fh:
        root = yaml.compose(fh.read(), Loader=yaml.SafeLoader)
    for k, v in _items(root):
        if k.value == key:
            return [(kn.value, vn.value if isinstance(vn, yaml.ScalarNode) else
                     [x.value for x in vn.value]) for kn, vn in _items(v)]
    return []


def _words(flag: str, value) -> list[str]:
    """The words ``_run_training.sh`` makes of one ``flag: value``."""
    if isinstance(value, list):  # a YAML sequence: yq prints it as a list; not in the corpus
        return [flag, *[str(v) for v in value]]
    text = str(value).strip()
    if text == "true":
        return [flag]
    if text == "":
        return []
    if re.fullmatch(r"\([^)]+\)", text):
        return [flag, text]
    if re.fullmatch(r"\[[^]]+\]", text):
        return [flag, *shlex.split(text[1:-1])]
    if any(c in text for c in " |()"):
        return [flag, text]
    return [flag, *shlex.split(text)]


def _placeholder(flag: str, word: str) -> str:
    """``word`` with the CI's directories replaced (module docstring)."""
    if flag == "--prompt-file":  # also the repository-relative files of three cases
        return "{FILE}"
    if "$" not in word:
        return word
    for name, size in VOCAB:
        if word.rstrip("/").endswith(name):
            return f"{{TOKENIZER:{size}}}"
    if flag in ("--merge-file",):
        return "{TOKENIZER}"
    if flag in ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path",
                "--per-split-data-args-path", "--data-args-path"):
        return "{DATA}"
    if flag == "--tokenizer-model":
        return "{TOKENIZER:131072}"  # (the nemotron-3 tiktoken file of the QAD case)
    exact = {"${TENSORBOARD_PATH}": "{TB}", "${DATA_CACHE_PATH}": "{CACHE}",
             "${CHECKPOINT_SAVE_PATH}": "{SAVE}", "${CHECKPOINT_LOAD_PATH}": "{LOAD}",
             "${INFERENCE_OUTPUT_PATH}": "{OUT}/inference.json", "${WANDB_SAVE_PATH}": "{OUT}",
             "${WANDB_EXPERIMENT}": "{NAME}", "${REPEAT}": "1"}
    if word in exact:
        return exact[word]
    if flag in ("--load", "--pretrained-checkpoint") or "CKPT" in word or \
            word.startswith("${CHECKPOINT_LOAD_PATH}/model"):
        return "{CKPT}"
    if "DATA_BLEND" in word:
        return "{DATA}"
    return "{FILE}"


def _default_world(argv: list[str]) -> int:
    """A case no recipe runs (65 at d98e8a6): one node of 8 GPUs, or the smallest multiple of 8
    its model-parallel sizes fill."""
    size = 1
    for flag in ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                 "--context-parallel-size"):
        if flag in argv:
            size *= int(argv[argv.index(flag) + 1])
    return math.lcm(8, size)


def transcribe(root: str) -> dict:
    recipes = _recipes(root)
    cases = []
    for family in FAMILIES:
        for path in sorted(glob.glob(os.path.join(root, "tests/functional_tests/test_cases",
                                                  family, "*", "model_config.yaml"))):
            name = os.path.basename(os.path.dirname(path))
            with open(path, encoding="utf-8") as fh:
                doc = yaml.safe_load(fh)
            mode = str(doc.get("MODE", "pretraining"))
            argv: list[str] = []
            for flag, value in _raw_args(path):
                words = _words(flag, value)
                argv += [words[0], *[_placeholder(flag, w) for w in words[1:]]]
            recipe = recipes.get(name, {})
            gpus = ((doc.get("MODEL_ENV_VARS") or {}).get("MODEL_ARGS") or {}).get(
                "GPUS_PER_NODE")  # the case's own GPU count (one node)
            world = int(gpus) if gpus else recipe.get("world_size") or _default_world(argv)
            cases.append({"name": name, "family": family, "mode": mode,
                          "entry": recipe.get("entry") or DEFAULT_ENTRY[family],
                          "world_size": world, "recipe": recipe.get("recipe"),
                          "argv": argv})
    try:
        commit = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"
    return {"repository": "NVIDIA/Megatron-LM", "commit": commit,
            "source": "tests/functional_tests/test_cases/{gpt,moe,bert,hybrid}/*/"
                      "model_config.yaml (MODEL_ARGS)", "cases": cases}


def unescaped(word: str) -> str:
    """``word`` as the older CI runner's ``eval`` passed it on: ``\\\\`` -> ``\\``, then
    ``\\c`` -> ``c``."""
    return re.sub(r"\\(.)", r"\1", word.replace("\\\\", "\\")) if "\\" in word else word


def earlier_releases(mirror: str, tags: list[str], corpus: str) -> dict:
    """The training and inference cases of Megatron-LM's releases ``tags`` (archived from ``mirror``) not
    already in ``corpus`` (a transcribed corpus) or an earlier tag of the list; ``name``
    ``TAG:case``."""
    import tempfile
    with open(corpus, encoding="utf-8") as fh:
        seen = {json.dumps([c["argv"], c["entry"], c["world_size"]])
                for c in json.load(fh)["cases"]}
    cases, commits = [], {}
    for tag in tags:
        with tempfile.TemporaryDirectory() as root:
            archive = subprocess.run(["git", "-C", mirror, "archive", tag, "tests"],
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", root], input=archive, check=True)
            commits[tag] = subprocess.run(["git", "-C", mirror, "rev-parse", f"{tag}^{{commit}}"],
                                          capture_output=True, text=True,
                                          check=True).stdout.strip()
            for c in transcribe(root)["cases"]:
                c["argv"] = [unescaped(w) for w in c["argv"]]
                key = json.dumps([c["argv"], c["entry"], c["world_size"]])
                if c["mode"] not in ("pretraining", "inference") or key in seen:
                    continue
                seen.add(key)
                cases.append({**c, "name": f"{tag}:{c['name']}"})
    return {"repository": "NVIDIA/Megatron-LM", "releases": commits,
            "source": "tests/functional_tests/test_cases/{gpt,moe,bert,hybrid}/*/"
                      "model_config.yaml (MODEL_ARGS) of each release", "cases": cases}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkout", help="a Megatron-LM source tree (git archive of the commit), "
                                     "or with --releases its git directory")
    ap.add_argument("--out", default=None)
    ap.add_argument("--releases", nargs="+", metavar="TAG",
                    help="transcribe these release tags of the git directory instead")
    ap.add_argument("--corpus", default="tests/unit/megatron_corpus.json")
    args = ap.parse_args(argv)
    if args.releases:
        corpus = earlier_releases(args.checkout, args.releases, args.corpus)
        args.out = args.out or "tests/unit/megatron_corpus_earlier.json"
    else:
        corpus = transcribe(args.checkout)
        args.out = args.out or "tests/unit/megatron_corpus.json"
    with open(args.out, "w", encoding="utf-8") as fh:  # one case per line
        fh.write("{" + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in corpus.items()
                                 if k != "cases") + ', "cases": [\n')
        fh.write(",\n".join(json.dumps(c) for c in corpus["cases"]))
        fh.write("\n]}\n")
    modes: dict[str, int] = {}
    for c in corpus["cases"]:
        modes[c["mode"]] = modes.get(c["mode"], 0) + 1
    print(f"{len(corpus['cases'])} cases {modes} -> {args.out}")


if __name__ == "__main__":
    main()
