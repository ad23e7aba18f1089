"""Launch scripts of Megatron-LM's forks and derivatives through ``loom train --dry-run``.

Usage::

    python -m benchmarks.megatron_wild MIRRORS [--recorded FILE]

``MIRRORS`` is a folder of git directories (``OWNER+NAME/repo``, as the ``fetch`` tool leaves
them: Megatron-LM forks, Megatron-DeepSpeed and its forks, Pai-Megatron-Patch, megablocks,
Megatron-LLM, training recipes). Every ``*.sh`` at each repository's HEAD that launches a
``pretrain_*.py`` of a language model (``gpt``, ``bert``, ``mamba``, ``hybrid``, ``llama``,
``qwen``, ``deepseek``, ``mcore_*``, ...) is run by ``bash`` with the stand-in launchers of
:mod:`benchmarks.megatron_examples` (they record the command line instead of starting it); a
script that submits itself with ``sbatch`` runs once as the job, one that ``pkill``-s python or
waits is cut off (15 s). Each distinct command then goes through ``loom train --dry-run`` as
:mod:`benchmarks.megatron_examples` does it (``--mock-data``, a vocabulary size for a tokenizer
file, the launcher's world size). ``--recorded FILE`` keeps (or, when it exists, reuses) the
recorded commands.

Prints one JSON line per command (``repo``, ``script``, ``world``, ``accepted``, the refusal's last
line, ``foreign``: the refused flags that no Megatron-LM release declares, i.e. the fork's own;
``unexplained``: some flag answered only "not supported by loom") and a summary: commands,
accepted, refused for foreign flags, those whose every foreign flag had a fix, refused
otherwise.

Measured 2026-11-29 over 66 repositories (~15 min to record): 288 distinct commands, 52 accepted;
185 refused for flags no Megatron-LM release has (Megatron-DeepSpeed's ``--deepspeed``,
``--zero-stage``, ``--train-tokens``, ...: 103 commands of its three repositories; fwyc0573's
simulator flags; Megatron-LLM's underscore spellings, 15 commands); of the 51 other refusals, 42
are scripts that want positional arguments the recorder does not give (a path where a number
goes), 7 are refused by Megatron too (24 layers over 16 stages, 3 over 2; an unquoted batch
schedule; no ``--seq-length``), 1 ``--yaml-cfg`` and 1 ``--exit-interval 0`` (Megatron: off;
loom refused it). With Megatron-LLM's spelling read (``loom.cli.hyphenated``) and
``--exit-interval 0`` read as off: 68 accepted, 170 refused for foreign flags, 50 otherwise; with
``loom/config/foreign_flags.py``, 108 of those 170 have every foreign flag answered with its
origin and loom's fix (the rest carry personal forks' flags: HYGON's DAS, fwyc0573's simulator).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.megatron_examples import _launching, _stand_ins, _world, loom_argv

ENTRY = re.compile(r"pretrain_(gpt|bert|mamba|hybrid|llama\w*|mistral\w*|mixtral\w*|qwen\w*|"
                   r"deepseek\w*|mcore_\w+)\.py")
SBATCH = """#!{python}
import os, subprocess, sys
# a script that submits itself (``sbatch $0`` outside a job) runs once, as the job
scripts = [a for a in sys.argv[1:] if a.endswith(".sh")]
if scripts and not os.environ.get("SLURM_JOB_ID"):
    subprocess.run(["bash", scripts[-1]], stdin=subprocess.DEVNULL,
                   env=dict(os.environ, SLURM_JOB_ID="1", SLURM_NNODES="1", SLURM_PROCID="0",
                            SLURM_JOB_NUM_NODES="1", SLURM_NODEID="0", SLURM_LOCALID="0"))
