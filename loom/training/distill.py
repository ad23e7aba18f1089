"""Knowledge distillation (Megatron-LM's ``--export-kd-teacher-load``, ModelOpt's logits KD):
a frozen teacher, loaded from a loom or Megatron checkpoint, runs in forward on each
micro-batch, and the student trains on the KL divergence of its softmax from the teacher's
(:func:`loom.parallel.distill_loss.kd_logits_kl`), with or without the LM loss.

``--export-kd-cfg`` (YAML, every key optional; without it, Megatron's default: logits KL only,
temperature 1):

=========================  ===================================================================
``logit_layers``           ``[student, teacher]`` output modules; only ``output_layer`` (the
                           logits) is known to loom
``intermediate_layer_pairs``  refused unless empty (loom has no intermediate-layer losses)
``skip_lm_loss``           True (default): the loss is the KD loss alone; False: LM loss +
                           ``kd_loss_scale`` x KD loss
``kd_loss_scale``          1.0 by default
``logit_kl_temperature``   T, 1.0 by default: both logits divided by T before the softmax
=========================  ===================================================================

The teacher's shape is its checkpoint's saved config (loom's stored config, or Megatron's saved
args); the sequence length and the vocabulary (which the two models must share) are the
student's. Nothing here is read at ``--dry-run``: :func:`check_distillation` holds the rules
that need no file, :func:`read_kd_cfg` and :func:`teacher_checkpoint` run in a real run.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Optional

from loom.errors import ConfigError

KD_KEYS = ("logit_layers", "intermediate_layer_pairs", "skip_lm_loss", "kd_loss_scale",
           "logit_kl_temperature")
"""The keys of ModelOpt's distillation YAML that Megatron-LM passes through."""
_NOT_ARCHITECTURE = ("seq_length", "max_position_embeddings", "vocab_size",
                     "make_vocab_size_divisible_by", "padded_vocab_size", "exclude_padded_vocab",
                     "no_pad_vocab_size")
"""Model fields the teacher takes from the student, not from its checkpoint."""


@dataclass(frozen=True)
class KDConfig:
    """The distillation settings (``--export-kd-cfg``; the defaults are ModelOpt's)."""
    skip_lm_loss: bool = True
    kd_loss_scale: float = 1.0
    logit_kl_temperature: float = 1.0


def check_distillation(cfg, family=None) -> None:
    """The rules that need no file (run at ``--dry-run`` too): raises a one-line ConfigError
    naming the flag. ``family`` (the run's ModelFamily): distillation replaces its forward step
    by the shared language-model step on logits (:func:`distillation_step`), so a family with a
    forward step of its own (BERT's masked LM, Gemma 3's) is refused."""
    t = cfg.training
    if t.export_kd_cfg and not t.export_kd_teacher_load:
        raise ConfigError("--export-kd-cfg needs --export-kd-teacher-load (the teacher to "
                          "distill from): give it, or drop --export-kd-cfg")
    if not t.export_kd_teacher_load:
        return
    m, p = cfg.model, cfg.parallel
    if family is not None:
        from loom.models.language_model import forward_step
        if family.forward_step is not forward_step:
            raise ConfigError(f"--export-kd-teacher-load with --model-type {m.model_type}: "
                              f"distillation runs the shared language-model forward step, "
                              f"which this family replaces with its own: drop the flag")
    why = (
           "--pipeline-model-parallel-size > 1" if p.pipeline_model_parallel_size > 1 else
           "--context-parallel-size > 1" if p.context_parallel_size > 1 else
           "--mtp-num-layers" if m.mtp_num_layers else
           "ZeRO-3 (FSDP)" if getattr(t, "zero_stage", 0) == 3 else None)
    if why:
        raise ConfigError(f"--export-kd-teacher-load with {why}: loom distills language "
                          f"models on one pipeline stage without context parallelism, multi-token prediction "
                          f"or ZeRO-3")


