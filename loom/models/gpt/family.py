"""GPT's :class:`~loom.models.family.ModelFamily` value, ``FAMILY`` (its registry row in
:mod:`loom.models` imports this module; its config hooks come from :mod:`.config`)."""

from loom.models.family import Generation, ModelFamily
from loom.models.gpt import config, parallelize
from loom.models.gpt.hf import HF
from loom.models.gpt.model import GPTModel, forward_step  # noqa: F401


def learned_positions_differ(saved: dict, model) -> list[str]:
    """A learned position table ``[max_positions, h]`` must keep the checkpoint's length
    (``saved``: its flat config; ``model``: a ModelConfig)."""
    have = saved.get("max_position_embeddings") or saved.get("seq_length")
    if model.position_embedding_type != "learned_absolute" or not have \
            or have == model.max_positions:
        return []
    return [f"--max-position-embeddings {have} in the checkpoint, {model.max_positions} here "
            f"(learned positions)"]


def logged_metrics(model) -> tuple[str, ...]:
    """``mtp loss`` (mean over the depths) with ``--mtp-num-layers``, logged apart."""
    return ("mtp loss",) if model.mtp_num_layers else ()


FAMILY = ModelFamily(name="gpt", build=GPTModel, plan=parallelize.plan, init=parallelize.init,
                     forward_step=forward_step, generation=Generation(),
                     logged_metrics=logged_metrics,
                     evaluation_tasks=("perplexity", "cloze"), hf=HF,
                     checkpoint_differences=learned_positions_differ,
                     megatron_checkpoints=True, check=config.check,
                     refuse_own_flags=config.refuse_own_flags,
                     layer_kinds=config.layer_kinds, records_attention_logits=True)
