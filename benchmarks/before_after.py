"""loom before issue 13, loom now, and PyTorch-native on the reference work, alternated.

The "before" tree is ``git archive`` of ``--before`` (default ``3fad154``, the last commit
before issue 13's first change: unfused ``vocab_parallel_cross_entropy`` after ``F.linear``,
zeroed gradient buckets with 40 M-element default, per-tensor AdamW, Python-loop gradient norm)
extracted to a temporary directory. Per layout and repeat, three fresh worlds run in turn:
before, now, native (B A N B A N ...), each ``--warmup`` + ``--steps`` steps with a barrier
before each step; a run's time is the median over its measured steps of the slowest rank's
step, a layout's the median over repeats. The "before" world imports loom from the archive
(its own working directory and ``PYTHONPATH``), the other two from this checkout, through
``vs_torch_native.run_loom`` / ``run_native``. All three must reach the same loss (first step
rtol 1e-4). Prints one JSON line per layout, then a markdown table.

    OMP_NUM_THREADS=1 python -m benchmarks.before_after [--layouts 1 dp2 ...] [--before REV]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import vs_torch_native as b

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent

# Runs in the "before" tree: that version's Trainer API (forward_backward, optimizer_step,
# batches, global_loss) is the one run_loom uses; its config had no "None = rule" bucket size.
BEFORE_RUNNER = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
from benchmarks import vs_torch_native as b
from testkit import run_distributed

def run(layout, steps):
    import torch.distributed as dist
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    tp, pp, dp, sp, micro, _, schedule = layout
    cfg = b.reference_config(tp, pp, dp, sp, micro, schedule, steps)
    world = tp * pp * dp
    mesh = ParallelMesh.build(tp=tp, pp=pp, dp=dp) if world > 1 else ParallelMesh.single()
    tr = Trainer(cfg, mesh=mesh)
    times, losses = [], []
    for _ in range(steps):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        loss = tr.forward_backward(tr.batches(tr.train_ds, tr.consumed_samples))
        tr.optimizer_step()
        times.append(time.perf_counter() - t0)
        tr.consumed_samples += tr.global_batch
        losses.append(tr.global_loss(loss))
    return {{"times": times, "losses": losses}}

if __name__ == "__main__":
    layout = tuple(json.loads(sys.argv[1]))
    res = run_distributed(layout[0] * layout[1] * layout[2], run, layout, int(sys.argv[2]),
                          timeout=1800)
    print("RESULT " + json.dumps(res))
"""

# Runs in this checkout: loom now or native.
NOW_RUNNER = r"""
import json, sys
import torch
torch.set_num_threads(1)
from benchmarks import vs_torch_native as b
from testkit import run_distributed

if __name__ == "__main__":
    layout = tuple(json.loads(sys.argv[1]))
    fn = b.run_loom if sys.argv[3] == "loom" else b.run_native
    res = run_distributed(layout[0] * layout[1] * layout[2], fn, layout, int(sys.argv[2]),
                          timeout=1800)
    print("RESULT " + json.dumps(res))
"""


def _old_config_fix(tree: Path) -> None:
    """The before tree's ParallelConfig has no ``None`` bucket size (the rule came with issue
    13) and no ``overlap_grad_reduce``: keep that version's defaults there. The tree also gets
    this checkout's ``testkit`` (torch only, no loom) and a ``benchmarks`` package, so that the
    runner imports both from ``PYTHONPATH`` as here."""
    bench = tree / "benchmarks" / "vs_torch_native.py"
    bench.parent.mkdir(exist_ok=True)
    (bench.parent / "__init__.py").write_text("")
    shutil.copytree(ROOT / "testkit", tree / "testkit", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    src = (BENCH / "vs_torch_native.py").read_text()
    src = src.replace("    p.ddp_bucket_size = None", "    pass  # before: its own bucket size")
    src = src.replace("    p.overlap_grad_reduce = True", "    pass  # before: no such flag")
    bench.write_text(src)


def _run(script: Path, cwd: Path, pythonpath: Path, layout: tuple, steps: int, impl: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(pythonpath), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(script), json.dumps(layout), str(steps), impl],
                         cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{impl} run failed:\n{out.stderr[-3000:]}")


def measure(name: str, tree: Path, repeats: int, warmup: int, steps: int) -> dict:
    layout = b.LAYOUTS[name]
    scripts = {}
    for impl, text in (("before", BEFORE_RUNNER), ("now", NOW_RUNNER)):
        # a file (spawned ranks re-import it) beside no loom package: its directory leads
        # sys.path, so loom comes from PYTHONPATH
        scripts[impl] = tree.parent / "runners" / f"{impl}_runner.py"
        scripts[impl].parent.mkdir(exist_ok=True)
        scripts[impl].write_text(text.format())
    impls = {"before": (scripts["before"], tree, tree), "loom": (scripts["now"], ROOT, ROOT),
             "native": (scripts["now"], ROOT, ROOT)}
    runs = {k: [] for k in impls}
    first = {}
    for _ in range(repeats):
        for impl, (script, cwd, path) in impls.items():
            res = _run(script, cwd, path, layout, warmup + steps, impl)
            per_step = [max(r["times"][i] for r in res) for i in range(warmup, warmup + steps)]
            runs[impl].append(statistics.median(per_step))
            first[impl] = res[0]["losses"][0]
    med = {k: statistics.median(v) for k, v in runs.items()}
    same = all(abs(first[k] - first["native"]) < 1e-4 * abs(first["native"]) for k in first)
    return {"layout": name, "native": b.native_label(layout),
            "before_s_per_step": round(med["before"], 4), "loom_s_per_step": round(med["loom"], 4),
            "native_s_per_step": round(med["native"], 4),
            "before_over_native": round(med["before"] / med["native"], 3),
            "loom_over_native": round(med["loom"] / med["native"], 3),
            "runs": {k: [round(x, 4) for x in v] for k, v in runs.items()},
            "same_first_loss": same}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", nargs="+", default=list(b.LAYOUTS), choices=list(b.LAYOUTS))
    ap.add_argument("--before", default="3fad154", help="git revision of the 'before' loom")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "before"
        tree.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.before, "loom"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        _old_config_fix(tree)
        for name in args.layouts:
            try:
                row = measure(name, tree, args.repeats, args.warmup, args.steps)
            except RuntimeError as e:  # one layout failing must not lose the others
                print(json.dumps({"layout": name, "error": str(e)[-2000:]}), flush=True)
                continue
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n| layout | native | before s/step | now s/step | native s/step | before / native |"
          f" now / native | same loss |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['native']} | {r['before_s_per_step']:.3f} | "
              f"{r['loom_s_per_step']:.3f} | {r['native_s_per_step']:.3f} | "
              f"{r['before_over_native']:.2f} | {r['loom_over_native']:.2f} | "
              f"{'yes' if r['same_first_loss'] else 'NO'} |")


if __name__ == "__main__":
    main()