def read_kd_cfg(path: Optional[str]) -> KDConfig:
    """``--export-kd-cfg PATH`` read (None: the defaults); a one-line ConfigError for an
    unreadable file, an unknown key, intermediate layer pairs or logit layers other than the
    output layer."""
    if not path:
        return KDConfig()
    import yaml
    flag = f"--export-kd-cfg {path}"
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"{flag}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{flag}: not YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{flag}: a mapping of {', '.join(KD_KEYS)} expected")
    unknown = sorted(set(raw) - set(KD_KEYS))
    if unknown:
        raise ConfigError(f"{flag}: unknown key {unknown[0]!r} (known: {', '.join(KD_KEYS)})")
    if raw.get("intermediate_layer_pairs"):
        raise ConfigError(f"{flag}: intermediate_layer_pairs: loom has no intermediate-layer "
                          f"distillation losses: give [] (logits only)")
    layers = raw.get("logit_layers")
    if layers is not None and list(layers) != ["output_layer", "output_layer"]:
        raise ConfigError(f"{flag}: logit_layers {layers}: loom distills the output layer's "
                          f"logits only: give [output_layer, output_layer]")
    try:
        kd = KDConfig(bool(raw.get("skip_lm_loss", True)), float(raw.get("kd_loss_scale", 1.0)),
                      float(raw.get("logit_kl_temperature", 1.0)))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{flag}: {e}") from None
    if kd.logit_kl_temperature <= 0:
        raise ConfigError(f"{flag}: logit_kl_temperature {kd.logit_kl_temperature}: give > 0")
    return kd


def teacher_checkpoint(load: str) -> tuple[str, dict]:
    """``(checkpoint directory, saved flat config)`` of ``--export-kd-teacher-load`` (its
    latest checkpoint); a one-line ConfigError naming the flag when there is none."""
    from loom.checkpoint.io import read_common
    from loom.checkpoint.reader import latest_checkpoint
    if not os.path.isdir(load):
        raise ConfigError(f"--export-kd-teacher-load {load}: no such directory (the teacher's "
                          f"checkpoint, loom or Megatron)")
    ckpt = latest_checkpoint(load)
    if ckpt is None:
        raise ConfigError(f"--export-kd-teacher-load {load}: holds no checkpoint")
    saved = read_common(ckpt).get("config") or {}
    if not saved:
        raise ConfigError(f"--export-kd-teacher-load {load}: the checkpoint stores no model "
                          f"args (a bare Megatron-Core checkpoint): loom cannot shape the "
                          f"teacher")
    return ckpt, saved


def teacher_config(cfg, saved: dict):
    """The student's LoomConfig ``cfg`` with the teacher's architecture (the model fields of
    its checkpoint's ``saved`` flat config but :data:`_NOT_ARCHITECTURE`), resolved."""
    from loom.config import LoomConfig, ModelConfig
    from loom.models import resolve_config
    arch = {f.name: saved[f.name] for f in dataclasses.fields(ModelConfig)
            if f.name in saved and f.name not in _NOT_ARCHITECTURE}
    flat = {**cfg.to_flat(), **arch, "export_kd_teacher_load": None, "export_kd_cfg": None,
            "recompute_granularity": None, "load": None, "save": None}
    return resolve_config(LoomConfig.from_flat(flat), cfg.require_derived().world_size)


def build_teacher(cfg, mesh, family, tracker, dtype) -> list:
    """The teacher's chunks on this rank: built with the student's layout, its weights read
    from ``--export-kd-teacher-load`` (no optimizer state), cast to ``dtype``, in eval mode and
    frozen."""
    from loom.checkpoint.reader import load_checkpoint
    from loom.parallel.parallelize import build_model_chunks
    from loom.training.precision import cast_parameters
    ckpt, saved = teacher_checkpoint(cfg.training.export_kd_teacher_load)
    tcfg = teacher_config(cfg, saved)
    chunks = build_model_chunks(family, tcfg, mesh, tracker)
    load_checkpoint(os.path.dirname(ckpt), chunks, None, None, mesh, None,
                    step=_step_of(ckpt), model_cfg=tcfg.model)
    cast_parameters(chunks, dtype)
    for chunk in chunks:
        chunk.eval()
        chunk.requires_grad_(False)
    return chunks