print("Submitted batch job 1")
"""
QUIET = ("pkill", "killall", "scancel", "sleep", "wget", "curl", "pip", "git")


def _run(script: Path, cwd: Path, env: dict) -> None:
    proc = subprocess.Popen(["bash", str(script.resolve()), "/tmp/x/ckpt", "/tmp/x/tb",
                             "/tmp/x/vocab.json", "/tmp/x/merges.txt", "/tmp/x/data_text_document"],
                            cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        pass
    try:  # the whole session: a script's background children too
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
    proc.wait()


def recorded(mirrors: Path) -> list[dict]:
    """The commands the launch scripts of every repository under ``mirrors`` build."""
    out: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        bin_dir = Path(tmp) / "bin"
        bin_dir.mkdir()
        _stand_ins(bin_dir, sys.executable)
        (bin_dir / "sbatch").write_text(SBATCH.format(python=sys.executable))
        for name in QUIET:
            (bin_dir / name).write_text("#!/bin/bash\nexit 0\n")
        for p in bin_dir.iterdir():
            p.chmod(0o755)
        for git_dir in sorted(mirrors.glob("*/repo")):
            repo = git_dir.parent.name
            files = subprocess.run(["git", "-C", str(git_dir), "ls-tree", "-r", "--name-only",
                                    "HEAD"], capture_output=True, text=True).stdout.split("\n")
            shell = [f for f in files if f.endswith(".sh")]
            if not shell:
                continue
            root = Path(tmp) / repo
            root.mkdir()
            archive = subprocess.run(["git", "-C", str(git_dir), "archive", "HEAD", *shell],
                                     capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(root)], input=archive, capture_output=True)
            for script in root.glob("**/*.sh"):  # placeholders such as <Specify path>
                if script.is_file():
                    script.write_text(re.sub(r"<[^<>\n]*>", "/tmp/x/p",
                                             script.read_text(errors="replace")))
            for script in _launching(root, "", ENTRY):
                log = Path(tmp) / "argv.jsonl"
                env = dict(os.environ, ARGV_OUT=str(log),
                           PATH=f"{bin_dir}:{os.environ.get('PATH', '')}")
                for cwd in (root, script.parent):
                    _run(script, cwd, env)
                    if log.exists() and any(ENTRY.search(json.loads(ln)["entry"])
                                            and json.loads(ln)["argv"]
                                            for ln in log.read_text().splitlines()):
                        break
                    log.unlink(missing_ok=True)
                if log.exists():
                    for line in log.read_text().splitlines():
                        rec = json.loads(line)
                        if ENTRY.search(rec["entry"]):
                            out.append({"repo": repo, "script": str(script.relative_to(root)),
                                        **rec})
                    log.unlink()
            print(f"{repo}: {len(out)} commands so far", file=sys.stderr, flush=True)
    return out


def megatron_lm_flags() -> set:
    """Every flag some Megatron-LM release declares (loom's two snapshots of its parsers)."""
    here = Path(__file__).resolve().parents[1] / "loom" / "config"
    return {f for name in ("megatron_flags.json", "megatron_removed_flags.json")
            for row in json.loads((here / name).read_text())["flags"] for f in row["flags"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mirrors", type=Path)
    ap.add_argument("--recorded", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.recorded is not None and args.recorded.exists():
        recs = json.loads(args.recorded.read_text())
    else:
        recs = recorded(args.mirrors)
        if args.recorded is not None:
            args.recorded.write_text(json.dumps(recs))
    os.environ.pop("WORLD_SIZE", None)
    os.environ.pop("RANK", None)
    from testkit.megatron_corpus import dry_run
    megatron = megatron_lm_flags()
    seen, rows = set(), []
    with tempfile.TemporaryDirectory() as tmp:
        for rec in recs:
            key = json.dumps([Path(rec["entry"]).name, rec["argv"]])
            if key in seen:
                continue
            seen.add(key)
            world = _world(rec["launcher"], rec["argv"])
            code, err = dry_run(loom_argv(rec, tmp), world)
            refused = set(re.findall(r"(--[\w-]+): (?:not supported by loom|did you mean|"
                                     r"[\w.-]+'s? flag;)", err))
            row = {"repo": rec["repo"], "script": rec["script"], "world": world,
                   "accepted": code == 0, "refusal": err.splitlines()[-1] if code else None,
                   "foreign": sorted(refused - megatron),
                   "unexplained": "not supported by loom" in err}
            rows.append(row)
            print(json.dumps(row))
    print(json.dumps({"commands": len(rows), "accepted": sum(r["accepted"] for r in rows),
                      "foreign_flags": sum(bool(r["foreign"]) for r in rows),
                      "foreign_each_with_a_fix": sum(bool(r["foreign"]) and not r["unexplained"]
                                                     for r in rows),
                      "refused_otherwise": sum(not r["accepted"] and not r["foreign"]
                                               for r in rows)}))


if __name__ == "__main__":
    main()
