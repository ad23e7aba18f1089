"""Megatron-LM flags of issue 23 that loom now trains with Megatron's meaning: ``--lr-warmup-init``
and ``--decoupled-lr`` / ``--decoupled-min-lr`` (the LR schedule of
``megatron/core/optimizer_param_scheduler.py``, the parameter groups of
``megatron/core/optimizer/__init__.py``), ``--log-num-zeros-in-grad`` (Megatron's
``count_zeros_fp32``), ``--squared-relu`` (``megatron/core/activations.py``). The TP / DP
parity of the zero count and of these flags is tests/parallel/test_script_flags_parity.py."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from loom.errors import ConfigError
from testkit import run_distributed

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
        "--mock-data", "--vocab-size", "96", "--eval-iters", "0", "--no-progress-bar",
        "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights"]
SCHEDULE = ["--lr", "1e-3", "--min-lr", "1e-4", "--train-iters", "6", "--lr-warmup-iters", "2",
            "--lr-decay-iters", "5", "--lr-decay-style", "cosine"]


def megatron_lr(num_steps: int, max_lr: float, min_lr: float, init_lr: float, warmup: int,
                decay: int, style: str) -> float:
    """Megatron-LM's ``OptimizerParamScheduler.get_lr`` (d98e8a6, lines 218-280), transcribed
    for warm-up / decay in iterations (Megatron counts both in samples: the same ratios)."""
    if warmup > 0 and num_steps <= warmup:
        return init_lr + (max_lr - init_lr) * float(num_steps) / float(warmup)
    if style == "constant":
        return max_lr
    if num_steps > decay:
        return min_lr
    ratio = float(num_steps - warmup) / float(decay - warmup)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


def _parse(argv):
    from loom.training.cli import add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def _prepare(argv, monkeypatch):
    from loom.training.cli import prepare
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    return prepare(_parse(argv))


def _megatron_step(iteration: int, warmup: int) -> int:
    """Megatron's ``num_steps`` of loom's ``iteration``: loom takes the warm-up one step
    ahead (no step spent at the initial learning rate), the decay at the same count."""
    return iteration + 1 if iteration < warmup else iteration


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
def test_lr_warmup_init_follows_megatrons_formula(style, monkeypatch):
    from loom.training.optimizer import lr_at
    argv = BASE + SCHEDULE + ["--lr-warmup-init", "2e-4", "--lr-decay-style", style]
    t = _prepare(argv, monkeypatch).training
    assert t.lr_warmup_init == 2e-4
    for it in range(8):
        want = megatron_lr(_megatron_step(it, 2), 1e-3, 1e-4, 2e-4, 2, 5, style)
        assert lr_at(it, t) == pytest.approx(want, rel=1e-12), it
    assert lr_at(0, t) == pytest.approx(2e-4 + 0.5 * (1e-3 - 2e-4))  # halfway up from init


def _run(argv):
    from loom.training.cli import prepare
    from loom.training.trainer import Trainer
    trainer = Trainer(prepare(_parse(argv)))
    groups = []
    for g in trainer.optimizer.param_groups:
        ids = {id(p) for p in g["params"]}
        if hasattr(trainer.optimizer, "ranges"):  # distributed optimizer: masters by range
            names = {r.name for r in trainer.optimizer.ranges if id(r.master) in ids}
        else:
            names = {n for c in trainer.model_chunks for n, p in c.named_parameters()
                     if id(p) in ids}
        groups.append((g.get("max_lr"), g.get("min_lr"), sorted(names)))
    history = trainer.train()
    weights = {n: p.detach().numpy().copy() for c in trainer.model_chunks
               for n, p in c.named_parameters()}  # numpy: tensors do not cross the queue
    return history, groups, weights


@pytest.mark.parametrize("extra", [[], ["--use-distributed-optimizer"]])
def test_decoupled_lr_groups_follow_megatrons_schedule(extra):
    """The word-embedding and output-layer weights (only they) get their own group whose LR
    runs Megatron's schedule from --lr-warmup-init to --decoupled-lr, down to
    --decoupled-min-lr; the others to --lr, down to --min-lr. With --decoupled-lr equal to
    --lr (and its minimum to --min-lr) training is the run without the flag."""
    argv = BASE + SCHEDULE + ["--lr-warmup-init", "1e-5"] + extra
    decoupled = ["--decoupled-lr", "3e-3", "--decoupled-min-lr", "2e-5"]
    history, groups, _ = run_distributed(1, _run, argv + decoupled, start_method="fork")[0]
    own = groups[-1]
    assert own[:2] == (3e-3, 2e-5)
    assert own[2] == ["embedding.word_embeddings.weight", "output_layer.weight"]
    assert all(g[:2] == (1e-3, 1e-4) for g in groups[:-1])
    for it, rec in enumerate(history):
        n = _megatron_step(it, 2)
        assert rec["lr"] == pytest.approx(megatron_lr(n, 1e-3, 1e-4, 1e-5, 2, 5, "cosine"))
        assert rec["decoupled_lr"] == pytest.approx(
            megatron_lr(n, 3e-3, 2e-5, 1e-5, 2, 5, "cosine"))
    plain, _, w0 = run_distributed(1, _run, argv, start_method="fork")[0]
    same, groups1, w1 = run_distributed(1, _run, argv + ["--decoupled-lr", "1e-3"],
                                        start_method="fork")[0]
    assert len(groups1) == len(groups) and groups1[-1][:2] == (1e-3, 1e-4)  # min: --min-lr
    assert [r["loss"] for r in same] == pytest.approx([r["loss"] for r in plain], rel=1e-6)
    for name, w in w0.items():
        torch.testing.assert_close(torch.from_numpy(w1[name]), torch.from_numpy(w), rtol=1e-5,
                                   atol=1e-7, msg=name)
    assert [r["loss"] for r in history] != pytest.approx([r["loss"] for r in plain], rel=1e-6)


def _zeros(argv):
    from loom.training.cli import prepare
    from loom.training.param_stats import grad_zeros
    from loom.training.trainer import Trainer
    trainer = Trainer(prepare(_parse(argv)))
    trainer.forward_backward(trainer.batches(trainer.train_ds, 0))
    counted = grad_zeros(trainer.optimizer, trainer.parts.model.groups, trainer.mesh)
    direct = sum(int((p.grad == 0).sum()) for c in trainer.model_chunks
                 for p in c.parameters())
    rec = trainer.train_step()
    return counted, direct, rec["num_zeros_in_grad"]


def test_log_num_zeros_in_grad_counts_zero_entries():
    """On 1 rank: every zero gradient entry (the unused vocabulary rows of the embedding, at
    least), logged in the iteration's record (no dropout: the same count twice)."""
    argv = BASE + SCHEDULE + ["--log-num-zeros-in-grad", "--hidden-dropout", "0",
                              "--attention-dropout", "0"]
    counted, direct, logged = run_distributed(1, _zeros, argv, start_method="fork")[0]
    assert counted == direct == logged
    assert counted >= (128 - 2 * 16) * 32  # Vp 128 rows, at most 32 tokens seen


