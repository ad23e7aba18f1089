"""Prediction for exactly one layout (``loom train ... --dry-run``).

:func:`predict_layout` reads the layout from a :class:`~loom.config.LoomConfig` (t, p, c, d from
the world size, v from ``--num-layers-per-virtual-pipeline-stage``, b, recompute, SP, EP, and the
distributed optimizer / ZeRO stage when the config carries one) and evaluates the same memory and
time models as the search; :func:`format_prediction` renders it. No torch import (a family's
layer kinds come from its torch-free config module).
"""

from __future__ import annotations

import sys

from loom.config import LoomConfig
from loom.planner.cli_args import (gradient_option, optimizer_option, unpriced_model_note,
                                   unpriced_note)
from loom.planner.hardware import GB, Cluster, lookup_gpu, make_cluster
from loom.planner.layout import (LOOM_BUCKETS, RECOMPUTE, Options, given_buckets, make_layouts,
                                 param_gather_overlapped)
from loom.planner.moe import MOE_LOAD_IMBALANCE, load_imbalance
from loom.planner.search import MEMORY_TERMS, TIME_TERMS, evaluate, with_group
from loom.planner.stages import given_split


def _zero_stage(cfg: LoomConfig) -> int:
    """``--zero-stage``; 3 with ``--use-torch-fsdp2``, at least 1 with
    ``--use-distributed-optimizer``."""
    z = 0
    for group in (cfg.parallel, cfg.training):
        z = max(z, int(getattr(group, "zero_stage", None) or 0))
        if getattr(group, "use_torch_fsdp2", False):
            z = 3
        if getattr(group, "use_distributed_optimizer", False):
            z = max(z, 1)
    return z


