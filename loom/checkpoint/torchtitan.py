"""``loom checkpoint convert --from-torchtitan FILE.toml STEP_DIR OUT``: a torchtitan checkpoint
(its DCP ``step-N`` directory) of Llama 2 / 3 / 4, Qwen3, Qwen3-MoE, DeepSeek-V3 or gpt-oss into
a loom checkpoint of the model ``loom train --config FILE.toml`` builds: torchtitan's names
mapped to Hugging Face's, then that family's Hugging Face import
(:func:`loom.checkpoint.convert.save_import`); a full checkpoint (optimizer, train state) at
its step with its AdamW moments, so the run continues in loom (:func:`from_torchtitan`).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from loom.checkpoint.convert import save_import
from loom.errors import ConfigError


# torchtitan's names (v0.2.x torchtitan/models/{llama3,qwen3,deepseek_v3}/model/model.py and
# torchtitan/models/moe/moe.py) -> Hugging Face's, within a layer
_TT_NAMES = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
             "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
             "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm",
             "moe.router.gate": "mlp.gate", "moe.shared_experts.w1": "mlp.shared_experts.gate_proj",
             "moe.shared_experts.w3": "mlp.shared_experts.up_proj",
             "moe.shared_experts.w2": "mlp.shared_experts.down_proj"}
# DeepSeek-V3's multi-latent attention (its q_norm is the query latent's norm)
_TT_MLA = {"attention.wq_a": "self_attn.q_a_proj", "attention.q_norm": "self_attn.q_a_layernorm",
           "attention.wq_b": "self_attn.q_b_proj", "attention.wkv_a": "self_attn.kv_a_proj_with_mqa",
           "attention.kv_norm": "self_attn.kv_a_layernorm", "attention.wkv_b": "self_attn.kv_b_proj"}
# GroupedExperts' stacked tensors (no ``.weight``): w1 / w3 [E, f, h], w2 [E, h, f]
_TT_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# gpt-oss (torchtitan/models/gpt_oss/model/): its router is transformers' mlp.router, its
# experts' stacked tensors (gate / linear rows interleaved, as transformers' columns) are
# transformers' in-memory ones transposed: mlp1 [E, 2f, h] -> gate_up_proj [E, h, 2f], mlp2
# [E, h, f] -> down_proj [E, f, h]; the biases as they are
_TT_GPT_OSS = {"moe.router.gate": "mlp.router", "attention.sinks": "self_attn.sinks"}
# Llama 4 (torchtitan/models/llama4/model/): transformers' Llama4ForCausalLM names its MLPs
# feed_forward (router, shared_expert, experts.gate_up_proj [E, h, 2f] = [w1; w3]^T, down_proj
# [E, f, h] = w2^T)
_TT_LLAMA4 = {"feed_forward.w1": "feed_forward.gate_proj", "feed_forward.w3": "feed_forward.up_proj",
              "feed_forward.w2": "feed_forward.down_proj", "moe.router.gate": "feed_forward.router",
              "moe.shared_experts.w1": "feed_forward.shared_expert.gate_proj",
              "moe.shared_experts.w3": "feed_forward.shared_expert.up_proj",
              "moe.shared_experts.w2": "feed_forward.shared_expert.down_proj"}
_TT_GPT_OSS_EXPERTS = {"mlp1_weight": ("gate_up_proj", True), "mlp1_bias": ("gate_up_proj_bias",
                                                                           False),
                       "mlp2_weight": ("down_proj", True), "mlp2_bias": ("down_proj_bias", False)}


def _halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Query / key rows ``[heads * d, h]`` from RoPE on adjacent pairs (torchtitan's, Meta's)
    to RoPE on halves (Hugging Face's, loom's): within each head, rows ``0, 2, 4, ...`` then
    ``1, 3, 5, ...`` (the permutation transformers' convert_llama_weights_to_hf applies)."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def torchtitan_to_hf(model: dict, heads: int, kv_heads: int, where: str,
                     halves: bool = True, mla: bool = False, gpt_oss: bool = False,
                     llama4: bool = False) -> dict:
    """torchtitan's tensors (``tok_embeddings.weight``, ``layers.N.attention.wq.weight``,
    ``layers.N.moe.experts.w1 [E, f, h]``, ...) under Hugging Face's names, the query / key rows
    reordered to RoPE on halves (:func:`_halves`; ``halves=False``: as they are, for RoPE on
    adjacent pairs), each MoE layer's stacked experts split into ``mlp.experts.<i>.*_proj``;
    ``mla``: DeepSeek-V3's attention names; ``gpt_oss``: gpt-oss's (linear biases, sinks, its
    router and experts as transformers holds them, :data:`_TT_GPT_OSS_EXPERTS`); ``llama4``:
    Llama 4's (:data:`_TT_LLAMA4`, its experts fused and transposed). The
    load-balancing ``moe.expert_bias`` is not mapped (:func:`from_torchtitan` places it).
    Raises ConfigError naming a tensor that is not one of torchtitan's."""
    ends = {"tok_embeddings.weight": "model.embed_tokens.weight",
            "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
    names = {**_TT_NAMES, **(_TT_MLA if mla else {}), **(_TT_GPT_OSS if gpt_oss else {}),
             **(_TT_LLAMA4 if llama4 else {})}
    sd: dict = {}
    if llama4:  # the experts of each MoE layer, fused as transformers holds them
        for name in [n for n in model if n.endswith(".moe.experts.w1")]:
            pre, w1 = name[:-len("moe.experts.w1")], model.pop(name)
            w3, w2 = model.pop(pre + "moe.experts.w3"), model.pop(pre + "moe.experts.w2")
            hf = f"model.{pre}feed_forward.experts."
            sd[hf + "gate_up_proj"] = torch.cat([w1, w3], dim=1).transpose(1, 2)
            sd[hf + "down_proj"] = w2.transpose(1, 2)
    for name, w in model.items():
        if name in ends:
            sd[ends[name]] = w
            continue
        parts = name.split(".")
        inner = ".".join(parts[2:-1])
        pre = f"model.layers.{parts[1] if len(parts) > 1 else ''}."
        if gpt_oss and parts[0] == "layers" and inner == "moe.experts" \
                and parts[-1] in _TT_GPT_OSS_EXPERTS:
            hf_name, transpose = _TT_GPT_OSS_EXPERTS[parts[-1]]
            sd[f"{pre}mlp.experts.{hf_name}"] = w.transpose(1, 2) if transpose else w
            continue
        if gpt_oss and parts[0] == "layers" and ".".join(parts[2:]) == "attention.sinks":
            sd[f"{pre}self_attn.sinks"] = w
            continue
        if parts[0] == "layers" and inner == "moe.experts" and parts[-1] in _TT_EXPERTS \
                and w.dim() == 3:
            for i, wi in enumerate(w.unbind(0)):
                sd[f"{pre}mlp.experts.{i}.{_TT_EXPERTS[parts[-1]]}.weight"] = wi
            continue
        if parts[0] != "layers" or inner not in names or \
                parts[-1] not in (("weight", "bias") if gpt_oss else ("weight",)):
            raise ConfigError(f"{where}: tensor {name!r} is not one of torchtitan's "
                              f"(tok_embeddings, layers.N.attention.*, layers.N.feed_forward.*, "
                              f"layers.N.moe.*, norms, output)")
        if halves and inner in ("attention.wq", "attention.wk"):
            w = _halves(w, heads if inner == "attention.wq" else kv_heads)
        sd[f"{pre}{names[inner]}.{parts[-1]}"] = w
    return sd


def read_dcp(path: str, scalars: Optional[dict] = None) -> dict:
    """Every tensor of a torch.distributed.checkpoint directory, on CPU, in one process
    (``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``); nested state dicts
    flattened with dots; ``scalars`` (if given) receives the int / float entries (torchtitan's
    ``train_state.step``). Raises ConfigError when ``path`` holds no DCP checkpoint."""
    import tempfile
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    if not os.path.exists(os.path.join(path, ".metadata")):
        raise ConfigError(f"{path}: no torch.distributed.checkpoint here (no .metadata): give "
                          f"torchtitan's checkpoint/step-N directory")
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(path, os.path.join(tmp, "all.pt"))
        raw = torch.load(os.path.join(tmp, "all.pt"), map_location="cpu", weights_only=False)
    out: dict = {}
    stack = [("", raw)]
    while stack:
        pre, d = stack.pop()
        for k, v in d.items():
            if isinstance(v, dict):
                stack.append((f"{pre}{k}.", v))
            elif isinstance(v, torch.Tensor):
                out[pre + k] = v
            elif scalars is not None and isinstance(v, (int, float)):
                scalars[pre + k] = v
    return out


def _toml_model(toml_path: str):
    """The :class:`~loom.config.ModelConfig` ``loom train --config toml_path`` builds (the
    torchtitan reader's model, router semantics included). Raises ConfigError as loom train
    would for a config it refuses."""
    import argparse
    from loom.config import add_config_arguments, config_from_args
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(["--config", toml_path])).model


