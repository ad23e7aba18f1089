"""loom's --sft data (loom.data.sft) against Megatron-LM's own SFTTokenizer and SFTDataset.

Usage::

    git -C MIRROR show HEAD:megatron/core/tokenizers/text/libraries/sft_tokenizer.py > /tmp/mref/meg_sft_tok.py
    git -C MIRROR show HEAD:megatron/training/datasets/sft_dataset.py > /tmp/mref/meg_sft_ds.py
    PYTHONPATH=. python -m benchmarks.sft_vs_megatron /tmp/mref

Megatron's two files (d98e8a6) are read from the directory given, never stored in loom; the
dataset's base classes come from the installed megatron-core. Builds the tokenizer of
tests/unit/test_sft.py and compares, for the prompt formats nemotron-h-aligned,
nemotron-nano-v2 and identity, every conversation's tokens and targets, and for sequence
lengths 8, 17, 24, 40 at context-parallel sizes 1 and 2 every sample's tokens, loss mask, the
labels under the mask and the positions (0..s-1). Prints the counts; an AssertionError names
the first difference.
"""

from __future__ import annotations

import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch


def main(ref: str) -> None:
    sys.path.insert(0, ref)
    import meg_sft_ds  # noqa: E402 - Megatron's files, from the directory given
    from meg_sft_tok import SFTTokenizer as Megatron

    from loom.data.sft import SFTDataset, SFTTokenizer
    from tests.unit.test_sft import CONVS, files
    tok_dir = files.__wrapped__(types.SimpleNamespace(
        mktemp=lambda name: Path(tempfile.mkdtemp(prefix=name))))[0]
    pairs = samples = 0
    for fmt in ("nemotron-h-aligned", "nemotron-nano-v2", "identity"):
        meg, ours = Megatron(tok_dir, fmt), SFTTokenizer(tok_dir, fmt)
        assert (meg.pad_id, meg.eod, meg.vocab_size) == (ours.pad, ours.eod, ours.vocab_size)
        convs = CONVS if fmt != "identity" else \
            [[dict(t, content=t["content"] + "\n") for t in c] for c in CONVS]
        for c in convs:
            a, b = meg.tokenize_conversation(c, return_target=True, add_generation_prompt=False)
            x, y = ours.tokenize_conversation(c)
            assert a.tolist() == x.tolist() and b.tolist() == y.tolist(), (fmt, c)
            pairs += 1
        meg.pad = meg.pad_id
        for s in (8, 17, 24, 40):
            for cp in (1, 2):
                ds = meg_sft_ds.SFTDataset.__new__(meg_sft_ds.SFTDataset)
                ds.config = types.SimpleNamespace(
                    tokenizer=meg, sequence_length=s, context_parallel_size=cp,
                    reset_position_ids=False, create_attention_mask=False,
                    reset_attention_mask=False)
                ds.dataset, ds.indices = convs, np.arange(len(convs))
                mine = SFTDataset(convs, (0, len(convs)), ours, s)
                for k in range(len(convs)):
                    want, got = ds[k], mine[k]
                    assert want["tokens"].tolist() == got["tokens"].tolist(), (fmt, s, cp, k)
                    assert torch.equal(want["loss_mask"], got["loss_mask"]), (fmt, s, cp, k)
                    keep = want["loss_mask"].bool()
                    assert want["labels"][keep].tolist() == got["labels"][keep].tolist()
                    assert want["position_ids"].tolist() == list(range(s))
                    samples += 1
    print(f"identical to Megatron-LM: tokens and targets of {pairs} conversations; tokens, "
          f"loss mask, masked labels and positions of {samples} samples")


if __name__ == "__main__":
    main(sys.argv[1])
