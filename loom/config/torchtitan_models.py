"""torchtitan's models as loom's flags: each ``[model] name`` and ``flavor`` of torchtitan
v0.2.2 (``torchtitan/models/*/__init__.py`` and ``model/args.py``) as the loom fields of the same
model (:data:`FLAVORS`), read by :mod:`loom.config.torchtitan`.

Llama (``llama3``; the older ``llama``, ``llama2``): SwiGLU of width ``multiple_of``-rounded
``ffn_dim_multiplier x 8 dim / 3``, RMSNorm, RoPE, Llama 3's with Llama 3.1's frequency scaling
(factor 8, low 1, high 4, original 8192: ``--use-rope-scaling``), untied output, no biases, V
from the flavor (Llama 3's tokenizer, 128,256; Llama 2's, 32,000; debugmodel 2,048). Llama 4
(:func:`llama4`: MoE every first or second layer, top-1 sigmoid on the input, one shared
expert, Llama 4's RoPE scaling; iRoPE's NoPE layers while the sequence fits one of its
attention blocks), Qwen3 dense (QK norm, head dim 128, tied embeddings up to 4B) and MoE
(:func:`qwen3_moe`), DeepSeek-V3 (multi-latent attention, DeepSeek-MoE: :func:`deepseek`,
:func:`moe`), gpt-oss (:func:`gpt_oss`). torchtitan rotates adjacent pairs of each head's
dimensions, loom (as Hugging Face) its two halves: the same model up to a fixed reordering of
each head's query and key rows, which ``loom checkpoint convert --from-torchtitan`` applies
(:func:`loom.checkpoint.torchtitan.from_torchtitan`).
"""

from __future__ import annotations

from typing import Optional


