"""Megatron-LM's example launch scripts of any release through ``loom train --dry-run``.

Usage::

    python -m benchmarks.megatron_examples MIRROR [TAG ...]    # default: 15 releases, v1.0 .. HEAD

``MIRROR`` is a Megatron-LM git directory with its release tags. For each tag, every
``examples/**/*.sh`` that launches ``pretrain_{gpt,bert,mamba,hybrid}.py`` is run by ``bash`` with
stand-in launchers first on ``PATH`` (``torchrun``, ``python``, ``python3``, ``srun``, ...): they
record the command line the script builds, with its shell variables expanded as the script
expands them, instead of starting anything. Placeholders such as ``<Specify path>`` become a path;
the scripts' positional arguments are paths. Each recorded command then goes through
``loom train --dry-run --world-size W`` in this process: ``--data-path`` becomes
``--mock-data``, a tokenizer file ``--vocab-size`` (30522 for BERT, else 50257), the entry script
``--model-type``; W is the launcher's ``--nproc_per_node x --nnodes``, raised to the model-parallel
size (and EP) when the script's layout needs more ranks than its launcher line gives.

Prints one JSON line per distinct command (``tag``, ``script``, ``world``, ``accepted``, the
refusal) and a summary. Slurm's ``srun ... sh -c CMD`` and ``sbatch SCRIPT`` run what the job
would (sc21's paper scripts: ``run_table_1.sh`` -> ``SBATCH.sh`` -> ``SRUN.sh``). Measured
2026-11-29 (~4 min): 60 distinct commands, 54 accepted; the 6 refused are scripts Megatron
refuses as well: v2.5's BERT script without ``--seq-length``, BERT 340M at PP 16 with 24
layers (the same script in four releases) and the core_v0.18 175B script, whose unquoted array
word-splits its ``--step-batch-size-schedule``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
import subprocess
import tempfile
from pathlib import Path

TAGS = ("v1.0", "v2.0", "v2.5", "v2.6", "23.04", "23.06", "core_v0.4.0", "core_v0.6.0",
        "core_v0.8.0", "core_v0.10.0", "core_v0.12.0", "core_v0.14.0", "core_v0.16.0",
        "core_v0.18.0", "HEAD")
ENTRY = re.compile(r"pretrain_(gpt|bert|mamba|hybrid)\.py")
RECORDER = """#!{python}
import json, os, sys
args = sys.argv[1:]
if args[:2] and args[0] == "-m" and args[1].startswith("torch.distributed"):
    args = args[2:]
i = next((k for k, a in enumerate(args) if a.endswith(".py")), None)
if i is not None:
    with open(os.environ["ARGV_OUT"], "a") as f:
        f.write(json.dumps({{"entry": args[i], "launcher": args[:i], "argv": args[i + 1:]}}) + "\\n")
"""


SLURM = """#!{python}
import os, subprocess, sys
args = sys.argv[1:]
# srun ... sh -c "CMD": run CMD; sbatch [options] SCRIPT: run SCRIPT (the exported variables
# are already in the environment); anything else: nothing
if "-c" in args and args.index("-c") > 0 and args[args.index("-c") - 1] in ("sh", "bash"):
    subprocess.run(["bash", "-c", args[args.index("-c") + 1]], stdin=subprocess.DEVNULL)
elif os.path.basename(sys.argv[0]) == "sbatch" and args and args[-1].endswith(".sh"):
    subprocess.run(["bash", args[-1]], stdin=subprocess.DEVNULL)
