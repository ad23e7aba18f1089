"""README.md's commands are accepted as written (issue 45 item 5: its LLaMA recipe once warned on
every run). The ``bash`` blocks are read as a shell would join them (``\\`` continuations,
``$DATA`` / ``$MODEL`` expanded); in a scratch directory the README's own ``loom preprocess``
commands build its datasets from a generated corpus, then every ``loom train`` command that needs
no checkpoint runs with ``--dry-run --world-size N`` (N: torchrun's ranks) and must exit 0 without
a ``loom train:`` line (a warning or a refusal), and the ``loom plan`` preset commands must plan.
What needs a checkpoint, Hugging Face weights or a cluster (``--load``, ``--config run.yaml``,
``${...[@]}``) is left to the tests of those features."""

from __future__ import annotations

import json
import random
import re
import shlex
from pathlib import Path

import pytest

from loom.cli import main

README = Path(__file__).resolve().parents[2] / "README.md"
WORDS = ("the river town market winter garden letter morning station history city people "
         "road north house small green water light night story children school old new "
         "king village mountain bridge").split()
INPUTS = ("corpus.jsonl", "heldout.jsonl", "wiki.jsonl", "c4.jsonl")


def readme_commands() -> list[str]:
    """The bash blocks' commands in order, continuations joined, trailing comments dropped."""
    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S):
        cur = ""
        for line in block.split("\n"):
            s = line.rstrip()
            if not cur and (not s.strip() or s.lstrip().startswith("#")):
                continue
            if s.endswith("\\"):
                cur += s[:-1].strip() + " "
                continue
            cmds.append(re.sub(r"\s+#\s.*$", "", cur + s.strip()))
            cur = ""
    return cmds


def expand(cmds: list[str]) -> list[list[str]]:
    """Word lists with ``NAME="..."`` assignments applied to later ``$NAME``s."""
    env, out = {}, []
    for c in cmds:
        m = re.fullmatch(r'([A-Z_]+)="(.*)"', c)
        if m:
            env[m.group(1)] = " ".join(m.group(2).split())
            continue
        out.append(shlex.split(re.sub(r"\$([A-Z_]+)\b", lambda v: env.get(v.group(1), v.group(0)),
                                      c)))
    return out


def train_argv(words: list[str]):
    """``(loom train arguments, world size)`` of a ``loom train`` command (world size None: it
    is a ``--dry-run`` itself) or of ``torchrun ... -m loom train``; None for any other."""
    if words[:2] == ["loom", "train"]:
        return words[2:], None
    if words[0] == "torchrun" and "-m" in words:
        i = words.index("-m")
        if words[i + 1:i + 3] == ["loom", "train"]:
            n = int(words[words.index("--nproc-per-node") + 1])
            nodes = int(words[words.index("--nnodes") + 1]) if "--nnodes" in words else 1
            return words[i + 3:], n * nodes
    return None


def run(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out + out.err


@pytest.fixture(scope="module")
def commands() -> list[list[str]]:
    return expand(readme_commands())


@pytest.fixture()
def workdir(tmp_path, monkeypatch, commands, capsys):
    """The README's input files (generated text) and its datasets, built by its own
    ``loom preprocess`` commands (those reading a checkpoint's tokenizer left out)."""
    rng = random.Random(0)
    for name in INPUTS:
        with open(tmp_path / name, "w") as f:
            for _ in range(150):
                doc = " ".join(rng.choice(WORDS) for _ in range(rng.randint(80, 200)))
                f.write(json.dumps({"text": doc.capitalize() + "."}) + "\n")
    monkeypatch.chdir(tmp_path)
    for words in commands:
        if words[:2] == ["loom", "preprocess"] and not any("ckpt" in w for w in words):
            code, out = run(words[1:], capsys)
            assert code in (0, None), (words, out)
    return tmp_path


def test_readme_train_commands_run_without_a_warning(commands, workdir, capsys):
    checked = []
    for words in commands:
        if "--load" in words or "--config" in words or any("$" in w for w in words):
            continue
        parsed = train_argv(words)
        if parsed is None:
            continue
        args, world = parsed
        argv = ["train", *args]
        if "--dry-run" not in args:  # a torchrun command: predicted for its ranks
            argv += ["--dry-run", "--gpu", "H100-80GB", "--world-size", str(world)]
        code, out = run(argv, capsys)
        said = [ln for ln in out.splitlines() if ln.startswith("loom train:")]
        assert code == 0 and not said, (" ".join(words), said or out[-2000:])
        checked.append(" ".join(words))
    assert len(checked) >= 10, checked  # the recipes were all found
    assert any("--group-query-attention --num-query-groups" in c for c in checked)


def test_readme_plan_presets(commands, capsys):
    plans = [w for w in commands if w[:2] == ["loom", "plan"] and "--from-hf" not in w]
    assert plans
    for words in plans:
        code, out = run(words[1:], capsys)
        assert code in (0, None) and "loom plan:" in out, (" ".join(words), out[-2000:])
