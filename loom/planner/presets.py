"""Model presets for ``loom plan NAME``: GPT-3 175B, LLaMA-3 8B/70B/405B and the shapes of the
paper tables (NAR table 1, KOR table 3) used by the validation tests.

LLaMA-3 shapes from Meta's model cards / ``config.json`` (layers, hidden, heads, 8 KV groups,
FFN 14336/28672/53248, V 128256, RMSNorm, RoPE, SwiGLU, untied, no biases, no dropout).
GPT shapes: ``ffn = 4h``, LayerNorm, learned positions, tied embeddings, V = 51200, s = 2048
(NAR sec 5.1).

Mixture-of-experts presets (LLaMA layout: RMSNorm, RoPE, SwiGLU experts, untied, no biases), the
training sequence length s = 4096 (DeepSeek-V3 and Qwen3 pre-train at 4K; Mixtral's is not
published, 4096 chosen; override with ``--seq-length``):

* ``mixtral-8x7b``: Jiang et al. 2024, "Mixtral of Experts" (arXiv 2401.04088) table 1: L 32,
  h 4096, 32 heads, 8 KV heads, FFN 14336, V 32000, 8 experts, top-2; 46.7B total / 12.9B active
  (Mistral AI, "Mixtral of experts", Dec 2023 announcement; the paper rounds to 47B / 13B).
* ``mixtral-8x22b``: ``mistralai/Mixtral-8x22B-v0.1`` ``config.json`` (L 56, h 6144, 48 heads,
  8 KV heads, FFN 16384, 8 experts, top-2) with the v0.3 tokenizer's V 32768 of the Instruct
  model; 141B total / 39B active (Mistral AI, "Cheaper, Better, Faster, Stronger", 2024).
* ``deepseek-v3``: DeepSeek-AI 2024, arXiv 2412.19437 sec 4.2 and ``config.json``: L 61,
  h 7168, 128 heads, 1 shared + 256 routed experts of width 2048, top-8, sigmoid router, the
  first 3 layers dense with FFN 18432 (``first_k_dense_replace``), V 129280; 671B total / 37B
  active. Multi-latent attention as trained (q rank 1536, kv rank 512, head dims 128 + 64 RoPE,
  value 128: 187.1M parameters per layer, :mod:`loom.planner.mla`), YaRN factor 40, the
  aux-loss-free bias, group-limited routing (8 groups, 4 per token), scaling factor 2.5. The
  multi-token-prediction module (D = 1, 14B: 685B with it) is left out, as in the published
  671B; ``--mtp-num-layers 1`` adds it. The 3 dense layers are expressed by :class:`PlannerModelConfig` (loom's
  ``--moe-layer-freq`` cannot: layer 0 is always MoE), so ``loom train`` cannot build this
  preset as is.
* ``deepseek-v2-lite``: DeepSeek-AI 2024, "DeepSeek-V2" (arXiv 2405.04434) appendix B and
  ``deepseek-ai/DeepSeek-V2-Lite`` ``config.json``: L 27, h 2048, 16 heads, MLA without query
  compression (kv rank 512, head dims 128 + 64, value 128), the first layer dense (FFN 10944),
  then 64 routed experts of width 1408 (top-6 of a softmax over all, unnormalized:
  ``--moe-router-pre-softmax``; sequence-wise balance loss 0.001) + 2 shared, V 102400, YaRN
  factor 40 (mscale 0.707); 15.7B total / 2.4B active (the latter without the embedding
  lookup).
* ``qwen3-30b-a3b``: Qwen Team 2025, "Qwen3 Technical Report" (arXiv 2505.09388) table 2 and
  ``Qwen/Qwen3-30B-A3B`` ``config.json``: L 48, h 2048, 32 heads of dim 128, 4 KV heads,
  128 experts of width 768, top-8, no shared expert, untied, V 151936; 30.5B total / 3.3B active.
  QK-norm: ``--qk-layernorm`` (2 x 128 parameters per layer; the planner's count leaves them
  out).

Mamba-2 and hybrid presets (``model_type="mamba"``, :mod:`loom.planner.mamba`):

* ``mamba2-1.3b``: Dao & Gu 2024 (arXiv 2405.21060) sec. 9 / table 3 and the
  ``state-spaces/mamba2-1.3b`` ``config.json``: 48 layers, d_model 2048, all Mamba-2
  (``d_intermediate`` 0: no MLP layers), d_state N 128, head dim P 64, expand 2 (d_inner 4096,
  H 64), ngroups G 1, d_conv 4, chunk 256, RMSNorm, no linear biases (conv bias), tied
  embeddings, V 50277, trained at s = 2048 on the Pile; 1.34B parameters here (published
  "1.3B"). ``num_attention_heads`` 32 is a placeholder (no attention layers).
* ``nemotron-h-8b``: NVIDIA 2025, "Nemotron-H: A Family of Accurate and Efficient Hybrid
  Mamba-Transformer Models" (arXiv 2504.03624) table 1 and ``nvidia/Nemotron-H-8B-Base-8K``
  ``config.json``: 52 layers, pattern ``M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-``
  (24 Mamba-2, 4 attention = 8%, 24 MLP), h 4096, 32 attention heads of 128, 8 KV heads,
  Mamba-2 128 heads of 64 (expand 2), 8 groups, state 128, d_conv 4, chunk 128, FFN 21504,
  RMSNorm, no biases, untied, V 131072, s = 8192. Approximations: the MLP's squared-ReLU
  (not gated) is modelled as loom's non-gated GeLU MLP (same ``4 h f`` FLOPs and parameters);
  Nemotron-H's attention layers use no position embedding, loom's use RoPE (no parameters).
"""

