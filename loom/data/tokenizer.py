"""Tokenizers: a thin wrapper over Hugging Face ``tokenizers`` (GPT-2 BPE, any tokenizer.json, or a
byte-level BPE trained on the corpus). Every tokenizer saves to a single ``tokenizer.json``.
"""

from __future__ import annotations

import os
from typing import Iterable, Iterator, Optional, Sequence

from loom.data.documents import EOD_TOKEN, read_documents
from loom.errors import ConfigError

_EOD_FALLBACKS = (EOD_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]")
TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "ByteLevelBPETrained",
                   "BertWordPieceLowerCase", "BertWordPieceCase", "Llama2Tokenizer",
                   "GPTSentencePieceTokenizer", "SentencePieceTokenizer", "TikTokenizer",
                   "NullTokenizer")
SENTENCEPIECE_TYPES = ("Llama2Tokenizer", "GPTSentencePieceTokenizer", "SentencePieceTokenizer")
BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# Hugging Face's tokenizer roles and the spellings that fill them, first found wins
# (``Tokenizer.special_tokens``); eos is loom's end-of-document token, always
SPECIAL_ROLES = {"bos_token": ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"),
                 "pad_token": ("<pad>", "[PAD]", "<|pad|>"), "unk_token": ("<unk>", "[UNK]"),
                 "cls_token": ("[CLS]", "<cls>"), "sep_token": ("[SEP]", "<sep>"),
                 "mask_token": ("[MASK]", "<mask>")}


