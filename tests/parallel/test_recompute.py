"""Activation recomputation changes nothing but memory: full (uniform and block, N = 1 and 2)
and selective recompute give the loss and every gradient of the run without recompute (fp32,
dropout 0.1 in attention and hidden states, so the masks must replay), on 1 rank and at TP=2
(with and without sequence parallelism); runs with and without recompute have the same
parameter names and initial weights and load each other's checkpoints.

That recomputation ran is counted, not assumed: every layer's first module and its attention
core count their executions in the forward pass and inside backward (the recomputation), per
micro-batch: full uniform recomputes every layer once, full block the first N, selective the
attention core only, and no recompute nothing. The replay is checked directly, at TP=1 as at
TP=2: each recomputed dropout mask and attention-core output (dropout inside) equals bitwise one
of the same module's forward-pass results (the same operations on the same inputs: a replayed
generator gives the same bits; a fresh draw does not).
"""

from __future__ import annotations

import contextlib
import copy
import os

import torch
from torch import nn

from loom.config import LoomConfig
from testkit import run_distributed
from testkit.numerics import PARITY_RTOL, rel_err
from testkit.config import MEGATRON_DROPOUT, tiny_config, tiny_model

VARIANTS = [("full", "uniform", 1), ("full", "uniform", 2), ("full", "block", 1),
            ("selective", "uniform", 1)]


def make_cfg(kind: str, tp: int, sp: bool = False) -> LoomConfig:
    common = dict(MEGATRON_DROPOUT, num_layers=3, hidden_size=64, vocab_size=300)
    model = tiny_model("gpt", common) if kind == "gpt" else \
        tiny_model("llama", common, ffn_hidden_size=96)
    return tiny_config(model=model, tensor_model_parallel_size=tp, sequence_parallel=sp,
                       global_batch_size=4, world=tp)


def _phase() -> str:
    """"recompute" inside an autograd backward (where checkpointing re-runs forwards), else
    "forward"."""
    return "recompute" if torch._C._current_graph_task_id() != -1 else "forward"


class Probe:
    """Executions per layer and phase of each layer's first module and attention core, and the
    results of every dropout and attention core (masks / outputs) by module and phase.

    The attention core's class ``forward`` is wrapped before the model is built, so the bound
    method that selective recompute checkpoints is the counting one; the layers' first modules
    and the dropouts are called through ``__call__`` by the recomputed code too, so hooks see
    both runs."""

    def __init__(self):
        self.counts: dict = {}  # (what, layer, phase) -> executions
        self.results: dict = {}  # (module id, phase) -> [tensor]
        self.layer_of: dict = {}  # id(core) -> layer index
        self.handles: list = []

    def count(self, what: str, layer: int) -> None:
        key = (what, layer, _phase())
        self.counts[key] = self.counts.get(key, 0) + 1

    def keep(self, module, value: torch.Tensor) -> None:
        self.results.setdefault((id(module), _phase()), []).append(value.detach().clone())

    @contextlib.contextmanager
    def core_patched(self):
        from loom.models.attention import DotProductAttention
        original = DotProductAttention.forward
        probe = self

        def forward(self, *args, **kwargs):
            if id(self) in probe.layer_of:
                probe.count("core", probe.layer_of[id(self)])
            out = original(self, *args, **kwargs)
            if id(self) in probe.layer_of and self.training:
                probe.keep(self, out)
            return out
        DotProductAttention.forward = forward
        try:
            yield
        finally:
            DotProductAttention.forward = original

    def attach(self, chunk: nn.Module) -> None:
        from loom.models.attention import DotProductAttention
        from loom.parallel.random import ForkedDropout
        for i, layer in enumerate(chunk.layers.values()):
            first = next(layer.children())
            self.handles.append(first.register_forward_pre_hook(
                lambda m, a, i=i: self.count("first", i)))
            for m in layer.modules():
                if isinstance(m, DotProductAttention):
                    self.layer_of[id(m)] = i
                if isinstance(m, (nn.Dropout, ForkedDropout)) and m.p > 0:
                    self.handles.append(m.register_forward_hook(self._mask_hook))

    def _mask_hook(self, module, args, out) -> None:  # returns None: the output is unchanged
        if module.training:
            self.keep(module, out == 0)

    def per_layer(self, what: str, phase: str, layers: int) -> list:
        return [self.counts.get((what, i, phase), 0) for i in range(layers)]

    def replay_errors(self) -> list[str]:
        """Each recomputed result must equal bitwise one of the same module's forward ones."""
        errors = []
        for (mid, phase), values in self.results.items():
            if phase != "recompute":
                continue
            first = self.results.get((mid, "forward"), [])
            for v in values:
                if not any(f.shape == v.shape and torch.equal(f, v) for f in first):
                    errors.append(f"module {mid}: a recomputed result differs from every "
                                  f"forward one (RNG not replayed?)")
        return errors


