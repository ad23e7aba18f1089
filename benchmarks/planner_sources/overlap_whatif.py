"""What-if of issue 47 item 3's overlap terms on the published sources (not the shipped model):
leave-one-source-out with :attr:`Options.overlap_interference` on for every source, and with
``--prefetch`` also :attr:`Options.zero3_prefetch` for the PyTorch FSDP sources (llm-foundry,
torchtitan: ``published._fsdp_options``). The constants are refitted as the protocol does.
docs/planner.md, "3-shot calibration", "Tried and not kept", quotes its output.

    OMP_NUM_THREADS=1 python -m benchmarks.planner_sources.overlap_whatif [--prefetch]   # ~1.5 min
    ... --three-shot [--prefetch]: the 3-shot table (three_shot --sample 0) with them, ~1 min
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import fields, replace
from unittest import mock

from benchmarks.planner_sources import megascale, published, validation
from benchmarks.planner_sources.fit import leave_one_source_out
from loom.planner.layout import Options


@contextlib.contextmanager
def option_defaults(**kw):
    """``Options()`` with ``kw`` as its defaults inside the block (restored after): every
    source builds its options from ``Options(...)`` and keeps the fields it does not state;
    the sources' module-level options (``validation.TORCH_DDP_2021``, ...) get ``kw`` too."""
    old = Options.__init__.__defaults__
    names = [f.name for f in fields(Options)]
    new = list(old)
    for k, v in kw.items():
        new[names.index(k) - (len(names) - len(old))] = v
    with contextlib.ExitStack() as stack:
        for mod in (validation, published, megascale):
            for name, val in list(vars(mod).items()):
                if isinstance(val, Options):
                    stack.enter_context(mock.patch.object(mod, name, replace(val, **kw)))
        Options.__init__.__defaults__ = tuple(new)
        try:
            yield
        finally:
            Options.__init__.__defaults__ = old


def with_terms(fn, prefetch: bool = False):
    """``fn()`` with the interference on for every source (and FSDP's prefetch for the
    llm-foundry and torchtitan rows when ``prefetch``)."""
    fsdp = published._fsdp_options
    patch = mock.patch.object(published, "_fsdp_options",
                              lambda c: Options(**{**vars(fsdp(c)), "zero3_prefetch": True})) \
        if prefetch else contextlib.nullcontext()
    with option_defaults(overlap_interference=True), patch:
        return fn()


def run(prefetch: bool = False) -> dict:
    """``leave_one_source_out()`` before and with the terms: ``{"before": .., "after": ..}``."""
    return {"before": leave_one_source_out(),
            "after": with_terms(leave_one_source_out, prefetch)}


def markdown(res: dict) -> str:
    b, a = res["before"], res["after"]
    lines = ["| source | rows | held-out median: before / with | held-out worst: before / with |",
             "|---|---|---|---|"]
    for s, r in b["sources"].items():
        h, w = r["heldout"], a["sources"][s]["heldout"]
        lines.append(f"| {s} | {h['n']} | {100 * h['median']:.1f}% / {100 * w['median']:.1f}% | "
                     f"{100 * h['worst']:.1f}% / {100 * w['worst']:.1f}% |")
    o, p = b["overall"], a["overall"]
    lines.append(f"| all held-out rows | {o['n']} | {100 * o['median']:.1f}% / "
                 f"{100 * p['median']:.1f}% | {100 * o['worst']:.1f}% / {100 * p['worst']:.1f}% |")
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--prefetch", action="store_true",
                    help="also FSDP's per-layer prefetch for llm-foundry and torchtitan")
    ap.add_argument("--three-shot", action="store_true",
                    help="the 3-shot table (three_shot --sample 0) with the terms instead")
    args = ap.parse_args()
    if args.three_shot:
        from benchmarks.planner_sources import three_shot as T
        print(T.markdown(with_terms(lambda: T.three_shot(sample=0), args.prefetch)))
    else:
        print(markdown(run(args.prefetch)))