def _moe_hf_layout(cfg) -> dict:
    """A ``config.json`` dict whose Hugging Face layout (tensor names and shapes) is that of the
    torchtitan MoE model ``cfg``: DeepseekV3ForCausalLM under MLA, else Qwen3MoeForCausalLM.
    Only the layout is read from it: the model loom builds is ``cfg`` itself, with
    torchtitan's router (which neither class expresses in general)."""
    common = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size,
              "moe_intermediate_size": cfg.moe_ffn_size, "num_hidden_layers": cfg.num_layers,
              "num_attention_heads": cfg.num_attention_heads, "vocab_size": cfg.vocab_size,
              "num_experts_per_tok": cfg.moe_router_topk, "rms_norm_eps": cfg.norm_epsilon,
              "rope_theta": cfg.rotary_base, "max_position_embeddings": cfg.max_positions,
              "tie_word_embeddings": not cfg.untie_embeddings_and_output_weights,
              "hidden_act": "silu", "norm_topk_prob": True}
    kinds = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
    if cfg.moe_apply_probs_on_input:  # Llama 4: its dense width, NoPE layers, RoPE bands
        return {**common, "model_type": "llama4_text", "num_key_value_heads": cfg.num_kv_groups,
                "head_dim": cfg.head_dim, "num_local_experts": cfg.num_experts,
                "intermediate_size": cfg.moe_ffn_size, "intermediate_size_mlp": cfg.ffn_size,
                "moe_layers": [i for i, k in enumerate(kinds) if k],
                "no_rope_layers": [int(not cfg.is_no_rope_layer(i))
                                   for i in range(cfg.num_layers)],
                "use_qk_norm": False, "attn_temperature_tuning": False,
                "attention_chunk_size": cfg.attention_chunk_size or cfg.max_positions}
    if cfg.softmax_type == "learnable":  # gpt-oss: its window pattern and YaRN
        window = cfg.window
        return {**common, "model_type": "gpt_oss", "num_key_value_heads": cfg.num_kv_groups,
                "head_dim": cfg.head_dim, "num_local_experts": cfg.num_experts,
                "sliding_window": window[0] + 1 if window else None,
                "layer_types": ["sliding_attention" if window and cfg.is_window_layer(i) else
                                "full_attention" for i in range(cfg.num_layers)],
                "swiglu_limit": cfg.activation_func_clamp_value,
                "rope_scaling": {"rope_type": "yarn", "factor": cfg.rotary_scaling_factor,
                                 "beta_fast": cfg.yarn_beta_fast,
                                 "beta_slow": cfg.yarn_beta_slow, "truncate": False,
                                 "original_max_position_embeddings":
                                     cfg.yarn_original_max_position_embeddings}}
    if not cfg.multi_latent_attention:
        return {**common, "model_type": "qwen3_moe", "num_key_value_heads": cfg.num_kv_groups,
                "head_dim": cfg.head_dim, "num_experts": cfg.num_experts,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i, k in enumerate(kinds) if not k]}
    shared = cfg.moe_shared_expert_intermediate_size or 0
    return {**common, "model_type": "deepseek_v3", "num_key_value_heads": cfg.num_attention_heads,
            "n_routed_experts": cfg.num_experts, "n_shared_experts": shared // cfg.moe_ffn_size,
            "first_k_dense_replace": kinds.index(True), "kv_lora_rank": cfg.kv_lora_rank,
            "q_lora_rank": cfg.q_lora_rank, "qk_rope_head_dim": cfg.qk_pos_emb_head_dim,
            "qk_nope_head_dim": cfg.qk_head_dim, "v_head_dim": cfg.v_head_dim,
            "n_group": cfg.moe_router_num_groups or 1, "topk_group": cfg.moe_router_group_topk or 1,
            "routed_scaling_factor": cfg.moe_router_topk_scaling_factor or 1.0,
            "rope_interleave": True}


