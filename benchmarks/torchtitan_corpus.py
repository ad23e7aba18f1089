"""Every distinct torchtitan train config in the history of a torchtitan mirror, for
tests/unit/test_torchtitan_config.py: the ``train_configs/*.toml`` files of every commit that
changed one (torchtitan moved to Python config registries at 9810191bb, 2026-02-23), parsed
with ``tomllib``, one entry per distinct content: ``{"path", "commit", "config"}``.

    python -m benchmarks.torchtitan_corpus /work/.mirror/pytorch+torchtitan/repo \\
        > tests/unit/torchtitan_configs.json
    python -m benchmarks.torchtitan_corpus /work/.mirror/pytorch+torchtitan/repo \\
        --jobconfig-keys v0.2.2 > tests/unit/torchtitan_jobconfig_keys.json
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib


def git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True,
                          text=True).stdout


def corpus(repo: str) -> list[dict]:
    """The distinct train configs of ``repo``'s history (module docstring), oldest first."""
    seen: dict[str, dict] = {}
    contents: set = set()
    commits = git(repo, "rev-list", "--reverse", "HEAD", "--", "train_configs/*.toml",
                  "*/train_configs/*.toml").split()
    for c in commits:
        for line in git(repo, "ls-tree", "-r", c).splitlines():
            meta, path = line.split("\t", 1)
            blob = meta.split()[2]
            if "train_configs/" not in path or not path.endswith(".toml") or blob in seen:
                continue
            cfg = tomllib.loads(git(repo, "cat-file", "-p", blob))
            key = json.dumps(cfg, sort_keys=True)
            seen[blob] = {} if key in contents else dict(path=path, commit=c[:10], config=cfg)
            contents.add(key)
    return [e for e in seen.values() if e]


def jobconfig_keys(repo: str, ref: str = "v0.2.2") -> list[str]:
    """Every ``section.key`` of torchtitan's ``JobConfig`` at ``ref``
    (``torchtitan/config/job_config.py``, read statically with ``ast``: nested dataclasses
    expanded, ``training.dataloader.num_workers``)."""
    tree = ast.parse(git(repo, "show", f"{ref}:torchtitan/config/job_config.py"))
    classes = {n.name: [(s.target.id, ast.unparse(s.annotation)) for s in n.body
                        if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
               for n in tree.body if isinstance(n, ast.ClassDef)}

    def expand(cls: str, prefix: str) -> list[str]:
        out = []
        for name, ann in classes[cls]:
            out += expand(ann, f"{prefix}{name}.") if ann in classes else [prefix + name]
        return out
    return expand("JobConfig", "")


def main(argv=None) -> int:
    """``MIRROR``: the configs as JSON; ``MIRROR --jobconfig-keys [REF]``: the keys."""
    argv = sys.argv[1:] if argv is None else argv
    if "--jobconfig-keys" in argv:
        rest = argv[argv.index("--jobconfig-keys") + 1:]
        print(json.dumps(jobconfig_keys(argv[0], *rest[:1]), indent=0))
        return 0
    print(json.dumps(corpus(argv[0]), sort_keys=True, separators=(",", ":")).replace("},{", "},\n{"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
