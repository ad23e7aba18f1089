"""``loom plan``'s own options, declared once with ``opt()`` as the config sections are (help,
bounds, choices); ``loom.planner.cli`` adds them and every config flag of ``loom train``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from loom.config.fields import opt
from loom.planner.cost import NODE_POWER_OVERHEAD, PUE, RESTART_S
from loom.planner.hardware import DEVICES
from loom.planner.moe import MOE_LOAD_IMBALANCE


@dataclass
class ClusterOptions:
    """The cluster to plan for."""

    gpu: Optional[str] = opt(None, f"accelerator: {', '.join(DEVICES)} (default A100-80GB)",
                             metavar="NAME")
    num_gpus: Optional[int] = opt(None, "GPUs in the job (default 8)")
    gpus_per_node: Optional[int] = opt(None, "GPUs per node (default: 8, DGX/HGX)")
    intra_node_bandwidth: Optional[float] = opt(
        None, "GB/s per GPU, achievable NVLink bus bandwidth (default per GPU type)")
    inter_node_bandwidth: Optional[float] = opt(None, "GB/s per GPU between nodes (default "
                                                      "per GPU type)")
    cluster: Optional[str] = opt(None, "cluster JSON (from --calibrate); --gpu/--num-gpus/... "
                                       "override it")


@dataclass
class PlannerOptions:
    """What the planner searches and prints (--zero-stage N and --use-torch-fsdp2 fix the
    ZeRO stage; the model is a preset, --from-hf or the config flags)."""

    max_zero_stage: Literal[0, 1, 2, 3] = opt(
        3, "highest ZeRO stage searched (3: loom train runs 1, --use-distributed-optimizer, "
           "and 3, --zero-stage 3 with FSDP2; 2 is a what-if)")
    attention: Optional[Literal["fused", "cudnn", "unfused"]] = opt(
        None, "fused (flash/SDPA, loom's default; Mamba: mamba_ssm's chunk scan), cudnn (fused, "
              "skipping the blocks above the causal diagonal at the fused rate: cuDNN's Hopper "
              "kernel, Transformer Engine's NVTE_FUSED_ATTN=1, SDPA's cuDNN backend) or unfused "
              "(as in the 2021-22 papers; Mamba: loom's plain-PyTorch scan)")
    layer_memory: Literal["loom", "kor"] = opt(
        "loom", "activation bytes per layer: loom (what loom's own layer saves, measured with "
                "saved_tensors_hooks) or kor (KOR table 2: what the layer needs, as Megatron-Core "
                "keeps it)")
    allow_tp_across_nodes: bool = opt(False, "let TP groups span nodes")
    allow_uneven_interleaved: bool = opt(
        False, "kept for old scripts: virtual stages with uneven first/last stages are searched "
               "by default (Megatron-Core, Llama 3)")
    straggler_jitter: float = opt(
        0.0, "relative std. dev. of one node's step time: adds SIGMA x sqrt(2 ln nodes) of "
             "waiting for the slowest node", ge=0, metavar="SIGMA")
    moe_load_imbalance: float = opt(
        MOE_LOAD_IMBALANCE, "MoE: busiest EP rank's expert tokens over the mean, >= 1; scales "
                            "the expert compute and activations", ge=1, metavar="X")
    dp_overlap: Literal["on", "off"] = opt(
        "on", "data-parallel communication: on (overlapped, each command then carries "
              "--overlap-grad-reduce and, with the distributed optimizer, --overlap-param-gather) "
              "or off (reduced after the backward and gathered after the step, exposed: Megatron's "
              "and loom train's default without those flags)")
    top: int = opt(10, "rows of the table", ge=1)
    command_for: int = opt(1, "print the torchrun command of row N of the table (1: the chosen "
                              "layout)", ge=1, metavar="N")
    from_hf: Optional[str] = opt(None, "the model of a Hugging Face config.json (gpt2, llama, "
                                       "mistral, mixtral, qwen2, qwen3 and every model_type a "
                                       "loom family converts); model flags given override it",
                                 metavar="config.json")
    json: bool = opt(False, 'print {"layouts": [...]} best first')
    plot: Optional[str] = opt(None, "MFU against memory per GPU for every feasible layout",
                              metavar="FILE.png")
    plot_breakdown: Optional[str] = opt(None, "stacked bars: iteration time by term for the "
                                              "chosen layout and runner-ups",
                                        metavar="FILE.png")
    calibrate: bool = opt(False, "measure this machine (GEMM FLOP/s, gloo all-reduce "
                                 "alpha/beta) and write a cluster file")
    calibrate_output: str = opt("cluster.json", "where --calibrate writes")
    calibrate_from: Optional[str] = opt(
        None, "your own measured runs, one JSON line each ({\"layout\": {\"tp\": 2, \"pp\": "
              "1, \"dp\": 4, \"mbs\": 2, \"recompute\": \"selective\"}, \"step_time_s\": 1.9, "
              "\"peak_memory_gb\": 61.2}): fits the memory reserve and, how many of them "
              "by leave-one-out over the runs, the GEMM efficiency and the element-wise "
              "traffic, then plans with them", metavar="RUNS.jsonl")


@dataclass
class CostOptions:
    """Time to train, energy, cost, failures (--mtbf-hours-per-node, the node MTBF in hours,
    Llama 3: ~6300, comes with the config flags: the same flag sizes `loom train --save-interval
    auto`)."""

    train_tokens: Optional[str] = opt(None, "tokens to train on (300B, 15T, 2.5e9): days, "
                                            "GPU-hours, energy, cost", metavar="N")
    gpu_hour_price: Optional[float] = opt(None, "price per GPU-hour")
    gpu_tdp_watts: Optional[float] = opt(None, "GPU board power, W (default per GPU type)")
    node_power_overhead: float = opt(NODE_POWER_OVERHEAD, "node power / GPU power")
    pue: float = opt(PUE, "data-centre PUE")
    checkpoint_write_bandwidth: Optional[float] = opt(
        None, "aggregate checkpoint write bandwidth, GB/s (default 1 per GPU)")
    restart_minutes: float = opt(RESTART_S / 60, "time to restart after a failure")


PLAN_OPTIONS = (("cluster", ClusterOptions), ("planner", PlannerOptions),
                ("time to train, energy, cost, failures", CostOptions))
