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


def format_table(records: list[dict], header: str = "") -> str:
    """A ranked text table: layout, memory GB by term (W weights, G gradients, O optimizer,
    A activations, E embedding/output activations, R reserve), iteration time (s), tokens/s,
    model and hardware TFLOP/s per GPU, MFU."""
    cols = ("#  tp pp   dp cp vp mbs recompute sp z |" + "".join(f"{s:>6}" for _, s in _MEM_SHORT)
            + "  total |   iter s    tok/s  TFLOP/s   hw  MFU")
    lines = [header] if header else []
    lines += [cols, "-" * len(cols)]
    for i, r in enumerate(records, 1):
        mem = "".join(f"{r['memory_terms_gb'][k]:6.1f}" for k, _ in _MEM_SHORT)
        lines.append(
            f"{i:<2} {r['tp']:>2} {r['pp']:>2} {r['dp']:>4} {r['cp']:>2} {r['vp']:>2} "
            f"{r['micro_batch_size']:>3} {r['recompute']:<9} {'y' if r['sequence_parallel'] else 'n'}"
            f"  {r['zero']} |{mem} {r['memory_gb']:6.1f} | {r['iteration_time_s']:8.3f} "
            f"{r['tokens_per_s']:8.0f} {r['tflops_per_gpu']:8.1f} {r['hw_tflops_per_gpu']:5.0f} "
            f"{100 * r['mfu']:4.1f}%")
    if records:
        best = records[0]
        tt = best["time_terms_s"]
        lines.append("best layout, time per iteration (s): " + ", ".join(
            f"{k} {v:.3g}" for k, v in tt.items() if v > 0))
    return "\n".join(lines)


def plot(res: dict, path: str, title: str = "") -> None:
    """MFU against memory per GPU (GB) for every feasible layout, coloured by the parallelism of
    largest degree (tp/pp/dp/cp), the chosen (fastest) layout marked with a star."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    idx = res["order"]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    if len(idx):
        sizes = np.stack([res[k][idx] for k in ("tp", "pp", "cp", "dp")])
        dom = np.argmax(sizes, axis=0)  # ties -> first: tp > pp > cp > dp
        colours = {0: "tab:red", 1: "tab:blue", 2: "tab:purple", 3: "tab:green"}
        for j, name in enumerate(("TP", "PP", "CP", "DP")):
            sel = idx[dom == j]
            if len(sel):
                ax.scatter(res["mem_total"][sel] / GB, 100 * res["mfu"][sel], s=6, alpha=0.45,
                           color=colours[j], label=f"{name} largest ({len(sel)})", linewidths=0)
        b = idx[0]
        ax.scatter([res["mem_total"][b] / GB], [100 * res["mfu"][b]], marker="*", s=260,
                   color="gold", edgecolors="black", zorder=5,
                   label=(f"chosen: tp{int(res['tp'][b])} pp{int(res['pp'][b])} "
                          f"dp{int(res['dp'][b])} cp{int(res['cp'][b])}"))
        ax.legend(loc="best", fontsize=8)
    ax.set_xlabel("memory per GPU (GB)")
    ax.set_ylabel("MFU (%)")
    ax.set_title(title or "feasible layouts")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
