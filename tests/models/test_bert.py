"""BERT (``--model-type bert``): parallel parity, ``transformers`` equivalence, masking statistics,
the CLI end to end, and the refusals.

* pre-LN and post-LN, with the binary (sentence-order) head: 3 steps at TP=2, TP=2 + SP, PP=2
  and TP=2 x DP=2 (and with the distributed optimizer) equal the single-process run (fp32, loss, every gradient or its shard, the
  gradient norm; rtol 1e-5);
* post-LN loom equals ``transformers.BertForMaskedLM`` logits (random weights, padded batch,
  token types) on one rank and at TP=2 (atol 1e-5);
* masking on ~100k tokens of a WordPiece corpus: 15% predicted, 80/10/10, whole words;
* ``loom preprocess`` with a trained WordPiece then ``loom train --model-type bert``: the loss
  falls.
"""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
import torch.distributed as dist

from loom.config import LoomConfig, ModelConfig
from loom.errors import ConfigError
from loom.models import resolve_config
from loom.parallel.mesh import ParallelMesh
from loom.parallel.registry import local_shard
from testkit import run_distributed
from testkit.numerics import PARITY_RTOL, rel_err
from testkit.config import PARITY_ADAM_EPS, tiny_config

V = 100


def bert_cfg(post: bool, tp: int = 1, dp: int = 1, pp: int = 1, sp: bool = False,
             binary: bool = True) -> LoomConfig:
    return tiny_config(
        "gpt", model_type="bert", vocab_size=V, post_layernorm=post, bert_binary_head=binary,
        padded_vocab_size=128,  # the same padded softmax columns at every t
        mock_data=False, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        sequence_parallel=sp, global_batch_size=8,
        adam_eps=PARITY_ADAM_EPS, clip_grad=0.5,  # as tests/parallel/test_parallel_parity.py
        adam_beta2=0.95, lr_decay_style="cosine",  # loom's defaults before issue 21, pinned
        recompute_method="uniform", recompute_num_layers=1,
        short_seq_prob=0.5,  # many padded samples: the padding mask matters
        ddp_bucket_size=5_000, world=tp * dp * pp)


def parity_case(post: bool, tp: int = 1, dp: int = 1, pp: int = 1, sp: bool = False,
                zero: bool = False) -> dict:
    from loom.training.trainer import Trainer
    cfg = bert_cfg(post, tp, dp, pp, sp)
    cfg.training.use_distributed_optimizer = zero
    mesh = ParallelMesh.build(tp=tp, pp=pp, dp=dp)
    par = Trainer(cfg, mesh=mesh)
    ref_cfg = copy.deepcopy(cfg)
    ref_cfg.parallel.tensor_model_parallel_size = ref_cfg.parallel.pipeline_model_parallel_size = 1
    ref_cfg.parallel.sequence_parallel = False
    ref_cfg.training.use_distributed_optimizer, ref_cfg.training.zero_stage = False, 0
    ref = Trainer(ref_cfg.validate(1), mesh=ParallelMesh.single())
    from loom.parallel.grad_buffer import flat_buffers
    from loom.training.step import grad_getter
    owner = {id(q): r for r in flat_buffers(par.reducers) for q in r.params}
    grad_of = grad_getter(par.reducers)  # p.grad, or the distributed optimizer's owned shard
    out = {"loss": 0.0, "grad": 0.0, "norm": 0.0, "nparams": 0, "sop": False, "loss_value": 0.0}
    for _ in range(3):
        lp = par.global_loss(par.forward_backward(par.batches(par.train_ds, par.consumed_samples)))
        lr_ = float(ref.forward_backward(ref.batches(ref.train_ds, ref.consumed_samples)))
        out["loss"] = max(out["loss"], abs(lp - lr_) / abs(lr_))
        out["loss_value"] = lr_
        out["sop"] = "sop loss" in ref.last_metrics
        ref_params = dict(ref.model_chunks[0].named_parameters())
        for chunk in par.model_chunks:
            for name, p in chunk.named_parameters():
                want = local_shard(ref_params[name].grad, par.registry[name], mesh.tp_rank,
                                   mesh.tp_size).reshape(-1)
                lo, hi = owner[id(p)].shard_range(p) if id(p) in owner else (0, p.numel())
                got = grad_of(p).reshape(-1)
                if got.numel():  # a rank may own none of a parameter
                    out["grad"] = max(out["grad"], rel_err(got, want[lo:hi], scale=want))
                out["nparams"] += 1
        np_, nr = par.optimizer_step(), ref.optimizer_step()
        out["norm"] = max(out["norm"], abs(np_ - nr) / nr)
        par.consumed_samples += par.global_batch
        ref.consumed_samples += ref.global_batch
    return out


