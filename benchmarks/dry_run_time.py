"""Seconds ``loom train --dry-run`` takes on THUDM/slime's model configurations (the largest MoE
ones are dominated by the exact per-rank count on the meta device).

Usage::

    python -m benchmarks.dry_run_time [MODEL ...]      # default: the five largest MoE configs

Prints one JSON line per model: ``{"model", "seconds", "exit"}`` (one process, one run each).
Measured 2026-11-29 before/after apply_plan's one listing per pattern (e706a3f), under cProfile:
Qwen3-235B-A22B 33.3 s -> 28.5 s; without the profiler, before: Kimi K2 40 s, DeepSeek-V3 29 s,
MiniMax-M2 25 s, GLM-4.5-355B 23 s, Qwen3-235B-A22B 19 s; after: Qwen3-235B-A22B 16.3 s.
2026-11-30, after 0c60438 (meta builds skip the modules' initializers; the count's mesh is a
meta one, no ``to_empty``), one run each: Kimi K2 23.0 s, DeepSeek-V3 14.5 s, MiniMax-M2
13.2 s, GLM-4.5-355B 13.8 s, Qwen3-235B-A22B 12.0 s.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

DEFAULT = ("kimi-k2", "deepseek-v3", "minimax-m2", "glm4.5-355B-A32B", "qwen3-235B-A22B")


def main(argv: list[str] | None = None) -> None:
    names = (argv if argv is not None else sys.argv[1:]) or list(DEFAULT)
    root = Path(__file__).resolve().parents[1]
    models = json.loads((root / "tests" / "unit" / "slime_model_args.json").read_text())["models"]
    sys.path.insert(0, str(root / "tests" / "unit"))
    from test_slime_models import _argv
    from testkit.megatron_corpus import dry_run
    os.environ.pop("WORLD_SIZE", None)
    os.environ.pop("RANK", None)
    for name in names:
        t0 = time.perf_counter()
        code, _ = dry_run(_argv(models[name]), 8)
        print(json.dumps({"model": name, "seconds": round(time.perf_counter() - t0, 1),
                          "exit": code}), flush=True)


if __name__ == "__main__":
    main()
