"""The tokenizer files Megatron-LM's scripts name, as Hugging Face ``tokenizers`` objects (so
every dataset keeps one ``PREFIX.tokenizer.json``, whatever the source):

* SentencePiece ``.model`` files (``Llama2Tokenizer``, ``GPTSentencePieceTokenizer``,
  ``SentencePieceTokenizer``), read with the ``sentencepiece`` package: BPE models become a
  ``tokenizers`` BPE (merges ranked by the merged piece's score, as SentencePiece merges the
  highest-scoring pair first), unigram models a ``tokenizers`` Unigram; byte fallback, the
  dummy ``▁`` prefix and the precompiled normalizer carried over.
* tiktoken BPE ranks (``TikTokenizer``): a ``.tiktoken`` file (``base64 rank`` lines, read with
  ``tiktoken.load``) or Megatron's JSON list of ``{rank, token_bytes, token_str}``; Megatron's
  layout: ``num_special_tokens`` (1000) special ids first (``<unk> <s> </s> <mask> <pad> <cls>
  <sep>`` then ``<SPECIAL_i>``), the ranks shifted after them, ``--tiktoken-pattern`` v1/v2
  splitting the text. The merges are recovered by re-running tiktoken's byte-pair merge on each
  token below its own rank.
* ``NullTokenizer``: text of space-separated ids, ``--vocab-size`` V ids plus the end-of-document
  id V (Megatron's ``_NullTokenizer``), as a word-level vocabulary.

Equality with the libraries themselves is tested (tests/unit/test_tokenizers_formats.py).
"""

from __future__ import annotations

import base64
import json
import os
from typing import Optional

from loom.errors import ConfigError

PATTERN_V1 = r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
PATTERN_V2 = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
              r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
              r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
"""Megatron-LM's ``--tiktoken-pattern`` v1 / v2 pre-tokenizer regexes
(megatron/core/tokenizers/text/libraries/tiktoken_tokenizer.py)."""
TIKTOKEN_SPECIALS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
TIKTOKEN_NUM_SPECIAL = 1000


def _need(path: Optional[str], what: str) -> str:
    if not path or not os.path.isfile(path):
        raise ConfigError(f"--tokenizer-model {path}: no such file; give {what}")
    return path


