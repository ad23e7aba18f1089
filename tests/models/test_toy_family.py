"""A new model family plugs in without touching ``loom/``: defined entirely in tests (here: the
model, forward step, its own samples and logged metric, its config rules (``check``) and the
layer kinds the planner prices (``layer_kinds``) through the family hooks; block, plan and
initializers in toy_family_parts.py, shared with test_model_family.py), registered with
:func:`loom.models.register_family` (no global state: the registry is a value), its config is
resolved with its own rules, it trains through the real Trainer at 1 rank and at 2 (TP=2, DP=2;
gloo) with equal losses (fp32, rtol 1e-5), and the planner prices it (``loom train --dry-run``'s
prediction and parameter counts) with no planner line naming it.

The family: embedding -> L x residual MLP blocks -> norm -> untied output layer -> loom's shared
LM head (:class:`loom.models.chunk.LMHead`, vocabulary-parallel under TP).
"""

from __future__ import annotations

import math
import sys
from types import MappingProxyType
from typing import Optional

import pytest
import torch
from torch import nn

from loom.config import LoomConfig, ModelConfig
from loom.errors import ConfigError
import loom.models
from loom.models import FamilyRegistry, get_family, register_family, resolve_config
from loom.models.family import ModelFamily, StageSpec
from loom.models.chunk import LMHead
from testkit import run_distributed

from toy_family_parts import Block, toy_init, toy_plan
from testkit.numerics import PARITY_RTOL
from testkit.config import MEGATRON_DROPOUT, tiny_config

STEPS = 3


class MlpLM(nn.Module):
    """``tokens [b, s]`` -> per-token loss ``[b, s]`` (last chunk) or hidden ``[s, b, h]``."""

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
            self.head = LMHead(cfg.vocab_size)  # the shared LM head

    def forward(self, tokens=None, hidden=None, labels=None):
        x = self.embed(tokens).transpose(0, 1) if self.pre_process else hidden
        for layer in self.layers.values():
            x = layer(x)
        return self.head(self.norm(x), self.out.weight, labels) if self.post_process else x


def toy_forward_step(chunk: MlpLM, batch: dict, hidden: Optional[torch.Tensor] = None):
    out = chunk(tokens=batch["tokens"] if chunk.pre_process else None, hidden=hidden,
                labels=batch["labels"] if chunk.post_process else None)

    def loss_fn(per_token):
        loss = per_token.float().mean()
        return loss, {"toy loss": loss.detach()}
    return out, loss_fn


class Counting:
    """The toy family's own samples: ``tokens[i] = (3k + 5i) mod V``, labels the next ones."""

    def __init__(self, vocab_size: int, seq_length: int, offset: int):
        self.v, self.s, self.offset = vocab_size, seq_length, offset

    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, k: int) -> dict:
        ids = (3 * (int(k) + self.offset) + 5 * torch.arange(self.s + 1)) % self.v
        return {"tokens": ids[:-1], "labels": ids[1:]}


def toy_datasets(cfg: LoomConfig) -> tuple:
    m = cfg.model
    return Counting(m.vocab_size, m.seq_length, 0), Counting(m.vocab_size, m.seq_length, 7), None


def toy_check(cfg: LoomConfig, world_size: int) -> None:
    """The toy's own config rules: its block is a GeLU MLP (``--swiglu`` refused), and what
    its layout fixes is written into the config (no position table, an untied output layer),
    so checkpoints and the planner describe the model it builds."""
    m = cfg.model
    if m.swiglu:
        raise ConfigError("--swiglu: --model-type toy has GeLU MLP blocks: drop --swiglu")
    m.position_embedding_type, m.untie_embeddings_and_output_weights = "none", True


def mlp_layers(model_cfg: ModelConfig) -> str:
    """The toy's layer kinds for the planner: every layer a residual MLP (``-``)."""
    return "-" * model_cfg.num_layers


TOY = ModelFamily(name="toy", build=MlpLM, plan=toy_plan, init=toy_init,
                  forward_step=toy_forward_step, datasets=toy_datasets,
                  logged_metrics=lambda model_cfg: ("toy loss",), check=toy_check,
                  layer_kinds=mlp_layers)
FAMILY = TOY  # what a FAMILY_MODULES row's family() module holds


def make_cfg(tp: int = 1, vocab_size: int = 100) -> LoomConfig:
    return tiny_config("gpt", MEGATRON_DROPOUT, model_type="toy", ffn_hidden_size=64,
                       seq_length=8, vocab_size=vocab_size, make_vocab_size_divisible_by=8,
                       mock_data=False, tensor_model_parallel_size=tp, global_batch_size=8)


def train(cfg: LoomConfig, mesh) -> list[dict]:
    """``STEPS`` training records of the toy family, looked up by name in a registry."""
    from loom.training.trainer import Trainer
    trainer = Trainer(cfg, mesh=mesh, family=get_family("toy", register_family(TOY)))
    return [trainer.train_step() for _ in range(STEPS)]


def layouts() -> dict:
    import torch.distributed as dist

    from loom.parallel.mesh import ParallelMesh
    registry = register_family(TOY)
    ref = train(resolve_config(make_cfg(), 1, registry), ParallelMesh.single())
    out = {}
    for name, tp in {"tp2": 2, "dp2": 1}.items():
        mesh = ParallelMesh.build(tp=tp)
        recs = train(resolve_config(make_cfg(tp), dist.get_world_size(), registry), mesh)
        out[name] = [(r["loss"], r["toy_loss"], rr["loss"]) for r, rr in zip(recs, ref)]
    return out


