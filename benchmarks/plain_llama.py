"""A plain PyTorch LLaMA and its training step: the baseline ``benchmarks/gpu_check.py`` times
loom against on one GPU. Nothing of loom's runs here.

The model is loom's LLaMA layout at the same sizes, written the way a single-GPU training script
writes it (torchtitan's and nanochat's shape): batch-first ``[b, s, h]``, RMSNorm
(``nn.RMSNorm``), rotary embeddings (halves layout), grouped-query attention through
``F.scaled_dot_product_attention`` (``is_causal``, ``enable_gqa``), a SwiGLU MLP with separate
``w1``, ``w3``, ``w2``, no biases, untied output layer, ``F.cross_entropy`` on the full fp32
logits. The step is PyTorch's mixed-precision recipe: fp32 parameters under
``torch.autocast(bf16)``, fused AdamW (weight decay on matrices only), the global gradient norm
clipped to 1.0 (loom's ``--clip-grad`` default). ``compile_blocks``: each block
``torch.compile``'d (torchtitan's per-block compilation, as loom's ``--compile``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rope_tables(seq_length: int, head_dim: int, base: float, device) -> tuple:
    """cos, sin ``[s, d]`` (halves layout), fp32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                            device=device) / head_dim))
    freqs = torch.outer(torch.arange(seq_length, dtype=torch.float32, device=device), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [b, heads, s, d]`` rotated by position."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.to(x.dtype) + torch.cat([-x2, x1], dim=-1) * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, h: int, heads: int, groups: int):
        super().__init__()
        self.d = h // heads
        self.wq = nn.Linear(h, heads * self.d, bias=False)
        self.wk = nn.Linear(h, groups * self.d, bias=False)
        self.wv = nn.Linear(h, groups * self.d, bias=False)
        self.wo = nn.Linear(heads * self.d, h, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.d).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, h: int, f: int):
        super().__init__()
        self.w1 = nn.Linear(h, f, bias=False)
        self.w3 = nn.Linear(h, f, bias=False)
        self.w2 = nn.Linear(f, h, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, h: int, heads: int, groups: int, f: int, eps: float):
        super().__init__()
        self.attention_norm = nn.RMSNorm(h, eps=eps)
        self.attention = Attention(h, heads, groups)
        self.ffn_norm = nn.RMSNorm(h, eps=eps)
        self.feed_forward = FeedForward(h, f)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class PlainLlama(nn.Module):
    """``tokens [b, s]`` -> logits ``[b, s, V]``. Sizes from a loom ``ModelConfig`` (LLaMA
    layout): ``num_layers``, ``hidden_size``, ``num_attention_heads``, ``num_kv_groups``,
    ``ffn_size``, ``vocab_size``, ``seq_length``, ``norm_epsilon``, ``rotary_base``."""

    def __init__(self, m, device):
        super().__init__()
        h = m.hidden_size
        self.tok_embeddings = nn.Embedding(m.vocab_size, h)
        self.layers = nn.ModuleList(Block(h, m.num_attention_heads, m.num_kv_groups, m.ffn_size,
                                          m.norm_epsilon) for _ in range(m.num_layers))
        self.norm = nn.RMSNorm(h, eps=m.norm_epsilon)
        self.output = nn.Linear(h, m.vocab_size, bias=False)
        cos, sin = rope_tables(m.seq_length, h // m.num_attention_heads, m.rotary_base, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens):
        s = tokens.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


class PlainRunner:
    """The model on ``device`` (weights normal(0, 0.02), norms 1), fused AdamW, and
    :meth:`step`. ``compile_blocks``: each block ``.compile(backend=compile_backend)``."""

    def __init__(self, m, device: torch.device, lr: float = 3e-4, weight_decay: float = 0.01,
                 compile_blocks: bool = False, compile_backend: str = "inductor"):
        with torch.device(device):
            self.model = PlainLlama(m, device)
        with torch.no_grad():
            for p in self.model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.02)
        if compile_blocks:
            for block in self.model.layers:
                block.compile(backend=compile_backend)
        self.device = device
        decay = [p for p in self.model.parameters() if p.dim() >= 2]
        rest = [p for p in self.model.parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                      {"params": rest, "weight_decay": 0.0}],
                                     lr=lr, betas=(0.9, 0.95), fused=True)

    def step(self, tokens: torch.Tensor, labels: torch.Tensor) -> float:
        """One optimizer step on ``tokens``/``labels [b, s]``; the loss (a host sync)."""
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            logits = self.model(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.opt.step()
        return float(loss.detach())
