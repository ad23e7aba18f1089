"""PyTorch-native counterpart of loom's reference GPT for ``vs_torch_native.py``.

One plain ``nn.Module`` (batch-first ``[b, s, h]``, pre-LN, learned positions, exact GeLU, no
linear biases, untied output; q, k, v as separate projections so ``ColwiseParallel`` splits
heads) loaded with loom's initial weights, parallelized the way torchtitan does: DDP or FSDP2
(``fully_shard`` per layer) for data parallelism, DTensor TP (``ColwiseParallel`` /
``RowwiseParallel``, ``loss_parallel``; ``SequenceParallel`` norms with ``PrepareModuleInput``)
and ``torch.distributed.pipelining`` (GPipe / 1F1B) for pipelines, combined on a
``(dp, pp, tp)`` device mesh.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from loom.config import LoomConfig


class Attention(nn.Module):
    def __init__(self, h: int, a: int):
        super().__init__()
        self.d = h // a
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(h, h, bias=False) for _ in range(4))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.d).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, h: int, f: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, f, bias=False), nn.Linear(f, h, bias=False)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, h: int, a: int, f: int, eps: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(h, eps=eps), nn.LayerNorm(h, eps=eps)
        self.attn, self.mlp = Attention(h, a), MLP(h, f)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class NativeGPT(nn.Module):
    """The whole model, or pipeline stage ``stage`` of ``stages`` (its share of the layers;
    embeddings on the first, final norm and output on the last). ``[b, s]`` ids (or hidden
    ``[b, s, h]``) -> hidden, or logits ``[b, s, V]`` on the last stage."""

    def __init__(self, cfg: LoomConfig, stage: int = 0, stages: int = 1):
        super().__init__()
        m = cfg.model
        h, V = m.hidden_size, m.padded_vocab(1)
        per = m.num_layers // stages
        first, last = stage == 0, stage == stages - 1
        self.tok_emb = nn.Embedding(V, h) if first else None
        self.pos_emb = nn.Embedding(m.seq_length, h) if first else None
        self.layers = nn.ModuleDict({str(i): Block(h, m.num_attention_heads, m.ffn_size,
                                                   m.norm_epsilon)
                                     for i in range(stage * per, (stage + 1) * per)})
        self.final_norm = nn.LayerNorm(h, eps=m.norm_epsilon) if last else None
        self.output = nn.Linear(h, V, bias=False) if last else None

    def forward(self, x):
        if self.tok_emb is not None:
            x = self.tok_emb(x) + self.pos_emb.weight[:x.shape[1]]
        for layer in self.layers.values():
            x = layer(x)
        if self.output is not None:
            x = self.output(self.final_norm(x))
        return x


LOOM_NAMES = {"tok_emb.weight": "embedding.word_embeddings.weight",
              "pos_emb.weight": "embedding.position_embeddings.weight",
              "final_norm.weight": "final_layernorm.weight",
              "final_norm.bias": "final_layernorm.bias",
              "output.weight": "output_layer.weight"}
LAYER_NAMES = {"ln1": "input_layernorm", "ln2": "pre_mlp_layernorm", "attn.wo": "self_attention.linear_proj",
               "mlp.fc1": "mlp.linear_fc1", "mlp.fc2": "mlp.linear_fc2"}


@torch.no_grad()
def load_loom_weights(model: NativeGPT, cfg: LoomConfig) -> None:
    """Copy the single-process loom model's initial weights (same seed) into ``model``."""
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    ref = dict(build_model(get_family("gpt"), cfg.model, ParallelMesh.single(),
                           seed=cfg.training.seed).named_parameters())
    h = cfg.model.hidden_size
    for name, p in model.named_parameters():
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            mod, leaf = rest.rsplit(".", 1)
            if mod in ("attn.wq", "attn.wk", "attn.wv"):
                qkv = ref[f"layers.{i}.self_attention.linear_qkv.weight"]
                src = qkv[("attn.wq", "attn.wk", "attn.wv").index(mod) * h:][:h]
            else:
                src = ref[f"layers.{i}.{LAYER_NAMES[mod]}.{leaf}"]
        else:
            src = ref[LOOM_NAMES[name]]
        p.copy_(src)


