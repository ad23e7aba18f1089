"""What a run says about itself, besides the per-iteration lines: what it resumed from
(:func:`resume_record`, :func:`resume_line`) and what it did (:func:`run_summary`,
:func:`summary_line`). Each is a JSON-able record (``--log-json`` kinds ``resume`` and
``summary``) and one console line; pure functions of the trainer's values, no torch.

The resume line, e.g. ``loaded iter_0000100 (saved at TP2 x DP1, resharded to TP1 x DP2), 800
samples consumed, optimizer and RNG restored``: what Megatron users read in its
``loading checkpoint ... at iteration`` lines, plus the two facts loom's any-layout loading
adds: the layout it was saved at, and whether the optimizer and generators came back (a
``--finetune`` / ``--no-load-optim`` / ``--no-load-rng`` run, or a changed layout for the RNG,
starts those fresh).
"""

from __future__ import annotations

import os
from typing import Optional

DIMS = (("tp", "TP"), ("pp", "PP"), ("cp", "CP"), ("ep", "EP"), ("dp", "DP"))


def layout_text(sizes: Optional[dict], other: Optional[dict] = None) -> str:
    """``TP2 x DP1``: TP and DP always, PP / CP / EP when this layout or ``other`` has more
    than one (so two layouts print the same dimensions); ``?`` for an unknown layout."""
    if not sizes:
        return "?"
    both = [sizes, other or {}]
    return " x ".join(f"{name}{sizes.get(key, 1)}" for key, name in DIMS
                      if key in ("tp", "dp") or any(s.get(key, 1) > 1 for s in both))


def resume_record(path: str, iteration: Optional[int], consumed_samples: Optional[int],
                  saved_layout: Optional[dict], layout: dict, optimizer: bool, rng: bool,
                  seq_length: int) -> dict:
    """The ``resume`` record: ``checkpoint`` (path), ``iteration`` and ``consumed_samples``
    the run continues from (None: ``--finetune``, which keeps its own), ``consumed_tokens``,
    ``saved_layout`` / ``layout`` (``{tp, pp, dp, ...}``), ``optimizer`` and ``rng``
    (restored or not)."""
    return {"checkpoint": path, "iteration": iteration, "consumed_samples": consumed_samples,
            "consumed_tokens": None if consumed_samples is None else consumed_samples * seq_length,
            "saved_layout": saved_layout, "layout": layout, "optimizer": optimizer, "rng": rng}


def resume_line(rec: dict) -> str:
    """``loaded iter_0000100 (saved at TP2 x DP1, resharded to TP1 x DP2), 800 samples
    consumed, optimizer and RNG restored`` from a :func:`resume_record`."""
    saved, now = rec["saved_layout"], rec["layout"]
    where = (f"saved at {layout_text(saved, now)}, resharded to {layout_text(now, saved)}"
             if saved != now else f"saved at {layout_text(now)}, the same layout")
    name = os.path.basename(os.path.normpath(rec["checkpoint"]))
    if rec["iteration"] is None:
        progress = "weights only (--finetune: iteration and samples start at 0)"
    else:
        progress = f"{rec['consumed_samples']:,} samples consumed"
    restored = [n for n, ok in (("optimizer", rec["optimizer"]), ("RNG", rec["rng"])) if ok]
    fresh = [n for n, ok in (("optimizer", rec["optimizer"]), ("RNG", rec["rng"])) if not ok]
    states = " and ".join(restored) + " restored" if restored else ""
    if fresh:
        why = " (generators are saved per rank: another layout starts them fresh)" \
            if "RNG" in fresh and saved != now else ""
        states += ("; " if states else "") + " and ".join(fresh) + " fresh" + why
    return f"loaded {name} ({where}), {progress}, {states}"


def run_summary(history: list, evaluations: list, start_iteration: int, iteration: int,
                consumed_samples: int, seq_length: int, wall_time_s: float,
                tokens_per_iter: int, flops_per_iter: float, world_size: int,
                peak_flops: Optional[float], checkpoint: Optional[str]) -> dict:
    """The ``summary`` record of a run: ``iterations`` trained (``start_iteration`` ->
    ``iteration``), ``tokens`` trained on in this run and ``consumed_tokens`` /
    ``consumed_samples`` in all, ``wall_time_s`` (the whole ``train()``: evaluations and saves
    included), ``tokens_per_s`` / ``tflops_per_rank`` / ``mfu`` over the iterations' step
    times (None without a peak), the last training ``loss``, the last ``valid_loss`` (None
    without a validation) and the last ``checkpoint`` saved (None without one)."""
    steps = sum(r["step_time_s"] for r in history)
    batch = tokens_per_iter // seq_length if seq_length else 0  # B; a ramp's records vary
    sizes = [r.get("batch_size", batch) for r in history]
    tokens, flops = tokens_per_iter * len(history), flops_per_iter * len(history)
    if batch and any(b != batch for b in sizes):  # a batch-size ramp: each iteration its B
        tokens, flops = sum(sizes) * seq_length, flops_per_iter * sum(sizes) / batch
    tflops = flops / steps / world_size / 1e12 if steps else None
    valid = [e["valid_loss"] for e in evaluations if e.get("kind") == "valid"]
    return {"start_iteration": start_iteration, "iteration": iteration,
            "iterations": len(history), "tokens": tokens,
            "consumed_samples": consumed_samples, "consumed_tokens": consumed_samples * seq_length,
            "wall_time_s": wall_time_s, "tokens_per_s": tokens / steps if steps else None,
            "tflops_per_rank": tflops,
            "mfu": tflops * 1e12 / peak_flops if tflops is not None and peak_flops else None,
            "loss": history[-1]["loss"] if history else None,
            "valid_loss": valid[-1] if valid else None, "checkpoint": checkpoint}


def _clock(seconds: float) -> str:
    s = int(round(max(seconds, 0)))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def summary_line(s: dict) -> str:
    """One line of a :func:`run_summary`, e.g. ``summary: 20 iterations (100 -> 120) in
    0:01:05, 163,840 tokens (983,040 consumed in all), 2,521 tokens/s, MFU 41.2% | loss
    3.2104, validation loss 3.3012 | checkpoint ckpt/iter_0000120``."""
    speed = "" if s["tokens_per_s"] is None else f", {s['tokens_per_s']:,.0f} tokens/s"
    mfu = "" if s["mfu"] is None else f", MFU {100 * s['mfu']:.1f}%"
    loss = "no training step" if s["loss"] is None else f"loss {s['loss']:.4f}"
    if s["valid_loss"] is not None:
        loss += f", validation loss {s['valid_loss']:.4f}"
    return (f"summary: {s['iterations']} iterations ({s['start_iteration']} -> "
            f"{s['iteration']}) in {_clock(s['wall_time_s'])}, {s['tokens']:,} tokens "
            f"({s['consumed_tokens']:,} consumed in all){speed}{mfu} | {loss} | checkpoint "
            f"{s['checkpoint'] or 'none saved'}")


def prediction_line(predicted_s: float, records: list[dict]) -> str:
    """The planner's predicted step time (seconds) against the median measured ``step_time_s``
    of ``records`` (the iterations after the first, which pays for warm-up)."""
    times = sorted(r["step_time_s"] for r in records)
    measured = times[len(times) // 2]
    return (f"step time: planner predicted {predicted_s:.4g} s, measured median "
            f"{measured:.4g} s ({100 * (predicted_s / measured - 1):+.0f}%)")