from __future__ import annotations

from dataclasses import dataclass

from loom.config import ConfigError, ModelConfig


@dataclass
class PlannerModelConfig(ModelConfig):
    """A :class:`ModelConfig` with what the planner can model but loom's flags cannot express:
    ``first_k_dense_replace`` leading dense layers before the MoE ones (DeepSeek-V3's
    ``config.json`` name)."""

    first_k_dense_replace: int = 0

    def is_moe_layer(self, layer_number: int) -> bool:
        """MoE unless among the first ``first_k_dense_replace`` layers (then ModelConfig's rule)."""
        return layer_number >= self.first_k_dense_replace and super().is_moe_layer(layer_number)


def gpt(L: int, h: int, a: int, s: int = 2048, V: int = 51200) -> ModelConfig:
    """A GPT of the NAR/KOR papers (biases, LayerNorm, dropout 0.1, tied embeddings)."""
    return ModelConfig.gpt2(num_layers=L, hidden_size=h, num_attention_heads=a, seq_length=s,
                            max_position_embeddings=s, vocab_size=V)


def llama3(L: int, h: int, a: int, ffn: int, s: int = 8192) -> ModelConfig:
    return ModelConfig.llama(num_layers=L, hidden_size=h, num_attention_heads=a,
                             num_query_groups=8, group_query_attention=True, ffn_hidden_size=ffn,
                             seq_length=s, max_position_embeddings=s, vocab_size=128256,
                             rotary_base=500000.0, hidden_dropout=0.0, attention_dropout=0.0)


def moe_llama(L: int, h: int, a: int, g: int, ffn: int, V: int, E: int, k: int,
              s: int = 4096, **kw) -> ModelConfig:
    """An MoE model in the LLaMA layout (SwiGLU experts of width ``ffn`` unless
    ``moe_ffn_hidden_size`` is given), softmax top-k router, no dropout."""
    cfg = dict(num_layers=L, hidden_size=h, num_attention_heads=a, num_query_groups=g,
               group_query_attention=g != a, ffn_hidden_size=ffn, seq_length=s,
               max_position_embeddings=s, vocab_size=V, num_experts=E, moe_router_topk=k,
               rotary_base=1e6, hidden_dropout=0.0, attention_dropout=0.0)
    cfg.update(kw)
    cls = PlannerModelConfig if "first_k_dense_replace" in cfg else ModelConfig
    return cls.llama(**cfg)


def mamba2(L: int, h: int, V: int, s: int, pattern: str | None = None, **kw) -> ModelConfig:
    """A Mamba-2 / hybrid model (RMSNorm, no linear biases, no dropout; RoPE in attention
    layers, no learned positions); Mamba and attention sizes from ``kw``."""
    cfg = dict(model_type="mamba", num_layers=L, hidden_size=h, seq_length=s,
               max_position_embeddings=s, vocab_size=V, hybrid_override_pattern=pattern,
               hidden_dropout=0.0, attention_dropout=0.0)
    cfg.update(kw)
    return ModelConfig.llama(**cfg)


# DeepSeek-V3's attention and router (config.json): MLA ranks and head dims, YaRN (factor 40 over
# 4096 positions, mscale 1), aux-loss-free bias, 8 groups of which 4 per token, scaling 2.5
DEEPSEEK_V3_MLA = dict(multi_latent_attention=True, qk_layernorm=True, q_lora_rank=1536,
                       kv_lora_rank=512,
                       qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, rope_type="yarn",
                       rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0,
                       yarn_original_max_position_embeddings=4096,
                       moe_router_enable_expert_bias=True, moe_router_num_groups=8,
                       moe_router_group_topk=4, moe_router_topk_scaling_factor=2.5)