def run(cfg: LoomConfig, mesh, steps: int = 3) -> dict:
    from torch.utils.checkpoint import set_checkpoint_early_stop

    from loom.training.trainer import Trainer
    probe = Probe()
    with probe.core_patched():
        tr = Trainer(cfg, mesh=mesh)
        probe.attach(tr.model_chunks[0])
        init = {n: p.detach().clone() for n, p in tr.model_chunks[0].named_parameters()}
        losses, grads = [], []
        # no early stop: every recomputed forward runs to its end, so each recomputed result
        # can be compared (early stop only skips the tail that backward does not need)
        with set_checkpoint_early_stop(False):
            for _ in range(steps):
                losses.append(float(tr.forward_backward(tr.batches(tr.train_ds,
                                                                   tr.consumed_samples))))
                grads.append({n: p.grad.detach().clone()
                              for n, p in tr.model_chunks[0].named_parameters()})
                tr.optimizer_step()
                tr.consumed_samples += tr.global_batch
    for h in probe.handles:
        h.remove()
    layers = len(tr.model_chunks[0].layers)
    micro = steps * tr.global_batch // (cfg.training.micro_batch_size * tr.mesh.dp_size)
    counts = {f"{what}-{phase}": probe.per_layer(what, phase, layers)
              for what in ("first", "core") for phase in ("forward", "recompute")}
    recomputed = sum(len(v) for (_, ph), v in probe.results.items() if ph == "recompute")
    return {"trainer": tr, "init": init, "losses": losses, "grads": grads, "counts": counts,
            "micro_batches": micro, "layers": layers, "replay": probe.replay_errors(),
            "recomputed_results": recomputed}


def expected_recomputes(gran, method, n: int, layers: int) -> dict:
    """Recomputations per layer and micro-batch of its first module and its attention core."""
    if gran is None:
        return {"first": [0] * layers, "core": [0] * layers}
    if gran == "selective":
        return {"first": [0] * layers, "core": [1] * layers}
    full = [1] * layers if method == "uniform" else [int(i < n) for i in range(layers)]
    return {"first": full, "core": full}


def count_errors(res: dict, gran, method, n: int) -> list[str]:
    """The forward runs once per micro-batch and layer, recomputation as planned, and every
    recomputed dropout mask / attention output replays the forward's bits."""
    m, layers, c = res["micro_batches"], res["layers"], res["counts"]
    want = expected_recomputes(gran, method, n, layers)
    errors = []
    for what in ("first", "core"):
        if c[f"{what}-forward"] != [m] * layers:
            errors.append(f"{what} forward executions {c[what + '-forward']} != {[m] * layers}")
        if c[f"{what}-recompute"] != [m * k for k in want[what]]:
            errors.append(f"{what} recomputations {c[what + '-recompute']} != "
                          f"{[m * k for k in want[what]]}")
    if gran is not None and res["recomputed_results"] == 0:
        errors.append("no recomputed dropout mask or attention output to compare")
    return errors + res["replay"]


def compare(base: dict, other: dict) -> list[str]:
    errors = []
    if list(base["init"]) != list(other["init"]):
        errors.append("parameter names differ")
    for n, w in base["init"].items():
        if n in other["init"] and not torch.equal(w, other["init"][n]):
            errors.append(f"initial weight {n} differs")
    for step, (a, b) in enumerate(zip(base["losses"], other["losses"])):
        if abs(a - b) > PARITY_RTOL * abs(a):
            errors.append(f"step {step}: loss {b} != {a}")
    for step, (ga, gb) in enumerate(zip(base["grads"], other["grads"])):
        for n, g in ga.items():
            err = rel_err(gb[n], g)
            if err > PARITY_RTOL:
                errors.append(f"step {step}: grad {n} rel err {err:.2e}")
    return errors


