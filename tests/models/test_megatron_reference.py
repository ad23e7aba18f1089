"""Megatron-Core itself (the ``megatron-core`` package of the test extras, 0.16.1, on CPU through
``testkit.megatron``) as the golden reference: loom and Megatron-Core on the same weights.

One spawned world of 2 gloo ranks runs every case: for GPT-2 (LayerNorm, learned positions,
GeLU, biases, tied embeddings), LLaMA with GQA (RMSNorm, RoPE, SwiGLU, untied), LLaMA with
QK-layernorm, LLaMA with the gated attention output (``--attention-output-gate``, Qwen3-Next's; at TP=2 only),
LLaMA with Llama 4's QK L2 norm (``--qk-l2-norm``, Megatron-Core's ``L2Norm``; at TP=2 only),
at TP=1 and TP=2, and MoE (4 experts, top-2, auxiliary load-balancing loss,
shared expert), latent MoE (``--moe-latent-size``; Transformer Engine's duplicated linear stood
in for: ``testkit.megatron``) and top-1 MoE with ``--moe-apply-probs-on-input`` at TP=1,
Megatron-Core builds ``GPTModel`` (local layer spec), saves it with
``dist_checkpointing`` and loom reads that checkpoint into its own model at the same TP; then
logits, loss and every gradient (Megatron's gathered over TP and read into loom's layout) agree
within rtol 1e-5, and one Adam step (Megatron's optimizer, wrapped in its DDP, with Megatron-LM's
scheduler setting the groups' lr and weight decay, against loom's ``build_optimizer``: same lr,
betas, eps, weight decay, no clipping) leaves every parameter within 1e-5 (atol on O(1)
parameters, see :func:`_case`). MoE trains at TP > 1 in Megatron-Core only with sequence parallelism, which its
local spec refuses on CPU (``torch_norm.py``), so its MoE rows are TP=1. A perturbed weight must
fail the same comparison (the negative control). Megatron-Core also loads a loom checkpoint
written by ``convert --to-megatron`` at TP=1 and TP=2 with loom's logits, and a Megatron
checkpoint read into loom and written back is bit-equal, tensor by tensor.

The vocabulary (256) needs no padding at TP 1 or 2 (Megatron-Core's softmax runs over its
padded columns; loom's is being made to on branch ``modelcaps``).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("megatron.core")

from loom.config import LoomConfig, ModelConfig  # noqa: E402
from testkit import run_distributed  # noqa: E402
from testkit.numerics import PARITY_RTOL, rel_err

BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
            vocab_size=256, seq_length=16, max_position_embeddings=16, hidden_dropout=0.0,
            attention_dropout=0.0)
STYLES = {
    "gpt2": ModelConfig.gpt2(**BASE),
    "llama_gqa": ModelConfig.llama(**BASE, num_query_groups=2),
    "qk_layernorm": ModelConfig.llama(**BASE, num_query_groups=2, qk_layernorm=True),
    "gated": ModelConfig.llama(**BASE, num_query_groups=2, attention_output_gate=True),
    "qk_l2": ModelConfig.llama(**BASE, num_query_groups=2, qk_l2_norm=True),
    "moe": ModelConfig.llama(**BASE, num_query_groups=2, num_experts=4, moe_router_topk=2,
                             moe_ffn_hidden_size=16, moe_aux_loss_coeff=0.01,
                             moe_shared_expert_intermediate_size=32),
}
# latent MoE (Nemotron-3's --moe-latent-size: experts in 16 of the 32 hidden channels, the
# shared expert on the full ones) and --moe-apply-probs-on-input (top-1, pre-softmax: the
# probability, < 1, scales the expert's input); both at TP=1, as the MoE row
LATENT = dict(num_query_groups=2, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16,
              moe_aux_loss_coeff=0.01, moe_shared_expert_intermediate_size=32)
STYLES["moe_latent"] = ModelConfig.llama(**BASE, **LATENT, moe_latent_size=16)
STYLES["moe_probs_on_input"] = ModelConfig.llama(**BASE, **{**LATENT, "moe_router_topk": 1},
                                                 moe_router_pre_softmax=True,
                                                 moe_apply_probs_on_input=True)
MOE_STYLES = ("moe", "moe_latent", "moe_probs_on_input")
MOE_LIST = ModelConfig.llama(**BASE, num_query_groups=2, num_experts=4, moe_router_topk=2,
                             moe_ffn_hidden_size=16, moe_layer_freq="[0,1]",
                             moe_shared_expert_intermediate_size=32)  # layer 0 dense, 1 MoE
GDN_CFG = ModelConfig.llama(**BASE, experimental_attention_variant="gdn", linear_attention_freq="2",
                            linear_conv_kernel_dim=3, linear_key_head_dim=8,
                            linear_value_head_dim=6, linear_num_key_heads=2,
                            linear_num_value_heads=4)
CASES = [(s, tp) for tp in (1, 2) for s in STYLES
         if not (s in MOE_STYLES and tp == 2) and not (s in ("gated", "qk_l2") and tp == 1)]
# (gate: TP=2's per-group split is the layout to check; QK L2 norm: the per-head heads of a rank)
# eps 1e-5, not Megatron's default 1e-8: Adam's first step is lr g / (|g| + eps), and where a
# gradient is zero in exact arithmetic (the key bias: softmax ignores a constant added to every
# score; QK-normed keys' directions) both sides hold rounding residues ~1e-9, which eps 1e-8
# would turn into updates differing by O(lr); with eps 1e-5 they stay ~1e-7.
ADAM = dict(lr=1e-3, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-5)


def _batch(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


def _gather(logits: torch.Tensor, group) -> torch.Tensor:
    from loom.parallel.mappings import gather_from_tensor_parallel_region
    return gather_from_tensor_parallel_region(logits, group)


def _errors(ours: dict, ref: dict) -> tuple[float, list]:
    """(largest per-tensor relative error, names only one side has)."""
    odd = sorted(set(ours) ^ set(ref))
    return max(rel_err(ours[n], ref[n]) for n in ours if n in ref), odd


def _case(style: str, tp: int, tmp: str) -> dict:
    """One style at one TP: Megatron-Core's model and loom's from its checkpoint."""
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from loom.checkpoint.reader import load_model_weights, open_checkpoint
    from loom.models import get_family
    from loom.models.gpt.model import forward_step
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    from loom.parallel.sequence import allreduce_sequence_parallel_grads
    from loom.training.optimizer import build_optimizer
    from testkit.megatron import (init_megatron_parallel, loom_full, megatron_full, megatron_gpt,
                                  save_megatron)
    cfg = STYLES[style]
    tokens, labels = _batch(cfg)
    s = cfg.seq_length
    init_megatron_parallel(tp=tp)
    ref = megatron_gpt(cfg, tp=tp)
    ddp = DistributedDataParallel(ref.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True), ref)
    path = os.path.join(tmp, f"{style}_tp{tp}")
    save_megatron(ref, path)
    mesh = ParallelMesh.build(tp=tp)
    model = build_model(get_family("gpt"), cfg, mesh)
    load_model_weights(open_checkpoint(path, cfg), [model], mesh)
    out = {}
    ref.eval(), model.eval()
    with torch.no_grad():
        want = _gather(ref(tokens, torch.arange(s).expand(2, s), None), mesh.groups["tp"])
        got = _gather(model(tokens), mesh.groups["tp"])
        out["logits"] = rel_err(got, want)
        if style == "llama_gqa" and tp == 2:  # the negative control: one weight moved
            w = model.layers["0"].self_attention.linear_qkv.weight
            w[0, 0] += 1e-2  # (the weights' scale is 0.02)
            out["perturbed logits"] = rel_err(_gather(model(tokens), mesh.groups["tp"]), want)
            w[0, 0] -= 1e-2
        out.update(_moe_controls(style, cfg, model, tokens, want, path, mesh))
    ref.train(), model.train()
    ddp.zero_grad_buffer()
    ref_loss = ddp(tokens, torch.arange(s).expand(2, s), None, labels=labels).float().mean()
    ref_loss.backward()
    finalize_model_grads([ddp])  # Megatron-LM's: DP reduction, QK-norm grads summed over TP
    batch = {"tokens": tokens, "labels": labels, "position_ids": torch.arange(s),
             "num_microbatches": 1}
    output, loss_fn = forward_step(model, batch)
    loss, _ = loss_fn(output)
    loss.backward()
    allreduce_sequence_parallel_grads(  # loom's: gradients partial per TP rank, summed
        [p for n, p in model.named_parameters() if model.registry[n].grad_summed_over_tp],
        mesh.groups["tp"])
    out["loss"] = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
    out["grads"], out["grad names one side only"] = _errors(loom_full(model, "grad"),
                                                           megatron_full(ddp, cfg, "grad"))
    ropt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=ADAM["lr"], weight_decay=ADAM["weight_decay"],
        adam_beta1=ADAM["adam_beta1"], adam_beta2=ADAM["adam_beta2"], adam_eps=ADAM["adam_eps"],
        clip_grad=0.0), [ddp])
    # Megatron-LM's scheduler sets each group's lr and weight decay (wd_mult 0: biases, norms)
    OptimizerParamScheduler(ropt, ADAM["lr"], ADAM["lr"], 0.0, 0, 10, "constant",
                            ADAM["weight_decay"], ADAM["weight_decay"], 10, "constant")
    before = loom_full(model, "param")
    ropt.step()
    build_optimizer(model, LoomConfig.from_flat(ADAM).training).step()
    ours, theirs = loom_full(model, "param"), megatron_full(ddp, cfg, "param")
    # atol 1e-5 x max(1, max|ref|) (tests/README.md: a parameter's scale is O(1), and a wrong
    # step - lr, betas, bias correction, weight decay - is off by O(lr) = 1e-3). Not rtol:
    # zero-initialized biases hold nothing but the step (see ADAM's eps).
    out["params after Adam"] = max(rel_err(ours[n], theirs[n], floor=1.0)
                                   for n in theirs if n in ours)
    out["Adam moved"] = max(rel_err(ours[n], before[n], floor=1.0) for n in theirs if n in ours)
    return out


def _moe_controls(style: str, cfg: ModelConfig, model, tokens, want, path: str, mesh) -> dict:
    """The MoE rows' negative controls (their features ran): the latent model's logits move
    when its up projection ``fc2_latent_proj`` is scaled; the probabilities-on-input model read
    into a loom model without the flag (the same weights) gives other logits."""
    from loom.checkpoint.reader import load_model_weights, open_checkpoint
    from loom.models import get_family
    from loom.parallel.parallelize import build_model
    from testkit.numerics import rel_err
    if style == "moe_latent":
        w = model.layers["1"].mlp.fc2_latent_proj.weight
        kept = w.clone()
        w.mul_(10.0)  # (its scale is 0.02 / sqrt(2 L): one entry moved would hardly show)
        moved = rel_err(model(tokens), want)
        w.copy_(kept)
        return {"control": moved, "latent shape": tuple(model.layers["1"].mlp.experts["0"]
                                                        .linear_fc1.weight.shape)}
    if style == "moe_probs_on_input":
        plain = dataclasses.replace(cfg, moe_apply_probs_on_input=False)
        other = build_model(get_family("gpt"), plain, mesh).eval()
        load_model_weights(open_checkpoint(path, plain), [other], mesh)
        return {"control": rel_err(other(tokens), want)}
    return {}


def _megatron_loads_loom(ckpt: str, cfg: ModelConfig, want: torch.Tensor) -> dict:
    """Megatron-Core's ``dist_checkpointing.load`` of a ``--to-megatron`` directory at TP 1
    and 2: its logits against loom's ``want``."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from testkit.megatron import init_megatron_parallel, megatron_gpt
    tokens, _ = _batch(cfg)
    s, out = cfg.seq_length, {}
    for tp in (1, 2):
        init_megatron_parallel(tp=tp)
        ref = megatron_gpt(cfg, tp=tp).eval()
        loaded = dist_checkpointing.load({"model": ref.sharded_state_dict()}, ckpt)
        ref.load_state_dict(loaded["model"])
        with torch.no_grad():
            got = _gather(ref(tokens, torch.arange(s).expand(2, s), None),
                          ps.get_tensor_model_parallel_group())
        out[tp] = rel_err(got, want)
    return out