PRESETS = {
    "gpt3-175b": lambda: gpt(96, 12288, 96),
    "llama3-8b": lambda: llama3(32, 4096, 32, 14336),
    "llama3-70b": lambda: llama3(80, 8192, 64, 28672),
    "llama3-405b": lambda: llama3(126, 16384, 128, 53248),
    # KOR table 3
    "gpt-22b": lambda: gpt(48, 6144, 64),
    "gpt-530b": lambda: gpt(105, 20480, 128),
    "gpt-1t": lambda: gpt(128, 25600, 160),
    # mixture of experts (sources in the module docstring)
    "mixtral-8x7b": lambda: moe_llama(32, 4096, 32, 8, 14336, 32000, 8, 2),
    "mixtral-8x22b": lambda: moe_llama(56, 6144, 48, 8, 16384, 32768, 8, 2),
    "deepseek-v3": lambda: moe_llama(61, 7168, 128, 128, 18432, 129280, 256, 8,
                                     moe_ffn_hidden_size=2048,
                                     moe_shared_expert_intermediate_size=2048,
                                     moe_router_score_function="sigmoid", first_k_dense_replace=3,
                                     rotary_base=10000.0, **DEEPSEEK_V3_MLA),
    "deepseek-v2-lite": lambda: moe_llama(27, 2048, 16, 16, 10944, 102400, 64, 6,
                                          moe_ffn_hidden_size=1408,
                                          moe_shared_expert_intermediate_size=2816,
                                          moe_layer_freq="([0]*1+[1]*26)", rotary_base=10000.0,
                                          **{**DEEPSEEK_V3_MLA, "q_lora_rank": None,
                                             "moe_router_enable_expert_bias": False,
                                             "moe_router_num_groups": None,
                                             "moe_router_group_topk": None,
                                             "moe_router_topk_scaling_factor": 1.0,
                                             "moe_router_pre_softmax": True,
                                             "moe_router_load_balancing_type": "seq_aux_loss",
                                             "moe_aux_loss_coeff": 0.001,
                                             "mscale": 0.707, "mscale_all_dim": 0.707}),
    "qwen3-30b-a3b": lambda: moe_llama(48, 2048, 32, 4, 6144, 151936, 128, 8,
                                       moe_ffn_hidden_size=768, kv_channels=128,
                                       qk_layernorm=True),
    # Mamba-2 / hybrid (sources in the module docstring)
    "mamba2-1.3b": lambda: mamba2(48, 2048, 50277, 2048, num_attention_heads=32,
                                  mamba_state_dim=128, mamba_head_dim=64, mamba_num_groups=1,
                                  mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=256,
                                  untie_embeddings_and_output_weights=False),
    "nemotron-h-8b": lambda: mamba2(52, 4096, 131072, 8192,
                                    "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
                                    num_attention_heads=32, num_query_groups=8,
                                    group_query_attention=True, kv_channels=128,
                                    ffn_hidden_size=21504, swiglu=False, mamba_state_dim=128,
                                    mamba_head_dim=64, mamba_num_groups=8, mamba_expand=2,
                                    mamba_d_conv=4, mamba_chunk_size=128),
}

# NAR table 1 (references.md): params(B), heads, h, L, TP, PP, GPUs, B, TFLOP/s/GPU, % peak.
NAR_TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52),
]

# KOR tables 3 and 5: model, heads, h, L, TP, PP, GPUs, B, b, full (s), sp+sel (s), MFU, HFU.
KOR_TABLE3 = [
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 4, 1.42, 1.10, 0.415, 0.437),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 1, 18.13, 13.75, 0.514, 0.528),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 1, 49.05, 37.83, 0.560, 0.570),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 1, 94.42, 71.49, 0.563, 0.570),
]


def get_preset(name: str) -> ModelConfig:
    """The :class:`ModelConfig` of a preset name (case-insensitive)."""
    key = name.lower()
    if key not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)} "
                          f"or give the model flags (--num-layers, --hidden-size, ...)")
    return PRESETS[key]()

# NAR table 2 (references.md): scheme, params(B), MP (t x p), B, GPUs, b, TFLOP/s/GPU, days for
# 300B tokens. PTD-P MP = 8 x 12 (174.6B, GPT-3 shape) and 8 x 35 (529.6B).
NAR_TABLE2 = [
    ("ZeRO-3", 174.6, 1, 1536, 384, 4, 144, 90),
    ("ZeRO-3", 174.6, 1, 1536, 768, 2, 88, 74),
    ("ZeRO-3", 174.6, 1, 1536, 1536, 1, 44, 74),
    ("ZeRO-3", 529.6, 1, 2560, 640, 4, 138, 169),
    ("ZeRO-3", 529.6, 1, 2240, 1120, 2, 98, 137),
    ("ZeRO-3", 529.6, 1, 2240, 2240, 1, 48, 140),
    ("PTD-P", 174.6, 96, 1536, 384, 1, 153, 84),
    ("PTD-P", 174.6, 96, 1536, 768, 1, 149, 43),
    ("PTD-P", 174.6, 96, 1536, 1536, 1, 141, 23),
    ("PTD-P", 529.6, 280, 2240, 560, 1, 171, 156),
    ("PTD-P", 529.6, 280, 2240, 1120, 1, 167, 80),
    ("PTD-P", 529.6, 280, 2240, 2240, 1, 159, 42),
]