"""


def _stand_ins(bin_dir: Path, python: str) -> None:
    for name in ("torchrun", "python", "python3", "deepspeed"):
        (bin_dir / name).write_text(RECORDER.format(python=python))
    for name in ("srun", "sbatch"):  # Slurm: what the job would run (sc21's scripts)
        (bin_dir / name).write_text(SLURM.format(python=python))
    for name in ("nvidia-smi", "nsys"):
        (bin_dir / name).write_text("#!/bin/bash\nexit 0\n")
    for p in bin_dir.iterdir():
        p.chmod(p.stat().st_mode | stat.S_IEXEC)


def _launching(root: Path, under: str = "examples/", entry: re.Pattern = ENTRY) -> list[Path]:
    """The scripts under ``root/under`` that launch an ``entry`` themselves or through sibling
    scripts they name (sc21's ``run_table_1.sh`` -> ``SBATCH.sh`` -> ``SRUN.sh``)."""
    scripts = sorted(p for p in root.glob(f"{under}**/*.sh") if p.is_file())
    text = {p: p.read_text(errors="replace") for p in scripts}
    found = {p for p in scripts if entry.search(text[p])}
    grew = True
    while grew:
        more = {p for p in scripts if p not in found and any(
            q.parent == p.parent and re.search(rf"\b{re.escape(q.name)}\b", text[p])
            for q in found)}
        found |= more
        grew = bool(more)
    return [p for p in scripts if p in found]


def recorded(mirror: str, tags, python: str) -> list[dict]:
    """The commands the example scripts of ``tags`` launch (``tag``, ``script`` added)."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        bin_dir = Path(tmp) / "bin"
        bin_dir.mkdir()
        _stand_ins(bin_dir, python)
        for tag in tags:
            root = Path(tmp) / tag
            root.mkdir()
            archive = subprocess.run(["git", "-C", mirror, "archive", tag, "examples"],
                                     capture_output=True, check=True).stdout
            subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
            for script in root.glob("examples/**/*.sh"):  # placeholders, in every script
                text = script.read_text(errors="replace")  # (a sourced one's too)
                script.write_text(re.sub(r"<[^<>\n]*>", "/tmp/x/p", text))
            for script in _launching(root):
                log = Path(tmp) / "argv.jsonl"
                env = dict(os.environ, ARGV_OUT=str(log),
                           PATH=f"{bin_dir}:{os.environ.get('PATH', '')}")
                for cwd in (root, script.parent):  # from the repository, else beside it
                    try:  # (sc21's scripts source their siblings from `pwd`); a script that
                        # waits (a loop, a prompt) records nothing
                        subprocess.run(["bash", str(script.resolve()), "/tmp/x/ckpt",
                                        "/tmp/x/tb", "/tmp/x/vocab.json", "/tmp/x/merges.txt",
                                        "/tmp/x/data_text_document"], cwd=cwd, env=env,
                                       capture_output=True, stdin=subprocess.DEVNULL,
                                       timeout=20)
                    except subprocess.TimeoutExpired:
                        pass
                    if log.exists() and ENTRY.search(log.read_text()) and \
                            any(json.loads(ln)["argv"] for ln in log.read_text().splitlines()):
                        break
                    log.unlink(missing_ok=True)
                if log.exists():
                    for line in log.read_text().splitlines():
                        out.append({"tag": tag, "script": str(script.relative_to(root)),
                                    **json.loads(line)})
                    log.unlink()
    return out


def _world(launcher: list[str], argv: list[str]) -> int:
    argv = [w.replace("_", "-") if w.startswith("--") else w for w in argv]  # Megatron-LLM's

    def flag(names, words, default=1):
        for k, w in enumerate(words):
            for n in names:
                if w == n and k + 1 < len(words) and words[k + 1].isdigit():
                    return int(words[k + 1])
                if w.startswith(n + "=") and w.split("=", 1)[1].isdigit():
                    return int(w.split("=", 1)[1])
        return default
    world = flag(("--nproc_per_node", "--nproc-per-node"), launcher) * flag(("--nnodes",),
                                                                            launcher)
    pp = flag(("--pipeline-model-parallel-size",), argv)
    mp = flag(("--tensor-model-parallel-size",), argv) * pp * flag(("--context-parallel-size",),
                                                                   argv)
    world = world if world % mp == 0 else mp
    ep = flag(("--expert-model-parallel-size",), argv)
    return world if (world // pp) % ep == 0 else ep * pp


def loom_argv(rec: dict, tmp: str) -> list[str]:
    """The recorded command as ``loom train`` takes it here (module docstring)."""
    from testkit.megatron_corpus import groups
    bert = "bert" in rec["entry"]
    out: list[str] = []
    words = [w for w in rec["argv"] if w]
    while words and not words[0].startswith("-"):  # the script's own "$@" before the flags
        words = words[1:]
    for flag, *vals in groups(words):
        name = flag.replace("_", "-")  # Megatron-LLM's spelling: the same stand-ins
        if name in ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"):
            out += [] if "--mock-data" in out else ["--mock-data"]
        elif name in ("--vocab-file", "--merge-file", "--tokenizer-model"):
            continue
        elif name in ("--save", "--load", "--tensorboard-dir", "--data-cache-path") and vals:
            out += [flag, os.path.join(tmp, vals[0].strip("/").replace("/", "_"))]
        else:
            out += [flag, *vals]
    if "--mock-data" in out and "--vocab-size" not in out:
        out += ["--vocab-size", "30522" if bert else "50257"]
    if bert:
        out += ["--model-type", "bert"]
    if "mamba" in rec["entry"] or "hybrid" in rec["entry"]:
        out += ["--model-type", "mamba"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mirror")
    ap.add_argument("tags", nargs="*", default=list(TAGS))
    args = ap.parse_args(argv)
    import sys
    os.environ.pop("WORLD_SIZE", None)
    os.environ.pop("RANK", None)
    from testkit.megatron_corpus import dry_run
    seen, rows = set(), []
    with tempfile.TemporaryDirectory() as tmp:
        for rec in recorded(args.mirror, args.tags, sys.executable):
            key = json.dumps([rec["entry"], rec["argv"]])
            if key in seen:
                continue
            seen.add(key)
            world = _world(rec["launcher"], rec["argv"])
            code, err = dry_run(loom_argv(rec, tmp), world)
            row = {"tag": rec["tag"], "script": rec["script"], "world": world,
                   "accepted": code == 0, "refusal": err.splitlines()[-1] if code else None}
            rows.append(row)
            print(json.dumps(row))
    print(json.dumps({"commands": len(rows), "accepted": sum(r["accepted"] for r in rows)}))


if __name__ == "__main__":
    main()