def cases(tmp: str) -> dict:
    import torch.distributed as dist

    from loom.parallel.mesh import ParallelMesh
    world = dist.get_world_size()
    meshes = {1: ParallelMesh.single(), world: ParallelMesh.build(tp=world)}
    out = {}
    layouts = [("gpt", 1, False), ("llama", 1, False), ("gpt", world, False),
               ("llama", world, True)]
    for kind, tp, sp in layouts:
        base_cfg = make_cfg(kind, tp, sp)
        base = run(base_cfg, meshes[tp])
        out[f"{kind}-tp{tp}{'-sp' if sp else ''}-counts-none"] = count_errors(base, None, None, 0)
        for gran, method, n in VARIANTS:
            cfg = copy.deepcopy(base_cfg)
            cfg.training.recompute_granularity = gran
            cfg.training.recompute_method = method
            cfg.training.recompute_num_layers = n
            other = run(cfg, meshes[tp])
            key = f"{kind}-tp{tp}{'-sp' if sp else ''}-{gran}-{method}{n}"
            out[key] = compare(base, other) + count_errors(other, gran, method, n)
            if gran == "full" and method == "uniform" and n == 2 and tp == world:
                # checkpoints are shared: save with recompute, load without, same weights
                save_dir = os.path.join(tmp, key)
                other["trainer"].save(save_dir)
                fresh = run(base_cfg, meshes[tp], steps=0)["trainer"]
                fresh.load(save_dir)
                saved = dict(other["trainer"].model_chunks[0].named_parameters())
                out[key + "-ckpt"] = [n_ for n_, p in fresh.model_chunks[0].named_parameters()
                                      if not torch.equal(p, saved[n_])]
        out[f"{kind}-tp{tp}-dropout-active"] = base["losses"][0] != run(
            _no_dropout(base_cfg), meshes[tp], steps=1)["losses"][0]
    return out


def _no_dropout(cfg: LoomConfig) -> LoomConfig:
    cfg = copy.deepcopy(cfg)
    cfg.model.hidden_dropout = cfg.model.attention_dropout = 0.0
    return cfg


def test_recompute_equals_no_recompute(tmp_path):
    results = run_distributed(2, cases, str(tmp_path), timeout=600)
    for rank, res in enumerate(results):
        # per layout: the variants, the run without recompute (counts), dropout active; + the
        # two TP=2 checkpoint checks
        assert len(res) == 4 * (len(VARIANTS) + 2) + 2
        for key, errors in res.items():
            if key.endswith("dropout-active"):
                assert errors is True, f"rank {rank} {key}: dropout had no effect"
            else:
                assert not errors, f"rank {rank} {key}: " + "; ".join(errors[:5])


def test_recompute_comparison_can_fail():
    base = {"init": {"w": torch.ones(2)}, "losses": [1.0], "grads": [{"w": torch.ones(2)}]}
    other = {"init": {"w": torch.ones(2)}, "losses": [1.0],
             "grads": [{"w": torch.tensor([1.0, 1.001])}]}
    assert compare(base, other)


def test_recompute_counts_and_replay_checks_can_fail():
    """A plan that skipped recomputation, or recomputed with a fresh dropout mask, is caught."""
    res = {"micro_batches": 2, "layers": 3, "replay": [], "recomputed_results": 4,
           "counts": {"first-forward": [2] * 3, "core-forward": [2] * 3,
                      "first-recompute": [0] * 3, "core-recompute": [0] * 3}}
    assert count_errors(res, "full", "uniform", 1)  # nothing was recomputed
    assert count_errors(res, "selective", "uniform", 1)
    assert not count_errors(res | {"recomputed_results": 0}, None, None, 0)
    probe = Probe()
    mask = torch.rand(64, generator=torch.Generator().manual_seed(0)) < 0.1
    probe.results = {(1, "forward"): [mask], (1, "recompute"): [mask.roll(1)]}
    assert probe.replay_errors()
    probe.results[(1, "recompute")] = [mask.clone()]
    assert not probe.replay_errors()