def _from_torchtitan_moe(model: dict, toml_path: str, where: str, what: str,
                         weights: bool = True):
    """``(family, full loom tensors)`` of torchtitan's DeepSeek-V3 / Qwen3-MoE / gpt-oss
    tensors ``model`` (:func:`from_torchtitan`); ``weights`` False: Adam states of them, which
    the load-balancing bias (a buffer) has none of."""
    from loom.models import FamilyRegistry
    cfg = _toml_model(toml_path)
    bias = {k: model.pop(k) for k in list(model) if k.endswith(".moe.expert_bias")}
    model.pop("tokens_per_expert", None)
    for k in [k for k in model if k.endswith(".moe.tokens_per_expert")]:
        del model[k]  # a running count of routed tokens, not a weight
    if not cfg.untie_embeddings_and_output_weights:
        model.pop("output.weight", None)
    for k, w in model.items():  # what the Hugging Face layout would silently leave unread
        parts = k.split(".")
        if parts[0] == "layers" and (not parts[1].isdigit() or int(parts[1]) >= cfg.num_layers
                                     or (parts[2:4] == ["moe", "experts"]
                                         and w.shape[0] != cfg.num_experts)):
            raise ConfigError(f"{where}: tensor {k!r} {tuple(w.shape)} is not one of the {what} "
                              f"model of {toml_path} ({cfg.num_layers} layers, "
                              f"{cfg.num_experts} experts): a checkpoint of another flavor?")
    # torchtitan's DeepSeek-V3 rotates adjacent pairs as DeepSeek's own checkpoints do
    # (transformers' rope_interleave), Qwen3 and gpt-oss rotate halves: no reordering here
    sd = torchtitan_to_hf(model, cfg.num_attention_heads, cfg.num_kv_groups, where,
                          halves=False, mla=cfg.multi_latent_attention,
                          gpt_oss=cfg.softmax_type == "learnable",
                          llama4=bool(cfg.moe_apply_probs_on_input))
    hf = _moe_hf_layout(cfg)
    family = FamilyRegistry().for_hf(hf["model_type"])
    try:
        _, full = family.hf.to_loom(hf, sd, where)
    except KeyError as e:  # a tensor the flavor has and the checkpoint lacks
        raise ConfigError(f"{where}: no tensor for {e.args[0]!r} of the {what} model of "
                          f"{toml_path}: a checkpoint of another flavor?") from None
    moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    if cfg.moe_router_enable_expert_bias and weights:
        for i in moe_layers:
            b = bias.pop(f"layers.{i}.moe.expert_bias", None)
            if b is None:
                raise ConfigError(f"{where}: layers.{i}.moe.expert_bias missing: the {what} model "
                                  f"of {toml_path} routes with a load-balancing bias")
            full[f"layers.{i}.mlp.router.expert_bias"] = b.float()
    if bias:
        raise ConfigError(f"{where}: tensor {next(iter(bias))!r} is not one of the {what} "
                          f"model of {toml_path}: a checkpoint of another flavor?")
    return family, full


