"""Megatron-Core (the installed ``megatron-core`` package, the suite's golden reference) on a
CPU-only torch build: :func:`megatron_on_cpu` redirects the few ``torch.cuda`` calls its model,
RNG tracker and checkpoint writer make, for the duration of a ``with`` block; nothing of loom
imports this module and nothing outside the block is changed.

What it patches (measured on megatron-core 0.16.1 with torch 2.13+cpu, gloo):

- ``torch.tensor`` / ``zeros`` / ``ones`` / ``empty`` / ``full`` / ``arange`` with a CUDA
  ``device`` -> on the CPU, ``Tensor.cuda()`` -> the tensor itself, ``Tensor.type()`` -> the
  CUDA type's name (the optimizer, its gradient scaler and gradient clipping create their flags
  and norms with ``device='cuda'`` and sort parameters by ``type() == 'torch.cuda.FloatTensor'``),
- ``torch.cuda.current_device`` -> ``"cpu"`` (the attention-score buffer in
  ``megatron/core/utils.py``; the checkpoint writer's failure flag tensors),
- the RNG tracker (``tensor_parallel/random.py``): ``torch.cuda.manual_seed``,
  ``torch.cuda.get_rng_state``, ``_get_cuda_rng_state`` and ``_set_cuda_rng_state`` -> the CPU
  generator (the tracker forks it around dropout; tests run with dropout 0),
- the default causal mask of the unfused softmax (``transformer/utils.py`` builds it with
  ``device="cuda"``) -> the same mask on the CPU,
- ``torch.cuda.synchronize`` -> nothing (``dist_checkpointing``'s writer syncs before saving),
  and the writer's results queue -> an in-process ``queue.Queue`` (a synchronous save collects
  its results in the calling process; Megatron starts a ``multiprocessing`` manager process),
  and its forked writer processes -> the same write function called in this process (a
  spawned test rank is a daemon: it may not fork children).

- ``moe_utils.te_general_gemm`` -> None: 0.16.1's router GEMM reads the name, which is defined
  only when Transformer Engine imports (a ``NameError`` without it; the module-level default
  is missing in that release).
- the latent MoE's projections (``moe_latent_size``): ``MoELayer`` builds them only as
  Transformer Engine's ``TELinear(parallel_mode="duplicated")``, a plain linear replicated on
  every TP rank; without Transformer Engine they become Megatron-Core's own
  ``ColumnParallelLinear`` at TP 1 (the same ``x W^T + b``, parameters and checkpoint key;
  :func:`_duplicated_linear`).

Not on CPU with the local layer spec: sequence parallelism (``torch_norm.py``) and the
``alltoall`` MoE dispatcher (``torch.cuda.Stream``); ``allgather`` works.

:func:`megatron_gpt` builds a ``GPTModel`` with ``get_gpt_layer_local_spec`` from a small
dictionary of loom-style sizes, after :func:`init_megatron_parallel`.
"""

from __future__ import annotations

import contextlib
import queue
import warnings
from typing import Iterator
from unittest import mock

import torch


def _cpu_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_state(state: torch.Tensor, *_args, **_kwargs) -> None:
    torch.set_rng_state(state)


def _causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange")


def _is_cuda(device) -> bool:
    return isinstance(device, int) or (device is not None and torch.device(device).type == "cuda")


def _on_cpu(factory):
    """``factory(..., device="cuda")`` -> the same on the CPU (the optimizer's and gradient
    scaler's flags and norms are made with ``device='cuda'``)."""
    def make(*args, **kwargs):
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)
    return make


def _tensor_cuda(self, *args, **kwargs):
    return self


_TYPE = torch.Tensor.type


def _cuda_type_name(self, *args, **kwargs):
    """``t.type()`` names a CPU tensor as the CUDA one (``torch.cuda.FloatTensor``): the
    optimizer sorts its parameters by that string; ``t.type(dtype)`` is unchanged."""
    if args or kwargs:
        return _TYPE(self, *args, **kwargs)
    return _TYPE(self).replace("torch.", "torch.cuda.", 1)