def build_native(cfg: LoomConfig, dp: int, pp: int, tp: int, sp: bool, dp_kind: str,
                 compile_layers: bool = False):
    """This rank's parallelized model on a ``(dp, pp, tp)`` mesh; ``compile_layers``: each
    block ``torch.compile``'d after TP and before FSDP2 / DDP (torchtitan's order).

    Returns ``(model, mesh, stage_index)``; ``dp_kind`` is "ddp" or "fsdp2"."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
    stage = mesh["pp"].get_local_rank() if pp > 1 else 0
    model = NativeGPT(cfg, stage, pp)
    load_loom_weights(model, cfg)
    if tp > 1:
        apply_tp(model, mesh["tp"], sp)
    if compile_layers:
        for layer in model.layers.values():
            layer.compile()
    if dp > 1:
        if dp_kind == "fsdp2" or tp > 1 or pp > 1:
            from torch.distributed.fsdp import fully_shard
            for layer in model.layers.values():
                fully_shard(layer, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        else:
            model = nn.parallel.DistributedDataParallel(model, process_group=mesh["dp"].get_group())
    dist.barrier()
    return model, mesh, stage


def apply_tp(model: NativeGPT, tp_mesh, sp: bool) -> None:
    """torchtitan's Llama TP plan adapted to this model (``sp``: sequence-parallel norms)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)
    plan = {}
    if model.tok_emb is not None:
        plan["tok_emb"] = RowwiseParallel(input_layouts=Replicate())
    if model.output is not None:
        plan["output"] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                         output_layouts=Shard(-1), use_local_output=False)
        if sp:
            plan["final_norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, plan)
    first = min(int(i) for i in model.layers)
    for i, layer in model.layers.items():
        lp = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
              "attn.wv": ColwiseParallel(), "mlp.fc1": ColwiseParallel()}
        if sp:
            lp.update({"ln1": SequenceParallel(), "ln2": SequenceParallel(),
                       "attn": PrepareModuleInput(input_layouts=(Shard(1),),
                                                  desired_input_layouts=(Replicate(),)),
                       "mlp": PrepareModuleInput(input_layouts=(Shard(1),),
                                                 desired_input_layouts=(Replicate(),)),
                       "attn.wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
                       "mlp.fc2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)})
            if int(i) == first and model.tok_emb is not None:  # [b, s, h] -> [b, s/t, h]
                parallelize_module(layer, tp_mesh, PrepareModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                    use_local_output=False))
        else:
            lp.update({"attn.wo": RowwiseParallel(), "mlp.fc2": RowwiseParallel()})
        parallelize_module(layer, tp_mesh, lp)


def native_optimizer(model: nn.Module, cfg: LoomConfig) -> torch.optim.Optimizer:
    """AdamW with loom's decay grouping (no decay for 1-D); fused on plain tensors, foreach on
    DTensors (kept in separate groups: one multi-tensor kernel cannot mix the two)."""
    from torch.distributed.tensor import DTensor
    t = cfg.training
    groups = []
    for decay in (True, False):
        for dt in (True, False):
            ps = [p for p in model.parameters() if p.requires_grad and (p.ndim >= 2) == decay
                  and isinstance(p, DTensor) == dt]
            if ps:
                groups.append({"params": ps, "weight_decay": t.weight_decay if decay else 0.0,
                               "foreach": dt, "fused": not dt})
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)


def cross_entropy(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


class NativeRunner:
    """One training step of the native layout: ``step(batches) -> local mean loss`` (float, or
    None on ranks without the loss)."""

    def __init__(self, cfg: LoomConfig, dp: int, pp: int, tp: int, sp: bool, dp_kind: str,
                 schedule: str, compile_layers: bool = False):
        self.model, self.mesh, self.stage = build_native(cfg, dp, pp, tp, sp, dp_kind,
                                                         compile_layers)
        self.tp, self.pp = tp, pp
        self.opt = native_optimizer(self.model, cfg)
        self.sched = None
        if pp > 1:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
            st = PipelineStage(self.model, self.stage, pp, torch.device("cpu"),
                               group=self.mesh["pp"].get_group())
            cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
            self.m = None  # set per step from the batches
            self._make = lambda m: cls(st, n_microbatches=m, loss_fn=cross_entropy)

    def loss_ctx(self):
        if self.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel
            return loss_parallel()
        return contextlib.nullcontext()

    def step(self, batches: list[dict]):
        self.opt.zero_grad(set_to_none=True)
        if self.pp > 1:
            if self.sched is None:
                self.sched = self._make(len(batches))
            tokens = torch.cat([b["tokens"] for b in batches])
            labels = torch.cat([b["labels"] for b in batches])
            losses = []
            with self.loss_ctx():
                if self.stage == 0:
                    self.sched.step(tokens)
                elif self.stage == self.pp - 1:
                    self.sched.step(target=labels, losses=losses)
                else:
                    self.sched.step()
            out = (sum(float(_local(x.detach())) for x in losses) / len(losses)) if losses else None
        else:
            total = 0.0
            for b in batches:
                with self.loss_ctx():
                    loss = cross_entropy(self.model(b["tokens"]), b["labels"]) / len(batches)
                    loss.backward()
                total += float(_local(loss.detach()))
            out = total
        self.opt.step()
        return out


def _local(x):
    return x.full_tensor() if hasattr(x, "full_tensor") else x