def _from_torchtitan_dense(model: dict, f: dict, toml_path: str, where: str):
    """``(family, full loom tensors)`` of torchtitan's Llama 2 / 3 or dense Qwen3 tensors
    ``model`` (weights or their Adam states alike: :func:`from_torchtitan`)."""
    from loom.models import FamilyRegistry
    qwen3 = bool(f.get("qk_layernorm"))  # RoPE on halves already (its rotate_half)
    a, g, h = f["num_attention_heads"], f["num_query_groups"], f["hidden_size"]
    tied = not f.get("untie_embeddings_and_output_weights", True)
    hf = {"model_type": "qwen3" if qwen3 else "llama", "hidden_size": h,
          "intermediate_size": f["ffn_hidden_size"],
          "num_hidden_layers": f["num_layers"], "num_attention_heads": a,
          "num_key_value_heads": g, "vocab_size": f["vocab_size"],
          "rms_norm_eps": f["norm_epsilon"], "rope_theta": f["rotary_base"],
          "max_position_embeddings": f["seq_length"], "tie_word_embeddings": tied,
          "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
          **({"head_dim": f["kv_channels"]} if f.get("kv_channels") else {})}
    if f["use_rope_scaling"]:  # torchtitan's Llama 3.1 frequency scaling (its RoPEScalingArgs)
        hf["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}
    if tied:  # the output layer is the embedding (torchtitan may save both names)
        model.pop("output.weight", None)
    sd = torchtitan_to_hf(model, a, g, where, halves=not qwen3)
    family = FamilyRegistry().for_hf(hf["model_type"])
    expected = 3 - tied + (11 if qwen3 else 9) * f["num_layers"]
    if len(sd) != expected:
        raise ConfigError(f"{where}: {len(sd)} model tensors, the {toml_path} model has "
                          f"{expected}: a checkpoint of another flavor?")
    return family, family.hf.to_loom(hf, sd, where)[1]  # the tensors; the model is the config's


# torchtitan's full checkpoint (CheckpointManager, v0.2.x): the model's tensors at the top
# (flattened; under ``model.`` in older releases), then these states
_TT_STATES = ("optimizer.", "lr_scheduler.", "dataloader.", "train_state.")


def _torchtitan_parts(tt: dict) -> tuple[dict, dict]:
    """``(model tensors, Adam states)`` of a torchtitan DCP checkpoint's tensors: the states
    ``{"exp_avg": {fqn: tensor}, "exp_avg_sq": ..., "step": ...}`` from its flattened optimizer
    state dict (``optimizer.state.<fqn>.<key>``; empty for a model-only checkpoint)."""
    model = {k[len("model."):]: v for k, v in tt.items() if k.startswith("model.")} or \
        {k: v for k, v in tt.items() if not k.startswith(_TT_STATES)}
    states: dict = {}
    for k, v in tt.items():
        if k.startswith("optimizer.state."):
            fqn, _, key = k[len("optimizer.state."):].rpartition(".")
            states.setdefault(key, {})[fqn[len("model."):] if fqn.startswith("model.")
                                       else fqn] = v
    return model, states


def _torchtitan_ranks(src: str) -> int:
    """How many ranks wrote the DCP checkpoint ``src`` (its ``__<rank>_<n>.distcp`` files)."""
    import re
    return len({m.group(1) for n in os.listdir(src)
                for m in [re.fullmatch(r"__(\d+)_\d+\.distcp", n)] if m})


def _resume_state(states: dict, convert, scalars: dict, f: dict, src: str, where: str) -> dict:
    """``_save_import``'s ``resume`` of torchtitan's Adam states ``states``
    (:func:`_torchtitan_parts`), each moment mapped as the weights are (``convert(tensors) ->
    full loom tensors``: the maps are permutations, concatenations and transposes, which
    commute with AdamW's element-wise moments); the iteration torchtitan's ``train_state.step``
    (else the optimizer's step), the samples consumed ``step x B`` with B its global batch
    (``[training] global_batch_size``, else the local batch x the data-parallel size, the
    ranks that wrote ``src`` over t x p x c). Raises ConfigError for states it cannot read."""
    if not {"exp_avg", "exp_avg_sq", "step"} <= set(states):
        raise ConfigError(f"{where}: optimizer states {sorted(states)}: loom reads torchtitan's "
                          f"AdamW (exp_avg, exp_avg_sq, step)")
    steps = {float(v) for v in states["step"].values()}
    if len(steps) != 1:
        raise ConfigError(f"{where}: the optimizer's parameters have taken {sorted(steps)} "
                          f"steps: loom resumes one step count")
    step = int(steps.pop())
    iteration = int(scalars.get("train_state.step", step))
    batch = f.get("global_batch_size")
    if not batch:
        tpc = f["tensor_model_parallel_size"] * f["pipeline_model_parallel_size"] * \
            f["context_parallel_size"]
        ranks = _torchtitan_ranks(src)
        if not ranks or ranks % tpc:
            raise ConfigError(f"{where}: written by {ranks} ranks, not a multiple of its TP x PP "
                              f"x CP {tpc}: the data-parallel size (and so the samples "
                              f"consumed) is unknown; give [training] global_batch_size")
        batch = f["micro_batch_size"] * ranks // tpc
    return {"iteration": iteration, "consumed_samples": iteration * batch, "step": step,
            **{k: convert(dict(states[k])) for k in ("exp_avg", "exp_avg_sq")}}


def from_torchtitan(src: str, out_dir: str, toml_path: str, overwrite: bool = False) -> str:
    """A loom checkpoint in ``out_dir`` from torchtitan's checkpoint ``src`` (a DCP ``step-N``
    directory: model-only, at iteration 0; or full, torchtitan's CheckpointManager's, its model
    at the top or, in older releases, under ``model.``: at its ``train_state.step`` with its
    AdamW moments mapped as the weights are, so that ``loom train --config toml_path --load
    OUT`` continues the run: :func:`_resume_state`) of the Llama 2 / 3 / 4, Qwen3, Qwen3-MoE,
    DeepSeek-V3 or gpt-oss model the torchtitan job config ``toml_path`` describes
    (:func:`loom.config.torchtitan.read_torchtitan_config`): torchtitan's names mapped to
    Hugging Face's (Llama 2 / 3: each head's query / key rows reordered from RoPE on adjacent
    pairs to RoPE on halves, :func:`_halves`, the same model; Qwen3 rotates halves already and
    is renamed only, its Q/K norms too, a tied output dropped; DeepSeek-V3 and Llama 4 keep
    their adjacent pairs, which Hugging Face's layouts hold too; MoE layers' stacked experts
    split per expert, or fused as transformers holds them), then Hugging Face's import of that
    layout. The model is the one ``loom train --config toml_path`` builds (torchtitan's router,
    initialization, no dropout), its load-balancing bias carried (``moe.expert_bias`` ->
    ``router.expert_bias``). Returns the checkpoint path. Raises ConfigError for a missing or
    non-DCP ``src``, a config loom's torchtitan reader refuses, a tensor the model lacks,
    misses or holds in another shape, optimizer states it cannot map, and an ``out_dir`` it
    may not write (as :func:`from_hf`)."""
    from loom.checkpoint.targets import check_output_dir
    from loom.config.torchtitan import read_torchtitan_config
    check_output_dir(out_dir, f"--from-torchtitan output {out_dir}", overwrite,
                     allow_import=True)
    f = read_torchtitan_config(toml_path)
    where = f"--from-torchtitan {toml_path} {src}"
    what = "DeepSeek-V3" if f.get("multi_latent_attention") else \
        "Llama 4" if f.get("moe_apply_probs_on_input") else \
        "gpt-oss" if f.get("softmax_type") == "learnable" else \
        "Qwen3-MoE" if f.get("num_experts") else "Llama / Qwen3"
    scalars: dict = {}
    tt = read_dcp(src, scalars)
    if torch.is_tensor(tt.get("train_state.step")):  # (a tensor in some writers)
        scalars["train_state.step"] = int(tt["train_state.step"])
    model, states = _torchtitan_parts(tt)
    del tt

    def convert(tensors: dict, weights: bool = False) -> tuple:
        if f.get("num_experts"):
            return _from_torchtitan_moe(tensors, toml_path, where, what, weights)
        return _from_torchtitan_dense(tensors, f, toml_path, where)
    family, full = convert(model, weights=True)
    resume = _resume_state(states, lambda t: convert(t)[1], scalars, f, src, where) \
        if states else None
    try:
        return save_import(family, _toml_model(toml_path), full, out_dir, None, resume)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"{where}: {e.args[0] if e.args else e}: a checkpoint of another "
                          f"{what} flavor than {toml_path}'s?") from None
