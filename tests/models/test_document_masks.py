"""``--reset-attention-mask`` and ``--reset-position-ids`` (loom.data.document_masks,
loom.config.document_masks): the samples' document starts and reset positions against
Megatron-Core 0.16.1's own ``_get_ltor_masks_and_position_ids``; a packed sample's logits against
each of its documents run alone (what the mask is for); the refusals; and a ``loom train`` run
whose loss is the masked model's."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from loom.config import LoomConfig
from loom.data.document_masks import DocumentResets, document_starts
from loom.errors import ConfigError
from loom.models import get_family
from loom.models.attention import document_causal_mask
from loom.parallel.mesh import ParallelMesh
from loom.parallel.parallelize import build_model
from testkit import run_distributed
from testkit.config import tiny_config, tiny_model

EOD = 7


def test_starts_positions_and_mask_are_megatron_cores():
    """Over random samples (EOD at any index, several in a row, none, at the end), the reset
    position ids are ``arange - starts`` and the mask is ``document_causal_mask(starts)``,
    each equal to Megatron-Core's ``_get_ltor_masks_and_position_ids(reset_position_ids=True,
    reset_attention_mask=True)`` (its mask is True where masked)."""
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
    g = torch.Generator().manual_seed(0)
    eods = 0
    for _ in range(300):
        s = int(torch.randint(1, 33, (1,), generator=g))
        tokens = torch.randint(0, 9, (s,), generator=g)
        eods += int((tokens == EOD).sum())
        mask, _, positions = _get_ltor_masks_and_position_ids(tokens, EOD, True, True, False,
                                                              True)
        starts = document_starts(tokens, EOD)
        assert torch.equal(torch.arange(s) - starts, positions)
        assert torch.equal(document_causal_mask(starts[None])[0, 0], ~mask[0])
    assert eods > 100  # the samples held documents to reset at
    batch = torch.stack([torch.tensor([1, EOD, 2, 3]), torch.tensor([EOD, EOD, 4, 5])])
    assert document_starts(batch, EOD).tolist() == [[0, 0, 2, 2], [0, 1, 2, 2]]


def _packed(lengths: list[int], vocab: int, seed: int = 0) -> tuple[torch.Tensor, list]:
    """One sample ``[1, sum(lengths)]`` of documents of these lengths, each ending in EOD, and
    the documents' slices."""
    g = torch.Generator().manual_seed(seed)
    docs, spans, at = [], [], 0
    for n in lengths:
        body = torch.randint(0, EOD, (n - 1,), generator=g)
        docs.append(torch.cat([body, torch.tensor([EOD])]))
        spans.append(slice(at, at + n))
        at += n
    return torch.cat(docs)[None], spans


def _doc_inputs(tokens: torch.Tensor, positions: bool) -> dict:
    starts = document_starts(tokens, EOD)
    out = {"document_starts": starts}
    if positions:
        out["document_position_ids"] = torch.arange(tokens.shape[1]) - starts
    return out


@pytest.mark.parametrize("family,positions", [("llama", False), ("gpt", True)])
def test_a_packed_sample_is_its_documents_run_alone(family, positions):
    """With the document mask (and, for GPT-2's learned positions, the reset position ids)
    the logits of a sample packing three documents equal each document's logits run alone
    (RoPE depends on relative positions only, so its sequence positions need no reset, as in
    Megatron-Core); without the mask the later documents' logits differ."""
    cfg = tiny_model(family, dict(vocab_size=16, num_query_groups=None))
    model = build_model(get_family("gpt"), cfg, ParallelMesh.single(), seed=3).eval()
    tokens, spans = _packed([5, 6, 5], vocab=16)
    with torch.no_grad():
        packed = model(input_ids=tokens, **_doc_inputs(tokens, positions))  # [1, s, Vp]
        plain = model(input_ids=tokens)
        for span in spans:
            alone = model(input_ids=tokens[:, span])
            torch.testing.assert_close(packed[:, span], alone, rtol=1e-5, atol=1e-5)
        assert (plain[:, spans[1]] - packed[:, spans[1]]).abs().max() > 1e-3


def _config(family: str = "gpt", world: int = 1, **flags) -> LoomConfig:
    """The resolved tiny config (the family's rules included)."""
    return tiny_config(family, world=world,
                       **{"mock_data": True, "tokenizer_type": "NullTokenizer", **flags})


@pytest.mark.parametrize("flags,words", [
    (dict(reset_position_ids=True, mtp_num_layers=1), "--mtp-num-layers"),
    (dict(dataloader_inter_document_masking=True, mock_data=False, fim_data=True,
          data_path="/nonexistent"), "--fim-data"),
])
def test_partial_or_contradictory_uses_are_refused_in_one_line(flags, words):
    with pytest.raises(ConfigError) as e:
        _config(**flags)
    msg = str(e.value)
    assert words in msg and "drop" in msg and "\n" not in msg


@pytest.mark.parametrize("family,flags,words", [
    ("mamba", dict(reset_attention_mask=True), "--model-type mamba"),
    ("gpt", dict(reset_attention_mask=True, context_parallel_size=2, world=2),
     "--context-parallel-size > 1"),
    ("gpt", dict(reset_attention_mask=True, multi_latent_attention=True, q_lora_rank=None,
                 kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8,
                 position_embedding_type="none"), "--multi-latent-attention"),
    ("gpt", dict(dataloader_inter_document_masking=True), "--mock-data"),
    ("llama", dict(reset_position_ids=True), "RoPE ignores the position ids"),
])
def test_where_loom_cannot_apply_them_the_run_is_told_at_start(family, flags, words):
    """Where loom's mask is not applied (as Megatron's Transformer Engine attention never
    applies it), the run trains without it and says so once at start, naming why."""
    from loom.config.document_masks import document_plan
    from loom.training.script_checks import start_notes
    cfg = _config(family, **flags)
    takes = get_family(cfg.model.model_type).takes_documents
    assert not document_plan(cfg, takes).active
    notes = [n for n in start_notes(cfg, {}) if words in n]
    assert len(notes) == 1 and "no " in notes[0], start_notes(cfg, {})