def _write_in_process(writer):
    """Megatron's ``write_preloaded_data_multiproc`` without its forked writer processes (a
    spawned test rank is a daemon process, which may not have children): each bucket goes
    through Megatron's own ``write_preloaded_data`` in this process, one after another."""
    def write_all(transform_list, use_msc, rank, write_buckets, global_results_queue):
        results, counts = queue.Queue(), queue.Queue()
        out: dict = {}
        for i, bucket in enumerate(write_buckets):
            counts.put(i)
            writer.write_preloaded_data(transform_list, i, bucket, results, _Done(counts),
                                        use_fsync=False)
            idx, written = results.get()
            if isinstance(written, Exception):
                global_results_queue.put(written)
                return
            out[idx] = written
        global_results_queue.put(out)
    return write_all


class _Done:
    """The ``count_queue`` protocol of Megatron's writer (``get`` then ``task_done``)."""

    def __init__(self, q: queue.Queue):
        self.q = q

    def get(self):
        return self.q.get()

    def task_done(self) -> None:
        self.q.task_done()


def _quiet() -> None:
    """Megatron-Core's notes about what this machine lacks (Transformer Engine, Apex) and its
    deprecations, inside the ``with`` block only."""
    for message in (".*Transformer Engine and Apex are not installed", ".*Apex is not installed",
                    ".*cuda_graph_scope"):
        warnings.filterwarnings("ignore", message=message)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def _duplicated_linear(input_size: int, output_size: int, *, parallel_mode: str, config,
                       init_method, bias: bool, skip_bias_add: bool,
                       skip_weight_param_allocation: bool = False, is_expert: bool = False):
    """Transformer Engine's ``TELinear`` in ``parallel_mode="duplicated"`` (no TP split, the
    weight whole on every TP rank: the latent MoE's ``fc1_latent_proj`` / ``fc2_latent_proj``)
    as Megatron-Core's ``ColumnParallelLinear`` on a TP group of one rank, which computes and
    stores the same (``(x W^T + b, None)``; ``decoder.layers.mlp.fc1_latent_proj.weight``).
    Refused at TP > 1, where a column-parallel linear would split what TE keeps whole."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import ColumnParallelLinear
    if parallel_mode != "duplicated" or ps.get_tensor_model_parallel_world_size() != 1:
        raise NotImplementedError("the TELinear stand-in is a duplicated linear at TP 1 only")
    return ColumnParallelLinear(input_size, output_size, config=config, init_method=init_method,
                                bias=bias, gather_output=False, skip_bias_add=skip_bias_add,
                                skip_weight_param_allocation=skip_weight_param_allocation,
                                is_expert=is_expert)


@contextlib.contextmanager
def megatron_on_cpu() -> Iterator[None]:
    """Inside: Megatron-Core's model, RNG tracker, optimizer and ``dist_checkpointing`` run on
    the CPU build of torch (see the module docstring for what is redirected)."""
    with warnings.catch_warnings():
        _quiet()
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        from megatron.core.fusions import fused_softmax
        from megatron.core.tensor_parallel import random as mrandom
        from megatron.core.transformer.moe import moe_layer, moe_utils
    with contextlib.ExitStack() as stack:
        if not moe_layer.HAVE_TE:  # the latent MoE's projections (module docstring)
            stack.enter_context(mock.patch.object(moe_layer, "HAVE_TE", True))
            stack.enter_context(mock.patch.object(moe_layer, "TELinear", _duplicated_linear,
                                                  create=True))
        for fn in _FACTORIES:
            stack.enter_context(mock.patch(f"torch.{fn}", _on_cpu(getattr(torch, fn))))
        stack.enter_context(mock.patch.object(torch.Tensor, "cuda", _tensor_cuda))
        stack.enter_context(mock.patch.object(torch.Tensor, "type", _cuda_type_name))
        for target, value in (("torch.cuda.current_device", lambda: "cpu"),
                              ("torch.cuda.synchronize", lambda *a, **k: None),
                              ("torch.cuda.manual_seed", torch.manual_seed),
                              ("torch.cuda.get_rng_state", _cpu_state),
                              ("torch.cuda.random.get_rng_state", _cpu_state)):
            stack.enter_context(mock.patch(target, value))
        stack.enter_context(mock.patch.object(mrandom, "_get_cuda_rng_state", _cpu_state))
        stack.enter_context(mock.patch.object(mrandom, "_set_cuda_rng_state", _set_cpu_state))
        stack.enter_context(mock.patch.object(fused_softmax, "get_default_causal_mask",
                                              _causal_mask))
        stack.enter_context(mock.patch.object(filesystem_async, "_get_write_results_queue",
                                              queue.Queue))
        stack.enter_context(mock.patch.object(moe_utils, "te_general_gemm", None, create=True))
        writer = filesystem_async.FileSystemWriterAsync
        stack.enter_context(mock.patch.object(writer, "write_preloaded_data_multiproc",
                                              staticmethod(_write_in_process(writer))))
        stack.enter_context(warnings.catch_warnings())
        _quiet()
        yield


def init_megatron_parallel(tp: int = 1, pp: int = 1, ep: int = 1, seed: int = 1) -> None:
    """(Re)initialize Megatron-Core's model-parallel groups (its module state) on the current
    ``torch.distributed`` world and seed its RNG tracker; call inside :func:`megatron_on_cpu`."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def megatron_config(cfg, tp: int = 1, pp: int = 1, ep: int = 1, **extra):
    """Megatron-Core's ``TransformerConfig`` of the loom ``ModelConfig`` ``cfg`` (GPT family:
    GPT-2 / LLaMA layouts, QK-layernorm or QK L2 norm, interleaved RoPE, NoPE layers, the gated attention
    output, MoE with the allgather dispatcher, latent MoE, probabilities on the expert input),
    fp32, no dropout, CPU initialization; ``extra``: more ``TransformerConfig`` fields."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig
    if cfg.swiglu:
        act = F.silu
    elif cfg.openai_gelu:
        def act(x):
            return F.gelu(x, approximate="tanh")
    else:
        act = F.gelu
    kw = dict(num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
              num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_kv_groups,
              ffn_hidden_size=cfg.ffn_size, kv_channels=cfg.head_dim,
              normalization=cfg.normalization, layernorm_epsilon=cfg.norm_epsilon,
              gated_linear_unit=cfg.swiglu, activation_func=act,
              add_bias_linear=not cfg.disable_bias_linear, add_qkv_bias=cfg.add_qkv_bias,
              qk_layernorm=cfg.qk_layernorm, hidden_dropout=0.0, attention_dropout=0.0,
              use_cpu_initialization=True, tensor_model_parallel_size=tp,
              pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
              bias_activation_fusion=False, masked_softmax_fusion=False,
              bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
              persist_layer_norm=False, init_method_std=0.02, pipeline_dtype=torch.float32,
              rotary_interleaved=cfg.rotary_interleaved,
              attention_output_gate=cfg.attention_output_gate, no_rope_freq=_no_rope(cfg),
              qk_l2_norm=cfg.qk_l2_norm)
    if cfg.num_experts:
        kw.update(num_moe_experts=cfg.num_experts, moe_router_topk=cfg.moe_router_topk,
                  moe_ffn_hidden_size=cfg.moe_ffn_size, moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
                  moe_router_load_balancing_type=cfg.moe_router_load_balancing_type,
                  moe_token_dispatcher_type="allgather",
                  moe_router_score_function=cfg.moe_router_score_function,
                  moe_router_pre_softmax=cfg.moe_router_pre_softmax,
                  moe_router_enable_expert_bias=cfg.moe_router_enable_expert_bias,
                  moe_shared_expert_intermediate_size=cfg.moe_shared_expert_intermediate_size,
                  moe_router_dtype="fp32" if cfg.moe_router_dtype == "fp32" else None,
                  moe_grouped_gemm=False, moe_latent_size=cfg.moe_latent_size,
                  moe_apply_probs_on_input=cfg.moe_apply_probs_on_input)
    return TransformerConfig(**{**kw, **extra})


def _no_rope(cfg):
    """``--no-rope-freq`` as Megatron's parser hands it to ``TransformerConfig``: an int
    (which Megatron expands itself) or the 0/1 list, or None."""
    text = getattr(cfg, "no_rope_freq", None)
    if text is None:
        return None
    text = str(text).strip()
    return int(text) if text.isdigit() else \
        [int(cfg.is_no_rope_layer(i)) for i in range(cfg.num_layers)]


def megatron_gpt(cfg, tp: int = 1, pp: int = 1, ep: int = 1, vocab: int | None = None,
                 **extra):
    """Megatron-Core's ``GPTModel`` (local layer spec) of the loom ``ModelConfig`` ``cfg`` on
    this rank (``vocab``: the embedding's rows, default ``cfg.padded_vocab(tp)``; ``extra``:
    more ``TransformerConfig`` fields); its model parallel groups must be set up
    (:func:`init_megatron_parallel`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_experts, qk_layernorm=cfg.qk_layernorm,
                                    normalization=cfg.normalization, qk_l2_norm=cfg.qk_l2_norm)
    return GPTModel(megatron_config(cfg, tp, pp, ep, **extra), spec,
                    vocab_size=vocab or cfg.padded_vocab(tp),
                    max_sequence_length=cfg.max_positions,
                    pre_process=ps.is_pipeline_first_stage(),
                    post_process=ps.is_pipeline_last_stage(),
                    position_embedding_type=cfg.position_embedding_type,
                    rotary_base=int(cfg.rotary_base), rotary_percent=cfg.rotary_percent,
                    rope_scaling=cfg.use_rope_scaling, rope_scaling_factor=cfg.rope_scaling_factor,
                    seq_len_interpolation_factor=cfg.rotary_seq_len_interpolation_factor,
                    share_embeddings_and_output_weights=not cfg.untie_embeddings_and_output_weights)