def tiny_hf():
    from transformers import BertConfig, BertForMaskedLM
    torch.manual_seed(0)
    hc = BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=24, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
    model = BertForMaskedLM(hc).eval()
    for p in model.parameters():  # LN weights and biases away from 1 / 0: every tensor checked
        p.data.add_(0.05 * torch.randn_like(p))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, V, (2, 20), generator=g)
    types = torch.zeros_like(ids)
    types[:, 9:] = 1
    att = torch.ones_like(ids)
    att[1, 13:] = 0
    return model, hc, ids, types, att


def hf_logits_case() -> float:
    """max |loom - transformers| of the masked-LM logits (this rank's vocabulary shard
    gathered over TP)."""
    from loom.interop.hf import load_full_state_dict
    from loom.models.bert.hf import bert_config, bert_to_loom
    from loom.models import get_family
    from loom.parallel.parallelize import build_model
    hf, hc, ids, types, att = tiny_hf()
    cfg = bert_config(hc)
    t = dist.get_world_size() if dist.is_initialized() else 1
    mesh = ParallelMesh.build(tp=t) if t > 1 else ParallelMesh.single()
    model = build_model(get_family("bert"), cfg, mesh, seed=None)
    load_full_state_dict(model, bert_to_loom(hf.state_dict(), cfg))
    model.eval()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=att, token_type_ids=types).logits
        logits, _ = model(input_ids=ids, tokentype_ids=types, padding_mask=att)
        if t > 1:
            parts = [torch.empty_like(logits) for _ in range(t)]
            dist.all_gather(parts, logits.contiguous(), group=mesh.groups["tp"])
            logits = torch.cat(parts, dim=-1)
    return float((logits[..., :V] - ref).abs().max())


def save_reference(ckpt_dir: str) -> None:
    """Train the post-LN model 2 steps on one rank and save a checkpoint."""
    from loom.training.trainer import Trainer
    tr = Trainer(bert_cfg(True), mesh=ParallelMesh.single())
    for _ in range(2):
        tr.train_step()
    tr.save(ckpt_dir)


def checkpoint_case(ckpt_dir: str) -> dict:
    """Load the 1-rank checkpoint at TP=2: every shard (the vocabulary-parallel output bias
    included) equals the 1-rank weights, and the next step's loss is the same."""
    from loom.training.trainer import Trainer
    cfg = bert_cfg(True, tp=2)
    cfg.checkpoint.load = ckpt_dir
    par = Trainer(cfg, mesh=ParallelMesh.build(tp=2))
    ref_cfg = bert_cfg(True)
    ref_cfg.checkpoint.load = ckpt_dir
    ref = Trainer(ref_cfg, mesh=ParallelMesh.single())
    ref_params = dict(ref.model_chunks[0].named_parameters())
    err = max(rel_err(p.detach(), local_shard(ref_params[n].detach(), par.registry[n],
                                              par.mesh.tp_rank, 2))
              for n, p in par.model_chunks[0].named_parameters())
    loss = [par.global_loss(par.forward_backward(par.batches(par.train_ds, par.consumed_samples))),
            float(ref.forward_backward(ref.batches(ref.train_ds, ref.consumed_samples)))]
    return {"iteration": par.iteration, "weights": err, "loss": abs(loss[0] - loss[1]) / loss[1]}


