"""What ``loom train`` says once at start about Megatron's flags of a run (implementation
switches with no effect, Megatron's rules applied, conversions), and the refusal of the
Megatron flags whose training loom does not implement yet (a dry run accepts them: it only
predicts). Nothing is dropped silently.
"""

from __future__ import annotations

from loom.config import LoomConfig
from loom.config.document_masks import document_notes, document_plan
from loom.config.flag_table import no_effect_report
from loom.config.batch_ramp import BatchRamp
from loom.errors import ConfigError


def refuse_unimplemented(cfg: LoomConfig) -> None:
    """Refuse a training run with a Megatron flag whose effect loom does not implement
    (``--calculate-per-token-loss`` for a family whose micro-batches hold different
    numbers of loss tokens; ``--eod-mask-loss`` or ``--sft`` for a family whose forward step is
    not GPT's, or with multi-token prediction; ``--eod-mask-loss`` without a known
    end-of-document id, or with ``--sft``). Raises
    ConfigError naming the flag and what to do."""
    from loom.models import get_family
    from loom.models.family import next_token_windows
    t = cfg.training
    todo = []
    family = get_family(cfg.model.model_type)
    if t.calculate_per_token_loss and family.datasets is not next_token_windows:
        todo.append(f"--calculate-per-token-loss with --model-type {cfg.model.model_type}, "
                    f"whose micro-batches hold different numbers of loss tokens (drop it)")
    plan = document_plan(cfg, family.takes_documents)
    if plan.active and not plan.own_documents:  # documents end at the end-of-document id
        from loom.data.loss_mask import end_of_document_id
        end_of_document_id(cfg.data, cfg.model.vocab_size, "--reset-attention-mask"
                           if plan.attention else "--reset-position-ids")  # refused without
    masked = "--sft" if cfg.data.sft else "--eod-mask-loss" if cfg.data.eod_mask_loss else None
    if masked:
        from loom.data.loss_mask import end_of_document_id
        from loom.models.gpt.model import forward_step as gpt_step
        if family.forward_step is not gpt_step:  # the step that hands loss_mask to lm_loss
            todo.append(f"{masked} with --model-type {cfg.model.model_type}, whose "
                        f"forward step does not read the loss mask (drop it)")
        elif t.calculate_per_token_loss:
            todo.append(f"--calculate-per-token-loss with {masked}: micro-batches then "
                        f"hold different numbers of loss tokens (drop one)")
        elif cfg.model.mtp_num_layers:
            todo.append(f"{masked} with --mtp-num-layers: the multi-token prediction "
                        f"loss is not masked (drop one)")
        elif cfg.data.sft and cfg.data.eod_mask_loss:
            todo.append("--eod-mask-loss with --sft: the SFT loss mask is the conversations' "
                        "(drop --eod-mask-loss)")
        elif not cfg.data.sft:
            end_of_document_id(cfg.data, cfg.model.vocab_size)  # refused without one
    if todo:
        raise ConfigError("not implemented in loom yet (a --dry-run accepts them): "
                          + "; ".join(todo))