def test_registry_is_a_value():
    registry = register_family(TOY)
    assert get_family("toy", registry) is TOY and "toy" in registry.names()
    assert get_family("gpt", registry) is get_family("gpt")  # built-ins stay reachable
    with pytest.raises(ValueError, match="unknown model family 'toy'"):
        get_family("toy")  # nothing global changed
    with pytest.raises(ValueError, match="already registered"):
        registry.register(TOY)
    with pytest.raises(ValueError, match="already registered"):
        FamilyRegistry([ModelFamily("gpt", MlpLM, toy_plan, toy_init, toy_forward_step)])


def test_hooks_have_defaults():
    """A family of only build / plan / init / forward_step: no generation, no evaluation task,
    no Hugging Face layout, next-token windows, no extra metric."""
    from loom.evaluation.registry import get_task
    bare = ModelFamily(name="bare", build=MlpLM, plan=toy_plan, init=toy_init,
                       forward_step=toy_forward_step)
    assert bare.generation is None and bare.hf is None and bare.logged_metrics(None) == ()
    assert bare.checkpoint_differences({}, None) == [] and not bare.wordpiece_data
    cfg = make_cfg()
    cfg.data.mock_data = True
    train_ds, valid_ds, _ = bare.datasets(cfg)
    assert train_ds[0]["tokens"].shape == (8,) and valid_ds is not None
    with pytest.raises(ConfigError, match="not supported for model type bare"):
        get_task(bare, "perplexity")


def test_resolved_with_its_own_rules():
    """The toy's check runs inside the validation pass, by its registered name (not a built-in
    --model-type): its refusal is one ConfigError, its derived values are in the config."""
    registry = register_family(TOY)
    cfg = resolve_config(make_cfg(), 1, registry)
    assert cfg.model.model_type == "toy" and cfg.model.position_embedding_type == "none"
    assert cfg.model.untie_embeddings_and_output_weights and cfg.derived is not None
    bad = make_cfg()
    bad.model.swiglu = True
    with pytest.raises(ConfigError, match="--model-type toy has GeLU MLP blocks: drop --swiglu"):
        resolve_config(bad, 1, registry)
    bad.model.model_type = "nope"
    with pytest.raises(ConfigError, match="--model-type: 'nope' is not one of gpt, mamba, bert, "
                                          "gemma3, toy"):
        resolve_config(bad, 1, registry)


def test_planner_prices_the_declared_layer_kinds(monkeypatch):
    """One registry row (the line a built-in family adds to ``FAMILY_MODULES``; undone after the
    test) and ``loom train --dry-run``'s planner works on the toy: its prediction runs and the
    planner's parameter formula equals the count of the model the toy really builds (the
    dry-run's meta-device count), because the planner prices the kinds the family declares (MLP
    layers). Priced as a transformer layer (attention + MLP: what a planner without the
    declaration would do) the count is off, so this fails if the planner needed a toy branch."""
    from loom.planner.meta_count import count_rank_states, planner_stage_params
    from loom.planner.predict import predict_layout
    rows = {**loom.models.FAMILY_MODULES,
            "toy": loom.models.FamilyRow(lambda: sys.modules[__name__], lambda: TOY)}
    monkeypatch.setattr(loom.models, "FAMILY_MODULES", MappingProxyType(rows))
    cfg = resolve_config(make_cfg(vocab_size=96), 1)  # V = Vp: the formula counts V rows
    exact = count_rank_states(cfg, 1)["params"]
    planned = planner_stage_params(cfg, 1)
    assert exact == 2 * 96 * 32 + 2 * (2 * 32 + 2 * 32 * 64 + 64 + 32) + 2 * 32  # by hand
    assert planned["first"] == exact, (planned, exact)  # one stage holds the whole model
    pred = predict_layout(cfg, 1, cluster="H100-80GB")
    assert pred["fits"] and pred["time_s"]["iteration"] > 0 and pred["mfu"] > 0
    as_transformer = resolve_config(make_cfg(vocab_size=96), 1)
    as_transformer.model.model_type = "gpt"  # the same shape priced as GPT layers
    assert planner_stage_params(as_transformer, 1)["first"] != exact
    # the row alone makes it a --model-type of the command line (no choices list to extend)
    from loom.cli import main
    argv = ["train", "--dry-run", "--world-size", "1", "--model-type", "toy", "--num-layers",
            "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
            "--seq-length", "8", "--vocab-size", "96", "--micro-batch-size", "1", "--lr", "1e-3",
            "--train-iters", "2", "--mock-data", "--position-embedding-type", "none",
            "--untie-embeddings-and-output-weights"]
    with pytest.raises(SystemExit) as e:
        main(argv[:5] + ["toi"] + argv[6:])
    assert e.value.code == 2  # an unknown name is one line naming --model-type
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0


def test_toy_family_trains_at_one_and_two_ranks():
    for rank, res in enumerate(run_distributed(2, layouts)):
        assert set(res) == {"tp2", "dp2"}
        for name, steps in res.items():
            for step, (loss, toy_loss, ref) in enumerate(steps):
                assert math.isclose(loss, ref, rel_tol=PARITY_RTOL), (rank, name, step, loss, ref)
                assert math.isclose(toy_loss, loss, rel_tol=PARITY_RTOL), (rank, name, step)
        assert res["tp2"][-1][0] < res["tp2"][0][0]  # it learns
