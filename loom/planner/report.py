"""Output of ``loom plan``: the ranked table, the ``--json`` document and the ``--plot`` figure."""

from __future__ import annotations

import json

import numpy as np

from loom.planner.hardware import GB
from loom.planner.search import record

_MEM_SHORT = [("weights", "W"), ("gradients", "G"), ("optimizer", "O"), ("activations", "A"),
              ("embedding_output", "E"), ("reserve", "R")]


def top_records(res: dict, n: int | None) -> list[dict]:
    """The ``n`` best feasible layouts (all when None) as :func:`search.record` dicts."""
    order = res["order"] if n is None else res["order"][:n]
    return [record(res, int(i)) for i in order]


def to_json(records: list[dict], header: dict | None = None) -> str:
    """``{"layouts": [...], ...header}``, best first."""
    doc = dict(header or {})
    doc["layouts"] = records
    return json.dumps(doc, indent=1)


def _etp_label(prefix: str, rec: dict) -> str:
    """``prefix + u`` for a record whose expert TP u is not its t (MoE), else empty."""
    return f"{prefix}{rec['etp']}" if rec.get("etp", rec["tp"]) != rec["tp"] else ""


def format_table(records: list[dict], header: str = "") -> str:
    """A ranked text table: layout (``ep``: expert-parallel size, part of ``dp``), memory GB by term (W weights, G gradients, O optimizer,
    A activations, E embedding/output activations, R reserve), iteration time (s), tokens/s,
    model and hardware TFLOP/s per GPU, MFU."""
    cols = ("#  tp pp   dp ep cp vp mbs recompute sp z |" + "".join(f"{s:>6}" for _, s in _MEM_SHORT)
            + "  total |   iter s    tok/s  TFLOP/s   hw  MFU")
    lines = [header] if header else []
    lines += [cols, "-" * len(cols)]
    for i, r in enumerate(records, 1):
        mem = "".join(f"{r['memory_terms_gb'][k]:6.1f}" for k, _ in _MEM_SHORT)
        lines.append(
            f"{i:<2} {r['tp']:>2} {r['pp']:>2} {r['dp']:>4} {r.get('ep', 1):>2} {r['cp']:>2} "
            f"{r['vp']:>2} "
            f"{r['micro_batch_size']:>3} {_recompute_label(r):<9} "
            f"{'y' if r['sequence_parallel'] else 'n'}"
            f"  {r['zero']} |{mem} {r['memory_gb']:6.1f} | {r['iteration_time_s']:8.3f} "
            f"{r['tokens_per_s']:8.0f} {r['tflops_per_gpu']:8.1f} {r['hw_tflops_per_gpu']:5.0f} "
            f"{100 * r['mfu']:4.1f}%"
            + (f"  split {r['pipeline_split']}" if r.get("first_stage_layers") else "")
            + (f"  cp {r['cp_comm_type']}" if r['cp'] > 1 and r.get("cp_comm_type", "p2p")
               != "p2p" else "")
            + _etp_label("  etp ", r)
            + (f"  ep {r['moe_token_dispatcher_type']}" if r.get("ep", 1) > 1 else ""))
    if records:
        best = records[0]
        tt = best["time_terms_s"]
        lines.append("best layout, time per iteration (s): " + ", ".join(
            f"{k} {v:.3g}" for k, v in tt.items() if v > 0))
    return "\n".join(lines)


def _recompute_label(r: dict) -> str:
    """``none`` / ``selective`` / ``full``, or ``block N`` for full recompute of the first N
    layers of every chunk (``--recompute-method block --recompute-num-layers N``)."""
    n = r.get("recompute_num_layers") or 0
    return f"block {n}" if r["recompute"] == "full" and n else r["recompute"]


_TIME_SHORT = [("compute", "comp"), ("recompute", "recomp"), ("elementwise", "elem"),
               ("tp_comm", "TP"), ("cp_comm", "CP"), ("ep_comm", "EP"), ("pp_bubble", "bubble"),
               ("pp_comm", "PP"),
               ("dp_comm", "DP"), ("optimizer", "optim"), ("straggler", "strag")]