def _detect_cluster(world_size: int) -> Cluster:
    """The GPU torch sees, when torch is already imported and CUDA is up; else A100-80GB."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
            if lookup_gpu(name):
                return make_cluster(name, world_size, min(world_size, 8))
    except Exception:  # pragma: no cover - best effort only
        pass
    return make_cluster("A100-80GB", world_size, min(world_size, 8))


def layout_of(cfg: LoomConfig, world_size: int) -> dict:
    """The layout dict (:data:`loom.planner.layout.KEYS`) of a config at ``world_size``
    (uneven first/last stages from ``--decoder-first/last-pipeline-num-layers``; any split
    from ``--pipeline-model-parallel-layout`` where the config has it: ``split``)."""
    p = cfg.parallel
    pp = p.pipeline_model_parallel_size
    vp = 1
    if p.num_layers_per_virtual_pipeline_stage:
        vp = max(1, cfg.model.num_layers // (pp * p.num_layers_per_virtual_pipeline_stage))
    lf = ll = 0
    first = getattr(p, "decoder_first_pipeline_num_layers", None)
    last = getattr(p, "decoder_last_pipeline_num_layers", None)
    if pp > 1 and (first is not None or last is not None):
        lf, ll = given_split(cfg.model.num_layers, pp, first, last) or (0, 0)
    layout = getattr(p, "pipeline_model_parallel_layout", None)
    split = {}
    if layout and pp > 1:  # --pipeline-model-parallel-layout (once loom's config takes it)
        from loom.config.pipeline_layout import parse_layout
        lay = parse_layout(layout, pp)
        counts = lay.rank_layer_counts()
        split = dict(split=lay)
        vp, lf, ll = lay.vp, counts[0], counts[-1]
    return dict(tp=p.tensor_model_parallel_size, pp=pp, cp=p.context_parallel_size,
                lf=lf, ll=ll, **split,
                dp=cfg.data_parallel_size(world_size), vp=vp,
                mbs=cfg.training.micro_batch_size,
                recompute=cfg.training.recompute_granularity or "none",
                sp=int(bool(p.sequence_parallel)), zero=_zero_stage(cfg),
                ep=getattr(p, "expert_model_parallel_size", 1),
                etp=getattr(p, "expert_tensor_parallel_size", None) or 0,  # 0: = t
                zb={"zero-bubble": 1, "zbv": 2, "gpipe": 3}.get(
                    getattr(p, "pipeline_schedule", None), 0))


def run_options(cfg: LoomConfig) -> Options:
    """The planner :class:`Options` of the run ``cfg`` configures: fused attention, loom's
    measured layer memory, and its data-parallel overlap as loom train runs it:
    ``overlap_grad_reduce`` from ``--overlap-grad-reduce`` (loom's ``GradBuffer`` launches each
    bucket in backward only then, loom/training/setup.py ``chunk_reducer``),
    ``overlap_param_gather`` from ``--overlap-param-gather`` (the distributed optimizer's
    asynchronous all-gather waited for by forward pre-hooks, loom/training/optimizer.py);
    both default off (Megatron's defaults); its gradient buckets: ``--ddp-bucket-size`` or
    else loom's default size (:data:`loom.planner.layout.LOOM_BUCKETS`); its optimizer's
    states (``--optimizer``, ``--sgd-momentum``: :func:`loom.planner.cli_args.optimizer_option`;
    Muon's momentum and Newton-Schulz step: :mod:`loom.planner.muon`); its gradient buffer's dtype
    (:func:`loom.planner.cli_args.gradient_option`: ``--grad-reduce-in-bf16``, ...); its
    experts' load imbalance, the planner's default capped by its
    ``--moe-expert-capacity-factor`` (:func:`loom.planner.moe.load_imbalance`)."""
    # --ddp-bucket-size, or loom's default_bucket_size
    buckets = given_buckets(cfg.parallel.ddp_bucket_size) or LOOM_BUCKETS
    return Options(flash_attention=True, layer_memory="loom",
                   overlap_grad_reduce=bool(cfg.parallel.overlap_grad_reduce),
                   overlap_param_gather=bool(cfg.training.overlap_param_gather), **buckets,
                   moe_load_imbalance=load_imbalance(cfg.model, MOE_LOAD_IMBALANCE),
                   **optimizer_option(cfg.training), **gradient_option(cfg.training))


def predict_layout(cfg: LoomConfig, world_size: int, cluster=None,
                   opts: Options | None = None) -> dict:
    """Memory terms (bytes) and time terms (seconds) of exactly the layout in ``cfg``.

    ``cluster``: a :class:`Cluster`, a GPU name (``"H100-80GB"``, ``"NVIDIA A100-SXM4-80GB"``), a
    cluster JSON path, or None (the CUDA device when torch is loaded, else A100-80GB). ``opts``
    default: fused attention (loom uses ``scaled_dot_product_attention``), loom's measured layer
    memory, and the run's own data-parallel overlap (:func:`run_options`: the config's
    ``--overlap-grad-reduce`` / ``--overlap-param-gather``, off unless given, as loom train
    runs it; not the search's default, which assumes both).
    Returns ``layout``, ``memory_bytes`` (weights, gradients, optimizer, activations,
    embedding_output, reserve, total), ``time_s`` (compute, recompute, elementwise, tp_comm,
    cp_comm, ep_comm, pp_bubble, pp_comm, dp_comm, optimizer, straggler, iteration),
    ``tokens_per_s``,
    ``tflops_per_gpu`` (model FLOPs), ``hw_tflops_per_gpu`` (with recompute), ``mfu``, ``fits``,
    ``hbm_bytes``, ``cluster`` (GPU name), ``world_size``.
    """
    if cluster is None:
        cluster = _detect_cluster(world_size)
    elif isinstance(cluster, str):
        cluster = (Cluster.load(cluster) if cluster.endswith(".json")
                   else make_cluster(cluster, world_size, min(world_size, 8)))
    if cluster.num_gpus != world_size:
        from dataclasses import replace
        cluster = replace(cluster, num_gpus=world_size)
    opts = opts or run_options(cfg)
    lay = layout_of(cfg, world_size)
    B = cfg.global_batch_size(world_size)
    s = cfg.model.seq_length
    L = with_group(make_layouts(lay),  # the run's interleaved micro-batch group N
                   cfg.parallel.microbatch_group_size_per_virtual_pipeline_stage)
    res = evaluate(cfg.model, L, B, s, cluster, opts)
    one = lambda k: float(res[k][0])  # noqa: E731
    mem = {k: one(f"mem_{k}") for k in MEMORY_TERMS}
    mem["total"] = one("mem_total")
    tim = {k: one(f"time_{k}") for k in TIME_TERMS}
    tim["iteration"] = one("time_iteration")
    if "split" in lay:
        lay["split"] = lay["split"].to_string()
    lay["recompute"] = RECOMPUTE[int(res["recompute"][0])]
    lay["num_microbatches"] = int(round(one("m")))
    return {
        "layout": lay, "memory_bytes": mem, "time_s": tim,
        "tokens_per_s": one("tokens_per_s"), "tflops_per_gpu": one("tflops_per_gpu"),
        "hw_tflops_per_gpu": one("hw_tflops_per_gpu"), "mfu": one("mfu"),
        "fits": bool(res["fits"][0]), "hbm_bytes": cluster.hbm_bytes, "cluster": cluster.gpu,
        "unpriced": "; ".join(n for n in (unpriced_note(cfg.training),
                                          unpriced_model_note(cfg.model)) if n) or None,
        "world_size": world_size, "global_batch_size": B, "seq_length": s,
        "vocab_known": bool(cfg.model.vocab_size),
        "overlap": {"grad_reduce": opts.overlap_grad_reduce,
                    "param_gather": param_gather_overlapped(opts)},
    }


def _overlap_words(overlap: dict | None) -> str:
    """`` overlapped: grad-reduce, param-gather`` (those the prediction assumed) or ``''``."""
    on = [k.replace("_", "-") for k, v in (overlap or {}).items() if v]
    return f" overlapped: {', '.join(on)}" if on else ""


def format_prediction(pred: dict) -> str:
    """Multi-line text of a :func:`predict_layout` result (GB = 1e9 bytes, seconds)."""
    lay = pred["layout"]
    lines = [
        f"planner prediction on {pred['world_size']} x {pred['cluster']} "
        f"(B={pred['global_batch_size']}, s={pred['seq_length']}, m={lay['num_microbatches']}):",
        f"  layout: tp={lay['tp']} pp={lay['pp']} dp={lay['dp']} cp={lay['cp']} vp={lay['vp']} "
        f"mbs={lay['mbs']} recompute={lay['recompute']} sp={bool(lay['sp'])} zero={lay['zero']}"
        + _overlap_words(pred.get("overlap")),
        "  memory per GPU (GB): " + ", ".join(
            f"{k} {v / GB:.2f}" for k, v in pred["memory_bytes"].items() if k != "total")
        + f"; total {pred['memory_bytes']['total'] / GB:.2f} of {pred['hbm_bytes'] / GB:.0f}"
        + ("" if pred["fits"] else "  ** DOES NOT FIT **"),
        "  time per iteration (s): " + ", ".join(
            f"{k} {v:.4g}" for k, v in pred["time_s"].items() if k != "iteration" and v > 0)
        + f"; total {pred['time_s']['iteration']:.4g}",
        f"  {pred['tokens_per_s']:.4g} tokens/s, {pred['tflops_per_gpu']:.1f} model TFLOP/s/GPU, "
        f"{pred['hw_tflops_per_gpu']:.1f} hardware TFLOP/s/GPU, MFU {100 * pred['mfu']:.1f}%",
    ]
    if pred.get("unpriced"):
        lines.append(f"  {pred['unpriced']}")
    if not pred.get("vocab_known", True):
        lines.append("  (vocab size unknown: embedding and output layer not counted)")
    return "\n".join(lines)
