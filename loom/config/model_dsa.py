"""DeepSeek Sparse Attention's fields of :class:`~loom.config.sections.ModelConfig` (DeepSeek-AI
2025, "DeepSeek-V3.2", sec. 2.1; Megatron-LM's ``TransformerConfig.dsa_*`` flag names, meanings
and defaults) and their checks (:func:`check_dsa`, part of the one validation pass).

``--experimental-attention-variant dsa`` on ``--multi-latent-attention`` layers: a lightning
indexer of ``--dsa-indexer-n-heads`` heads of ``--dsa-indexer-head-dim`` picks, per query, the
``--dsa-indexer-topk`` causal keys with the highest index score; the MLA attention then sees
only those keys. The indexer trains on its own loss (KL to the attention's distribution, times
``--dsa-indexer-loss-coeff``). The model: :mod:`loom.models.gpt.dsa`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from loom.config.fields import opt
from loom.errors import ConfigError


@dataclass
class DSAFields:
    """DeepSeek Sparse Attention flags; a mixin of ModelConfig (used with
    ``--experimental-attention-variant dsa`` only)."""

    dsa_indexer_n_heads: Optional[int] = opt(None, "DSA: indexer heads (needed with "
                                                   "--experimental-attention-variant dsa)",
                                             ge=1)
    dsa_indexer_head_dim: Optional[int] = opt(None, "DSA: indexer head dimension (its first "
                                                    "--qk-pos-emb-head-dim channels rotate)",
                                              ge=1)
    dsa_indexer_topk: Optional[int] = opt(None, "DSA: keys each query attends to, picked by "
                                                "the indexer", ge=1)
    dsa_indexer_loss_coeff: Optional[float] = opt(None, "DSA: coefficient of the indexer's KL "
                                                        "loss (unset or 0: no indexer loss)",
                                                  ge=0)
    dsa_indexer_use_sparse_loss: bool = opt(False, "DSA: the indexer loss over the top-k keys "
                                                   "only")
    no_dsa_indexer_rotate_activation: bool = opt(False, "DSA: no Hadamard rotation of the "
                                                        "index queries and key")
    no_dsa_indexer_scoring_relu: bool = opt(False, "DSA: no ReLU on the index head scores")
    dsa_indexer_k_norm_epsilon: Optional[float] = opt(None, "DSA: epsilon of the index key's "
                                                            "LayerNorm (default --norm-epsilon)",
                                                      gt=0)
    dsa_indexer_k_norm_fp32: bool = opt(False, "DSA: the index key's LayerNorm in fp32")

    @property
    def dsa(self) -> bool:
        """Whether attention is DeepSeek Sparse Attention."""
        return getattr(self, "experimental_attention_variant", None) == "dsa"


def check_dsa(m: Any, cp: int) -> None:
    """Refuse DSA settings that do not fit: Megatron's rules (MLA only, no linear biases, the
    indexer's sizes given) and what loom lacks (DSA under context parallelism, with multi-token
    prediction, a rotated head dimension that is not a power of 2). ConfigError, one line."""
    if not m.dsa:
        given = [f for f in ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk",
                             "dsa_indexer_loss_coeff") if getattr(m, f) is not None]
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')} configures DeepSeek sparse "
                              f"attention: add --experimental-attention-variant dsa or drop it")
        return
    if not m.multi_latent_attention:
        raise ConfigError("--experimental-attention-variant dsa sparsifies multi-latent "
                          "attention (as Megatron's): add --multi-latent-attention")
    if not m.disable_bias_linear:
        raise ConfigError("--experimental-attention-variant dsa needs --disable-bias-linear "
                          "(Megatron's absorbed MLA has no linear biases)")
    for f in ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk"):
        if getattr(m, f) is None:
            raise ConfigError(f"--experimental-attention-variant dsa needs --"
                              f"{f.replace('_', '-')}")
    d = m.dsa_indexer_head_dim
    if d < m.qk_pos_emb_head_dim:
        raise ConfigError(f"--dsa-indexer-head-dim {d} must be at least --qk-pos-emb-head-dim "
                          f"{m.qk_pos_emb_head_dim} (its RoPE part)")
    if not m.no_dsa_indexer_rotate_activation and d & (d - 1):
        raise ConfigError(f"--dsa-indexer-head-dim {d}: the Hadamard rotation needs a power of "
                          f"2; change it or add --no-dsa-indexer-rotate-activation")
    if cp > 1:
        raise ConfigError("--context-parallel-size > 1 with --experimental-attention-variant "
                          "dsa: loom has no context-parallel sparse attention; use 1")
    if m.mtp_num_layers:
        raise ConfigError("--mtp-num-layers with --experimental-attention-variant dsa: loom's "
                          "multi-token prediction layers are dense; drop --mtp-num-layers")