def test_the_plan_of_each_flag():
    from loom.config.document_masks import DocumentPlan, document_plan
    learned = tiny_config("gpt", reset_position_ids=True, reset_attention_mask=True).validate(1)
    assert document_plan(learned) == DocumentPlan(attention=True, positions=True)
    rope = tiny_config("llama", reset_position_ids=True).validate(1)
    assert document_plan(rope) == DocumentPlan()
    inter = tiny_config("gpt", mock_data=False, data_path="/d/x",
                        dataloader_inter_document_masking=True).validate(1)
    assert document_plan(inter) == DocumentPlan(True, True, True)


def _masked_run(argv):
    from loom.training.cli import add_arguments, prepare
    from loom.training.trainer import Trainer
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    trainer = Trainer(prepare(parser.parse_args(argv)))
    assert isinstance(trainer.train_ds, DocumentResets)
    batch = trainer.batches(trainer.train_ds, 0)[0]
    chunk = trainer.model_chunks[0]
    extra = {k: batch[k] for k in ("document_starts", "document_position_ids")}
    with torch.no_grad():
        logits = chunk(input_ids=batch["tokens"], position_ids=batch["position_ids"], **extra)
        plain = chunk(input_ids=batch["tokens"], position_ids=batch["position_ids"])

    def loss(out):
        logp = torch.log_softmax(out.double(), -1)
        return float(-logp.gather(-1, batch["labels"][..., None]).mean())
    eods = int((batch["tokens"] == trainer.train_ds.eod).sum())
    return [r["loss"] for r in trainer.train()], loss(logits), loss(plain), eods


def test_loom_train_trains_the_masked_model():
    """``loom train --reset-attention-mask --reset-position-ids`` on mock data (NullTokenizer:
    EOD is its added id): the first step's loss is the masked model's, not the plain one's."""
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--eval-iters",
            "0", "--no-progress-bar", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "12",
            "--make-vocab-size-divisible-by", "1", "--reset-attention-mask",
            "--reset-position-ids", "--position-embedding-type", "learned_absolute"]
    losses, masked, plain, eods = run_distributed(1, _masked_run, argv, start_method="fork")[0]
    assert eods >= 2 and len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert losses[0] == pytest.approx(masked, rel=1e-5)
    assert plain != pytest.approx(masked, rel=1e-4)


def test_inter_document_masking_reads_the_datasets_own_boundaries(tmp_path):
    """``--dataloader-inter-document-masking``: documents of distinct constant tokens (doc i
    holds only the token i, no end-of-document ids) give samples whose document starts are
    exactly where the token changes, through a blend too; the positions restart there."""
    import numpy as np

    from loom.data.blended import BlendedDataset
    from loom.data.gpt_dataset import GPTDataset
    from loom.data.indexed import IndexedDataset, IndexedDatasetBuilder
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(str(tmp_path / "ds"), np.uint16)
    for i in range(60):
        builder.add_document(np.full(int(rng.integers(1, 20)), i))
    builder.finalize()
    ds = GPTDataset(IndexedDataset(str(tmp_path / "ds")), (0, 60), seq_length=16, seed=1)
    blend = BlendedDataset([ds, ds], [0.5, 0.5], ["a", "b"])
    resets = DocumentResets(blend, None, positions=True, attention=True, own_documents=True)
    cuts = 0
    for k in range(40):
        sample = resets[k]
        tokens = sample["tokens"]
        change = torch.cat([torch.tensor([True]), tokens[1:] != tokens[:-1]])
        idx = torch.arange(16)
        want = torch.cummax(torch.where(change, idx, 0), 0).values
        assert torch.equal(sample["document_starts"], want), (k, tokens)
        assert torch.equal(sample["document_position_ids"], idx - want)
        cuts += int(change[1:].sum())
    assert cuts > 40




def test_loom_train_masks_at_the_datasets_documents(tmp_path):
    """Through the trainer (``--data-path`` of documents of distinct constant tokens, GPT-2's
    learned positions): the micro-batches carry the documents' starts and restarted positions,
    and training runs."""
    import numpy as np

    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    from testkit.data import write_dataset
    rng = np.random.default_rng(1)
    docs = [[1 + i % 90] * int(rng.integers(2, 12)) for i in range(80)]
    write_dataset(tmp_path / "docs", 1, 90, docs=docs)
    cfg = tiny_config("gpt", mock_data=False, data_path=str(tmp_path / "docs"), split="90,10,0",
                      global_batch_size=2, train_iters=2, eval_iters=0, no_progress_bar=True,
                      dataloader_inter_document_masking=True).validate(1)
    tr = Trainer(cfg, mesh=ParallelMesh.single())
    assert isinstance(tr.train_ds, DocumentResets) and tr.train_ds.own_documents
    batch = tr.batches(tr.train_ds, 0)[0]
    tokens = batch["tokens"]
    change = torch.cat([torch.ones_like(tokens[:, :1], dtype=torch.bool),
                        tokens[:, 1:] != tokens[:, :-1]], dim=1)
    idx = torch.arange(tokens.shape[1]).expand_as(tokens)
    want = torch.cummax(torch.where(change, idx, 0), 1).values
    assert int(change[:, 1:].sum()) >= 2
    assert torch.equal(batch["document_starts"], want)
    assert torch.equal(batch["document_position_ids"], idx - want)
    assert all(math.isfinite(r["loss"]) for r in tr.train())
