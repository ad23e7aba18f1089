"""A second model family, defined entirely in tests (here, and its block, plan and initializers
in toy_family_parts.py), runs under TP, PP and DP through the parallel plan and the
forward-step interface, without touching ``loom/``: its loss, every gradient and a metric of
its own equal the single-process run for 3 steps (fp32).

The family: a toy language model, embedding -> L x residual MLP blocks -> norm -> output layer
(untied) -> cross-entropy, written as plain ``nn`` math.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from loom.config import LoomConfig, ModelConfig
from loom.models.family import ModelFamily, StageSpec
from testkit import run_distributed

from toy_family_parts import Block, toy_init, toy_plan
from testkit.numerics import PARITY_RTOL
from testkit.config import MEGATRON_DROPOUT, PARITY_ADAM_EPS, tiny_config


class Head(nn.Module):
    """Per-token cross-entropy ``[b, s]`` of ``x [s, b, h] @ w^T`` against ``labels [b, s]``."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, x, weight, labels=None):
        logits = F.linear(x, weight)[..., :self.vocab_size]
        return F.cross_entropy(logits.flatten(0, 1), labels.t().flatten(),
                               reduction="none").view(labels.shape[1], -1).t()


class ToyLM(nn.Module):
    def __init__(self, cfg: ModelConfig, stage: StageSpec):
        super().__init__()
        self.pre_process, self.post_process = stage.pre_process, stage.post_process
        h, vp = cfg.hidden_size, stage.padded_vocab
        if self.pre_process:
            self.embed = nn.Embedding(vp, h)
        self.layers = nn.ModuleDict({str(i): Block(h, cfg.ffn_size) for i in stage.layer_numbers})
        if self.post_process:
            self.norm = nn.LayerNorm(h)
            self.out = nn.Linear(h, vp, bias=False)
            self.head = Head(cfg.vocab_size)

    def forward(self, tokens=None, hidden=None, labels=None):
        x = self.embed(tokens).transpose(0, 1) if self.pre_process else hidden
        for layer in self.layers.values():
            x = layer(x)
        return self.head(self.norm(x), self.out.weight, labels) if self.post_process else x


def toy_forward_step(chunk: ToyLM, batch: dict, hidden: Optional[torch.Tensor] = None):
    out = chunk(tokens=batch["tokens"] if chunk.pre_process else None, hidden=hidden,
                labels=batch["labels"] if chunk.post_process else None)

    def loss_fn(per_token):
        loss = per_token.mean()
        return loss, {"toy loss": loss.detach(), "toy tokens": torch.tensor(per_token.numel())}
    return out, loss_fn


TOY = ModelFamily(name="toy", build=ToyLM, plan=toy_plan, init=toy_init,
                  forward_step=toy_forward_step)


def make_cfg(tp: int = 1, pp: int = 1) -> LoomConfig:
    return tiny_config("gpt", MEGATRON_DROPOUT, num_layers=4, ffn_hidden_size=64, seq_length=8,
                       make_vocab_size_divisible_by=8, tensor_model_parallel_size=tp,
                       pipeline_model_parallel_size=pp, global_batch_size=8,
                       adam_eps=PARITY_ADAM_EPS,
                       adam_beta2=0.95, lr_decay_style="cosine")  # loom's defaults before
    # issue 21 (now Megatron's), pinned


def steps(cfg: LoomConfig, mesh, n: int = 3) -> list:
    from loom.training.trainer import Trainer
    tr = Trainer(cfg, mesh=mesh, family=TOY)
    out = []
    for _ in range(n):
        loss = tr.global_loss(tr.forward_backward(tr.batches(tr.train_ds, tr.consumed_samples)))
        grads = {name: (p.grad.detach().clone(), tr.registry[name])
                 for c in tr.model_chunks for name, p in c.named_parameters()}
        out.append((loss, grads, dict(tr.last_metrics), tr.optimizer_step()))
        tr.consumed_samples += tr.global_batch
    return out


def layouts() -> dict:
    import torch.distributed as dist

    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.registry import local_shard
    ref = steps(make_cfg().validate(1), ParallelMesh.single())
    res = {}
    for name, (tp, pp) in {"tp2": (2, 1), "pp2": (1, 2), "dp2": (1, 1)}.items():
        mesh = ParallelMesh.build(tp=tp, pp=pp)
        cfg = make_cfg(tp, pp).validate(dist.get_world_size())
        errors, compared = [], 0
        for step, ((loss, grads, metrics, norm), (rloss, rgrads, rmetrics, rnorm)) in \
                enumerate(zip(steps(cfg, mesh), ref)):
            if not math.isclose(loss, rloss, rel_tol=PARITY_RTOL):
                errors.append(f"step {step}: loss {loss} != {rloss}")
            if not math.isclose(norm, rnorm, rel_tol=PARITY_RTOL):
                errors.append(f"step {step}: grad norm {norm} != {rnorm}")
            if mesh.is_last_stage and "toy tokens" not in metrics:
                errors.append(f"step {step}: the loss function's metrics did not arrive")
            for pname, (g, meta) in grads.items():
                want = local_shard(rgrads[pname][0], meta, mesh.tp_rank, mesh.tp_size)
                compared += 1
                if not torch.allclose(g, want, rtol=PARITY_RTOL,
                                      atol=PARITY_RTOL * want.abs().max().item()):
                    errors.append(f"step {step}: grad {pname} differs")
        res[name] = {"errors": errors, "compared": compared}
    return res


def test_toy_family_under_tp_pp_dp():
    for rank, res in enumerate(run_distributed(2, layouts)):
        assert set(res) == {"tp2", "pp2", "dp2"}
        for name, r in res.items():
            assert r["compared"] > 0
            assert not r["errors"], f"rank {rank} {name}: " + "; ".join(r["errors"][:5])