def _step_of(ckpt: str) -> Optional[int]:
    name = os.path.basename(os.path.normpath(ckpt))
    return int(name[len("iter_"):]) if name.startswith("iter_") and \
        name[len("iter_"):].isdigit() else None


def _head_logits_of(chunk):
    """``(TP group or None, this rank's first vocabulary column, softmax columns or None)`` of
    ``chunk``'s output head."""
    head = chunk.head
    mesh = getattr(head, "mesh", None)
    if mesh is None or mesh.tp_size == 1:
        return None, 0, getattr(head, "vocab_size", None)
    n_local = chunk.output_weight().shape[0]
    return mesh.groups["tp"], mesh.tp_rank * n_local, head.vocab_size


def distillation_step(teacher_chunks: list, kd: KDConfig):
    """The forward step of a distillation run (GPT's, :func:`loom.models.language_model.
    forward_step`, on logits): the student's logits ``[b, s, Vp/t]``, the LM loss from them
    (the vocab-parallel cross-entropy) and the KD loss against the frozen teacher's logits of
    the same tokens; the loss is ``kd`` (``skip_lm_loss``) or ``lm + kd_loss_scale x kd``, each
    the masked mean over this micro-batch's tokens; in evaluation, the LM loss (Megatron's
    ``loss_func``). Metrics: ``lm loss``, ``kd loss``."""
    import torch

    from loom.models.language_model import lm_loss
    from loom.models.moe import MoEContext
    teacher = teacher_chunks[-1]

    def step(chunk, batch, hidden_states=None):
        moe = MoEContext(scale=1.0 / batch.get("num_microbatches", 1)) \
            if chunk.cfg.num_experts else None
        extra = {"moe": moe} if moe is not None else {}
        positions = batch.get("position_ids")
        logits = chunk(input_ids=batch["tokens"], labels=None, hidden_states=hidden_states,
                       position_ids=positions, **extra)  # [b, s, Vp/t]
        with torch.no_grad():
            t_extra = {"moe": MoEContext()} if teacher.cfg.num_experts else {}
            t_logits = teacher(input_ids=batch["tokens"], labels=None, position_ids=positions,
                               **t_extra)
        return logits, functools.partial(_kd_loss, chunk=chunk, batch=batch, t_logits=t_logits,
                                         kd=kd, moe=moe, lm_loss=lm_loss)
    return step


def _kd_loss(logits, *, chunk, batch, t_logits, kd: KDConfig, moe, lm_loss):
    from loom.parallel.distill_loss import kd_logits_kl
    from loom.parallel.tensor import _VocabParallelCrossEntropy
    group, start, columns = _head_logits_of(chunk)
    columns = columns or logits.shape[-1] * (1 if group is None else
                                             chunk.head.mesh.tp_size)
    per_token = _VocabParallelCrossEntropy.apply(logits, batch["labels"], group, start, columns)
    lm, metrics = lm_loss(per_token, moe=moe, loss_mask=batch.get("loss_mask"))
    kd_tok = kd_logits_kl(logits, t_logits, kd.logit_kl_temperature, group, start, columns)
    kd_mean, _ = lm_loss(kd_tok, loss_mask=batch.get("loss_mask"))
    metrics["kd loss"] = kd_mean.detach()
    if not chunk.training:  # evaluation reports the LM loss (Megatron's loss_func)
        return lm, metrics
    loss = kd_mean if kd.skip_lm_loss else lm + kd.kd_loss_scale * kd_mean
    return loss, metrics