def format_breakdown(records: list[dict]) -> str:
    """The chosen layout and its runner-ups, one iteration broken down (seconds): compute,
    recompute, element-wise (memory-bound) work, exposed TP / CP / EP / PP / DP communication,
    pipeline bubble, optimizer step; ``vs best``: extra time per iteration; with
    ``records[i]["training"]`` also days and cost of the whole run."""
    if not records:
        return ""
    train = all("training" in r for r in records)
    head = ("#  layout                          split    "
            + "".join(f"{s:>7}" for _, s in _TIME_SHORT)
            + "   iter s  vs best" + ("     days    GPU-h     cost" if train else ""))
    lines = ["breakdown of one iteration (s), chosen layout first:", head, "-" * len(head)]
    best = records[0]["iteration_time_s"]
    for i, r in enumerate(records, 1):
        ep = (f" ep{r['ep']}" if r.get("ep", 1) > 1 else "") + _etp_label(" etp", r)
        lay = (f"tp{r['tp']} pp{r['pp']} dp{r['dp']}{ep} cp{r['cp']} vp{r['vp']} "
               f"b{r['micro_batch_size']} "
               f"{r['recompute'][:4]}{' sp' if r['sequence_parallel'] else ''} z{r['zero']}")
        split = r.get("pipeline_split", "")
        row = (f"{i:<2} {lay:<31} {split:<8} "
               + "".join(f"{r['time_terms_s'].get(k, 0.0):7.3f}" for k, _ in _TIME_SHORT)
               + f" {r['iteration_time_s']:8.3f} {100 * (r['iteration_time_s'] / best - 1):+7.1f}%")
        if train:
            tr = r["training"]
            cost = "-" if tr["cost"] is None else f"{tr['cost'] / 1e6:.2f}M"
            row += f" {tr['wall_days']:8.1f} {tr['gpu_hours']:8.3g} {cost:>8}"
        lines.append(row)
    return "\n".join(lines)


def plot_breakdown(records: list[dict], path: str, title: str = "") -> None:
    """Stacked bars, one per layout (chosen first): the time terms of one iteration (s)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(records) + 3), 5))
    x = np.arange(len(records))
    bottom = np.zeros(len(records))
    for k, short in _TIME_SHORT:
        vals = np.array([r["time_terms_s"].get(k, 0.0) for r in records])
        if vals.any():
            ax.bar(x, vals, bottom=bottom, label=short, width=0.7)
            bottom += vals
    ax.set_xticks(x, [f"#{i + 1}\ntp{r['tp']} pp{r['pp']}\ndp{r['dp']} cp{r['cp']}"
                      for i, r in enumerate(records)], fontsize=7)
    ax.set_ylabel("seconds per iteration")
    ax.set_title(title or "iteration time breakdown")
    ax.legend(fontsize=7, ncol=3)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# Median |error| of the planner on published runs it was not fitted on: leave-one-source-out,
# all 59 held-out rows (benchmarks.planner_sources.fit.leave_one_source_out; docs/planner.md). Not in-sample.
VALIDATED_ERROR = 0.10


def chosen_label(rec: dict) -> str:
    """The chosen layout's full label: t, p, d, c, (e), v, b, recompute, SP, ZeRO stage."""
    ep = (f" e{rec['ep']}" if rec.get("ep", 1) > 1 else "") + _etp_label(" u", rec)
    return (f"t{rec['tp']} p{rec['pp']} d{rec['dp']} c{rec['cp']}{ep} v{rec['vp']} "
            f"b{rec['micro_batch_size']} recompute {rec['recompute']} "
            f"SP {'on' if rec['sequence_parallel'] else 'off'} ZeRO-{rec['zero']}")


def pareto_front(mem, mfu) -> tuple[np.ndarray, np.ndarray]:
    """The layouts no other beats on both axes: ascending memory, each with a higher MFU than
    every layout that needs less memory."""
    order = np.argsort(mem, kind="stable")
    best, xs, ys = -np.inf, [], []
    for i in order:
        if mfu[i] > best:
            best = mfu[i]
            xs.append(mem[i])
            ys.append(mfu[i])
    return np.array(xs), np.array(ys)