# -- SentencePiece ------------------------------------------------------------------------------
def sentencepiece_tokenizer(path: Optional[str]):
    """A ``tokenizers.Tokenizer`` equal to the SentencePiece model at ``path`` and its
    end-of-document id (SentencePiece's ``</s>``). Raises ConfigError naming
    ``--tokenizer-model`` for a missing or unreadable file."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, normalizers
    proto = pb.ModelProto()
    try:
        with open(_need(path, "a SentencePiece .model file"), "rb") as f:
            proto.ParseFromString(f.read())
        sp = spm.SentencePieceProcessor(model_file=path)
    except Exception as e:  # noqa: BLE001 - protobuf / sentencepiece errors
        raise ConfigError(f"--tokenizer-model {path}: not a SentencePiece model ({e})") from None
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    unk = sp.unk_id()
    byte_fallback = proto.trainer_spec.byte_fallback
    if proto.trainer_spec.model_type == pb.TrainerSpec.BPE:
        vocab = {piece: i for i, (piece, _, _) in enumerate(pieces)}
        merges = _sentencepiece_merges(pieces, vocab)
        model = models.BPE(vocab, merges, unk_token=pieces[unk][0] if unk >= 0 else None,
                           fuse_unk=True, byte_fallback=byte_fallback)
    elif proto.trainer_spec.model_type == pb.TrainerSpec.UNIGRAM:
        model = models.Unigram([(p, s) for p, s, _ in pieces], unk_id=max(unk, 0),
                               byte_fallback=byte_fallback)
    else:
        raise ConfigError(f"--tokenizer-model {path}: SentencePiece model type "
                          f"{proto.trainer_spec.model_type} (word/char) is not supported; "
                          f"give a BPE or unigram model")
    tok = HFTokenizer(model)
    norm = proto.normalizer_spec
    steps = []
    if norm.precompiled_charsmap:
        steps.append(normalizers.Precompiled(norm.precompiled_charsmap))
    if norm.remove_extra_whitespaces:  # leading/trailing spaces dropped, runs made one
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    if norm.add_dummy_prefix:
        steps.append(normalizers.Prepend("▁"))
    steps.append(normalizers.Replace(" ", "▁"))
    tok.normalizer = normalizers.Sequence(steps)
    dec = [decoders.Replace("▁", " ")]
    if byte_fallback:
        dec.append(decoders.ByteFallback())
    dec.append(decoders.Fuse())
    if norm.add_dummy_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    specials = [p for p, _, t in pieces if t in (pb.ModelProto.SentencePiece.CONTROL,
                                                  pb.ModelProto.SentencePiece.UNKNOWN,
                                                  pb.ModelProto.SentencePiece.USER_DEFINED)]
    tok.add_special_tokens(specials)
    return tok, sp.eos_id() if sp.eos_id() >= 0 else None


def _sentencepiece_merges(pieces: list, vocab: dict) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece BPE vocabulary: every split (left, right) of a normal
    piece into two vocabulary pieces, ranked by the merged piece's score (highest first), then
    by the halves' ids."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    normal = pb.ModelProto.SentencePiece.NORMAL
    found = []
    for merged, score, kind in pieces:
        if kind != normal or len(merged) < 2:
            continue
        for k in range(1, len(merged)):
            left, right = merged[:k], merged[k:]
            if left in vocab and right in vocab:
                found.append((-score, vocab[merged], vocab[left], vocab[right], left, right))
    found.sort()
    return [(f[4], f[5]) for f in found]


# -- tiktoken ---------------------------------------------------------------------------------
def load_tiktoken_ranks(path: Optional[str]) -> dict[bytes, int]:
    """``{token bytes: rank}`` of a ``.tiktoken`` file or Megatron's JSON vocabulary."""
    _need(path, "a tiktoken BPE file (.tiktoken) or Megatron's tiktoken vocabulary .json")
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
        return {base64.b64decode(e["token_bytes"]): int(e["rank"]) for e in entries}
    from tiktoken.load import load_tiktoken_bpe
    return load_tiktoken_bpe(path)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in character of each byte (byte-level BPE, Radford et al. 2019)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + \
        list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _split_below(ranks: dict[bytes, int], token: bytes, limit: int) -> list[bytes]:
    """tiktoken's byte-pair merge of ``token`` using only ranks below ``limit``."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best = None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < limit and (best is None or r < best[1]):
                best = (i, r)
        if best is None:
            break
        i = best[0]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def tiktoken_tokenizer(path: Optional[str], pattern: Optional[str] = "v2",
                       vocab_size: Optional[int] = None,
                       num_special: int = TIKTOKEN_NUM_SPECIAL):
    """A ``tokenizers.Tokenizer`` equal to Megatron's ``TikTokenizer`` of the ranks at ``path``
    (``num_special`` special ids first, at most ``vocab_size`` ids in all) and its
    end-of-document id (``</s>``). Raises ConfigError naming the flag at fault."""
    from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
    if pattern not in ("v1", "v2"):
        raise ConfigError(f"--tiktoken-pattern {pattern}: give v1 or v2")
    ranks = load_tiktoken_ranks(path)
    ordered = sorted(ranks.items(), key=lambda kv: kv[1])
    if vocab_size is not None:
        if vocab_size <= num_special:
            raise ConfigError(f"--vocab-size {vocab_size}: TikTokenizer needs more than its "
                              f"{num_special} special ids")
        ordered = ordered[:vocab_size - num_special]
    ranks = dict(ordered)
    byte_char = _bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(byte_char[x] for x in b)
    specials = list(TIKTOKEN_SPECIALS) + [f"<SPECIAL_{i}>"
                                          for i in range(len(TIKTOKEN_SPECIALS), num_special)]
    vocab = {s: i for i, s in enumerate(specials)}
    vocab.update({text(tok): rank + num_special for tok, rank in ordered})
    merges = []
    for tok, rank in ordered:
        if len(tok) > 1:
            parts = _split_below(ranks, tok, rank)
            if len(parts) != 2:
                raise ConfigError(f"--tokenizer-model {path}: token {tok!r} (rank {rank}) is not "
                                  f"one merge of lower-ranked tokens; not a BPE rank file")
            merges.append((text(parts[0]), text(parts[1])))
    tok = HFTokenizer(models.BPE(vocab, merges, ignore_merges=True))
    regex = PATTERN_V1 if pattern == "v1" else PATTERN_V2
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return tok, specials.index("</s>")


# -- NullTokenizer and Hugging Face directories -----------------------------------------------
def null_tokenizer(vocab_size: Optional[int]):
    """Megatron's ``NullTokenizer``: ``"3 14 15"`` -> ``[3, 14, 15]``; ids 0..V-1 plus the
    end-of-document id V (V + 1 ids). Raises ConfigError without ``--vocab-size``."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers
    if not vocab_size:
        raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size V (ids 0..V-1; V "
                          "is the end of document)")
    vocab = {str(i): i for i in range(vocab_size)}
    vocab["<eod>"] = vocab_size
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<eod>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="\0", cleanup=False)  # joins words with spaces
    tok.add_special_tokens(["<eod>"])
    return tok, vocab_size


def huggingface_file(path: Optional[str]) -> str:
    """The ``tokenizer.json`` of ``--tokenizer-model`` (a file, or a Hugging Face tokenizer
    directory holding one). Raises ConfigError for a hub name or a directory without one."""
    if path and os.path.isdir(path):
        inner = os.path.join(path, "tokenizer.json")
        if os.path.isfile(inner):
            return inner
        raise ConfigError(f"--tokenizer-model {path}: the directory holds no tokenizer.json "
                          f"(a SentencePiece tokenizer.model: give --tokenizer-type "
                          f"Llama2Tokenizer --tokenizer-model {path}/tokenizer.model)")
    if path and not os.path.exists(path) and "/" in path and not path.startswith(("/", ".")):
        raise ConfigError(f"--tokenizer-model {path}: looks like a Hugging Face hub name; loom "
                          f"reads local files only: download it first (huggingface-cli "
                          f"download {path} --local-dir DIR) and give DIR")
    return _need(path, "a tokenizer.json or a Hugging Face tokenizer directory")
