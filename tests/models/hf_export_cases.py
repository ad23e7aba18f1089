"""One tiny random ``transformers`` model per Hugging Face class loom imports and exports (the
export tests' cases, shared by tests/models/test_hf_export.py and the lm-eval test): built from
a config (no download), norms, routers and biases moved off their 0 / 1 initial values so every
tensor counts, with a word-level tokenizer holding the special tokens of its family. A plain
module beside the tests, not a test file."""

from __future__ import annotations

import torch

V = 100
GPT_SPECIALS = ["<|endoftext|>", "<pad>"]
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>"]
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def word_tokenizer(specials: list, n: int = V):
    """A ``tokenizers`` word-level tokenizer of exactly ``n`` ids: ``specials`` first (added as
    special tokens), then words ``w<i>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = specials + [f"w{i}" for i in range(n - len(specials))]
    unk = "[UNK]" if "[UNK]" in specials else words[-1]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(specials)
    return tok


def _perturb(model):
    """Norm weights, routers, biases and sinks away from their initial values."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in ("norm", "gate.weight", "bias", "sinks", "LayerNorm")):
                p.normal_(0.5 if "norm" in name.lower() else 0.0, 0.3)
    return model


def build(name: str):
    """``(model, tokenizer specials)`` of case ``name`` (a key of :data:`CASES`)."""
    import transformers as T
    c = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    if name == "gpt2":
        m = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4,
                                           n_positions=32))
    elif name == "llama":
        m = T.LlamaForCausalLM(T.LlamaConfig(intermediate_size=40, tie_word_embeddings=False, **c))
    elif name == "qwen2":
        m = T.Qwen2ForCausalLM(T.Qwen2Config(intermediate_size=40, tie_word_embeddings=False, **c))
    elif name == "qwen3":
        m = T.Qwen3ForCausalLM(T.Qwen3Config(intermediate_size=40, head_dim=16,
                                             tie_word_embeddings=False, **c))
    elif name == "mistral":  # a sliding window of 6 positions, within the tests' 12
        m = T.MistralForCausalLM(T.MistralConfig(intermediate_size=40, head_dim=16,
                                                 sliding_window=6, tie_word_embeddings=False,
                                                 **c))
    elif name == "phi3":  # Phi-4-mini's partial RoPE (3/4 of each head), a window of 6
        m = T.Phi3ForCausalLM(T.Phi3Config(
            intermediate_size=40, sliding_window=6, tie_word_embeddings=True, pad_token_id=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                             "partial_rotary_factor": 0.75}, **c))
    elif name == "nemotron":  # Nemotron-4: LayerNorm 1p, squared ReLU, half of RoPE; a d > h
        m = T.NemotronForCausalLM(T.NemotronConfig(
            intermediate_size=40, head_dim=12, norm_eps=1e-5, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                             "partial_rotary_factor": 0.5}, **c))
    elif name == "mixtral":
        m = T.MixtralForCausalLM(T.MixtralConfig(intermediate_size=24, num_local_experts=4,
                                                 num_experts_per_tok=2, sliding_window=6, **c))
    elif name == "qwen2_moe":
        m = T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
            intermediate_size=40, moe_intermediate_size=24, shared_expert_intermediate_size=16,
            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, **c))
    elif name == "qwen3_moe":
        m = T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
            intermediate_size=40, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
            mlp_only_layers=[0], head_dim=16, tie_word_embeddings=False, **c))
    elif name == "deepseek_v3":
        m = T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
            vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=4, n_shared_experts=1, n_routed_experts=8,
            routed_scaling_factor=2.5, kv_lora_rank=12, qk_rope_head_dim=4, v_head_dim=6,
            qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=4,
            first_k_dense_replace=1, max_position_embeddings=64, q_lora_rank=16,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
        for b in m.buffers():  # the routing correction bias, a buffer
            if b.dtype == torch.float32 and b.ndim == 1 and b.numel() == 8:
                b.normal_(0, 0.1)
    elif name == "qwen3_next":  # Gated DeltaNet (2 key heads of 4 value heads) + gated attention
        m = T.Qwen3NextForCausalLM(T.Qwen3NextConfig(
            intermediate_size=40, head_dim=8, num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention", "linear_attention",
                         "full_attention"], linear_conv_kernel_dim=4, linear_key_head_dim=8,
            linear_value_head_dim=6, linear_num_key_heads=2, linear_num_value_heads=4,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=24, mlp_only_layers=[0],
            rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                             "partial_rotary_factor": 0.5},
            **{k: v for k, v in c.items() if k != "num_hidden_layers"}))
        with torch.no_grad():  # zero-centred norms, A_log and dt_bias away from their inits
            for n, p in m.named_parameters():
                if n.endswith(("A_log", "dt_bias")):
                    p.normal_(0.0, 0.5)
    elif name == "glm4_moe":  # QKV biases, Q/K norms, half of RoPE; V3's router in 4 groups
        m = T.Glm4MoeForCausalLM(T.Glm4MoeConfig(
            intermediate_size=48, moe_intermediate_size=16, head_dim=16, n_routed_experts=8,
            num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
            routed_scaling_factor=2.5, first_k_dense_replace=1, attention_bias=True,
            use_qk_norm=True, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                             "partial_rotary_factor": 0.5}, **c))
        for b in m.buffers():  # the routing correction bias, a buffer
            if b.dtype == torch.float32 and b.ndim == 1 and b.numel() == 8:
                b.normal_(0, 0.1)
    elif name == "deepseek_v2":  # V2-Lite's q_proj and YaRN; softmax top-3 in 2 of 4 groups
        m = T.DeepseekV2ForCausalLM(T.DeepseekV2Config(
            vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=4, n_shared_experts=2, n_routed_experts=8,
            routed_scaling_factor=2.5, kv_lora_rank=12, qk_rope_head_dim=4, v_head_dim=6,
            qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=3,
            topk_method="group_limited_greedy", first_k_dense_replace=1,
            max_position_embeddings=64, q_lora_rank=None,
            rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                             "original_max_position_embeddings": 16, "mscale": 0.707,
                             "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}))
    elif name == "gpt_oss":
        m = T.GptOssForCausalLM(T.GptOssConfig(
            intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
            sliding_window=4, rope_parameters={"rope_type": "default", "rope_theta": 1e4}, **c))
    elif name == "gemma3":
        m = T.Gemma3ForCausalLM(T.Gemma3TextConfig(
            vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"], max_position_embeddings=32))
    elif name == "gemma2":  # no QK norm, local / global alternating, soft-capped (50 / 30)
        m = T.Gemma2ForCausalLM(T.Gemma2Config(
            vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
            query_pre_attn_scalar=16, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
            max_position_embeddings=32))
    elif name == "gemma":  # Gemma 1: no QK norm, no post-norms, every layer global; MQA
        m = T.GemmaForCausalLM(T.GemmaConfig(
            vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=1, head_dim=12,
            max_position_embeddings=32))
    elif name == "bert":
        m = T.BertForMaskedLM(T.BertConfig(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0))
    elif name == "mamba2":
        m = T.Mamba2ForCausalLM(T.Mamba2Config(
            vocab_size=V, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8,
            n_groups=2, state_size=8, expand=2, chunk_size=5, use_bias=False,
            tie_word_embeddings=False))
    elif name == "nemotron_h":
        m = T.NemotronHForCausalLM(T.NemotronHConfig(
            vocab_size=V, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"],
            # 6 x 8 = 48 Mamba channels, not a multiple of h (as Nemotron-H 47B / 56B)
            head_dim=8, intermediate_size=48, mamba_num_heads=6, mamba_head_dim=8, n_groups=2,
            ssm_state_size=8, expand=2, chunk_size=5))
        m.config.time_step_min = 0.0  # no dt floor in forward (loom has none; init is done)
        for layer in m.model.layers:
            if hasattr(layer.mixer, "time_step_limit"):
                layer.mixer.time_step_limit = (0.0, float("inf"))
    else:
        raise KeyError(name)
    specials = GEMMA_SPECIALS if name.startswith("gemma") else BERT_SPECIALS if name == "bert" else \
        GPT_SPECIALS
    return _perturb(m).eval(), specials


CASES = ("gpt2", "llama", "qwen2", "qwen3", "mistral", "phi3", "nemotron", "mixtral", "qwen2_moe", "qwen3_moe",
         "qwen3_next", "glm4_moe", "deepseek_v2", "deepseek_v3", "gpt_oss", "gemma3", "gemma2", "gemma", "bert", "mamba2", "nemotron_h")
