"""BERT fields of :class:`~loom.config.sections.ModelConfig` (``--model-type bert``;
Megatron's pretrain_bert.py)."""

from __future__ import annotations

from dataclasses import dataclass

from loom.config.fields import opt


@dataclass
class BertFields:
    """BERT's own flags; a mixin of ModelConfig."""

    # -- BERT (--model-type bert; Megatron's pretrain_bert.py) ---------------------------------
    bert_binary_head: bool = opt(False, "BERT: add the sentence-order prediction head (pooler "
                                        "on [CLS] + 2-way classifier) and its loss")
    post_layernorm: bool = opt(
        False, "BERT: the original post-LN order, LayerNorm after each residual add "
               "(x = LN(x + f(x)), LN on the embeddings, no final LN); default: Megatron's "
               "pre-LN (x = x + f(LN(x)), final LN). Not Megatron's "
               "--apply-residual-connection-post-layernorm, which keeps pre-LN and only takes "
               "the residual from the LayerNorm output")
