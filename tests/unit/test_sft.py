"""``--sft`` with ``--tokenizer-type SFTTokenizer`` (loom.data.sft; Megatron-LM d98e8a6's SFT
tokenizer and dataset): the loss mask covers exactly the predictions of assistant tokens, a
tiny run trains on a JSONL file with the hand-computed masked loss at step 1, and bad input is
one line, exit 2. The tokenizer is built here with ``tokenizers`` (no download)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math

import pytest
import torch

from loom.cli import main
from testkit import run_distributed

WORDS = "hi hello what is two plus three five the answer sky blue why System User Assistant"
SPECIALS = ["<unk>", "<s>", "</s>", "<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>",
            "<SPECIAL_233>"]
CONVS = [
    [{"role": "system", "content": "hi"}, {"role": "user", "content": "what is two plus three?"},
     {"role": "assistant", "content": "five"}, {"role": "user", "content": "why?"},
     {"role": "assistant", "content": "the answer is five."}],
    [{"role": "user", "content": "why is the sky blue?"},
     {"role": "assistant", "content": "hello, the sky is blue."}],
    [{"role": "system", "content": "hello"}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hi, what is the answer?"}],
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(tokenizer directory, JSONL file of CONVS x 4) built locally: a word-level tokenizer
    whose ids split at every non-word character, so the turns tokenize apart."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tmp = tmp_path_factory.mktemp("sft")
    chars = sorted(set(WORDS.replace(" ", "")) | set("\n ?.,"))
    vocab = {t: i for i, t in enumerate(SPECIALS + chars + WORDS.split())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|[^\w]"), behavior="isolated")
    tok.add_special_tokens(SPECIALS)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(str(tmp / "tok"))
    data = tmp / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVS * 4))
    return str(tmp / "tok"), str(data)


def _assistant_positions(tok, conv: list, prefix: int) -> set[int]:
    """Token positions of the assistant turns' text (after their first ``prefix`` tokens), found
    by rendering the conversation up to each turn (independent of the masking code)."""
    out, at = set(), 0
    for i, turn in enumerate(conv):
        n = len(tok._ids(conv[:i + 1])) - at
        if turn["role"] == "assistant":
            out |= set(range(at + prefix, at + n))
        at += n
    return out


@pytest.mark.parametrize("fmt,prefix", [("nemotron-h-aligned", 0), ("nemotron-nano-v2", 3),
                                        ("identity", 0)])
def test_the_loss_mask_covers_exactly_the_assistant_tokens(files, fmt, prefix):
    from loom.data.sft import IGNORE_INDEX, SFTDataset, SFTTokenizer
    tok = SFTTokenizer(files[0], fmt)
    conv = CONVS[0] if fmt != "identity" else \
        [dict(t, content=t["content"] + "\n") for t in CONVS[0]]  # identity joins the turns
    tokens, targets = tok.tokenize_conversation(conv)
    want = _assistant_positions(tok, conv, prefix)
    assert want and {i for i, t in enumerate(targets) if t != IGNORE_INDEX} == want
    n = len(tokens)
    for s in (n + 5, n - 4):  # padded, truncated
        sample = SFTDataset([conv], (0, 1), tok, s)[0]
        assert sample["tokens"].shape == sample["loss_mask"].shape == (s,)
        got = {i + 1 for i in torch.nonzero(sample["loss_mask"]).flatten().tolist()}
        assert got == {p for p in want if p < s and tokens[p] != tok.pad}  # label i = token i+1
        assert sample["tokens"][:min(n, s)].tolist() == tokens[:min(n, s)].tolist()
        assert set(sample["tokens"][n:].tolist()) <= {tok.pad}
        keep = torch.nonzero(sample["loss_mask"]).flatten().tolist()
        assert sample["labels"][keep].tolist() == [int(tokens[i + 1]) for i in keep]


def _sft_run(argv):
    from loom.training.cli import add_arguments, prepare
    from loom.training.trainer import Trainer
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    trainer = Trainer(prepare(parser.parse_args(argv)))
    batch = trainer.batches(trainer.train_ds, 0)[0]
    chunk = trainer.model_chunks[0]
    with torch.no_grad():
        logits = chunk(input_ids=batch["tokens"], labels=None,
                       position_ids=batch.get("position_ids"))
    logp = torch.log_softmax(logits.double(), -1)
    per_token = -logp.gather(-1, batch["labels"][..., None]).squeeze(-1)
    mask = batch["loss_mask"].double()
    hand = float((per_token * mask).sum() / mask.sum())
    return [r["loss"] for r in trainer.train()], hand, float(per_token.mean()), \
        float(mask.sum()), mask.numel()


def test_sft_trains_with_the_masked_loss(files):
    tok, data = files
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "24", "--max-position-embeddings", "24", "--micro-batch-size", "2",
            "--global-batch-size", "2", "--train-iters", "3", "--lr", "1e-3", "--eval-iters",
            "0", "--no-progress-bar", "--make-vocab-size-divisible-by", "1",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--sft", "--tokenizer-type",
            "SFTTokenizer", "--tokenizer-model", tok, "--data-path", data, "--split", "10,1,1"]
    losses, hand, unmasked, kept, total = run_distributed(1, _sft_run, argv,
                                                          start_method="fork")[0]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert 0 < kept < total  # the mask was active
    assert losses[0] == pytest.approx(hand, rel=1e-5)
    assert unmasked != pytest.approx(hand, rel=1e-3)


def _train(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(["train", *argv])
            code = 0
        except SystemExit as e:
            code = e.code or 0
    return code, err.getvalue().strip()


def test_bad_sft_input_is_one_line(files, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    tok, data = files
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": CONVS[1]}) + "\n{not json\n")
    orphan = tmp_path / "orphan.jsonl"
    orphan.write_text(json.dumps({"messages": CONVS[1]}) + "\n" + json.dumps(
        {"messages": [{"role": "system", "content": "hi"}, CONVS[1][1]]}) + "\n")
    packed = tmp_path / "packed.jsonl"
    packed.write_text(json.dumps({"messages": CONVS[0] + CONVS[2]}) + "\n")
    base = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--sft",
            "--tokenizer-type", "SFTTokenizer", "--tokenizer-model", tok]
    for argv, words in (
            (["--data-path", str(tmp_path / "missing.jsonl")], "missing.jsonl: no such file"),
            (["--data-path", str(bad)], "line 2 is not JSON"),
            (["--data-path", str(packed)], "line 1 packs 2 conversations"),
            (["--data-path", str(orphan)], "line 2: turn 1, an assistant turn, does not follow"),
            (["--data-path", data, "--sft-tokenizer-prompt-format", "chatml"],
             "--sft-tokenizer-prompt-format chatml: unknown"),
            (["--data-path", data, "--tokenizer-model", str(tmp_path)],
             "not a Hugging Face tokenizer directory"),
            (["--mock-data", "--vocab-size", "64"], "--sft with --mock-data")):
        code, err = _train(base + argv)
        assert code == 2 and err.startswith("loom train: error: ") and "\n" not in err, err
        assert words in err, err
    code, err = _train([a for a in base if a != "--sft"] + ["--data-path", data])
    assert code == 2 and "give --sft" in err, err


def test_prompt_format_default_is_the_tokenizers_template_without_masking(files, tmp_path):
    """Megatron's ``default``: the tokenizer's own chat template, pad = its pad (else eos),
    every token a target; a tokenizer without a template is refused for it."""
    from transformers import AutoTokenizer

    from loom.data.sft import SFTTokenizer
    from loom.errors import ConfigError
    with pytest.raises(ConfigError, match="has no chat template"):
        SFTTokenizer(files[0], "default")
    hf = AutoTokenizer.from_pretrained(files[0], local_files_only=True)
    hf.chat_template = "{% for m in messages %}{{ m['content'] + '\n' }}{% endfor %}"
    hf.save_pretrained(str(tmp_path / "tok"))
    tok = SFTTokenizer(str(tmp_path / "tok"), "default")
    tokens, targets = tok.tokenize_conversation(CONVS[1])
    assert tok.pad == tok.eod == hf.eos_token_id and targets.tolist() == tokens.tolist()
    assert hf.convert_ids_to_tokens(tokens.tolist())[:2] == ["why", " "]