def world2(ckpt_dir: str) -> dict:
    res = {"hf-tp2": hf_logits_case(), "ckpt": checkpoint_case(ckpt_dir)}
    for post in (False, True):
        ln = "post" if post else "pre"
        res[f"tp2-{ln}"] = parity_case(post, tp=2)
        res[f"tp2sp-{ln}"] = parity_case(post, tp=2, sp=True)
        res[f"pp2-{ln}"] = parity_case(post, pp=2)
    return res


def world4() -> dict:
    res = {f"tp2xdp2-{ln}": parity_case(ln == "post", tp=2, dp=2) for ln in ("pre", "post")}
    res["tp2xdp2-zero1-post"] = parity_case(True, tp=2, dp=2, zero=True)
    return res


@pytest.fixture(scope="module")
def results2(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("bert_ckpt"))
    save_reference(ckpt)
    return run_distributed(2, world2, ckpt)


@pytest.fixture(scope="module")
def results4():
    return run_distributed(4, world4)


def _check(case: dict) -> None:
    assert case["nparams"] > 10 and case["sop"], case
    assert case["loss"] < PARITY_RTOL and case["grad"] < PARITY_RTOL \
        and case["norm"] < PARITY_RTOL, case


@pytest.mark.parametrize("name", ["tp2-pre", "tp2-post", "tp2sp-pre", "tp2sp-post",
                                  "pp2-pre", "pp2-post"])
def test_parity_two_ranks(results2, name):
    for r in results2:
        _check(r[name])


@pytest.mark.parametrize("name", ["tp2xdp2-pre", "tp2xdp2-post", "tp2xdp2-zero1-post"])
def test_parity_tp2_dp2(results4, name):
    for r in results4:
        _check(r[name])


def test_checkpoint_reshards_to_tp2(results2):
    for r in results2:
        c = r["ckpt"]
        assert c["iteration"] == 2 and c["weights"] == 0.0 and c["loss"] < PARITY_RTOL, c


def test_pre_and_post_ln_differ():
    """The two orders are different functions of the same weights (not a no-op flag)."""
    from loom.training.trainer import Trainer
    losses = []
    for post in (False, True):
        tr = Trainer(bert_cfg(post), mesh=ParallelMesh.single())
        losses.append(float(tr.forward_backward(tr.batches(tr.train_ds, 0))))
    assert abs(losses[0] - losses[1]) > 1e-4, losses


def test_post_ln_matches_transformers_single_rank():
    assert hf_logits_case() < 1e-5


def test_post_ln_matches_transformers_tp2(results2):
    for r in results2:
        assert r["hf-tp2"] < 1e-5, r["hf-tp2"]


# -- data --------------------------------------------------------------------------------------

def _corpus(path, n_docs: int, seed: int = 0, n_words: int = 400) -> None:
    """Documents of pseudo-words built from syllables (many split into several WordPieces)."""
    rng = random.Random(seed)
    syll = ["ka", "lo", "mi", "ten", "ras", "qu", "ve", "dor", "sin", "pha", "ul", "bre"]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(n_words)]
    with open(path, "w") as f:
        for _ in range(n_docs):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(60)) + "."})
                    + "\n")


def _preprocess(tmp_path, n_docs: int, vocab: int = 300) -> str:
    from loom.data.preprocess import preprocess
    from loom.data.tokenizer import build_tokenizer
    src = tmp_path / "corpus.jsonl"
    _corpus(src, n_docs)
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_size=vocab, train_files=[str(src)])
    prefix = str(tmp_path / "bert")
    preprocess([str(src)], prefix, tok, append_eod=True, tokenizer_type="BertWordPieceLowerCase")
    return prefix