class Tokenizer:
    """Wraps a ``tokenizers.Tokenizer``.

    Attributes:
        vocab_size: int, number of ids including special/added tokens.
        eod: int, id of the end-of-document token (``<|endoftext|>``; for foreign tokenizer.json
            files without it, the first of ``</s>``, ``<|end_of_text|>``, ``<eos>``, ... found,
            special tokens before plain ones).

    Raises:
        ConfigError: (naming ``--tokenizer-model``) when no end-of-document token exists.
    """

    def __init__(self, hf_tokenizer, eod: Optional[int] = None):
        self.hf = hf_tokenizer
        if eod is None:  # a special (added) token first: Gemma has a plain "</s>" and "<eos>"
            try:
                special = {t.content for t in hf_tokenizer.get_added_tokens_decoder().values()
                           if t.special}
            except AttributeError:  # tokenizers < 0.14
                special = set()
            for tok in sorted(_EOD_FALLBACKS, key=lambda t: t not in special):
                eod = hf_tokenizer.token_to_id(tok)
                if eod is not None:
                    break
        if eod is None:
            raise ConfigError(f"tokenizer has no end-of-document token (looked for {list(_EOD_FALLBACKS)}); "
                              f"give --tokenizer-model a tokenizer.json that defines {EOD_TOKEN}")
        self.eod = int(eod)
        self.vocab_size = int(hf_tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """``[encode(t) for t in texts]``, parallelised inside ``tokenizers``."""
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of a sequence of ids (special tokens kept)."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_str(self) -> str:
        """The tokenizer.json text."""
        return self.hf.to_str()

    @classmethod
    def from_str(cls, s: str) -> "Tokenizer":
        """Inverse of :meth:`to_str`."""
        from tokenizers import Tokenizer as HFTokenizer
        return cls(HFTokenizer.from_str(s))

    def save(self, path: str) -> None:
        """Write ``tokenizer.json`` to ``path`` atomically (temp file + ``os.replace``)."""
        tmp = f"{path}.tmp{os.getpid()}"
        self.hf.save(tmp)
        os.replace(tmp, path)

    def special_tokens(self, bos_token: Optional[str] = None, generative: bool = True) -> dict:
        """The Hugging Face roles of this tokenizer's tokens (``tokenizer_config.json``):
        ``{"eos_token": the end-of-document token, "bos_token": ..., "pad_token": ..., ...}``.
        A role is filled by the first of its :data:`SPECIAL_ROLES` spellings that is a special
        (added) token. With ``generative`` (a causal model) the BOS is ``bos_token`` when given
        and present (the family's: Gemma's ``<bos>``), else a special BOS token, else the
        end-of-document token as GPT-2 does: loom's documents follow an end-of-document token,
        so that is what a first token is conditioned on. Encoders (``generative`` False) get
        no BOS / EOS."""
        try:
            special = {t.content for t in self.hf.get_added_tokens_decoder().values()
                       if t.special}
        except AttributeError:  # tokenizers < 0.14
            special = set()
        roles = {}
        for role, spellings in SPECIAL_ROLES.items():
            found = next((t for t in spellings if t in special), None)
            if found is not None:
                roles[role] = found
        if not generative:
            roles.pop("bos_token", None)
            return roles
        roles["eos_token"] = self.hf.id_to_token(self.eod)
        if bos_token is not None and self.hf.token_to_id(bos_token) is not None:
            roles["bos_token"] = bos_token
        roles.setdefault("bos_token", roles["eos_token"])
        return roles

    def differs_from(self, other: "Tokenizer") -> Optional[str]:
        """What tells this tokenizer from ``other`` (vocabulary size, end-of-document id, the
        token -> id map, the ids of a probe text), or None when they tokenize alike."""
        if self.vocab_size != other.vocab_size:
            return f"{self.vocab_size} ids vs {other.vocab_size}"
        if self.eod != other.eod:
            return f"end-of-document id {self.eod} vs {other.eod}"
        mine = self.hf.get_vocab(with_added_tokens=True)
        theirs = other.hf.get_vocab(with_added_tokens=True)
        if mine != theirs:
            diff = sorted(set(mine.items()) ^ set(theirs.items()))[:1]
            return f"token -> id maps differ (e.g. {diff[0] if diff else '?'})"
        probe = "The 3 quick brown foxes jump over 12 lazy dogs. Ünïcödé  ok\n"
        if self.encode(probe) != other.encode(probe):
            return "the same text tokenizes differently"
        return None

    @classmethod
    def load(cls, path: str) -> "Tokenizer":
        """Load a ``tokenizer.json``; ConfigError naming ``--tokenizer-model`` if it is missing."""
        from tokenizers import Tokenizer as HFTokenizer
        if not os.path.isfile(path):
            raise ConfigError(f"--tokenizer-model {path}: no such file; give a tokenizer.json")
        return cls(HFTokenizer.from_file(str(path)))


def _byte_level(model):
    from tokenizers import Tokenizer as HFTokenizer, decoders, pre_tokenizers, processors
    tok = HFTokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def gpt2_bpe(vocab_file: str, merge_file: str) -> Tokenizer:
    """GPT-2 byte-level BPE from ``vocab.json``/``encoder.json`` + ``merges.txt``/``vocab.bpe``.

    Raises ConfigError naming ``--vocab-file``/``--merge-file`` when a file is missing.
    """
    from tokenizers import models
    for flag_, p in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
        if not p or not os.path.isfile(p):
            raise ConfigError(f"{flag_} {p}: GPT2BPETokenizer needs --vocab-file (vocab.json or encoder.json) "
                              f"and --merge-file (merges.txt or vocab.bpe)")
    tok = _byte_level(models.BPE.from_file(vocab_file, merge_file))
    tok.add_special_tokens([EOD_TOKEN])  # already id 50256 in GPT-2's vocab: makes it atomic in text
    return Tokenizer(tok)


def train_byte_level_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE of ``vocab_size`` ids (``<|endoftext|>`` = id 0) on an iterator of texts."""
    from tokenizers import models, pre_tokenizers, trainers
    if not vocab_size or vocab_size < 257:
        raise ConfigError(f"--vocab-size {vocab_size}: a byte-level BPE needs at least 257 ids (256 bytes + "
                          f"{EOD_TOKEN}); give e.g. --vocab-size 8192")
    tok = _byte_level(models.BPE())
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=[EOD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(tok, eod=tok.token_to_id(EOD_TOKEN))


def bert_wordpiece(lower_case: bool, vocab_file: Optional[str] = None,
                   vocab_size: Optional[int] = None, texts: Optional[Iterable[str]] = None) -> Tokenizer:
    """BERT's WordPiece (Megatron's ``BertWordPieceLowerCase`` / ``BertWordPieceCase``): loaded
    from a ``vocab.txt`` (one token per line, ``##`` marks a word continuation) or trained on
    ``texts`` with ``vocab_size`` ids; [PAD] [UNK] [CLS] [SEP] [MASK] are special tokens and
    [SEP] ends documents. Raises ConfigError naming ``--vocab-file`` / ``--vocab-size``."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import trainers
    if vocab_file:
        if not os.path.isfile(vocab_file):
            raise ConfigError(f"--vocab-file {vocab_file}: no such file; give BERT's vocab.txt")
        tok = HFTokenizer(models.WordPiece.from_file(vocab_file, unk_token="[UNK]"))
    else:
        tok = HFTokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lower_case, strip_accents=lower_case or None)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    if not vocab_file:
        if not vocab_size or vocab_size <= len(BERT_SPECIAL_TOKENS):
            raise ConfigError(f"--vocab-size {vocab_size}: training a WordPiece needs a size "
                              f"(e.g. 8192), or give --vocab-file vocab.txt")
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=2,
                                            show_progress=False,
                                            special_tokens=list(BERT_SPECIAL_TOKENS))
        tok.train_from_iterator(texts or [], trainer=trainer)
    missing = [t for t in BERT_SPECIAL_TOKENS if tok.token_to_id(t) is None]
    if missing:
        raise ConfigError(f"--vocab-file {vocab_file}: lacks the special tokens {missing}")
    tok.add_special_tokens(list(BERT_SPECIAL_TOKENS))
    return Tokenizer(tok, eod=tok.token_to_id("[SEP]"))


