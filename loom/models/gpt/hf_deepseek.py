"""Hugging Face ``DeepseekV3ForCausalLM`` <-> loom's GPT family with multi-latent attention,
YaRN, DeepSeek-V3 routing (sigmoid scores, aux-loss-free expert bias, group-limited top-k,
routed scaling factor), dense first layers and a shared expert; and ``DeepseekV2ForCausalLM``
(DeepSeek-V2 / V2-Lite: the same layers, softmax routing with unnormalized top-k weights);
full tensors by loom name (:func:`loom.interop.hf.load_full_state_dict` cuts each rank's
TP / EP shard).

Layout differences handled here:

* RoPE: DeepSeek's checkpoints rotate interleaved pairs ``(x0, x1), (x2, x3), ...``
  (``rope_interleave``); loom rotates halves. Rotating pair i of ``x`` equals rotating halves of
  ``x[perm]`` with ``perm = (0, 2, 4, ..., 1, 3, 5, ...)``, and the attention scores only see
  ``q_r . k_r``, so the RoPE rows of ``q_b_proj`` / ``q_proj`` (the last ``dr`` of each head)
  and of ``kv_a_proj_with_mqa`` (its last ``dr``) are permuted on import, inverted on export.
* Experts: checkpoints store ``experts.<i>.{gate,up,down}_proj``; ``transformers`` holds them
  stacked, ``gate_up_proj [E, 2f, h]`` (gate then up, like loom's fused SwiGLU ``linear_fc1``)
  and ``down_proj [E, h, f]``; both are read, either is written. ``e_score_correction_bias`` is
  loom's ``router.expert_bias``.
* Multi-token prediction: ``transformers`` runs none; DeepSeek-V3's checkpoint keeps depth k as
  ``model.layers.<L + k - 1>`` (``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` plus a
  decoder layer), which is what export writes and import reads when present.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Mapping

import torch

from loom.config import ModelConfig
from loom.errors import ConfigError

TITLE = "DeepSeek-V3"


def _get(hf, name: str, default=None):
    return getattr(hf, name, default) if not isinstance(hf, dict) else hf.get(name, default)


def _rope_fields(hf, title: str = TITLE) -> dict:
    """loom's RoPE flags of an HF ``rope_parameters`` / ``rope_scaling`` (default or yarn)."""
    params = dict(_get(hf, "rope_parameters") or _get(hf, "rope_scaling") or {})
    theta = params.get("rope_theta", _get(hf, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return dict(rotary_base=theta, rope_type="rope")
    if kind != "yarn":
        raise ConfigError(f"{title}: rope_type {kind!r}: loom has default RoPE and YaRN only")
    if params.get("attention_factor") is not None:
        raise ConfigError(f"{title}: an explicit YaRN attention_factor has no loom flag")
    if params.get("truncate", True) is False:
        raise ConfigError(f"{title}: YaRN truncate=false has no loom flag")
    orig = params.get("original_max_position_embeddings", 4096)
    factor = params.get("factor") or _get(hf, "max_position_embeddings") / orig
    all_dim = params.get("mscale_all_dim") or 0.0
    # transformers ignores mscale unless mscale_all_dim is set (then both as Megatron)
    mscale = (params.get("mscale") or 1.0) if all_dim else 1.0
    return dict(rotary_base=theta, rope_type="yarn", rotary_scaling_factor=float(factor),
                mscale=float(mscale), mscale_all_dim=float(all_dim),
                yarn_original_max_position_embeddings=int(orig),
                yarn_beta_fast=float(params.get("beta_fast") or 32.0),
                yarn_beta_slow=float(params.get("beta_slow") or 1.0))


def sigmoid_routing(hf, k: int, exact: bool, title: str = TITLE) -> dict:
    """DeepSeek-V3's routing (also GLM-4.5's): sigmoid scores, the aux-loss-free expert bias,
    top-k normalized, groups scored by their top-2 experts. ConfigError (naming ``title``) for
    unnormalized weights, or (``exact``) a group score Megatron computes otherwise."""
    if not _get(hf, "norm_topk_prob", True) and k > 1:
        raise ConfigError(f"{title}: norm_topk_prob=false: loom's sigmoid router always "
                          f"normalizes the top-k weights")
    groups, gk = _get(hf, "n_group") or 1, _get(hf, "topk_group") or 1
    if groups > 1 and k // gk != 2 and exact:
        raise ConfigError(f"{title}: n_group {groups} with num_experts_per_tok {k} / "
                          f"topk_group {gk} != 2: transformers scores a group by its top-2 "
                          f"experts, Megatron (and loom) by its top k / group_topk")
    return dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_load_balancing_type="none",
                **(dict(moe_router_num_groups=groups, moe_router_group_topk=gk)
                   if groups > 1 else {}))


def _moe_v2(hf, k: int, exact: bool) -> dict:
    """DeepSeek-V2's routing (DeepseekV2TopkRouter; DeepSeek-AI 2024, arXiv 2405.04434 sec.
    2.2): a softmax over all experts, its top k kept unnormalized (Megatron's
    ``--moe-router-pre-softmax``), ``group_limited_greedy`` scoring a group by its best expert
    (Megatron: the sum of its top k / group_topk, the same when that is 1); the sequence-wise
    balance loss of weight ``aux_loss_alpha`` (``seq_aux``) for training on."""
    method = _get(hf, "topk_method") or "greedy"
    groups, gk = _get(hf, "n_group") or 1, _get(hf, "topk_group") or 1
    if method not in ("greedy", "group_limited_greedy"):
        raise ConfigError(f"DeepSeek-V2: topk_method {method!r}: loom routes greedy and "
                          f"group_limited_greedy")
    grouped = method == "group_limited_greedy" and groups > 1
    if grouped and k // gk != 1 and exact:
        raise ConfigError(f"DeepSeek-V2: group_limited_greedy with num_experts_per_tok {k} / "
                          f"topk_group {gk} != 1: transformers scores a group by its best "
                          f"expert, Megatron (and loom) by the sum of its top k / group_topk")
    balance = "seq_aux_loss" if _get(hf, "seq_aux", True) else "aux_loss"
    return dict(moe_router_score_function="softmax", moe_router_pre_softmax=True,
                moe_router_load_balancing_type=balance,
                moe_aux_loss_coeff=float(_get(hf, "aux_loss_alpha", 0.001) or 0.0),
                **(dict(moe_router_num_groups=groups, moe_router_group_topk=gk)
                   if grouped else {}))


def deepseek_v3_config(hf, version: int = 3, exact: bool = True) -> ModelConfig:
    """loom's layout of a ``transformers.DeepseekV3Config`` (``version`` 2: a
    ``DeepseekV2Config``; or its ``config.json`` dict). Raises ConfigError for what loom does
    not express (attention biases, unnormalized sigmoid top-k, a group score other than
    Megatron's; ``exact`` false: that group score becomes Megatron's, as Megatron-Bridge reads
    it, for the planner, whose costs it does not change)."""
    L, E = _get(hf, "num_hidden_layers"), _get(hf, "n_routed_experts")
    k = _get(hf, "num_experts_per_tok")
    dense = min(_get(hf, "first_k_dense_replace", 0) or 0, L)
    title = TITLE if version == 3 else "DeepSeek-V2"
    if _get(hf, "attention_bias"):
        raise ConfigError(f"{title}: attention_bias=true has no loom flag (MLA has no biases)")
    if (_get(hf, "moe_layer_freq") or 1) != 1:
        raise ConfigError(f"{title}: moe_layer_freq {_get(hf, 'moe_layer_freq')}: transformers "
                          f"places an MoE layer at every layer after first_k_dense_replace")
    moe: dict = {}
    if dense < L:
        moe = dict(num_experts=E, moe_router_topk=k,
                   moe_ffn_hidden_size=_get(hf, "moe_intermediate_size"),
                   moe_layer_freq=f"([0]*{dense}+[1]*{L - dense})",
                   moe_router_topk_scaling_factor=float(_get(hf, "routed_scaling_factor", 1.0)),
                   **(sigmoid_routing if version == 3 else _moe_v2)(hf, k, exact))
        shared = _get(hf, "n_shared_experts") or 0
        if shared:
            moe["moe_shared_expert_intermediate_size"] = shared * _get(hf, "moe_intermediate_size")
    return ModelConfig.llama(
        num_layers=L, hidden_size=_get(hf, "hidden_size"),
        num_attention_heads=_get(hf, "num_attention_heads"),
        ffn_hidden_size=_get(hf, "intermediate_size"), vocab_size=_get(hf, "vocab_size"),
        seq_length=_get(hf, "max_position_embeddings"),
        max_position_embeddings=_get(hf, "max_position_embeddings"),
        norm_epsilon=_get(hf, "rms_norm_eps"), hidden_dropout=0.0, attention_dropout=0.0,
        exclude_padded_vocab=True,
        untie_embeddings_and_output_weights=not _get(hf, "tie_word_embeddings", False),
        multi_latent_attention=True, qk_layernorm=True, q_lora_rank=_get(hf, "q_lora_rank"),
        kv_lora_rank=_get(hf, "kv_lora_rank"), qk_head_dim=_get(hf, "qk_nope_head_dim"),
        qk_pos_emb_head_dim=_get(hf, "qk_rope_head_dim"), v_head_dim=_get(hf, "v_head_dim"),
        **_rope_fields(hf, title), **moe)


def _rope_perm(dr: int) -> torch.Tensor:
    return torch.cat([torch.arange(0, dr, 2), torch.arange(1, dr, 2)])


def _permute_rope_rows(w: torch.Tensor, block: int, dr: int, inverse: bool) -> torch.Tensor:
    """Rows of ``w`` in blocks of ``block`` whose last ``dr`` rows are RoPE rows: those
    de-interleaved (``inverse``: interleaved back)."""
    perm = _rope_perm(dr)
    if inverse:
        perm = torch.argsort(perm)
    w = w.reshape(-1, block, w.shape[-1]).clone()
    w[:, block - dr:] = w[:, block - dr:][:, perm]
    return w.reshape(-1, w.shape[-1])


_ATTENTION = (("q_a_proj", "linear_q_down_proj"), ("q_a_layernorm", "q_layernorm"),
              ("q_b_proj", "linear_q_up_proj"), ("q_proj", "linear_q_proj"),
              ("kv_a_proj_with_mqa", "linear_kv_down_proj"), ("kv_a_layernorm", "kv_layernorm"),
              ("kv_b_proj", "linear_kv_up_proj"), ("o_proj", "linear_proj"))


def _layer(sd: Mapping, h: str, l: str, cfg: ModelConfig, moe: bool, interleaved: bool,
           to_loom: bool, fused: bool = False) -> dict:
    """One decoder layer's tensors, HF prefix ``h`` <-> loom prefix ``l`` (``to_loom``: read
    HF names, write loom's; else the reverse; ``fused``: write the experts as ``transformers``
    holds them in memory, else per expert as checkpoints store them)."""
    src, dst = (h, l) if to_loom else (l, h)
    out: dict = {}

    def move(hf_name: str, loom_name: str, fn=None):
        a, b = (hf_name, loom_name) if to_loom else (loom_name, hf_name)
        if src + a in sd:
            out[dst + b] = sd[src + a] if fn is None else fn(sd[src + a])

    dq, dr, r = cfg.q_head_dim, cfg.qk_pos_emb_head_dim, cfg.kv_lora_rank
    for hf_name, loom_name in _ATTENTION:
        fn = None
        if interleaved and hf_name in ("q_b_proj", "q_proj", "kv_a_proj_with_mqa"):
            block = r + dr if hf_name == "kv_a_proj_with_mqa" else dq
            fn = lambda w, b=block: _permute_rope_rows(w, b, dr, inverse=not to_loom)  # noqa: E731
        move(f"self_attn.{hf_name}.weight", f"self_attention.{loom_name}.weight", fn)
    move("input_layernorm.weight", "input_layernorm.weight")
    move("post_attention_layernorm.weight", "pre_mlp_layernorm.weight")
    return {**out, **mlp_tensors(sd, h, l, cfg, moe, to_loom, fused)}


def mlp_tensors(sd: Mapping, h: str, l: str, cfg: ModelConfig, moe: bool, to_loom: bool,
                fused: bool = False) -> dict:
    """A layer's MLP, DeepSeek's way (also GLM-4.5's): a SwiGLU ``mlp.{gate,up,down}_proj``, or
    the router ``mlp.gate`` (weight, ``e_score_correction_bias``: loom's ``router.expert_bias``),
    ``mlp.shared_experts`` and ``mlp.experts``; HF prefix ``h`` <-> loom prefix ``l``, the
    direction and ``fused`` as :func:`_layer`'s."""
    src, dst = (h, l) if to_loom else (l, h)
    if not moe:
        return _mlp(sd, src + "mlp.", dst + "mlp.", to_loom)
    out: dict = {}
    for hf_name, loom_name in (("mlp.gate.weight", "mlp.router.weight"),
                               ("mlp.gate.e_score_correction_bias", "mlp.router.expert_bias")):
        a, b = (hf_name, loom_name) if to_loom else (loom_name, hf_name)
        if src + a in sd:
            out[dst + b] = sd[src + a]
    out.update(_mlp(sd, src + "mlp.shared_experts.", dst + "mlp.shared_experts.", to_loom))
    E, x = cfg.num_experts, "mlp.experts."
    if to_loom and h + x + "gate_up_proj" in sd:  # transformers' in-memory [E, 2f, h] / [E, h, f]
        gate_up, down = sd[h + x + "gate_up_proj"], sd[h + x + "down_proj"]
        for i in range(E):
            out[l + f"{x}{i}.linear_fc1.weight"] = gate_up[i]
            out[l + f"{x}{i}.linear_fc2.weight"] = down[i]
    elif fused:
        out[h + x + "gate_up_proj"] = torch.stack([sd[l + f"{x}{i}.linear_fc1.weight"]
                                                   for i in range(E)])
        out[h + x + "down_proj"] = torch.stack([sd[l + f"{x}{i}.linear_fc2.weight"]
                                                for i in range(E)])
    else:  # checkpoints: experts.<i>.{gate,up,down}_proj
        for i in range(E):
            out.update(_mlp(sd, src + f"{x}{i}.", dst + f"{x}{i}.", to_loom))
    return out


def _mlp(sd: Mapping, src: str, dst: str, to_loom: bool) -> dict:
    """A SwiGLU MLP: HF ``gate_proj`` / ``up_proj`` / ``down_proj`` <-> loom ``linear_fc1``
    (gate; up fused) / ``linear_fc2``."""
    if to_loom:
        if src + "gate_proj.weight" not in sd:
            return {}
        return {dst + "linear_fc1.weight": torch.cat([sd[src + "gate_proj.weight"],
                                                      sd[src + "up_proj.weight"]], dim=0),
                dst + "linear_fc2.weight": sd[src + "down_proj.weight"]}
    if src + "linear_fc1.weight" not in sd:
        return {}
    gate, up = sd[src + "linear_fc1.weight"].chunk(2, dim=0)
    return {dst + "gate_proj.weight": gate, dst + "up_proj.weight": up,
            dst + "down_proj.weight": sd[src + "linear_fc2.weight"]}


_MTP = (("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"),
        ("eh_proj.weight", "eh_proj.weight"), ("shared_head.norm.weight", "final_layernorm.weight"))


def deepseek_v3_to_loom(sd: Mapping[str, torch.Tensor], cfg: ModelConfig,
                        interleaved: bool = True) -> dict[str, torch.Tensor]:
    """DeepseekV3ForCausalLM state dict -> full loom tensors (vocabulary unpadded; ``load_full_
    state_dict`` pads). ``interleaved``: the config's ``rope_interleave``."""
    out = {"embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
           "final_layernorm.weight": sd["model.norm.weight"]}
    if cfg.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = sd["lm_head.weight"]
    return {**out, **_layers(sd, cfg, interleaved, to_loom=True)}


def _layers(sd: Mapping, cfg: ModelConfig, interleaved: bool, to_loom: bool,
            fused: bool = False) -> dict:
    """Every decoder layer and MTP depth (DeepSeek's ``model.layers.<L + k>``), either way."""
    out: dict = {}
    for i in range(cfg.num_layers):
        out.update(_layer(sd, f"model.layers.{i}.", f"layers.{i}.", cfg, cfg.is_moe_layer(i),
                          interleaved, to_loom, fused))
    last_moe = cfg.is_moe_layer(cfg.num_layers - 1)
    for k in range(cfg.mtp_num_layers or 0):
        h, l = f"model.layers.{cfg.num_layers + k}.", f"mtp.layers.{k}."
        out.update(_layer(sd, h, l + "mtp_model_layer.", cfg, last_moe, interleaved, to_loom,
                          fused))
        out.update({(l + b if to_loom else h + a): sd[h + a if to_loom else l + b]
                    for a, b in _MTP})
    return out


def first_dense(cfg: ModelConfig, title: str = TITLE) -> int:
    """HF's ``first_k_dense_replace`` of loom's ``--moe-layer-freq`` (dense layers first);
    ConfigError naming ``title`` for dense layers after MoE ones."""
    kinds = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
    k = kinds.index(True) if any(kinds) else cfg.num_layers
    if any(not x for x in kinds[k:]):
        raise ConfigError(f"{title} has dense layers first then MoE layers only; "
                          f"--moe-layer-freq {cfg.moe_layer_freq!r} interleaves them")
    return k


def is_v2(cfg: ModelConfig) -> bool:
    """Whether a loom MLA model exports as DeepSeek-V2 (MoE with softmax routing) rather than
    DeepSeek-V3 (sigmoid routing, or no MoE)."""
    return bool(cfg.num_experts) and cfg.moe_router_score_function == "softmax"


def _router_v2(cfg: ModelConfig) -> dict:
    """DeepseekV2Config's routing fields of loom's softmax router; ConfigError for one it
    computes otherwise."""
    title = "DeepSeek-V2"
    if not cfg.moe_router_pre_softmax:
        raise ConfigError(f"{title}: its router keeps the softmax over all experts (give "
                          f"--moe-router-pre-softmax); loom's softmax over the top k only has "
                          f"no Hugging Face class")
    if cfg.moe_router_enable_expert_bias:
        raise ConfigError(f"{title}: --moe-router-enable-expert-bias with softmax scores has "
                          f"no Hugging Face class (DeepSeek-V3's bias is on sigmoid scores)")
    groups = cfg.moe_router_num_groups or 1
    if groups > 1 and cfg.moe_router_topk // cfg.moe_router_group_topk != 1:
        raise ConfigError(f"{title}: --moe-router-group-topk {cfg.moe_router_group_topk} with "
                          f"--moe-router-topk {cfg.moe_router_topk}: transformers scores a group "
                          f"by its best expert, loom by the sum of its top k / group_topk; "
                          f"they agree when those are equal")
    return {"topk_method": "group_limited_greedy" if groups > 1 else "greedy",
            "n_group": groups, "topk_group": cfg.moe_router_group_topk or 1,
            "norm_topk_prob": False, "seq_aux": cfg.moe_router_load_balancing_type
            != "aux_loss", "aux_loss_alpha": cfg.moe_aux_loss_coeff}


def hf_config(cfg: ModelConfig) -> dict:
    """``config.json`` of ``DeepseekV3ForCausalLM`` for a loom MLA model, or of
    ``DeepseekV2ForCausalLM`` for one whose experts route by softmax (:func:`is_v2`). Raises
    ConfigError for a layout it cannot express."""
    title = "DeepSeek-V2" if is_v2(cfg) else TITLE
    if not (cfg.multi_latent_attention and cfg.qk_layernorm and cfg.swiglu
            and cfg.normalization == "RMSNorm"):
        raise ConfigError(f"{title} export needs --multi-latent-attention, --qk-layernorm (the "
                          f"latent norms), --swiglu and RMSNorm")
    if cfg.position_embedding_type == "learned_absolute":
        raise ConfigError(f"{title} has no learned position table: a model trained with "
                          f"--multi-latent-attention --position-embedding-type learned_absolute "
                          f"does not convert")
    k = first_dense(cfg)
    f_moe = cfg.moe_ffn_size if cfg.num_experts else cfg.ffn_size
    shared = cfg.moe_shared_expert_intermediate_size or 0
    if shared % f_moe:
        raise ConfigError(f"{title}: --moe-shared-expert-intermediate-size {shared} must be a "
                          f"multiple of --moe-ffn-hidden-size {f_moe} (n_shared_experts)")
    if cfg.num_experts and cfg.moe_shared_expert_gate:
        raise ConfigError(f"{title}: --moe-shared-expert-gate has no Hugging Face class")
    if cfg.num_experts and not is_v2(cfg) and cfg.moe_router_score_function != "sigmoid":
        raise ConfigError(f"{TITLE}: MoE layers need --moe-router-score-function sigmoid "
                          f"(DeepSeek-V3) or softmax (DeepSeek-V2)")
    if cfg.effective_rope_type == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": cfg.rotary_base,
                "factor": cfg.rotary_scaling_factor or 1.0,
                "original_max_position_embeddings": cfg.yarn_original_max_position_embeddings
                or 4096, "beta_fast": cfg.yarn_beta_fast or 32.0,
                "beta_slow": cfg.yarn_beta_slow or 1.0, "mscale": cfg.mscale,
                "mscale_all_dim": cfg.mscale_all_dim}
        if not cfg.mscale_all_dim and cfg.mscale != 1.0:
            raise ConfigError(f"{title}: --mscale without --mscale-all-dim is read differently "
                              f"by transformers; give --mscale-all-dim")
    else:
        rope = {"rope_type": "default", "rope_theta": cfg.rotary_base}
    common = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
              "intermediate_size": cfg.ffn_size, "moe_intermediate_size": f_moe,
              "num_hidden_layers": cfg.num_layers,
              "num_attention_heads": cfg.num_attention_heads,
              "num_key_value_heads": cfg.num_attention_heads,
              "n_shared_experts": shared // f_moe, "n_routed_experts": cfg.num_experts or 1,
              "routed_scaling_factor": cfg.moe_router_topk_scaling_factor or 1.0,
              "kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank,
              "qk_rope_head_dim": cfg.qk_pos_emb_head_dim, "v_head_dim": cfg.v_head_dim,
              "qk_nope_head_dim": cfg.qk_head_dim,
              "num_experts_per_tok": cfg.moe_router_topk, "first_k_dense_replace": k,
              "hidden_act": "silu", "max_position_embeddings": cfg.max_positions,
              "rms_norm_eps": cfg.norm_epsilon,
              "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
              "rope_parameters": rope, "attention_bias": False}
    if is_v2(cfg):
        if cfg.mtp_num_layers:
            raise ConfigError("DeepSeek-V2 has no multi-token prediction layers: "
                              "--mtp-num-layers does not convert")
        return {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                **common, **_router_v2(cfg)}
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **common,
            "n_group": cfg.moe_router_num_groups or 1,
            "topk_group": cfg.moe_router_group_topk or 1, "norm_topk_prob": True,
            "rope_interleave": True, "num_nextn_predict_layers": cfg.mtp_num_layers or 0}


