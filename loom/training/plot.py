"""``loom plot LOG.jsonl``: the training curves of a ``--log-json`` file as one PNG.

Four panels against iterations (``--x tokens`` / ``samples``: against consumed tokens or
samples): training loss with the validation loss as points, learning rate, throughput
(tokens/s, with an MFU scale on the right when the run knew its peak FLOP/s), gradient norm. A file holding
several runs (each starts with a ``run`` header; a resume appends one) is drawn as one curve
per run, in the same colour, with a dotted line where each later run starts. Drawn with
matplotlib's Agg canvas (no display, no pyplot state).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Literal, Optional

from loom.config.fields import opt
from loom.config.run_log import read_run_log
from loom.errors import ConfigError

X_KEYS = {"iteration": "iteration", "tokens": "consumed_tokens", "samples": "consumed_samples"}


@dataclass
class PlotOptions:
    """What ``loom plot`` draws and where."""

    output: Optional[str] = opt(None, "the PNG to write (default: LOG with .png for .jsonl)",
                                spellings=("-o",), metavar="OUT.png")
    x: Literal["iteration", "tokens", "samples"] = opt(
        "iteration", "horizontal axis: iteration, consumed tokens or samples")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``loom plot LOG.jsonl``: the positional and :class:`PlotOptions`."""
    from loom.config.args import add_options
    parser.add_argument("log", metavar="LOG.jsonl", help="a --log-json file of loom train")
    add_options(parser, PlotOptions, "plot")


def _title(path: str, header: dict) -> str:
    c = header.get("config") or {}
    shape = " ".join(f"{k}{c[f]}" for k, f in (("L", "num_layers"), ("h", "hidden_size"),
                                                 ("a", "num_attention_heads"),
                                                 ("s", "seq_length")) if c.get(f))
    return f"{os.path.basename(path)}: {c.get('model_type', '')} {shape}".strip(": ")


def plot(path: str, output: str, x: str = "iteration") -> str:
    """Write the PNG of ``path``'s runs to ``output`` (:func:`loom.config.run_log.read_run_log`); returns
    ``output``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    runs, key = read_run_log(path), X_KEYS[x]
    fig = Figure(figsize=(11, 7.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    (loss, lr), (speed, norm) = fig.subplots(2, 2, sharex=True)
    mfu_per_token_s = set()  # MFU / (tokens/s): one constant for a model on one machine
    for i, run in enumerate(runs):
        tr = [r for r in run["train"] if r.get(key) is not None]
        xs = [r[key] for r in tr]
        first = i == 0
        loss.plot(xs, [r["loss"] for r in tr], color="C0", lw=1.2,
                  label="training loss" if first else None)
        va = [r for r in run["valid"] if r.get(key) is not None]
        for j, name in enumerate(dict.fromkeys(r.get("valid_set") for r in va)):  # the sets of
            pts = [r for r in va if r.get("valid_set") == name]  # --multiple-validation-sets
            label = "validation loss" + ("" if name is None else f" ({name})")
            loss.plot([r[key] for r in pts], [r["valid_loss"] for r in pts], "o-",
                      color=f"C{(1, 4, 6, 7, 8, 9)[j % 6]}", ms=4, lw=1,
                      label=label if first else None)
        lr.plot(xs, [r["lr"] for r in tr], color="C2", lw=1.2)
        speed.plot(xs, [r["tokens_per_s"] for r in tr], color="C3", lw=1.2)
        mfu_per_token_s |= {round(100 * r["mfu"] / r["tokens_per_s"], 12) for r in tr
                            if r.get("mfu") is not None and r["tokens_per_s"]}
        norm.plot(xs, [r["grad_norm"] for r in tr], color="C5", lw=1.2)
        if not first and xs:  # a resumed (or appended) run starts here
            start = run["header"].get("start_iteration") if key == "iteration" else None
            for ax in (loss, lr, speed, norm):
                ax.axvline(xs[0] if start is None else start, color="0.5", ls=":", lw=1)
    for ax, title in ((loss, "loss"), (lr, "learning rate"), (speed, "throughput (tokens/s)"),
                      (norm, "gradient norm")):
        ax.set_title(title)
        ax.grid(alpha=0.3)
    loss.legend()
    if len(mfu_per_token_s) == 1:  # the same curve read as MFU: a second scale, not a line
        k = mfu_per_token_s.pop()
        speed.secondary_yaxis("right", functions=(lambda v: v * k, lambda v: v / k)) \
            .set_ylabel("MFU (%)")
    lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    for ax in (speed, norm):
        ax.set_xlabel(x if x == "iteration" else f"consumed {x}")
    resumed = f" ({len(runs)} runs; dotted: where a later run starts)" if len(runs) > 1 else ""
    fig.suptitle(_title(path, runs[0]["header"]) + resumed)
    fig.savefig(output)
    return output


def run(args: argparse.Namespace) -> int:
    from loom.config.args import options_from_args
    opts = options_from_args(args, PlotOptions)
    out = opts.output or (os.path.splitext(args.log)[0] + ".png")
    print(f"wrote {plot(args.log, out, opts.x)}")
    return 0
