"""Timelines of the kill and hang drills (issue 9): the commands of
``tests/drills/test_fault_tolerance.py`` under torchrun (2 ranks, TP=2, a tiny mock-data model), with
the timestamped log lines that show failure -> detection -> restart -> first new iteration.

    OMP_NUM_THREADS=1 python -m benchmarks.fault_drills
"""
import re
import tempfile
import time

from testkit import torchrun_train
MODEL = ["--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32",
         "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--lr", "1e-3", "--lr-warmup-iters", "2",
         "--log-interval", "1", "--no-progress-bar", "--tensor-model-parallel-size", "2",
         # loom's defaults before issue 21 (now Megatron's), kept so the timelines compare
         "--adam-beta2", "0.95", "--lr-decay-style", "cosine", "--eval-iters", "10"]


def main() -> None:
    tmp = tempfile.mkdtemp()
    t0 = time.time()
    r = torchrun_train(MODEL + ["--train-iters", "10", "--save", f"{tmp}/ck", "--load", f"{tmp}/ck",
                                "--save-interval", "2", "--inject-fault", "1:6:kill"], restarts=1)
    t1 = time.time()
    text = r.stdout + r.stderr
    print("kill drill exit", r.returncode, "wall", round(t1 - t0, 1))
    for l in text.splitlines():
        if re.search(r"iteration +[0-9]+ \|| fires|loom: \{|exitcode|Restarting|restart|resum", l):
            print(l[:160])
    t0 = time.time()
    r = torchrun_train(MODEL + ["--train-iters", "8", "--inject-fault", "1:4:hang", "--hang-timeout-s", "20"])
    print("hang drill exit", r.returncode, "wall", round(time.time() - t0, 1))
    for l in (r.stdout + r.stderr).splitlines():
        if re.search(r"iteration +[0-9]+ \|| fires|hang detected|exitcode", l):
            print(l[:200])


if __name__ == "__main__":
    main()
