"""How long ``loom plan``'s default search takes: GPT-3 175B on 1,024 A100 (80 GB), global batch
1,536 sequences of 2,048 tokens, every layout the default options enumerate (a speed figure, so
a benchmark, not a timed test: tests/planner/test_planner.py::test_search_175b_enumerates_the_space
checks the same search's size).

    OMP_NUM_THREADS=1 python -m benchmarks.planner_search_speed [--repeats 5]

Prints JSON: the number of layouts scored and the wall time in seconds (min, median, max of the
repeats, after one warm-up run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from loom.planner.hardware import make_cluster
from loom.planner.presets import get_preset
from loom.planner.search import search


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    model, cluster = get_preset("gpt3-175b"), make_cluster("A100-80GB", 1024)
    res = search(model, cluster, 1536, 2048)  # warm-up: imports, first allocations
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        search(model, cluster, 1536, 2048)
        times.append(time.perf_counter() - t0)
    print(json.dumps({"model": "gpt3-175b", "cluster": "1024 x A100-80GB", "layouts":
                      len(res["tp"]), "seconds": {"min": min(times),
                                                  "median": statistics.median(times),
                                                  "max": max(times)}}, indent=1))


if __name__ == "__main__":
    main()
