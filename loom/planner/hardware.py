"""Accelerators and clusters: peak FLOP/s, HBM, link bandwidths and latencies.

Units everywhere: FLOP/s, bytes, bytes/s, seconds. Peak numbers are the vendors' dense
(no 2:4 sparsity) bf16 tensor-core figures from the data sheets (V100 has no bf16: its fp16 figure
is used). Link bandwidths are *achievable* bus bandwidths (what ``nccl-tests`` reports as
``busbw`` on that system), the ``W`` of the alpha-beta ring formulas in
``/work/shared/docs/references.md``:

* ``intra_bw``: per-GPU NVLink/NVSwitch bus bandwidth inside a node (A100: NVLink3 300 GB/s per
  direction, ~240 GB/s achieved; H100/H200: NVLink4 450 GB/s, ~360 GB/s; B200: NVLink5 900 GB/s,
  ~720 GB/s; V100 DGX-2: 150 GB/s, ~120 GB/s; PCIe cards: ~22 GB/s). The export parts keep
  their chip and cut NVLink to 400 GB/s both directions, 200 per direction (H800, A800: NVIDIA's
  data sheets), ~160 GB/s achieved at the same 80% (DeepSeek-V3 technical report, arXiv
  2412.19437 sec. 3.2.2: "NVLink offers a bandwidth of 160 GB/s" on its H800 cluster); H20
  keeps NVLink4 at 900 GB/s with a cut compute die (148 TFLOP/s dense bf16, 96 GB HBM3,
  4.0 TB/s).
* ``inter_bw``: per-GPU network bandwidth between nodes (DGX A100: one 200 Gb/s HDR NIC per GPU,
  25 GB/s, ~23 GB/s achieved; DGX H100/H200/B200: 400 Gb/s NDR per GPU, ~45 GB/s;
  DGX-2: 100 Gb/s per GPU, ~11.5 GB/s).
* ``intra_alpha`` / ``inter_alpha``: per-step latency of a ring collective (seconds).

The achievable GEMM efficiency (fraction of peak) is a cluster property too; see
:mod:`loom.planner.timing` for the model and its fitted constants.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Optional

from loom.config import ConfigError

GB = 1e9  # bytes; memory is reported in GB = 1e9 bytes (ZeRO table 1 uses this unit)


@dataclass(frozen=True)
class GPU:
    """One accelerator model. ``peak_flops``: dense bf16 FLOP/s; ``hbm_bytes``: memory in bytes
    (nominal GB x 1e9, a conservative capacity: the gap to GiB covers the CUDA context);
    ``hbm_bw``: memory bandwidth, bytes/s; ``intra_bw``/``inter_bw``: bytes/s per GPU;
    ``gpus_per_node``: of the reference system (DGX/HGX); ``tdp_w``: board power, watts (data
    sheets: A100 / A800 SXM 400, H100 / H800 / H200 SXM 700, H20 400, B200 1000, GH200 module
    1000, V100 SXM2 300, MI300X 750)."""

    name: str
    peak_flops: float
    hbm_bytes: float
    hbm_bw: float
    intra_bw: float
    inter_bw: float
    gpus_per_node: int = 8
    intra_alpha: float = 5e-6
    inter_alpha: float = 10e-6
    tdp_w: float = 700.0
    gemm_efficiency: float = 0.0  # 0 = timing.GEMM_EFFICIENCY (fitted on A100)


T = 1e12
# Relative standard deviation of one GPU's sustained speed against the others of the same SKU:
# chips differ in how fast they run under the same power cap (manufacturing variability + power
# management). Sinha et al., "Not All GPUs Are Created Equal: Characterizing Variability in
# Large-Scale, Accelerator-Rich Systems", SC22 (arXiv 2208.11035): 8% average performance
# variation (max 22%) between GPUs of one SKU across clusters of hundreds to tens of thousands
# of GPUs, outliers up to 1.5x slower. Read as the spread of ~1000 normal draws, about
# ``2 sigma sqrt(2 ln 1000) = 7.4 sigma``: sigma = 8% / 7.4 ~ 1%. The outliers are not in it
# (a job scheduler drains 1.5x-slow nodes; MegaScale sec 5.1 excluded its ~0.5% slow
# machines). Used by timing.straggler_factor through ``Cluster.speed_sigma``, which is 0 by
# default: turned on for every GPU, the term (2-4% of the GPU-bound time, growing with N) moved
# the refit (e 0.815 -> 0.874, h0 103 -> 143, Hopper 0.735 -> 0.836) and made held-out
# predictions worse where it should help (LF-H100 9.4% -> 10.4%, LF-A100 2.9% -> 5.5%, the 3-shot
# medians of NAR t1, NAR t2, KOR, MC-H100 up 0.2-1.1 points) for 1.5 points on MegaScale
# (docs/planner.md, "Scale"). A cluster file with ``"speed_sigma": 0.01`` turns it on.
GPU_SPEED_SIGMA = 0.01
# Large-GEMM efficiency of Hopper (H100/H200/GH200). Fitted jointly with the A100 compute
# constants (primitives.GEMM_EFFICIENCY, benchmarks.planner_sources.fit.fit_compute); the rows that determine
# it are the nine of Megatron-Core r0.8.0's H100 weak-scaling table, 1.7B-462B on 48-6144 GPUs
# (benchmarks.planner_sources.validation.MCORE_H100). The strong-scaling rows (MCORE_H100_STRONG) are not fitted.
HOPPER_GEMM_EFFICIENCY = 0.746
DEVICES: dict[str, GPU] = {g.name: g for g in [
    GPU("A100-80GB", 312 * T, 80 * GB, 2.039e12, 240e9, 23e9, tdp_w=400),
    GPU("A100-40GB", 312 * T, 40 * GB, 1.555e12, 240e9, 23e9, tdp_w=400),
    GPU("A800-80GB", 312 * T, 80 * GB, 2.039e12, 160e9, 23e9, tdp_w=400),
    GPU("H100-80GB", 989 * T, 80 * GB, 3.35e12, 360e9, 45e9, tdp_w=700,
        gemm_efficiency=HOPPER_GEMM_EFFICIENCY),
    GPU("H800", 989 * T, 80 * GB, 3.35e12, 160e9, 45e9, tdp_w=700,
        gemm_efficiency=HOPPER_GEMM_EFFICIENCY),
    GPU("H20", 148 * T, 96 * GB, 4.0e12, 360e9, 45e9, tdp_w=400,
        gemm_efficiency=HOPPER_GEMM_EFFICIENCY),
    GPU("H100-PCIe", 756 * T, 80 * GB, 2.0e12, 22e9, 23e9, intra_alpha=10e-6, tdp_w=350,
        gemm_efficiency=HOPPER_GEMM_EFFICIENCY),
    GPU("H100-NVL", 835 * T, 94 * GB, 3.9e12, 360e9, 45e9, tdp_w=400,
        gemm_efficiency=HOPPER_GEMM_EFFICIENCY),
    GPU("H200", 989 * T, 141 * GB, 4.8e12, 360e9, 45e9, tdp_w=700,
        gemm_efficiency=HOPPER_GEMM_EFFICIENCY),
    GPU("GH200", 989 * T, 96 * GB, 4.0e12, 360e9, 45e9, tdp_w=1000,
        gemm_efficiency=HOPPER_GEMM_EFFICIENCY),
    GPU("B200", 2250 * T, 180 * GB, 8.0e12, 720e9, 45e9, tdp_w=1000),
    GPU("V100-32GB", 125 * T, 32 * GB, 0.9e12, 120e9, 11.5e9, inter_alpha=15e-6, tdp_w=300),
    GPU("V100-16GB", 125 * T, 16 * GB, 0.9e12, 120e9, 11.5e9, inter_alpha=15e-6, tdp_w=300),
    GPU("L40S", 362 * T, 48 * GB, 0.864e12, 22e9, 23e9, intra_alpha=10e-6, tdp_w=350),
    GPU("MI300X", 1307 * T, 192 * GB, 5.3e12, 300e9, 45e9, tdp_w=750),
]}

# torch.cuda.get_device_name() patterns -> table entry (first match wins; order matters).
_NAME_PATTERNS = [
    (r"GH200", "GH200"),
    (r"H200", "H200"),
    (r"H100.*NVL", "H100-NVL"),
    (r"H100.*PCIe", "H100-PCIe"),
    (r"H800", "H800"),
    (r"H100", "H100-80GB"),
    (r"H20\b", "H20"),
    (r"B200|B100", "B200"),
    (r"A100.*40GB|A100-PCIE-40GB|A100-SXM4-40GB", "A100-40GB"),
    (r"A800", "A800-80GB"),
    (r"A100", "A100-80GB"),
    (r"V100.*16GB", "V100-16GB"),
    (r"V100", "V100-32GB"),
    (r"L40S", "L40S"),
    (r"MI300X", "MI300X"),
]


# Streaming multiprocessors per GPU (NVIDIA data sheets / whitepapers: A100 108, H100 SXM and
# the Hopper parts on its die 132 (H800 too), H20 78, H100 PCIe 114, A800 108 (A100's die), B200 148
# over its two dies, V100 80, L40S 142;
# MI300X: 304 compute units, which RCCL uses the same way). Name prefix -> count, first match.
SM_COUNTS = (("A100", 108), ("A800", 108), ("H100-PCIe", 114), ("H100", 132), ("H800", 132),
             ("H200", 132), ("H20", 78), ("GH200", 132),
             ("B200", 148), ("V100", 80), ("L40S", 142), ("MI300X", 304))


def sm_count(name: str) -> Optional[int]:
    """Streaming multiprocessors of the GPU named ``name`` (a planner name, :data:`SM_COUNTS`
    by prefix, case-insensitive), or None when unknown."""
    return next((sms for prefix, sms in SM_COUNTS if name.upper().startswith(prefix.upper())),
                None)


def lookup_gpu(name: str) -> Optional[GPU]:
    """The table entry for a planner name (``A100-80GB``, case-insensitive) or a torch device
    name (``NVIDIA A100-SXM4-80GB``, ``NVIDIA H100 80GB HBM3``); None when unknown."""
    if not name:
        return None
    for key, gpu in DEVICES.items():
        if key.lower() == name.strip().lower():
            return gpu
    for pattern, key in _NAME_PATTERNS:
        if re.search(pattern, name, re.IGNORECASE):
            return DEVICES[key]
    return None


def peak_flops_per_s(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a torch device name (e.g. ``"NVIDIA A100-SXM4-80GB"`` ->
    3.12e14, ``"NVIDIA H100 80GB HBM3"`` -> 9.89e14); None for a CPU or an unknown device.
    Source: NVIDIA/AMD data sheets (dense, without sparsity). Used by the trainer for MFU."""
    if not device_name or device_name.lower().startswith("cpu"):
        return None
    gpu = lookup_gpu(device_name)
    return gpu.peak_flops if gpu else None