def plot(res: dict, path: str, title: str = "", chosen: dict | None = None,
         capacity_gb: float | None = None) -> None:
    """MFU against memory per GPU (GB) for every feasible layout, coloured by the parallelism of
    largest degree (tp/pp/dp/cp), or, when some layout uses expert parallelism, by the EP size
    (one colour per e, marker by the largest of tp/pp/dp); the Pareto front (least memory for
    each MFU) with the planner's validated error band (+-6%, NAR table 1 median); the device
    capacity ``capacity_gb``; the chosen (fastest) layout as a star labelled with every choice
    (``chosen``: its record)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    idx = res["order"]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ep = res.get("ep")
    if len(idx) and ep is not None and np.any(ep[idx] > 1):
        _scatter_by_ep(ax, res, idx)
    elif len(idx):
        sizes = np.stack([res[k][idx] for k in ("tp", "pp", "cp", "dp")])
        dom = np.argmax(sizes, axis=0)  # ties -> first: tp > pp > cp > dp
        colours = {0: "tab:red", 1: "tab:blue", 2: "tab:purple", 3: "tab:green"}
        for j, name in enumerate(("TP", "PP", "CP", "DP")):
            sel = idx[dom == j]
            if len(sel):
                ax.scatter(res["mem_total"][sel] / GB, 100 * res["mfu"][sel], s=4, alpha=0.3,
                           color=colours[j], label=f"{name} largest ({len(sel)})", linewidths=0)
    if len(idx):
        px, py = pareto_front(res["mem_total"][idx] / GB, 100 * res["mfu"][idx])
        ax.step(px, py, where="post", color="black", lw=1.2, label="Pareto front")
        ax.fill_between(px, py * (1 - VALIDATED_ERROR), py * (1 + VALIDATED_ERROR), step="post",
                        color="gray", alpha=0.2, label=f"planner error band "
                        f"(+-{100 * VALIDATED_ERROR:.0f}%, held-out median)")
        b = idx[0]
        ep_b = f" ep{int(ep[b])}" if ep is not None and ep[b] > 1 else ""
        label = chosen_label(chosen) if chosen else (
            f"tp{int(res['tp'][b])} pp{int(res['pp'][b])} dp{int(res['dp'][b])}{ep_b} "
            f"cp{int(res['cp'][b])}")
        ax.scatter([res["mem_total"][b] / GB], [100 * res["mfu"][b]], marker="*", s=260,
                   color="gold", edgecolors="black", zorder=5, label=f"chosen: {label}")
    if capacity_gb:
        ax.axvline(capacity_gb, color="tab:red", ls="--", lw=1,
                   label=f"device memory {capacity_gb:.0f} GB")
    if len(idx) or capacity_gb:
        ax.legend(loc="best", fontsize=7)
    ax.set_xlabel("memory per GPU (GB)")
    ax.set_ylabel("MFU (%)")
    ax.set_title(title or "feasible layouts")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _scatter_by_ep(ax, res: dict, idx) -> None:
    """Feasible layouts coloured by EP size, marker by the largest of TP / PP / DP."""
    import matplotlib.pyplot as plt

    eps = sorted({int(e) for e in res["ep"][idx]})
    cmap = plt.get_cmap("tab10")
    dom = np.argmax(np.stack([res[k][idx] for k in ("tp", "pp", "dp")]), axis=0)
    for j, e in enumerate(eps):
        for mk, (marker, name) in enumerate((("^", "TP"), ("s", "PP"), ("o", "DP"))):
            sel = idx[(res["ep"][idx] == e) & (dom == mk)]
            if len(sel):
                ax.scatter(res["mem_total"][sel] / GB, 100 * res["mfu"][sel], s=8, alpha=0.5,
                           color=cmap(j % 10), marker=marker, linewidths=0,
                           label=f"EP={e}, {name} largest ({len(sel)})")
