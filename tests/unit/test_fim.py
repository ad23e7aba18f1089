"""Fill-in-the-middle data (``--fim-data``, loom.data.fim): Megatron-LM's FIM GPT dataset
semantics on hand-worked examples (a 10-letter character tokenizer, scripted draws), the same
ids as Megatron's own code at d98e8a6 for the same random stream (when its mirror is on this
machine), the wrapper over a real preprocessed dataset, and the flag rules."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from loom.data.fim import FimSpec, FimTransform
from loom.errors import ConfigError

LETTERS = "abcdefghij"  # ids 10..19; 0 EOD, 1 prefix, 2 middle, 3 suffix, 4 pad, 5 split


def text_of(ids) -> str:
    return "".join(LETTERS[i - 10] for i in ids if i >= 10)  # special ids dropped


def ids_of(text: str) -> list[int]:
    return [10 + LETTERS.index(c) for c in text]


def ids(text: str) -> list[int]:
    """``"abc|de"`` -> letter ids, ``|`` the EOD id 0 and ``/`` the split id 5."""
    return [0 if c == "|" else 5 if c == "/" else 10 + LETTERS.index(c) for c in text]


class Scripted:
    """A RandomState stand-in returning the scripted draws in order (asserting the order)."""

    def __init__(self, *draws):
        self.draws = list(draws)

    def binomial(self, n, p):
        kind, value = self.draws.pop(0)
        assert kind == "b" and n == 1, (kind, p)
        return value

    def randint(self, low, high, size):
        kind, value = self.draws.pop(0)
        assert kind == "r" and low == 0 and size == 2 and all(0 <= v < high for v in value)
        return np.array(value)


SPEC = FimSpec(prefix=1, middle=2, suffix=3, pad=4, eod=0, rate=0.5, spm_rate=0.5)


def fim(sample: str, *draws, spec: FimSpec = SPEC) -> list[int]:
    rng = Scripted(*draws)
    out = FimTransform(spec, text_of, ids_of)(np.array(ids(sample), dtype=np.int64), rng)
    assert not rng.draws, "draws left over"
    return out.tolist()


def test_psm_and_spm_cut_at_the_drawn_characters_and_truncated():
    # "abcde" | "fgh": the first document cut at 3 and 1 (sorted: prefix a, middle bc, suffix
    # de) in PSM order; the second at 2, 2 (prefix fg, empty middle, suffix h) in SPM order;
    # 8 + 1 + 6 = 15 ids cut to the sample's 9.
    assert fim("abcde|fgh", ("b", 1), ("r", [3, 1]), ("b", 0),
               ("b", 1), ("r", [2, 2]), ("b", 1)) == \
        [1, *ids("a"), 3, *ids("de"), 2, *ids("bc"), 0]
    # the whole of it in SPM: <pre> <suf> suffix <mid> prefix middle
    assert fim("abcdef", ("b", 1), ("r", [4, 2]), ("b", 1)) == \
        [1, 3, *ids("ef"), 2, *ids("a")]  # [1, 3, e, f, 2, a, b, c, d] cut to 6


def test_untouched_documents_and_empty_segments_drop_their_eod_then_pad():
    # no FIM draws for empty segments: "||ab" keeps only "ab" (Megatron drops an empty
    # segment's EOD), padded with the FIM pad id to the sample's 4 ids
    assert fim("||ab", ("b", 0)) == [*ids("ab"), 4, 4]
    # a trailing EOD: the empty last segment is still "transformed" (one draw), stays empty
    assert fim("abc|", ("b", 0), ("b", 0)) == ids("abc|")


def test_split_sample_fragments_and_no_prefix():
    split = FimSpec(prefix=1, middle=2, suffix=3, pad=4, eod=0, rate=0.5, spm_rate=0.5,
                    split=5, fragment_rate=0.25)
    # the document draws once with --fim-rate, then each fragment with --fim-fragment-rate:
    # "ab" kept, "cde" cut at 1, 2 in PSM
    assert fim("ab/cde", ("b", 1), ("b", 0), ("b", 1), ("r", [2, 1]), ("b", 0),
               spec=split) == [*ids("ab"), 5, 1, *ids("c"), 3]  # ... e 2 d cut
    assert fim("ab/cde", ("b", 0), spec=split) == ids("ab/cde")  # the document not chosen
    keep = FimSpec(prefix=1, middle=2, suffix=3, pad=4, eod=0, rate=1.0, spm_rate=0.5,
                   no_prefix="ab")
    assert fim("abc|dab", ("b", 1), ("b", 1), ("r", [0, 3]), ("b", 0), spec=keep) == \
        [*ids("abc|"), 1, 3, 2]  # "abc" kept (starts with ab); "dab": empty prefix, suffix


def _megatron_fim_class(monkeypatch):
    """Megatron-LM d98e8a6's GPTFIMDataset, read from the mirror's bare repository (None when
    it is not on this machine); its megatron.core imports (base classes only) stubbed."""
    repo = Path("/work/.mirror/NVIDIA+Megatron-LM/repo")
    if not repo.exists():
        return None
    src = subprocess.run(["git", "-C", str(repo), "show",
                          "d98e8a64ddf34856e74b24714e3bedb2f5a39553:"
                          "megatron/training/datasets/fim_dataset.py"],
                         capture_output=True, text=True, check=True).stdout
    stub = types.SimpleNamespace(GPTDataset=object, GPTDatasetConfig=object,
                                 IndexedDataset=object, Split=object)
    for name in ("gpt_dataset", "indexed_dataset", "utils"):
        monkeypatch.setitem(sys.modules, f"megatron.core.datasets.{name}", stub)
    ns: dict = {}
    exec(compile(src, "fim_dataset.py", "exec"), ns)
    return ns["GPTFIMDataset"]


def test_same_ids_as_megatrons_code_for_the_same_stream(monkeypatch):
    """Megatron's ``_query_document_sample_shuffle_indices`` on one-sample indexes (no
    shuffle) and loom's transform, each with ``RandomState(seed)``: equal on 300 random
    samples (EODs, split tokens, every rate)."""
    cls = _megatron_fim_class(monkeypatch)
    if cls is None:
        pytest.skip("Megatron-LM's mirror is not on this machine")
    gen = np.random.default_rng(0)
    tok = types.SimpleNamespace(ids_to_text=lambda s, remove_special_tokens: text_of(s),
                                text_to_ids=ids_of)
    for trial in range(300):
        sample = gen.choice([0, 5, *range(10, 20)], size=int(gen.integers(1, 30)),
                            p=[0.08, 0.07] + [0.085] * 10).astype(np.int64)
        rate, spm, frag = (float(x) for x in gen.choice([0.0, 0.3, 0.5, 1.0], 3))
        split = 5 if trial % 2 else None
        no_prefix = "a" if trial % 3 == 0 else None
        meg = object.__new__(cls)
        meg.np_rng = np.random.RandomState(trial)
        meg.shuffle_index, meg.document_index = [0], [0]
        meg.sample_index = [(0, 0), (0, len(sample) - 1)]
        meg.dataset = types.SimpleNamespace(
            get=lambda d, offset, length: sample[offset:offset + length])
        meg.config = types.SimpleNamespace(tokenizer=types.SimpleNamespace(_tokenizer=tok))
        meg.fim_rate, meg.fim_spm_rate, meg.fragment_fim_rate = rate, spm, frag
        meg.fim_split_sample, meg.no_fim_prefix = split, no_prefix
        meg.prefix_tok_id, meg.middle_tok_id, meg.suffix_tok_id = 1, 2, 3
        meg.pad_tok_id, meg.eod_tok_id = 4, 0
        want = meg._query_document_sample_shuffle_indices(0)[0]
        spec = FimSpec(prefix=1, middle=2, suffix=3, pad=4, eod=0, rate=rate, spm_rate=spm,
                       split=split, fragment_rate=frag, no_prefix=no_prefix)
        got = FimTransform(spec, text_of, ids_of)(sample.copy(), np.random.RandomState(trial))
        assert got.tolist() == want.tolist(), (trial, sample.tolist())


def test_fim_dataset_over_a_preprocessed_dataset(tmp_path):
    """--fim-data over a real dataset: every sample keeps s + 1 ids (labels the next
    tokens), sample k is the same whatever was read before, and with --fim-rate 1 the FIM
    sentinels appear in every document."""
    from loom.config import LoomConfig
    from loom.data.for_model import next_token_datasets
    from loom.data.preprocess import load_tokenizer_for
    from testkit.megatron_corpus import fim_dataset
    prefix = fim_dataset(tmp_path)
    cfg = LoomConfig.from_flat({"data_path": prefix, "seq_length": 64, "fim_data": True,
                                "fim_rate": 1.0, "split": "90,10,0"})
    train, valid, _ = next_token_datasets(cfg)
    tok = load_tokenizer_for(prefix)
    sentinel = {tok.hf.token_to_id(t) for t in ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")}
    plain = next_token_datasets(LoomConfig.from_flat({**cfg.to_flat(), "fim_data": False}))[0]
    a = [train[k] for k in range(6)]
    assert [train[k]["tokens"].tolist() for k in (5, 0)] == \
        [a[5]["tokens"].tolist(), a[0]["tokens"].tolist()]  # independent of the reading order
    for k, item in enumerate(a):
        assert item["tokens"].shape == (64,) and item["tokens"][1:].tolist() == \
            item["labels"][:-1].tolist()
        assert sentinel <= set(item["tokens"].tolist()) | set(item["labels"].tolist()), k
        assert item["tokens"].tolist() != plain[k]["tokens"].tolist()
    assert valid is not None and len(valid) > 0


@pytest.mark.parametrize("flat, words", [
    ({"fim_data": True, "mock_data": True, "vocab_size": 64}, "--fim-data with --mock-data"),
    ({"fim_data": True, "fim_rate": 0.0}, "--fim-rate 0.0"),
    ({"fim_data": True, "fim_spm_rate": 1.5}, "--fim-spm-rate 1.5: a probability"),
    ({"fim_data": True, "fim_split_sample": "x"}, "--fim-split-sample needs --fim-fragment-rate"),
    ({"fim_data": True, "model_type": "bert"}, "--fim-data with --model-type bert")])
def test_fim_flags_refused(flat, words):
    from loom.config import LoomConfig
    from loom.models import resolve_config
    base = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 16,
            "vocab_size": 64, "micro_batch_size": 1, "global_batch_size": 1, "lr": 1e-3,
            "train_iters": 1, "data_path": "x"}
    if flat.get("mock_data"):
        base.pop("data_path")
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        resolve_config(LoomConfig.from_flat({**base, **flat}), 1)


def test_a_tokenizer_without_the_fim_tokens_is_refused_naming_the_flag(tmp_path):
    from loom.data.fim import fim_spec
    from loom.data.tokenizer import train_byte_level_bpe
    tok = train_byte_level_bpe(["some text to learn from"] * 4, 300)
    data = types.SimpleNamespace(fim_prefix_token="<fim_prefix>", fim_middle_token="<m>",
                                 fim_suffix_token="<s>", fim_pad_token="<p>",
                                 fim_eod_token="<|endoftext|>", fim_split_sample=None,
                                 fim_rate=0.5, fim_spm_rate=0.5, fim_fragment_rate=None,
                                 fim_no_prefix=None)
    with pytest.raises(ConfigError, match="--fim-prefix-token '<fim_prefix>': the tokenizer of"):
        fim_spec(data, tok, "--data-path x")