def test_squared_relu_mlp(monkeypatch):
    from loom.models.gpt.model import MLP
    cfg = _prepare(BASE + ["--train-iters", "2", "--lr", "1e-3", "--squared-relu"],
                   monkeypatch).model
    assert cfg.squared_relu
    torch.manual_seed(0)
    mlp = MLP(cfg)
    x = torch.randn(3, 2, 32)
    want = mlp.linear_fc2(torch.relu(mlp.linear_fc1(x)) ** 2)  # Megatron's squared_relu
    torch.testing.assert_close(mlp(x), want)
    for extra, match in ((["--swiglu"], "drop --swiglu"),
                         (["--quick-geglu"], "drop --quick-geglu")):
        with pytest.raises(ConfigError, match=match):
            _prepare(BASE + ["--train-iters", "2", "--lr", "1e-3", "--squared-relu", *extra],
                     monkeypatch)


def test_squared_relu_experts(monkeypatch):
    """--squared-relu with --num-experts: each routed expert and the shared expert is
    ``fc2(relu(fc1 x)^2)`` (Megatron's experts take ``config.activation_func``), on the per-expert
    loop and the grouped GEMM alike."""
    from loom.models.moe import MoELayer
    argv = BASE + ["--train-iters", "2", "--lr", "1e-3", "--squared-relu", "--num-experts", "4",
                   "--moe-ffn-hidden-size", "16", "--moe-shared-expert-intermediate-size", "8"]
    for grouped in ([], ["--moe-grouped-gemm"]):
        cfg = _prepare(argv + grouped, monkeypatch).model
        torch.manual_seed(0)
        layer = MoELayer(cfg, 0)
        for p in layer.parameters():
            torch.nn.init.normal_(p, std=0.3)
        x = torch.randn(5, 2, 32)
        tokens = x.reshape(10, 32)
        r = layer.router(tokens, (5, 2))

        def mlp(m, t):
            return m.linear_fc2(torch.relu(m.linear_fc1(t)) ** 2)  # Megatron's squared_relu
        want = mlp(layer.shared_experts, tokens)
        for j in range(r.experts.shape[1]):
            want = want + torch.stack([r.weights[i, j] * mlp(layer.experts[str(int(e))],
                                                             tokens[i])
                                       for i, e in enumerate(r.experts[:, j])])
        assert layer.experts["0"].linear_fc1.weight.shape == (16, 32)  # ungated FC1
        torch.testing.assert_close(layer(x), want.view(5, 2, 32), rtol=1e-5, atol=1e-6)