@dataclass
class Cluster:
    """A homogeneous cluster: ``num_gpus`` GPUs in nodes of ``gpus_per_node``.

    Units: ``peak_flops`` FLOP/s per GPU, ``hbm_bytes`` bytes, ``hbm_bw`` / ``intra_bw`` /
    ``inter_bw`` bytes/s per GPU, alphas seconds. ``speed_sigma``: relative standard deviation of
    one GPU's sustained speed (0 = no straggler wait; :data:`GPU_SPEED_SIGMA` the measured one).
    ``gemm_efficiency`` and
    ``gemm_half_dim`` are the
    two constants of the achievable-FLOP/s model (see :func:`loom.planner.timing.gemm_efficiency`);
    ``mem_traffic`` the HBM-traffic multiplier of the element-wise model (bytes moved per byte of
    stored activation). Defaults are the values fitted to the published A100 runs.
    ``dp_net_efficiency``: the fraction of ``inter_bw`` that the data-parallel collectives get
    across nodes (:func:`loom.planner.timing.time_terms`: the inter-node bandwidth term of the
    gradient all-reduce / reduce-scatter, the weight all-gather and ZeRO-3's ring; TP, CP, EP,
    PP and every latency keep ``inter_bw`` and the alphas). 1.0 = ``inter_bw`` itself (the
    shipped, nccl-tests-style achieved figure); at most 1, a collective cannot beat the link.
    Not fitted to any published table: ``loom plan --calibrate-from`` fits it to a user's own
    runs when leave-one-out says it helps (:mod:`loom.planner.calibrate_runs`).
    """

    gpu: str = "A100-80GB"
    num_gpus: int = 8
    gpus_per_node: int = 8
    peak_flops: float = 312 * T
    hbm_bytes: float = 80 * GB
    hbm_bw: float = 2.039e12
    intra_bw: float = 240e9
    inter_bw: float = 23e9
    intra_alpha: float = 5e-6
    inter_alpha: float = 10e-6
    gemm_efficiency: float = 0.0  # 0 = the fitted default of timing.py
    gemm_half_dim: float = 0.0  # 0 = the fitted default of timing.py
    mem_traffic: float = 0.0  # 0 = the fitted default of timing.py
    tdp_w: float = 400.0  # watts per GPU (energy estimate)
    speed_sigma: float = 0.0  # per-GPU speed std. dev. (straggler term; GPU_SPEED_SIGMA); 0 = off
    dp_net_efficiency: float = 1.0  # DP collectives' share of inter_bw (see above)
    notes: dict = field(default_factory=dict)

    @property
    def num_nodes(self) -> int:
        return max(1, -(-self.num_gpus // self.gpus_per_node))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "Cluster":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"cluster file: unknown key(s) {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def load(cls, path: str) -> "Cluster":
        """Read a cluster JSON file (as written by ``loom plan --calibrate``)."""
        try:
            with open(path) as fh:
                return cls.from_dict(json.load(fh))
        except OSError as e:
            raise ConfigError(f"--cluster {path}: {e.strerror}") from e
        except json.JSONDecodeError as e:
            raise ConfigError(f"--cluster {path}: not JSON ({e})") from e

    def save(self, path: str) -> None:
        with open(path, "w") as fh:
            fh.write(self.to_json() + "\n")


def make_cluster(gpu: str = "A100-80GB", num_gpus: Optional[int] = None,
                 gpus_per_node: Optional[int] = None, **overrides) -> Cluster:
    """A :class:`Cluster` of ``num_gpus`` devices of the table entry ``gpu`` with the reference
    system's defaults; keyword ``overrides`` (any Cluster field, None = keep) replace them."""
    g = lookup_gpu(gpu)
    if g is None:
        raise ConfigError(f"--gpu {gpu}: unknown; choose one of {', '.join(DEVICES)} "
                          f"or give --cluster FILE")
    gpn = gpus_per_node or g.gpus_per_node
    c = Cluster(gpu=g.name, num_gpus=num_gpus or gpn, gpus_per_node=gpn,
                peak_flops=g.peak_flops, hbm_bytes=g.hbm_bytes, hbm_bw=g.hbm_bw,
                intra_bw=g.intra_bw, inter_bw=g.inter_bw, intra_alpha=g.intra_alpha,
                inter_alpha=g.inter_alpha, tdp_w=g.tdp_w, gemm_efficiency=g.gemm_efficiency)
    return replace(c, **{k: v for k, v in overrides.items() if v is not None})