def build_tokenizer(tokenizer_type: str, vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                    tokenizer_model: Optional[str] = None, vocab_size: Optional[int] = None,
                    train_files: Optional[Sequence[str]] = None, json_keys: Sequence[str] = ("text",),
                    tiktoken_pattern: Optional[str] = None) -> Tokenizer:
    """Build a :class:`Tokenizer` from Megatron-style flags.

    * ``GPT2BPETokenizer``: ``vocab_file`` + ``merge_file`` (GPT-2 files).
    * ``HuggingFaceTokenizer``: ``tokenizer_model`` = path to a ``tokenizer.json``.
    * ``ByteLevelBPETrained``: train a byte-level BPE of ``vocab_size`` on ``train_files``
      (.txt/.jsonl, read as :func:`loom.data.documents.read_documents` does).
    * ``BertWordPieceLowerCase`` / ``BertWordPieceCase``: BERT's WordPiece from ``vocab_file``
      (``vocab.txt``), or trained with ``vocab_size`` ids on ``train_files``.
    * ``Llama2Tokenizer`` / ``GPTSentencePieceTokenizer`` / ``SentencePieceTokenizer``: the
      SentencePiece model ``tokenizer_model``; ``TikTokenizer``: tiktoken ranks
      ``tokenizer_model`` split by ``tiktoken_pattern`` (default v2), ``vocab_size`` ids at most;
      ``NullTokenizer``: ids written as numbers, ``vocab_size`` + 1 ids
      (:mod:`loom.data.tokenizer_formats`). ``HuggingFaceTokenizer`` also takes a directory.

    Raises ConfigError naming the missing/invalid flag (``--tokenizer-type``, ``--vocab-file``,
    ``--merge-file``, ``--tokenizer-model``, ``--vocab-size``, ``--input``).
    """
    if tokenizer_type == "GPT2BPETokenizer":
        return gpt2_bpe(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        if not tokenizer_model:
            raise ConfigError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH/tokenizer.json")
        from loom.data.tokenizer_formats import huggingface_file
        return Tokenizer.load(huggingface_file(tokenizer_model))
    if tokenizer_type in SENTENCEPIECE_TYPES:
        from loom.data.tokenizer_formats import sentencepiece_tokenizer
        return Tokenizer(*sentencepiece_tokenizer(tokenizer_model))
    if tokenizer_type == "TikTokenizer":
        from loom.data.tokenizer_formats import tiktoken_tokenizer
        return Tokenizer(*tiktoken_tokenizer(tokenizer_model, tiktoken_pattern or "v2",
                                             vocab_size))
    if tokenizer_type == "NullTokenizer":
        from loom.data.tokenizer_formats import null_tokenizer
        return Tokenizer(*null_tokenizer(vocab_size))
    if tokenizer_type == "ByteLevelBPETrained":
        if not vocab_size:
            raise ConfigError("--tokenizer-type ByteLevelBPETrained needs --vocab-size N (e.g. 8192)")
        if not train_files:
            raise ConfigError("--tokenizer-type ByteLevelBPETrained needs --input files to train on")
        def texts() -> Iterator[str]:
            for f in train_files:
                yield from read_documents(f, json_keys)
        return train_byte_level_bpe(texts(), vocab_size)
    if tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        if not vocab_file and not train_files:
            raise ConfigError(f"--tokenizer-type {tokenizer_type} needs --vocab-file vocab.txt "
                              f"or --vocab-size N to train one on --input")
        texts = (d for f in train_files or () for d in read_documents(f, json_keys))
        return bert_wordpiece(tokenizer_type == "BertWordPieceLowerCase", vocab_file,
                              vocab_size, texts)
    raise ConfigError(f"--tokenizer-type {tokenizer_type}: unknown; choose one of {', '.join(TOKENIZER_TYPES)}")