def loom_to_deepseek_v3(full: Mapping[str, torch.Tensor], cfg: ModelConfig,
                        fused: bool = False) -> dict[str, torch.Tensor]:
    """Full loom tensors -> the DeepseekV3ForCausalLM state dict (vocabulary padding dropped,
    RoPE rows interleaved: ``rope_interleave`` true); experts per expert as checkpoints store
    them (``model.safetensors``), or with ``fused`` stacked as ``transformers`` holds them in
    memory (``load_state_dict``)."""
    V = cfg.vocab_size
    hf_config(cfg)  # refuses what it cannot express
    out = {"model.embed_tokens.weight": full["embedding.word_embeddings.weight"][:V],
           "model.norm.weight": full["final_layernorm.weight"]}
    out["lm_head.weight"] = (full["output_layer.weight"][:V] if
                             cfg.untie_embeddings_and_output_weights
                             else out["model.embed_tokens.weight"])
    out.update(_layers(full, cfg, True, to_loom=False, fused=fused))
    return {k: v.contiguous() for k, v in out.items()}


def mtp_depth(hf: dict) -> int:
    """The MTP depth a DeepSeek-V3 ``config.json`` declares (0: none)."""
    return hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers")) or 0


def read_config(hf: dict, where: str, exact: bool = False) -> ModelConfig:
    """loom's layout of a DeepSeek-V3 (or V2) ``config.json`` dict without its MTP layers
    (``where``: the source, for messages; ``loom plan --from-hf``); ConfigError for what loom
    does not express (``exact``: also for a group score computed otherwise than
    transformers', as the weights' import needs)."""
    try:
        return deepseek_v3_config(SimpleNamespace(**hf), exact=exact,
                                  version=2 if hf.get("model_type") == "deepseek_v2" else 3)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def to_loom(hf: dict, sd: Mapping[str, torch.Tensor], where: str) -> tuple:
    """``(ModelConfig, full loom tensors)`` of a DeepSeek-V3 ``config.json`` dict and state dict
    (``where``: the source, for messages). MTP depths are imported when their weights are
    present."""
    cfg = read_config(hf, where, exact=True)
    depth = mtp_depth(hf) if hf.get("model_type") != "deepseek_v2" else 0
    if depth and f"model.layers.{cfg.num_layers}.eh_proj.weight" in sd:
        cfg.mtp_num_layers = depth
    # DeepSeek-V2's RoPE always rotates interleaved pairs (view_as_complex)
    return cfg, deepseek_v3_to_loom(sd, cfg, interleaved=hf.get("rope_interleave", True))