def start_notes(cfg: LoomConfig, given: dict) -> list[str]:
    """Lines ``loom train`` prints once (rank 0) before anything else: the Megatron flags
    given that loom accepts without effect
    (:func:`loom.config.flag_table.no_effect_report`), and Megatron's rules that
    changed a given value. ``given``: the parsed command line (``vars(args)``)."""
    t, m = cfg.training, cfg.model
    out = list(cfg.config_notes)  # a torchtitan TOML's differences (loom.config.torchtitan)
    report = no_effect_report(cfg.megatron_no_effect)
    if report:
        out.append(report)
    factor = given.get("rotary_scaling_factor")
    if factor is not None and m.rotary_scaling_factor is None:
        out.append(f"--rotary-scaling-factor {factor:g}: no effect without YaRN or multi-latent "
                   f"attention (as in Megatron-LM)" + (
                       f"; Llama 3's RoPE scaling (--use-rope-scaling) takes "
                       f"--rope-scaling-factor, {m.rope_scaling_factor:g} here"
                       if m.use_rope_scaling else ""))
    granularity = given.get("moe_upcycling_granularity")
    if granularity not in (None, 1) and not cfg.checkpoint.moe_use_upcycling:
        out.append(f"--moe-upcycling-granularity {granularity} without --moe-use-upcycling: no "
                   f"effect (as in Megatron-LM: it shapes the first, upcycling run only)")
    etp = given.get("expert_tensor_parallel_size")
    if etp is not None and not m.num_experts:
        out.append(f"--expert-tensor-parallel-size {etp} without --num-experts: no experts, no "
                   f"effect (as in Megatron-LM)")
    layers = given.get("num_layers")
    if layers is not None and m.hybrid_override_pattern and layers != m.num_layers:
        out.append(f"--num-layers {layers} ignored: --hybrid-override-pattern has {m.num_layers} "
                   f"layers and sets the depth (Megatron-LM's rule)")
    g = given.get("num_query_groups")
    if g and g != m.num_attention_heads and not m.group_query_attention:
        out.append(f"--num-query-groups {g} without --group-query-attention: loom uses {g} "
                   f"key/value groups; Megatron-LM would ignore it (multi-head attention, "
                   f"argument_utils.py:330): add --group-query-attention to say so")
    if t.grad_reduce_in_bf16 and not t.bf16:
        dtype = "fp16" if t.fp16 and not t.accumulate_allreduce_grads_in_fp32 else "fp32"
        out.append(f"--grad-reduce-in-bf16 without --bf16: no effect (as in Megatron-LM, "
                   f"arguments.py:1213): gradients are reduced in {dtype}")
    if t.main_grads_dtype != "fp32" and not t.bf16:
        out.append(f"--main-grads-dtype {t.main_grads_dtype} without --bf16: no effect (as in "
                   f"Megatron-LM, arguments.py:1209): the gradient buffers keep their dtype")
    if t.main_params_dtype != "fp32" and not (t.bf16 or t.fp16):
        out.append(f"--main-params-dtype {t.main_params_dtype} in an fp32 run: no effect (the "
                   f"fp32 parameters are their own master weights)")
    b = cfg.derived.global_batch_size if cfg.derived else None
    ramp_free = not (t.rampup_batch_size or t.step_batch_size_schedule)  # else samples counted
    for name, iters in (("lr_warmup_samples", t.lr_warmup_iters),
                        ("lr_decay_samples", t.lr_decay_iters)):
        value = getattr(t, name)
        if value and b and value % b and ramp_free:
            out.append(f"--{name.replace('_', '-')} {value} is {value / b:.2f} global batches "
                       f"of {b}: loom's schedule steps per iteration, over {iters}")
    from loom.models import get_family
    out += document_notes(cfg, get_family(m.model_type).takes_documents)
    if t.calculate_per_token_loss:
        out.append("--calculate-per-token-loss: every micro-batch holds the same number of loss "
                   "tokens, so the per-token and per-micro-batch averages are the same loss")
    if m.num_experts and m.moe_router_enable_expert_bias and \
            m.moe_router_score_function == "softmax":
        out.append("--moe-router-enable-expert-bias with softmax scores: the bias is added to "
                   "the probabilities for the choice (torchtitan's router; Megatron-LM refuses "
                   "the pair)")
    if t.checkpoint_activations:
        out.append(f"--checkpoint-activations (Megatron-LM v1-v2; its later releases refuse it): "
                   f"every layer recomputed, as --recompute-granularity full --recompute-method "
                   f"uniform --recompute-num-layers {t.checkpoint_num_layers}")
    elif given.get("checkpoint_num_layers") is not None:
        out.append("--checkpoint-num-layers without --checkpoint-activations: no effect (as in "
                   "Megatron-LM v1-v2)")
    ramp = BatchRamp.from_training(t, m.seq_length)
    if ramp is not None:
        out.append(ramp.describe() + (
            "; the learning-rate schedule counts samples, as Megatron-LM's"
            if t.train_samples is not None else
            "; with --train-iters the learning-rate schedule counts iterations" + (
                " (Megatron-LM refused --rampup-batch-size without --train-samples until "
                "532ad926, and ignores the flag since)" if t.rampup_batch_size else
                " (Megatron-LM's step schedule counts --lr-*-iters in units of b x d samples)")))
    if t.ckpt_format in ("torch", "torch_dcp", "fsdp_dtensor"):
        out.append(f"--ckpt-format {t.ckpt_format}: loom writes its own format (loom_dcp) "
                   f"instead (--load reads Megatron's torch and torch_dist checkpoints); "
                   f"--ckpt-format torch_dist writes Megatron's")
    if t.ckpt_format == "torch_dist" and cfg.checkpoint.async_save:
        out.append("--async-save with --ckpt-format torch_dist: Megatron-format saves are "
                   "written synchronously (loom_dcp saves asynchronously)")
    ft = cfg.fault_tolerance
    if ft.exit_signal != "SIGTERM" and not ft.exit_signal_handler:
        out.append(f"--exit-signal {ft.exit_signal} without --exit-signal-handler: no effect (as "
                   f"in Megatron-LM): add --exit-signal-handler to save and exit on it")
    if t.use_megatron_fsdp:
        out.append(f"--use-megatron-fsdp --data-parallel-sharding-strategy "
                   f"{t.data_parallel_sharding_strategy}: ZeRO stage {t.zero_stage}"
                   + (" (PyTorch FSDP2, which gathers and prefetches the parameters "
                      "itself: --overlap-param-gather is its own)" if t.zero_stage == 3 else ""))
    return out
