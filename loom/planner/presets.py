"""Model presets for ``loom plan NAME``: GPT-3 175B, LLaMA-3 8B/70B/405B and the shapes of the
paper tables (NAR table 1, KOR table 3) used by the validation tests.

LLaMA-3 shapes from Meta's model cards / ``config.json`` (layers, hidden, heads, 8 KV groups,
FFN 14336/28672/53248, V 128256, RMSNorm, RoPE, SwiGLU, untied, no biases, no dropout).
GPT shapes: ``ffn = 4h``, LayerNorm, learned positions, tied embeddings, V = 51200, s = 2048
(NAR sec 5.1).
"""

from __future__ import annotations

from loom.config import ConfigError, ModelConfig


def gpt(L: int, h: int, a: int, s: int = 2048, V: int = 51200) -> ModelConfig:
    """A GPT of the NAR/KOR papers (biases, LayerNorm, dropout 0.1, tied embeddings)."""
    return ModelConfig.gpt2(num_layers=L, hidden_size=h, num_attention_heads=a, seq_length=s,
                            max_position_embeddings=s, vocab_size=V)


def llama3(L: int, h: int, a: int, ffn: int, s: int = 8192) -> ModelConfig:
    return ModelConfig.llama(num_layers=L, hidden_size=h, num_attention_heads=a,
                             num_query_groups=8, group_query_attention=True, ffn_hidden_size=ffn,
                             seq_length=s, max_position_embeddings=s, vocab_size=128256,
                             rotary_base=500000.0, hidden_dropout=0.0, attention_dropout=0.0)


PRESETS = {
    "gpt3-175b": lambda: gpt(96, 12288, 96),
    "llama3-8b": lambda: llama3(32, 4096, 32, 14336),
    "llama3-70b": lambda: llama3(80, 8192, 64, 28672),
    "llama3-405b": lambda: llama3(126, 16384, 128, 53248),
    # KOR table 3
    "gpt-22b": lambda: gpt(48, 6144, 64),
    "gpt-530b": lambda: gpt(105, 20480, 128),
    "gpt-1t": lambda: gpt(128, 25600, 160),
}

# Presets whose published runs use fused (flash) attention by default in the planner.
FLASH_DEFAULT = {"llama3-8b", "llama3-70b", "llama3-405b"}

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
