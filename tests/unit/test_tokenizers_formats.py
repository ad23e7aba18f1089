"""The tokenizers Megatron-LM's scripts name (issue 23, item 2), each equal to its own library:
SentencePiece models (``Llama2Tokenizer``, ``GPTSentencePieceTokenizer``) against
``sentencepiece``, tiktoken ranks (``TikTokenizer``, ``--tiktoken-pattern`` v1/v2) against
``tiktoken`` (offline: a local ``.tiktoken`` file trained here), Hugging Face tokenizer
directories, GPT-2 BPE files and ``NullTokenizer``; at train time the flags' tokenizer is
cross-checked against the dataset's stored one (a mismatch refused)."""

from __future__ import annotations

import argparse
import base64
import io

import pytest

from loom.data.tokenizer import build_tokenizer, train_byte_level_bpe
from loom.errors import ConfigError

TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs "
        "12345. Sphinx of black quartz, judge my vow! Üñïçødé text, naïve café.\n") * 40
SAMPLES = ["Hello world", "The quick brown fox", "  two  spaces and\ttab\n\nx",
           "naïve café 12345 🙂 ẞ", "", "judge my vow!!", "don't you're 1234567"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import sentencepiece as spm
    from tiktoken._educational import bpe_train

    from loom.data.tokenizer_formats import PATTERN_V2
    d = tmp_path_factory.mktemp("tok")
    lines = TEXT.splitlines() * 5
    for kind, size, extra in (("bpe", 400, dict(byte_fallback=True, add_dummy_prefix=True,
                                                 normalization_rule_name="identity",
                                                 remove_extra_whitespaces=False)),
                              ("unigram", 150, {})):
        buf = io.BytesIO()
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf,
                                       vocab_size=size, model_type=kind, minloglevel=2,
                                       hard_vocab_limit=False, **extra)
        (d / f"{kind}.model").write_bytes(buf.getvalue())
    ranks = bpe_train(TEXT[:2000], 300, PATTERN_V2)
    (d / "r.tiktoken").write_text("".join(f"{base64.b64encode(k).decode()} {v}\n"
                                          for k, v in sorted(ranks.items(), key=lambda kv: kv[1])))
    return d, ranks


@pytest.mark.parametrize("kind,tokenizer_type", [("bpe", "Llama2Tokenizer"),
                                                 ("bpe", "GPTSentencePieceTokenizer"),
                                                 ("unigram", "SentencePieceTokenizer")])
def test_sentencepiece_equals_the_library(files, kind, tokenizer_type):
    import sentencepiece as spm
    path = str(files[0] / f"{kind}.model")
    sp = spm.SentencePieceProcessor(model_file=path)
    tok = build_tokenizer(tokenizer_type, tokenizer_model=path)
    assert tok.vocab_size == sp.vocab_size() and tok.eod == sp.eos_id()
    for s in SAMPLES:
        assert tok.encode(s) == sp.encode(s), s
        if kind == "bpe":  # byte fallback: every text round-trips
            assert tok.decode(tok.encode(s)) == sp.decode(sp.encode(s)) == s


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktoken_equals_the_library(files, pattern):
    import tiktoken

    from loom.data.tokenizer_formats import PATTERN_V1, PATTERN_V2, TIKTOKEN_SPECIALS
    d, ranks = files
    tok = build_tokenizer("TikTokenizer", tokenizer_model=str(d / "r.tiktoken"),
                          tiktoken_pattern=pattern)
    specials = list(TIKTOKEN_SPECIALS) + [f"<SPECIAL_{i}>" for i in range(7, 1000)]
    enc = tiktoken.Encoding("megatron", pat_str=PATTERN_V1 if pattern == "v1" else PATTERN_V2,
                            mergeable_ranks={k: v + 1000 for k, v in ranks.items()},
                            special_tokens={s: i for i, s in enumerate(specials)})
    assert tok.vocab_size == 1000 + len(ranks) and tok.eod == specials.index("</s>") == 2
    for s in SAMPLES:
        assert tok.encode(s) == enc.encode_ordinary(s), s
        assert tok.decode(tok.encode(s)) == s
    cut = build_tokenizer("TikTokenizer", tokenizer_model=str(d / "r.tiktoken"),
                          vocab_size=1200, tiktoken_pattern=pattern)  # --vocab-size caps it
    assert cut.vocab_size == 1200