def _megatron_loads_loom_moe_list(ckpt: str, cfg: ModelConfig, want: torch.Tensor) -> dict:
    """Megatron-Core's ``GPTModel`` with dense and MoE layers (``moe_layer_freq`` a list, its
    decoder block spec): the keys and shapes of its ``sharded_state_dict`` (every layer keyed
    on its own) against those of loom's ``--to-megatron`` directory, and its logits after
    ``dist_checkpointing.load`` of it against loom's ``want``."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from loom.checkpoint.megatron.stores import DistStore
    from testkit.megatron import init_megatron_parallel, megatron_config
    init_megatron_parallel(tp=1)
    tc = megatron_config(cfg, moe_layer_freq=[0, 1])
    ref = GPTModel(tc, get_gpt_decoder_block_spec(tc, use_transformer_engine=False,
                                                  normalization=cfg.normalization),
                   vocab_size=cfg.padded_vocab(1), max_sequence_length=cfg.max_positions,
                   position_embedding_type=cfg.position_embedding_type,
                   rotary_base=int(cfg.rotary_base),
                   share_embeddings_and_output_weights=False).eval()
    sharded = ref.sharded_state_dict()
    theirs = {}
    for v in sharded.values():
        v = v if isinstance(v, ShardedTensor) else v.build() if hasattr(v, "build") else v
        for t in (v if isinstance(v, list) else [v]):
            if isinstance(t, ShardedTensor):
                theirs[t.key] = tuple(t.global_shape)
    ours = DistStore(ckpt).listing()
    loaded = dist_checkpointing.load({"model": sharded}, ckpt)
    ref.load_state_dict(loaded["model"])
    tokens, _ = _batch(cfg)
    s = cfg.seq_length
    with torch.no_grad():
        got = ref(tokens, torch.arange(s).expand(2, s), None)
    return {"logits": rel_err(got, want), "theirs - ours": sorted(set(theirs) - set(ours)),
            "shapes differ": sorted(k for k in theirs if k in ours and ours[k][0] != theirs[k]),
            "per layer": "decoder.layers.1.mlp.experts.experts.linear_fc2.weight" in theirs}


def megatron_gdn() -> dict:
    """Megatron-Core's GatedDeltaNet (TP=2, this rank's shards) and loom's from the gathered
    full tensors (loom's TP segments: :func:`loom.models.gpt.gdn.gdn_blocks`) on the same
    input: the relative output error, and Megatron's checkpoint keys against loom's."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm import gated_delta_net as meg
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from loom.checkpoint.megatron.names import gdn_of, write_sources
    from loom.models.gpt.gdn import GatedDeltaNet, gdn_blocks, l2_normalize
    from loom.parallel.registry import ShardSpec, full_from_shards
    from testkit.megatron import init_megatron_parallel, megatron_config
    cfg = GDN_CFG
    if True:  # (inside the world's megatron_on_cpu)
        init_megatron_parallel(tp=2)
        mcfg = megatron_config(cfg, tp=2, linear_conv_kernel_dim=3, linear_key_head_dim=8,
                               linear_value_head_dim=6, linear_num_key_heads=2,
                               linear_num_value_heads=4, deterministic_mode=True)
        subs = meg.GatedDeltaNetSubmodules(in_proj=ColumnParallelLinear,
                                           out_norm=WrappedTorchNorm, out_proj=RowParallelLinear)
        with pytest.MonkeyPatch.context() as mp:  # FLA's kernels: its l2norm, eps 1e-6
            mp.setattr(meg, "HAVE_FLA", True)
            mp.setattr(meg, "l2norm", l2_normalize, raising=False)
            ref = meg.GatedDeltaNet(mcfg, subs, layer_number=1,
                                    pg_collection=ProcessGroupCollection.use_mpu_process_groups())
            with torch.no_grad():
                for p in ref.parameters():
                    p.normal_(0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
            x = torch.randn(5, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
            want = ref(x, None)[0]
            keys = set(ref.sharded_state_dict("decoder.layers.0.self_attention.").keys())
            built = {sh.key for k, f in ref.sharded_state_dict("p.").items()
                     if hasattr(f, "build") for sh in f.build()}
        group = ps.get_tensor_model_parallel_group()

        def full(t, spec):
            parts = [torch.empty_like(t) for _ in range(2)]
            dist.all_gather(parts, t.detach().contiguous(), group=group)
            return full_from_shards(parts, spec)
        qk, _, v, *_ = gdn_blocks(cfg)
        loom = GatedDeltaNet(cfg, 0)
        with torch.no_grad():
            loom.in_proj.weight.copy_(full(ref.in_proj.weight, ShardSpec(0, gdn_blocks(cfg))))
            loom.conv1d.weight.copy_(full(ref.conv1d.weight, ShardSpec(0, (qk, qk, v))))
            loom.A_log.copy_(full(ref.A_log, ShardSpec(0)))
            loom.dt_bias.copy_(full(ref.dt_bias, ShardSpec(0)))
            loom.out_norm.weight.copy_(ref.out_norm.weight)
            loom.out_proj.weight.copy_(full(ref.out_proj.weight, ShardSpec(1)))
            got = loom(x)
    ours = {src.key + part for n, _ in loom.named_parameters()
            for src in write_sources(f"layers.0.self_attention.{n}", "gdn", stacked=False,
                                     mamba_stack=False)
            for part in (src.parts or ("",))}
    theirs = {k for k in keys if not k.endswith(("in_proj.weight", "conv1d.weight",
                                                 "._extra_state"))} | \
        {"decoder.layers.0.self_attention." + k[2:] for k in built}
    return {"error": rel_err(got, want),
            "ours - theirs": sorted(ours - theirs), "theirs - ours": sorted(theirs - ours),
            "gdn_of": gdn_of(cfg) is not None}


def world(tmp: str, loom_ckpt: str, loom_logits: torch.Tensor, moe_ckpt: str,
          moe_logits: torch.Tensor) -> dict:
    from testkit.megatron import megatron_on_cpu
    with megatron_on_cpu():
        out = {case: _case(*case, tmp) for case in CASES}
        out["megatron loads loom"] = _megatron_loads_loom(loom_ckpt, STYLES["llama_gqa"],
                                                          loom_logits)
        out["moe list"] = _megatron_loads_loom_moe_list(moe_ckpt, MOE_LIST, moe_logits)
        out["gdn"] = megatron_gdn()
    return out


def _loom_checkpoint(tmp: str, cfg: ModelConfig = STYLES["llama_gqa"],
                     name: str = "loom") -> tuple[str, torch.Tensor]:
    """A loom checkpoint of ``cfg`` (default: the LLaMA/GQA style; norm weights moved off 1)
    as Megatron's torch_dist (``convert --to-megatron``), and loom's logits of it."""
    from loom.checkpoint.io import save_checkpoint
    from loom.checkpoint.megatron.convert import to_megatron
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    from loom.parallel.random import RNGTracker
    mesh = ParallelMesh.single()
    tracker = RNGTracker(mesh.device)
    tracker.seed(0)
    model = build_model(get_family("gpt"), cfg, mesh, tracker, seed=11)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    save_checkpoint(os.path.join(tmp, name), 7, [model], torch.optim.AdamW(model.parameters()),
                    None, mesh, tracker, consumed_samples=56, config=dataclasses.asdict(cfg))
    with torch.no_grad():
        logits = model.eval()(_batch(cfg)[0])
    return to_megatron(os.path.join(tmp, name), os.path.join(tmp, f"{name}_as_megatron")), logits


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("megatron_reference"))
    ckpt, logits = _loom_checkpoint(tmp)
    moe_ckpt, moe_logits = _loom_checkpoint(tmp, MOE_LIST, "loom_moe_list")
    return tmp, run_distributed(2, world, tmp, ckpt, logits, moe_ckpt, moe_logits, timeout=600)


@pytest.mark.parametrize("case", CASES, ids=[f"{s}-tp{t}" for s, t in CASES])
def test_logits_loss_grads_and_adam_step_match_megatron_core(results, case):
    for rank, res in enumerate(results[1]):
        r = res[case]
        assert r["grad names one side only"] == [], (rank, r)
        for what in ("logits", "loss", "grads", "params after Adam"):
            assert r[what] < PARITY_RTOL, (rank, case, what, r)
        assert r["Adam moved"] > 10 * PARITY_RTOL, (rank, case, r)  # the step was taken (~lr)


def test_the_comparison_can_fail(results):
    for res in results[1]:
        r = res[("llama_gqa", 2)]
        assert r["logits"] < PARITY_RTOL < r["perturbed logits"], r


@pytest.mark.parametrize("style", ["moe_latent", "moe_probs_on_input"])
def test_latent_moe_and_probs_on_input_ran(results, style):
    """--moe-latent-size: the experts are 16 wide on input (SwiGLU fc1 [2 x 16, 16], not
    [32, 32]) and the logits follow the latent up projection; --moe-apply-probs-on-input: the
    same weights without it give other logits (top-1 pre-softmax probabilities are < 1). The
    parity itself: test_logits_loss_grads_and_adam_step_match_megatron_core."""
    for res in results[1]:
        r = res[(style, 1)]
        assert r["logits"] < PARITY_RTOL < r["control"], r
        if style == "moe_latent":
            assert r["latent shape"] == (32, 16), r


def test_megatron_core_loads_a_loom_checkpoint_at_tp1_and_tp2(results):
    for res in results[1]:
        assert all(err < PARITY_RTOL for err in res["megatron loads loom"].values()), res


def test_megatron_to_loom_to_megatron_is_bit_equal(results, tmp_path):
    """Each checkpoint Megatron-Core wrote, read into a loom checkpoint (``--from-megatron``
    with the model flags: a bare Megatron-Core checkpoint has no args) and written back
    (``--to-megatron``): every tensor of the original equal, bit for bit, and every
    ``_extra_state`` object there."""
    from torch.distributed.checkpoint import FileSystemReader

    from loom.checkpoint.megatron.convert import from_megatron, to_megatron
    from loom.checkpoint.megatron.stores import DistStore
    tmp = results[0]
    for style, tp in CASES:
        src = os.path.join(tmp, f"{style}_tp{tp}")
        flags = dataclasses.asdict(STYLES[style])
        loom_dir = from_megatron(src, str(tmp_path / f"{style}{tp}_loom"), flags)
        back = to_megatron(os.path.dirname(loom_dir), str(tmp_path / f"{style}{tp}_back"))
        a, b = DistStore(src), DistStore(back)
        assert set(a.tensors) <= set(b.tensors), (style, tp, set(a.tensors) - set(b.tensors))
        whole = [(key, ()) for key in a.tensors]
        got_a, got_b = a.read(whole), b.read(whole)
        for key in whole:
            assert torch.equal(got_a[key], got_b[key]), (style, tp, key)
        objects = {k for k in FileSystemReader(src).read_metadata().state_dict_metadata
                   if k not in a.tensors}
        assert objects and objects <= set(FileSystemReader(back).read_metadata()
                                          .state_dict_metadata), (style, tp)


def test_gated_delta_net_matches_megatron_core(results):
    """Megatron-Core 0.16.1's own GatedDeltaNet at TP=2 (on CPU: its deterministic torch path,
    FLA's ``l2norm`` stood in for) and loom's layer built from its gathered shards (loom's TP
    segments) give the same output on the same input; the checkpoint keys of its parameters
    (``in_proj.weight.query`` ... in parts) are the ones loom writes and reads."""
    for rank in results[1]:
        r = rank["gdn"]
        assert r["error"] < 1e-5, r
        assert not r["ours - theirs"] and not r["theirs - ours"] and r["gdn_of"], r


def test_megatron_core_keys_and_loads_a_dense_and_moe_stack_as_loom_writes_it(results):
    """``--moe-layer-freq`` a list (layer 0 dense, 1 MoE): Megatron-Core keys every layer on
    its own (``decoder.layers.<i>.``, experts ``[E, ...]`` per layer); loom's ``--to-megatron``
    writes each of those keys at Megatron's shape, and Megatron-Core loads it with loom's
    logits."""
    for rank in results[1]:
        r = rank["moe list"]
        assert r["per layer"] and not r["theirs - ours"] and not r["shapes differ"], r
        assert r["logits"] < PARITY_RTOL, r
