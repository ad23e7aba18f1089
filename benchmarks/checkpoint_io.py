"""Checkpoint save / load time and size of the demo model (configs/demo.yaml: 6 x 256, TP=2 x
DP=2 on 4 CPU ranks, mock data), synchronous vs ``--async-save``.

    OMP_NUM_THREADS=1 python -m benchmarks.checkpoint_io [--vocab-size 8192]

Prints, per mode: how long the step loop was blocked by the save call (slowest rank), the time
until the checkpoint was complete (renamed, pointer moved), the checkpoint's size, and the time
to load it back at the same layout (the second of two saves: the first also creates DCP's
gloo group).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from testkit import run_distributed


def _world(root: str, vocab: int, async_save: bool) -> dict:
    import torch.distributed as dist

    from loom.config import LoomConfig, read_yaml_config
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer

    def cfg():
        flat = read_yaml_config(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                             "configs", "demo.yaml"))
        c = LoomConfig.from_flat(dict(flat, vocab_size=vocab))
        c.data.mock_data = True
        c.logging.no_progress_bar = True
        c.checkpoint.async_save, c.checkpoint.save = async_save, root
        return c.validate(4)
    tr = Trainer(cfg(), mesh=ParallelMesh.build(tp=2))
    for it in range(2):  # the second save is the steady state (the first makes DCP's group)
        tr.train_step()
        dist.barrier()
        t0 = time.perf_counter()
        final = tr.save(root)
        blocked = time.perf_counter() - t0
        steps = 0
        while tr.saver.pending is not None and not tr.saver.pending.future.done():
            tr.train_step()  # training goes on while the write finishes
            steps += 1
        tr.saver.finish()
        dist.barrier()
        done = time.perf_counter() - t0
    t1 = time.perf_counter()
    again = Trainer(cfg(), mesh=ParallelMesh.build(tp=2))
    t2 = time.perf_counter()
    again.load(root)
    dist.barrier()
    load = time.perf_counter() - t2
    size = sum(os.path.getsize(os.path.join(final, f)) for f in os.listdir(final))
    return {"blocked_s": blocked, "complete_s": done, "steps_during_write": steps,
            "load_s": load, "build_s": t2 - t1, "bytes": size}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab-size", type=int, default=8192)
    args = ap.parse_args()
    for async_save in (False, True):
        with tempfile.TemporaryDirectory() as root:
            res = run_distributed(4, _world, root, args.vocab_size, async_save,
                                  start_method="spawn")
        worst = {k: max(r[k] for r in res) for k in res[0]}
        print(f"{'async' if async_save else 'sync '}: step loop blocked "
              f"{worst['blocked_s']:.3f} s, checkpoint complete after {worst['complete_s']:.3f} s "
              f"({worst['steps_during_write']} steps trained meanwhile), "
              f"{worst['bytes'] / 2**20:.1f} MiB, load {worst['load_s']:.3f} s")


if __name__ == "__main__":
    main()
