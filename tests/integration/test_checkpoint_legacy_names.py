"""Checkpoints saved before the modules took Megatron-Core's names (issue 22:
``input_norm`` -> ``input_layernorm``, ``final_norm`` -> ``final_layernorm``, ...) still load:
both readers map every saved name through :func:`loom.checkpoint.legacy.canonical_name`.

Each family's model is saved as a v2 (DCP) checkpoint under the old names (the keys
``model.NAME/RofT`` and ``param.NAME`` renamed back), then loaded into today's model: every
tensor comes back exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from loom.checkpoint.io import load_model_weights, open_checkpoint, rank_state_dict
from loom.checkpoint.legacy import canonical_name
from loom.checkpoint.reader import single_process_quiet
from loom.config import ModelConfig
from loom.models import get_family
from loom.parallel.mesh import ParallelMesh
from loom.parallel.parallelize import build_model

# today's spelling -> the one checkpoints were written with before issue 22
OLD = (("input_layernorm", "input_norm"), ("pre_mlp_layernorm", "pre_mlp_norm"),
       ("post_self_attn_layernorm", "post_attention_norm"), ("post_mlp_layernorm", "post_mlp_norm"),
       ("final_layernorm", "final_norm"), ("q_layernorm", "q_norm"), ("k_layernorm", "k_norm"),
       ("lm_head.layer_norm", "lm_head.norm"), ("output_layer.bias", "output_bias.bias"),
       ("shared_experts", "shared_expert"))

SMALL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, vocab_size=100)
CONFIGS = {
    "gpt2": lambda: ModelConfig.gpt2(**SMALL),
    "llama-moe": lambda: ModelConfig.llama(**SMALL, num_query_groups=2, num_experts=4,
                                           moe_ffn_hidden_size=24,
                                           moe_shared_expert_intermediate_size=16),
    "gemma3": lambda: ModelConfig(model_type="gemma3", **SMALL, num_query_groups=2,
                                  kv_channels=8, ffn_hidden_size=48, layer_types="LG",
                                  sliding_window=4),
    "bert": lambda: ModelConfig(model_type="bert", **SMALL),
    "bert-post-ln": lambda: ModelConfig(model_type="bert", post_layernorm=True, **SMALL),
}


def old_name(name: str) -> str:
    for new, old in OLD:
        name = name.replace(new, old)
    return name


def test_canonical_name_maps_old_names_and_keeps_todays():
    cases = {"layers.0.input_norm.weight": "layers.0.input_layernorm.weight",
             "layers.3.layer.pre_mlp_norm.bias": "layers.3.pre_mlp_layernorm.bias",
             "layers.1.post_attention_norm.weight": "layers.1.post_self_attn_layernorm.weight",
             "layers.1.post_mlp_norm.weight": "layers.1.post_mlp_layernorm.weight",
             "final_norm.weight": "final_layernorm.weight",
             "layers.2.self_attention.q_norm.weight": "layers.2.self_attention.q_layernorm.weight",
             "layers.2.self_attention.k_norm.weight": "layers.2.self_attention.k_layernorm.weight",
             "lm_head.norm.bias": "lm_head.layer_norm.bias",
             "output_bias.bias": "output_layer.bias",
             "layers.0.mlp.shared_expert.linear_fc1.weight":
                 "layers.0.mlp.shared_experts.linear_fc1.weight",
             "layers.0.layer.mlp.linear_fc1.weight": "layers.0.mlp.linear_fc1.weight"}
    for old, new in cases.items():
        assert canonical_name(old) == new
        assert canonical_name(new) == new
    # names that merely look alike are left alone
    for name in ("layers.0.mixer.norm.weight", "embedding.norm.weight", "lm_head.dense.weight",
                 "output_layer.weight"):
        assert canonical_name(name) == name


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_checkpoint_with_old_names_loads(tmp_path, family):
    cfg = CONFIGS[family]()
    mesh = ParallelMesh.single()
    fam = get_family(cfg.model_type)
    saved_model = build_model(fam, cfg, mesh, seed=7)
    names = [n for n, _ in saved_model.named_parameters()]
    renamed = [n for n in names if old_name(n) != n]
    assert renamed, f"{family}: no parameter was renamed"
    sd = rank_state_dict([saved_model], None, mesh, None)
    sd["model"] = {old_name(k): v for k, v in sd["model"].items()}
    sd["param"] = {old_name(k): v for k, v in sd["param"].items()}
    ckpt = str(tmp_path / "iter_0000001")
    with single_process_quiet():
        dcp.save(sd, storage_writer=FileSystemWriter(ckpt), no_dist=True)

    index = open_checkpoint(ckpt)
    assert sorted(index.names) == sorted(names)
    assert set(index.parameters()) == set(names)
    model = build_model(fam, cfg, mesh, seed=None)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    load_model_weights(index, [model], mesh)
    want = dict(saved_model.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, want[name]), name