def save_megatron(model, path: str, extra: dict | None = None) -> None:
    """``dist_checkpointing.save`` of ``{"model": model.sharded_state_dict(), **extra}`` into
    ``path`` (created by rank 0), as Megatron-LM's ``save_checkpoint`` does for torch_dist."""
    import os

    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict(), **(extra or {})}, path)


def loom_full(model, what: str = "grad") -> dict:
    """``{name: full tensor}`` of a loom model's gradients (``what="grad"``, parameters that
    have one) or parameters (``"param"``), TP shards all-gathered and joined by the registry."""
    import torch.distributed as dist

    from loom.parallel.registry import full_from_shards
    mesh, out = model.mesh, {}
    for name, p in model.named_parameters():
        local = p.grad if what == "grad" else p.detach()
        if local is None:
            continue
        meta = model.registry[name]
        if meta.shard is not None and mesh.tp_size > 1:
            parts = [torch.empty_like(local) for _ in range(mesh.tp_size)]
            dist.all_gather(parts, local.contiguous(), group=mesh.groups["tp"])
            local = full_from_shards(parts, meta.shard)
        out[name] = local.detach().clone()
    return out


def megatron_full(model, cfg, what: str = "grad") -> dict:
    """``{loom name: full tensor in loom's layout}`` of a live Megatron-Core model's gradients
    (``main_grad`` under its DDP, else ``grad``) or parameters: every TP rank's named tensors
    gathered, then read as a ``--ckpt-format torch`` checkpoint held in memory (its
    ``mp_rank_TT`` state dicts) by loom's Megatron reader."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from loom.checkpoint.megatron.index import MegatronIndex
    from loom.checkpoint.megatron.locate import Found
    from loom.checkpoint.megatron.stores import TorchStore
    local = {}
    for name, p in model.named_parameters():
        t = p.detach() if what == "param" else getattr(p, "main_grad", None)
        t = p.grad if t is None and what == "grad" else t
        if t is not None:
            local[name.removeprefix("module.")] = t.detach().clone()
    group = ps.get_tensor_model_parallel_group()
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    store = TorchStore("<live Megatron-Core model>",
                       {(r, 0, 0): {"model": sd} for r, sd in enumerate(gathered)})
    index = MegatronIndex(Found(store.path, "torch", None, ""), cfg, store)
    full, _, _ = index.load(index.names)
    return full
