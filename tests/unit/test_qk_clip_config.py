"""--qk-clip / --log-max-attention-logit validation: Megatron's bounds (arguments.py: 0 < alpha
< 1, threshold > 0, checked only with --qk-clip) and loom's one-line refusals (MLA, context
parallelism, other families, the clip under FSDP)."""

from __future__ import annotations

import pytest

from loom.errors import ConfigError
from testkit.config import tiny_config

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("kw, world, words", [
    (dict(qk_clip=True, qk_clip_alpha=1.0), 1, "--qk-clip-alpha"),
    (dict(qk_clip=True, qk_clip_alpha=0.0), 1, "--qk-clip-alpha"),
    (dict(qk_clip=True, qk_clip_threshold=0.0), 1, "--qk-clip-threshold"),
    (dict(qk_clip=True, context_parallel_size=2), 2, "--context-parallel-size"),
    (dict(log_max_attention_logit=True, context_parallel_size=2), 2, "--context-parallel-size"),
    (dict(qk_clip=True, zero_stage=3), 2, "FSDP"),
])
def test_refusals(kw, world, words):
    with pytest.raises(ConfigError, match=words) as e:
        tiny_config("llama", **kw).validate(world)
    assert "\n" not in str(e.value)


def test_refused_with_mla_and_other_families():
    mla = dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8,
               qk_pos_emb_head_dim=4, v_head_dim=6, position_embedding_type="rope")
    with pytest.raises(ConfigError, match="--multi-latent-attention"):
        tiny_config("llama", qk_clip=True, **mla).validate(1)
    from loom.models import FamilyRegistry
    rules = FamilyRegistry().rules
    with pytest.raises(ConfigError, match="--model-type gemma3"):
        tiny_config("llama", log_max_attention_logit=True).validate(1, rules("gemma3"))
    for family in ("gpt", "mamba"):  # the families whose attention records the logits
        tiny_config(family, log_max_attention_logit=True).validate(1, rules(family))


def test_accepted():
    """Bounds are Megatron's only with --qk-clip; the log alone accepts FSDP."""
    tiny_config("llama", qk_clip_alpha=2.0).validate(1)
    cfg = tiny_config("llama", qk_clip=True, qk_clip_alpha=0.25, qk_clip_threshold=50.0,
                      use_distributed_optimizer=True).validate(2)
    assert cfg.model.qk_clip and cfg.model.qk_clip_threshold == 50.0
    tiny_config("llama", log_max_attention_logit=True, zero_stage=3).validate(2)