def test_masking_statistics(tmp_path):
    """~100k candidate tokens: 15% predicted, of those 80% [MASK] / 10% random / 10% kept (each
    within 1 point); whole words masked together; specials and padding never predicted."""
    from loom.data.bert_dataset import build_bert_datasets, special_ids, word_starts
    from loom.data.preprocess import load_tokenizer_for
    prefix = _preprocess(tmp_path, 1200)
    cfg = LoomConfig(model=ModelConfig(model_type="bert", seq_length=128, vocab_size=300,
                                       num_layers=2, hidden_size=32, num_attention_heads=4))
    cfg.data.data_path, cfg.data.split = prefix, "100,0,0"
    cfg.training.micro_batch_size, cfg.training.lr, cfg.training.train_iters = 4, 3e-4, 100
    cfg = cfg.validate(1)
    train, _, _ = build_bert_datasets(cfg)
    tok = load_tokenizer_for(prefix)
    sp, starts = special_ids(tok), word_starts(tok)
    assert (~starts).sum() > 20  # the tokenizer marks continuations
    cand = pred = masked = kept = split_words = 0
    k = 0
    while cand < 100_000:
        smp = train[k]
        k += 1
        toks, labels, lm, real = (smp[x].numpy() for x in ("tokens", "labels", "loss_mask",
                                                           "padding_mask"))
        c = (real == 1) & ~torch.isin(smp["labels"], torch.tensor(list(sp.values()))).numpy()
        assert not (lm.astype(bool) & ~c).any()  # only ordinary tokens are predicted
        cand += int(c.sum())
        pos = lm.astype(bool)
        pred += int(pos.sum())
        masked += int((toks[pos] == sp["[MASK]"]).sum())
        kept += int((toks[pos] == labels[pos]).sum())
        cont = c[1:] & c[:-1] & ~starts[labels[1:]]  # a word piece continuing the previous
        split_words += int((lm[1:][cont] != lm[:-1][cont]).sum())
    random_ = pred - masked - kept
    assert abs(pred / cand - 0.15) < 0.01, pred / cand
    assert abs(masked / pred - 0.8) < 0.01 and abs(kept / pred - 0.1) < 0.01 \
        and abs(random_ / pred - 0.1) < 0.01, (masked / pred, kept / pred, random_ / pred)
    assert split_words == 0


def test_sentence_order_samples():
    """Binary head: [CLS] A [SEP] B [SEP] with token types 0 | 1, swapped about half the time."""
    from loom.data.bert_dataset import build_bert_datasets
    cfg = bert_cfg(False)
    train, _, _ = build_bert_datasets(cfg)
    swapped = 0
    for k in range(400):
        smp = train[k]
        n = int(smp["padding_mask"].sum())
        toks, types = smp["labels"][:n], smp["types"][:n]
        seps = (toks == 2).nonzero().flatten().tolist()
        assert toks[0] == 1 and len(seps) == 2 and seps[1] == n - 1
        assert types[:seps[0] + 1].eq(0).all() and types[seps[0] + 1:].eq(1).all()
        assert smp["tokens"][n:].eq(0).all()
        swapped += int(smp["sop_labels"])
    assert 160 < swapped < 240


