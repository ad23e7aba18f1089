"""How long ``testkit.run_distributed`` takes to start a world of gloo ranks that import loom's
trainer, by start method: ``spawn`` (each rank re-imports torch and loom) against
``forkserver`` (each rank forked from one server that imported ``testkit.PRELOAD`` once; the
suite's default since the CI run of stop 49 took 17.5 minutes).

Rounds alternate the methods (A B A B); the first forkserver world also starts the server, so
it is reported apart (``forkserver_first_s``) and left out of the median. Prints JSON and
writes ``benchmarks/results/rank_startup.json``.

Usage: ``OMP_NUM_THREADS=1 python -m benchmarks.rank_startup [--world 4 --rounds 3]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from testkit import run_distributed


def _rank() -> int:
    import loom.training.trainer  # noqa: F401 - what every test rank imports
    return 1


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "rank_startup.json"))
    args = ap.parse_args(argv)
    times: dict = {"spawn": [], "forkserver": []}
    first = None
    for _ in range(args.rounds):
        for method in ("spawn", "forkserver"):
            t0 = time.perf_counter()
            run_distributed(args.world, _rank, start_method=method)
            dt = time.perf_counter() - t0
            if method == "forkserver" and first is None:
                first = dt
                t0 = time.perf_counter()  # a second world: the server is up now
                run_distributed(args.world, _rank, start_method=method)
                dt = time.perf_counter() - t0
            times[method].append(dt)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"world": args.world, "rounds": args.rounds, "seconds": times,
           "median_s": med, "forkserver_first_s": first,
           "spawn_over_forkserver": med["spawn"] / med["forkserver"]}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