def test_null_tokenizer_hf_directory_and_hub_names(tmp_path):
    null = build_tokenizer("NullTokenizer", vocab_size=100)
    assert null.encode("3 14 15 99") == [3, 14, 15, 99] and null.vocab_size == 101
    assert null.eod == 100 and null.decode([3, 14]) == "3 14"
    with pytest.raises(ConfigError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")
    bpe = train_byte_level_bpe(TEXT.splitlines(), 300)
    (tmp_path / "hf").mkdir()
    bpe.save(str(tmp_path / "hf" / "tokenizer.json"))
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "hf"))
    assert tok.encode("quick fox") == bpe.encode("quick fox")
    with pytest.raises(ConfigError, match="hub name"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model="deepseek-ai/DeepSeek-V3")


def _prepare(argv, monkeypatch):
    from loom.training.cli import add_arguments, prepare
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK", raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return prepare(parser.parse_args(
        ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
         "--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
         *argv]))


def test_train_time_tokenizer_files_are_checked_against_the_data(tmp_path, monkeypatch):
    """GPT-2 BPE files (--vocab-file / --merge-file) and a SentencePiece model at train time:
    the dataset's stored tokenizer must be the same, else the run is refused."""
    from loom.data.preprocess import preprocess
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT)
    bpe = train_byte_level_bpe(TEXT.splitlines(), 300)
    (tmp_path / "gpt2").mkdir()
    bpe.hf.model.save(str(tmp_path / "gpt2"))  # vocab.json + merges.txt
    gpt2 = build_tokenizer("GPT2BPETokenizer", str(tmp_path / "gpt2" / "vocab.json"),
                           str(tmp_path / "gpt2" / "merges.txt"))
    preprocess([str(corpus)], str(tmp_path / "d"), gpt2, tokenizer_type="GPT2BPETokenizer")
    files = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file",
             str(tmp_path / "gpt2" / "vocab.json"), "--merge-file",
             str(tmp_path / "gpt2" / "merges.txt")]
    cfg = _prepare(["--data-path", str(tmp_path / "d"), *files], monkeypatch)
    assert cfg.model.vocab_size == gpt2.vocab_size and cfg.data.merge_file.endswith("merges.txt")
    other = train_byte_level_bpe(TEXT.upper().splitlines(), 300)
    (tmp_path / "other").mkdir()
    other.hf.model.save(str(tmp_path / "other"))
    with pytest.raises(ConfigError, match="not the tokenizer"):
        _prepare(["--data-path", str(tmp_path / "d"), "--tokenizer-type", "GPT2BPETokenizer",
                  "--vocab-file", str(tmp_path / "other" / "vocab.json"), "--merge-file",
                  str(tmp_path / "other" / "merges.txt")], monkeypatch)
    sp = build_tokenizer("Llama2Tokenizer", tokenizer_model=str(_sp_model(tmp_path)))
    preprocess([str(corpus)], str(tmp_path / "s"), sp, tokenizer_type="Llama2Tokenizer")
    cfg = _prepare(["--data-path", str(tmp_path / "s"), "--tokenizer-type", "Llama2Tokenizer",
                    "--tokenizer-model", str(tmp_path / "sp.model"), "--tiktoken-pattern", "v2"],
                   monkeypatch)
    assert cfg.model.vocab_size == sp.vocab_size and cfg.data.tiktoken_pattern == "v2"
    assert cfg.data.tokenizer_model.endswith("sp.model")


def test_null_tokenizer_adds_the_end_of_document_id(monkeypatch):
    cfg = _prepare(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"],
                   monkeypatch)
    assert cfg.model.vocab_size == 101  # Megatron's _NullTokenizer: V ids + the eod id


def _sp_model(tmp_path):
    import sentencepiece as spm
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(TEXT.splitlines() * 5),
                                   model_writer=buf, vocab_size=400, model_type="bpe",
                                   byte_fallback=True, minloglevel=2, hard_vocab_limit=False)
    (tmp_path / "sp.model").write_bytes(buf.getvalue())
    return tmp_path / "sp.model"