def test_cli_train_bert_loss_falls(tmp_path, monkeypatch):
    """`loom preprocess` (a WordPiece trained on the corpus) then `loom train --model-type bert
    --bert-binary-head`: the masked-LM loss at the end is below the start."""
    from loom.cli import main
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_PORT", "29651")
    src = tmp_path / "corpus.jsonl"
    _corpus(src, 60, n_words=40)  # ~5k tokens from 40 words: learnable in a few steps
    prefix = str(tmp_path / "tiny")
    with pytest.raises(SystemExit) as e:
        main(["preprocess", "--input", str(src), "--output-prefix", prefix, "--tokenizer-type",
              "BertWordPieceLowerCase", "--vocab-size", "300", "--append-eod"])
    assert e.value.code == 0
    log = tmp_path / "log.jsonl"
    with pytest.raises(SystemExit) as e:
        main(["train",  # pinned: loom's defaults before Megatron's (issue 21)
              "--adam-beta2", "0.95", "--lr-decay-style", "cosine",
              "--model-type", "bert", "--bert-binary-head", "--data-path", prefix,
              "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "32", "--micro-batch-size", "8", "--train-iters", "40",
              "--lr", "2e-3", "--lr-warmup-iters", "4", "--log-interval", "5",
              "--eval-interval", "40", "--eval-iters", "1", "--log-json", str(log),
              "--no-progress-bar", "--hidden-dropout", "0", "--attention-dropout", "0"])
    assert e.value.code == 0
    train = [json.loads(x) for x in log.read_text().splitlines()]
    train = [r for r in train if r["kind"] == "train"]
    assert "mlm_loss" in train[0] and "sop_loss" in train[0]
    assert train[-1]["mlm_loss"] < train[0]["mlm_loss"] - 1.0, [r["mlm_loss"] for r in train]


@pytest.mark.parametrize("flags,needle", [
    (dict(model_type="bert", cp=2), "--context-parallel-size"),
    (dict(model_type="gpt", post_layernorm=True), "--post-layernorm"),
    (dict(model_type="gpt", bert_binary_head=True), "--bert-binary-head"),
    (dict(model_type="bert", untie_embeddings_and_output_weights=True), "--untie"),
    (dict(model_type="bert", bert_binary_head=True, seq_length=4), "--seq-length"),
])
def test_refused(flags, needle):
    cp = flags.pop("cp", 1)
    cfg = LoomConfig(model=ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                       vocab_size=V, **{"seq_length": 16, **flags}))
    cfg.parallel.context_parallel_size = cp
    cfg.training.micro_batch_size, cfg.training.lr, cfg.training.train_iters = 4, 3e-4, 100
    with pytest.raises(ConfigError, match=needle):
        resolve_config(cfg, cp)


def test_convert_from_hf_then_train_loads_it(tmp_path):
    """`loom checkpoint convert --from-hf` of a saved `BertForMaskedLM`, loaded by the trainer
    (`--load --finetune`): its logits equal `transformers`'."""
    from loom.checkpoint.convert import from_hf
    from loom.training.trainer import Trainer
    hf, hc, ids, types, att = tiny_hf()
    hf.save_pretrained(str(tmp_path / "hf"))
    from_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
    cfg = LoomConfig(model=ModelConfig(model_type="bert", post_layernorm=True, num_layers=2,
                                       hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                                       seq_length=24, vocab_size=V, norm_epsilon=1e-12,
                                       hidden_dropout=0.0, attention_dropout=0.0))
    cfg.checkpoint.load, cfg.checkpoint.finetune = str(tmp_path / "ckpt"), True
    cfg.training.micro_batch_size = 2
    cfg.training.lr, cfg.training.train_iters = 3e-4, 100  # (never stepped)
    tr = Trainer(cfg.validate(1), mesh=ParallelMesh.single())
    model = tr.model_chunks[0].eval()
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=att, token_type_ids=types).logits
        logits, _ = model(input_ids=ids, tokentype_ids=types, padding_mask=att)
    assert float((logits[..., :V] - ref).abs().max()) < 1e-5


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recomputation_keeps_loss_and_gradients(granularity):
    from loom.training.trainer import Trainer
    grads = []
    for g in (None, granularity):
        cfg = bert_cfg(False)
        cfg.training.recompute_granularity = g
        tr = Trainer(cfg, mesh=ParallelMesh.single())
        loss = float(tr.forward_backward(tr.batches(tr.train_ds, 0)))
        grads.append((loss, {n: p.grad.clone() for n, p in tr.model_chunks[0].named_parameters()}))
    assert grads[0][0] == grads[1][0]
    assert all(torch.equal(grads[0][1][n], grads[1][1][n]) for n in grads[0][1])