def ffn_dim(dim: int, multiple_of: int = 256, multiplier: Optional[float] = None) -> int:
    """torchtitan's (Llama's) SwiGLU width: ``int(2 * 4 dim / 3)``, times ``multiplier``,
    rounded up to a multiple of ``multiple_of`` (Llama 3 8B: 14,336)."""
    hidden = int(2 * 4 * dim / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def llama(dim, n_layers, n_heads, n_kv_heads=None, multiple_of=256, multiplier=None,
           vocab=128256, rope_theta=500000.0, llama3=True) -> dict:
    return dict(num_layers=n_layers, hidden_size=dim, num_attention_heads=n_heads,
                num_query_groups=n_kv_heads or n_heads, group_query_attention=bool(n_kv_heads),
                ffn_hidden_size=ffn_dim(dim, multiple_of, multiplier), vocab_size=vocab,
                rotary_base=rope_theta, use_rope_scaling=llama3)


# torchtitan's flavors (v0.2.2 torchtitan/models/llama3/__init__.py; Llama 2's from the last
# release that had them, torchtitan/models/llama/__init__.py of 2024)
FLAVORS: dict[str, dict[str, dict]] = {
    "llama3": {
        "debugmodel": llama(256, 6, 16, vocab=2048),
        "8B": llama(4096, 32, 32, 8, 1024, 1.3),
        "70B": llama(8192, 80, 64, 8, 4096, 1.3),
        "405B": llama(16384, 126, 128, 8, 4096, 1.2),
    },
    "llama2": {
        "debugmodel": llama(256, 2, 16, vocab=32000, rope_theta=10000.0, llama3=False),
        "271M": llama(1024, 16, 8, vocab=32000, rope_theta=10000.0, llama3=False),
        "1B": llama(2048, 18, 16, vocab=32000, rope_theta=10000.0, llama3=False),
        "7B": llama(4096, 32, 32, vocab=32000, rope_theta=10000.0, llama3=False),
        "13B": llama(5120, 40, 40, vocab=32000, rope_theta=10000.0, llama3=False),
        "26B": llama(5120, 80, 40, vocab=32000, rope_theta=10000.0, llama3=False),
        "70B": llama(8192, 80, 64, 8, 4096, 1.3, vocab=32000, rope_theta=10000.0,
                      llama3=False),
    },
}
# the older model name ``llama``: Llama 3's flavors where it has them, else Llama 2's
FLAVORS["llama"] = {**FLAVORS["llama2"], **FLAVORS["llama3"]}


def qwen3(dim, n_layers, n_heads, hidden, tied, vocab=151936) -> dict:
    """torchtitan's dense Qwen3 (v0.2.2 torchtitan/models/qwen3/__init__.py): head_dim 128,
    8 KV groups, QK RMSNorm, RMSNorm eps 1e-6, RoPE base 1e6, no Llama 3.1 scaling."""
    return dict(num_layers=n_layers, hidden_size=dim, num_attention_heads=n_heads,
                num_query_groups=8, group_query_attention=True, kv_channels=128,
                ffn_hidden_size=hidden, vocab_size=vocab, rotary_base=1e6,
                use_rope_scaling=False, qk_layernorm=True, norm_epsilon=1e-6,
                untie_embeddings_and_output_weights=not tied)


FLAVORS["qwen3"] = {
    "debugmodel": qwen3(256, 8, 16, 3072, True, vocab=2048),
    "0.6B": qwen3(1024, 28, 16, 3072, True), "1.7B": qwen3(2048, 28, 16, 6144, True),
    "4B": qwen3(2560, 36, 32, 9728, True), "8B": qwen3(4096, 36, 32, 12288, False),
    "14B": qwen3(5120, 40, 40, 17408, False), "32B": qwen3(5120, 64, 64, 25600, False),
}


def moe(experts: int, top_k: int, inter: int, shared: int = 0, score: str = "softmax",
         route_norm: bool = False, route_scale: float = 1.0, groups: Optional[int] = None,
         limited: Optional[int] = None) -> dict:
    """torchtitan's ``MoEArgs`` (v0.2.2 torchtitan/models/moe/moe.py) as Megatron's router
    flags: softmax without ``route_norm`` is ``--moe-router-pre-softmax``, with it Megatron's
    default (the top-k renormalized); sigmoid with it is Megatron's sigmoid (normalized over
    the k); ``route_scale`` the top-k scaling factor; node-limited routing the group flags;
    torchtitan's default ``load_balance_coeff`` 1e-3 the aux-loss-free expert bias at rate 1e-3
    (torchtitan centres each update, which shifts every expert's bias alike and so chooses
    the same experts); ``num_shared_experts`` x ``moe_inter_dim`` one shared expert of that
    width; the weights applied after the experts (``score_before_experts = False``)."""
    out = dict(num_experts=experts, moe_router_topk=top_k, moe_ffn_hidden_size=inter,
               moe_router_score_function=score, moe_router_enable_expert_bias=True,
               moe_router_bias_update_rate=1e-3,
               moe_router_pre_softmax=score == "softmax" and not route_norm)
    if score == "sigmoid" and not route_norm and top_k > 1:
        raise ValueError("torchtitan's sigmoid router without route_norm has no Megatron flag")
    if shared:
        out["moe_shared_expert_intermediate_size"] = shared * inter
    if route_scale != 1.0:
        out["moe_router_topk_scaling_factor"] = route_scale
    if groups:
        out.update(moe_router_num_groups=groups, moe_router_group_topk=limited)
    return out


def deepseek(vocab, dim, inter, moe_inter, n_layers, n_dense, n_heads, routing: dict,
             q_lora_rank=0, mscale=1.0) -> dict:
    """torchtitan's DeepSeek-V3 (v0.2.2 torchtitan/models/deepseek_v3/__init__.py and
    model/args.py): multi-latent attention (kv rank 512, query / key heads of 128 + 64 RoPE
    dimensions, values 128; no query compression at ``q_lora_rank`` 0; RMSNorm on the latents:
    Megatron's ``--qk-layernorm`` under MLA), the first ``n_dense`` layers dense SwiGLU of
    width ``inter``, the rest MoE (``routing``: :func:`moe`), RoPE base 10,000; ``mscale`` is
    YaRN's, used past the original 4,096 positions (:func:`loom.config.torchtitan._translate`)."""
    return dict(num_layers=n_layers, hidden_size=dim, num_attention_heads=n_heads,
                num_query_groups=n_heads, ffn_hidden_size=inter, vocab_size=vocab,
                multi_latent_attention=True, qk_layernorm=True,
                q_lora_rank=q_lora_rank or None, kv_lora_rank=512, qk_head_dim=128,
                qk_pos_emb_head_dim=64, v_head_dim=128, rotary_base=10000.0, rope_type="rope",
                use_rope_scaling=False, mscale=mscale, mscale_all_dim=mscale,
                moe_layer_freq=f"([0]*{n_dense}+[1]*{n_layers - n_dense})", **routing)


DS_DEBUG = deepseek(2048, 256, 1024, 256, 6, 1, 16, moe(8, 3, 256, shared=2), mscale=0.70)
FLAVORS["deepseek_v3"] = {
    "debugmodel": DS_DEBUG, "debugmodel_flex_attn": DS_DEBUG,
    "16B": deepseek(102400, 2048, 10944, 1408, 27, 1, 16, moe(64, 6, 1408, shared=2),
                     mscale=0.70),
    "236B": deepseek(102400, 5120, 12288, 1536, 60, 1, 128,
                      moe(160, 6, 1536, shared=2, route_scale=16.0, groups=8, limited=3),
                      q_lora_rank=1536),
    "671B": deepseek(129280, 7168, 18432, 2048, 61, 3, 128,
                      moe(256, 8, 2048, shared=1, score="sigmoid", route_norm=True,
                           route_scale=2.5, groups=8, limited=4), q_lora_rank=1536),
}
DEEPSEEK_ROPE = dict(original_seq_len=4096, rope_factor=40.0, beta_fast=32, beta_slow=1)
"""torchtitan's DeepSeek-V3 RoPE defaults (model/args.py): YaRN over 4,096 original positions
by a factor 40, applied only when ``[training] seq_len`` exceeds them."""


def qwen3_moe(dim, n_layers, n_heads, n_kv_heads, hidden, experts, moe_inter, vocab=151936,
               rope_theta=1e6) -> dict:
    """torchtitan's Qwen3-MoE (v0.2.2 torchtitan/models/qwen3/__init__.py): dense Qwen3's
    attention (:func:`qwen3`, untied) and every layer MoE: top-8 softmax renormalized, no
    shared expert (:func:`moe`)."""
    out = qwen3(dim, n_layers, n_heads, hidden, False, vocab=vocab)
    out.update(num_query_groups=n_kv_heads, rotary_base=rope_theta,
               **moe(experts, 8, moe_inter, route_norm=True))
    return out


FLAVORS["qwen3"].update({
    "debugmodel_moe": qwen3_moe(256, 8, 16, 8, 3072, 64, 768, vocab=2048),
    "30B-A3B": qwen3_moe(2048, 48, 32, 4, 6144, 128, 768),
    "235B-A22B": qwen3_moe(4096, 94, 64, 4, 12288, 128, 1536, rope_theta=5e6),
})


def llama4(dim, n_layers, n_heads, n_kv_heads=None, multiple_of=256, multiplier=None,
            experts=8, step=2, scaled=True, vocab=202048, nope_every=None,
            block=8192) -> dict:
    """torchtitan's Llama 4 (v0.2.2 torchtitan/models/llama4/__init__.py and model/): Llama's
    attention and RMSNorm, every ``step``-th layer (1-based) MoE: ``experts`` SwiGLU experts and
    one shared expert of width ``int(int(multiplier x int(8 dim / 3)) / 2)`` rounded up to
    ``multiple_of`` (its ``auto_scale_hidden_dim`` over top-1 + 1 shared), top-1 sigmoid routing
    applied to the expert input (``score_before_experts``: Megatron's
    ``--moe-apply-probs-on-input``) with the load-balancing bias; the other layers dense of
    Llama's width; RoPE base 500,000 with Llama 4's frequency scaling (factor 16, low and high
    frequency factors 1, original 8,192: ``RoPEScalingArgs``) where the flavor sets it.
    ``nope_every``: iRoPE's layers without RoPE (0-based multiples: ``--no-rope-freq``); its
    other layers attend within fixed blocks of ``block`` positions (its
    ``fixed_attn_block_size``, ``get_fixed_block_mask_mod``: ``--attention-chunk-size``)."""
    hidden = int(2 * 4 * dim / 3)
    if multiplier is not None:
        hidden = int(multiplier * hidden)
    hidden = int(hidden / 2)  # top_k 1 + 1 shared expert
    hidden += -hidden % multiple_of
    out = llama(dim, n_layers, n_heads, n_kv_heads, multiple_of, multiplier, vocab=vocab,
                 llama3=scaled)
    out.update(moe(experts, 1, hidden, shared=1, score="sigmoid"), moe_apply_probs_on_input=True,
               moe_layer_freq="1" if step == 1 else
               f"([{','.join('1' if (i + 1) % step == 0 else '0' for i in range(step))}]"
               f"*{n_layers // step})")
    if nope_every:
        out["no_rope_freq"] = (f"([1{',0' * (nope_every - 1)}]*{n_layers // nope_every}"
                               + (f"+[1{',0' * (n_layers % nope_every - 1)}]"
                                  if n_layers % nope_every else "") + ")")
        out["attention_chunk_size"] = block
    if scaled:
        out.update(rope_scaling_factor=16.0, rope_scaling_low_freq_factor=1.0,
                   rope_scaling_high_freq_factor=1.0,
                   rope_scaling_original_max_position_embeddings=8192)
    return out


FLAVORS["llama4"] = {
    "debugmodel": llama4(256, 6, 16, vocab=2048),
    "17bx16e": llama4(5120, 48, 40, 8, 2048, 1.2, experts=16, step=1),
    "17bx128e": llama4(5120, 48, 40, 8, 2048, 1.2, experts=128, scaled=False),
    "debugmodel_irope": llama4(256, 6, 16, vocab=2048, nope_every=4, block=256),
    "17bx16e_irope": llama4(5120, 48, 40, 8, 2048, 1.2, experts=16, step=1, nope_every=4),
    "17bx128e_irope": llama4(5120, 48, 40, 8, 2048, 1.2, experts=128, scaled=False,
                              nope_every=4),
}
def gpt_oss(n_layers: int, experts: int, dim: int = 2880, inter: int = 2880,
             vocab: int = 201088) -> dict:
    """torchtitan's gpt-oss (v0.2.2 torchtitan/models/gpt_oss/__init__.py and model/): 64
    query heads of 64 and 8 KV groups with biases and learnable sinks (``--softmax-type
    learnable``), sliding windows of 128 positions on the even (0-based) layers, every layer
    MoE: top-4 softmax renormalized with the gate's bias and the load-balancing bias
    (:func:`moe`), experts of width ``inter`` with biases and gpt-oss's clamped SwiGLU
    (x sigmoid(1.702 x) of the gate clamped at 7, times the linear half clamped at +-7 plus
    1: ``--quick-geglu --glu-linear-offset 1 --activation-func-clamp-value 7``), YaRN RoPE
    applied at every length (base 150,000, factor 32 over 4,096 original positions, betas 32
    and 1, correction range not rounded, attention scale 0.1 ln 32 + 1), RMSNorm eps 1e-5,
    untied."""
    return dict(num_layers=n_layers, hidden_size=dim, num_attention_heads=64,
                num_query_groups=8, group_query_attention=True, kv_channels=64,
                ffn_hidden_size=inter, vocab_size=vocab, swiglu=False, quick_geglu=True,
                glu_linear_offset=1.0, activation_func_clamp_value=7.0,
                disable_bias_linear=False, softmax_type="learnable", window_size="127,0",
                window_attn_skip_freq="2", position_embedding_type="yarn",
                rotary_base=150000.0, rotary_scaling_factor=32.0,
                yarn_original_max_position_embeddings=4096, yarn_beta_fast=32.0,
                yarn_beta_slow=1.0, yarn_correction_range_round_to_int=False,
                **moe(experts, 4, inter, route_norm=True))


FLAVORS["gpt_oss"] = {"debugmodel": gpt_oss(4, 8, dim=256), "20b": gpt_oss(24, 32),
                      "120b": gpt_oss(36, 128)}