def test_eod_mask_loss_masks_end_of_document_inputs(monkeypatch):
    """--eod-mask-loss: loss_mask is 0 where the INPUT token is the end-of-document id (Megatron's
    ``loss_mask[data == eod_token] = 0.0`` on ``tokens``), and each micro-batch's loss is
    ``sum(loss x mask) / max(sum(mask), 1)`` (Megatron's ``loss_func`` and schedule)."""
    from loom.data.gpt_dataset import MockGPTDataset
    from loom.data.loss_mask import EodLossMask, end_of_document_id
    from loom.models.gpt.model import lm_loss
    argv = BASE + ["--train-iters", "2", "--lr", "1e-3", "--eod-mask-loss",
                   "--tokenizer-type", "NullTokenizer"]
    cfg = _prepare(argv, monkeypatch)
    assert cfg.data.eod_mask_loss
    eod = end_of_document_id(cfg.data, cfg.model.vocab_size)
    assert eod == 96 and cfg.model.vocab_size == 97  # NullTokenizer adds id --vocab-size
    ds = EodLossMask(MockGPTDataset(97, 256, 0), eod)
    sample = ds[3]
    assert (sample["tokens"] == eod).any()  # 256 random tokens of 97 hold some
    assert torch.equal(sample["loss_mask"], (sample["tokens"] != eod).float())
    assert torch.equal(sample["labels"], MockGPTDataset(97, 256, 0)[3]["labels"])
    per_token = torch.rand(2, 8)
    mask = torch.ones(2, 8)
    mask[0, 3] = mask[1, 0] = 0
    loss, metrics = lm_loss(per_token, loss_mask=mask)
    assert float(loss) == pytest.approx(float((per_token * mask).sum() / 14))
    assert float(lm_loss(per_token, loss_mask=torch.zeros(2, 8))[0]) == 0.0  # clamp(min=1)
    assert float(metrics["lm loss"]) == pytest.approx(float(loss))


def _eod_run(argv):
    from loom.training.cli import prepare
    from loom.training.trainer import Trainer
    trainer = Trainer(prepare(_parse(argv)))
    batch = trainer.batches(trainer.train_ds, 0)[0]
    masked = bool("loss_mask" in batch and (batch["loss_mask"] == 0).any())
    return [r["loss"] for r in trainer.train()], masked


def test_eod_mask_loss_trains_and_is_refused_where_not_honoured(monkeypatch):
    argv = BASE + ["--train-iters", "2", "--lr", "1e-3", "--seq-length", "128",
                   "--tokenizer-type", "NullTokenizer"]
    plain, _ = run_distributed(1, _eod_run, argv, start_method="fork")[0]
    masked, active = run_distributed(1, _eod_run, argv + ["--eod-mask-loss"],
                                     start_method="fork")[0]
    assert active and all(math.isfinite(v) for v in masked)
    assert masked != pytest.approx(plain, rel=1e-7)  # the masked tokens left the mean
    eod = ["--eod-mask-loss", "--tokenizer-type", "NullTokenizer"]
    small = BASE[:BASE.index("--position-embedding-type")] + ["--train-iters", "2", "--lr",
                                                              "1e-3"]
    for case, match in ((small + ["--eod-mask-loss"], "needs the end-of-document id"),
                        (small + eod + ["--model-type", "bert"],
                         "--eod-mask-loss with --model-type bert"),
                        (small + eod + ["--calculate-per-token-loss"],
                         "--calculate-per-token-loss with --eod-mask-loss")):
        with pytest.raises(ConfigError, match=match):
            _prepare(case, monkeypatch)


def test_decoupled_lr_schedule_resumes_per_group(tmp_path):
    """A run resumed from its checkpoint continues each group's schedule (--decoupled-lr's
    own peak and minimum) and its losses."""
    argv = BASE + SCHEDULE + ["--lr-warmup-init", "1e-5", "--decoupled-lr", "3e-3",
                              "--hidden-dropout", "0", "--attention-dropout", "0"]
    whole = run_distributed(1, _run, argv, start_method="fork")[0][0]
    ckpt = ["--save", str(tmp_path), "--load", str(tmp_path), "--save-interval", "3"]
    run_distributed(1, _run, argv + ckpt + ["--train-iters", "3"], start_method="fork")
    rest = run_distributed(1, _run, argv + ckpt, start_method="fork")[0][0]
    assert [r["iteration"] for r in rest] == [4, 5, 6]
    for key in ("lr", "decoupled_lr", "loss"):
        assert [r[key] for r in rest] == pytest.approx([r[key] for r in whole[3:]],
                                                       rel=1e-6), key
