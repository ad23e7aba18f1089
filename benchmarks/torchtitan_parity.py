"""loom against torchtitan's own models: a torchtitan model built and initialized by torchtitan,
saved as torchtitan saves it (DCP), converted with ``loom checkpoint convert --from-torchtitan``,
and both models' logits compared on the same tokens. Not a test: it needs torchtitan's package,
which loom does not depend on. Set-up (CPU, no triton)::

    pip download torchtitan==0.2.2 --no-deps -d /tmp/tt && cd /tmp/tt && \\
        unzip -q torchtitan-0.2.2-py3-none-any.whl -d src
    pip install --no-deps --target /tmp/tt/deps torchdata && pip install --target /tmp/tt/deps tyro
    PYTHONPATH=/tmp/tt/deps python -m benchmarks.torchtitan_parity /tmp/tt/src [MODEL [FLAVOR]]

``MODEL``: ``llama3`` (default), ``qwen3``, ``deepseek_v3``, ``gpt_oss`` or ``llama4``;
``FLAVOR`` one of its flavors (default ``debugmodel``; Qwen3-MoE: ``qwen3 debugmodel_moe``);
``all``: the six debug models; ``resume``: :func:`resume_parity`; a fourth word: the sequence
length (``llama4 debugmodel_irope 600``: iRoPE across three of its 256-position blocks).
torchtitan's package ``__init__`` imports its whole config and quantization stack (tyro, triton
kernels); this script imports only its model modules (the package's directory as a namespace;
its triton MoE kernel module stubbed: the experts run torchtitan's for-loop path,
``use_grouped_mm`` off). MoE models get a random load-balancing bias (torchtitan's
``expert_bias``, which its training updates) so that the conversion must carry it.
Prints JSON: the model, the flavor, the parameter counts, ``max |loom - torchtitan| / max
|torchtitan|`` of the logits, and how loom's own initialization of the config
(``--torchtitan-init``) compares with torchtitan's ``init_weights``: the standard deviation of
each tensor of at least 1,024 entries drawn by loom over the one torchtitan drew (each half of
a fused gate / up ``linear_fc1``), the ratio furthest from 1 and its tensor. Measured (2026-11-29, s 48, b 2): llama3 debugmodel 2.7e-7,
6,163,712 parameters each; see docs/benchmarks.md for the MoE models.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import types
import warnings


_MODELS = {"llama3": ("torchtitan.models.llama3", "llama3_args",
                      "torchtitan.models.llama3.model.model", "Transformer"),
           "qwen3": ("torchtitan.models.qwen3", "qwen3_args",
                     "torchtitan.models.qwen3.model.model", "Qwen3Model"),
           "deepseek_v3": ("torchtitan.models.deepseek_v3", "deepseekv3_args",
                           "torchtitan.models.deepseek_v3.model.model", "DeepSeekV3Model"),
           "gpt_oss": ("torchtitan.models.gpt_oss", "gptoss_configs",
                       "torchtitan.models.gpt_oss.model.model", "GptOssModel"),
           "llama4": ("torchtitan.models.llama4", "llama4_args",
                      "torchtitan.models.llama4.model.model", "Transformer")}
DEBUG = (("llama3", "debugmodel"), ("qwen3", "debugmodel"), ("qwen3", "debugmodel_moe"),
         ("deepseek_v3", "debugmodel"), ("gpt_oss", "debugmodel"), ("llama4", "debugmodel"))


def parity(src: str, model: str = "llama3", flavor: str = "debugmodel", seq: int = 48) -> dict:
    """Build torchtitan's ``model`` ``flavor`` from the unpacked package at ``src``, convert
    its DCP checkpoint with loom, compare logits (module docstring)."""
    import importlib

    import torch
    import torch.distributed.checkpoint as dcp
    pkg = types.ModuleType("torchtitan")
    pkg.__path__ = [os.path.join(src, "torchtitan")]
    sys.modules.setdefault("torchtitan", pkg)
    kernels = types.ModuleType("torchtitan.models.moe.kernels")
    kernels.generate_permute_indices = None  # triton; the grouped-GEMM path only
    sys.modules.setdefault("torchtitan.models.moe.kernels", kernels)
    args_module, args_name, model_module, model_class = _MODELS[model]
    flavors = getattr(importlib.import_module(args_module), args_name)
    Transformer = getattr(importlib.import_module(model_module), model_class)

    from loom.checkpoint.torchtitan import from_torchtitan
    from loom.checkpoint.io import latest_checkpoint, load_model_weights, open_checkpoint, \
        read_common
    from loom.config import LoomConfig
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    args = copy.deepcopy(flavors[flavor])
    args.max_seq_len = seq
    moe_args = getattr(args, "moe_args", None)
    if moe_args is not None:
        moe_args.use_grouped_mm = False  # torch._grouped_mm: GPU only
        if not hasattr(args, "moe_impl") and model == "deepseek_v3":
            args.moe_impl = "standard"  # set from [parallelism] by torchtitan's trainer
        if not getattr(torch.histc, "_for_ints", False):  # torchtitan counts tokens per expert
            histc = torch.histc                            # with histc, float-only on CPU

            def histc_ints(x, *a, **k):
                return histc(x.float(), *a, **k).to(x.dtype)
            histc_ints._for_ints = True
            torch.histc = histc_ints
    torch.manual_seed(0)
    theirs = Transformer(args)
    masks = {}
    if model == "gpt_oss":  # flex attention only: eager on CPU (compiled, it has no CPU
        from torch.nn.attention.flex_attention import flex_attention  # lowering here)
        from torchtitan.models import attention as tt_attention
        tt_attention.FlexAttentionWrapper._compiled_flex_attn = staticmethod(flex_attention)
        theirs = theirs.float()  # torchtitan builds gpt-oss's layers in bf16
    with torch.no_grad():
        theirs.init_weights()
        for name, buf in theirs.named_buffers():
            if name.endswith("expert_bias"):
                buf.copy_(torch.randn_like(buf) * 0.05)
    theirs.eval()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group: one process
        state = {k: v.detach() for k, v in theirs.state_dict().items() if "freqs_cis" not in k}
        dcp.save(state, checkpoint_id=os.path.join(tmp, "step-1"))
        toml = os.path.join(tmp, "job.toml")
        with open(toml, "w") as fh:
            fh.write(f'[model]\nname = "{model}"\nflavor = "{flavor}"\n'
                     f'[training]\nseq_len = {seq}\n')
        from_torchtitan(os.path.join(tmp, "step-1"), os.path.join(tmp, "ck"), toml)
        path = latest_checkpoint(os.path.join(tmp, "ck"))
        cfg = LoomConfig.from_flat(read_common(path)["config"]).model
        mesh = ParallelMesh.single()
        ours = build_model(get_family(cfg.model_type), cfg, mesh, seed=None).eval()
        load_model_weights(open_checkpoint(path), [ours], mesh)
        fresh = dict(build_model(get_family(cfg.model_type), cfg, mesh, seed=1)
                     .named_parameters())  # loom's own init of the same config
    ratios = {}  # std of loom's init / std of torchtitan's, per tensor (fc1: per half)
    for name, p in ours.named_parameters():
        if p.numel() < 1024 or name.endswith("expert_bias"):
            continue
        halves = (p.chunk(2), fresh[name].chunk(2)) if name.endswith("linear_fc1.weight") \
            else ((p,), (fresh[name],))
        for k, (a, b) in enumerate(zip(*halves)):
            ratios[f"{name}[{k}]" if len(halves[0]) > 1 else name] = float(b.std() / a.std())
    worst = max(ratios, key=lambda n: abs(ratios[n] - 1))
    ids = torch.randint(0, args.vocab_size, (2, seq), generator=torch.Generator().manual_seed(5))
    if model == "gpt_oss" or flavor.endswith("_irope"):  # flex attention's block masks
        one_document = types.SimpleNamespace(eos_id=-1)  # (block_causal: no token ends one)
        masks = {"attention_masks": theirs.get_attention_masks(ids, one_document)}
    if flavor.endswith("_irope"):  # v0.2.2's Attention hands flex the dict of both masks
        for m in theirs.modules():  # (block_mask=attention_masks): give it the layer's own
            if hasattr(m, "use_rope") and "inner_attention" in m._modules:
                inner = m._modules.pop("inner_attention")
                m.inner_attention = (lambda q, k, v, block_mask, inner=inner, key="rope" if
                                     m.use_rope else "nope", **kw:
                                     inner(q, k, v, block_mask=block_mask[key], **kw))
    with torch.no_grad():
        ref = theirs(ids, **masks)
        out = ours(input_ids=ids)
    out = (out[0] if isinstance(out, tuple) else out)[..., :args.vocab_size]
    return dict(model=model, flavor=flavor, params_torchtitan=sum(p.numel() for p in theirs.parameters()),
                params_loom=sum(p.numel() for p in ours.parameters()),
                rel_err=float((out - ref).abs().max() / ref.abs().max()),
                init_tensors=len(ratios), init_std_ratio_worst=[worst, ratios[worst]])


def resume_parity(src: str, steps: int = 3, seq: int = 32) -> dict:
    """torchtitan's llama3 debugmodel trained ``steps`` AdamW steps by torchtitan's own
    optimizer container (lr 1e-3, betas 0.9 / 0.95, weight decay 0.1 on every parameter, no
    clipping), saved as its CheckpointManager saves a full checkpoint (the model flattened at
    the top, ``optimizer``, ``train_state``), converted with ``--from-torchtitan``; then one
    more step on the same batch by torchtitan and by loom (``loom train``'s optimizer from the
    same TOML, loaded from the converted checkpoint: ``--weight-decay-norms-and-biases``, which
    the TOML sets). Returns the largest difference of any weight after that step relative to
    its largest entry, and of the update itself (after minus before) relative to the largest
    update: both near fp32 rounding when the moments, the step count and the decay carried."""
    import torch
    import torch.distributed.checkpoint as dcp
    pkg = types.ModuleType("torchtitan")
    pkg.__path__ = [os.path.join(src, "torchtitan")]
    sys.modules.setdefault("torchtitan", pkg)
    kernels = types.ModuleType("torchtitan.models.moe.kernels")
    kernels.generate_permute_indices = None
    sys.modules.setdefault("torchtitan.models.moe.kernels", kernels)
    from torchtitan.components.checkpoint import ModelWrapper
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.model import Transformer

    from loom.checkpoint.torchtitan import from_torchtitan
    from loom.checkpoint.reader import load_checkpoint
    from loom.config import LoomConfig
    from loom.config.torchtitan import read_torchtitan_config
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    from loom.training.optimizer import build_optimizer
    args = copy.deepcopy(llama3_args["debugmodel"])
    args.max_seq_len = seq
    torch.manual_seed(0)
    theirs = Transformer(args)
    with torch.no_grad():
        theirs.init_weights()
    opt = OptimizersContainer([theirs], torch.optim.AdamW,
                              dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                   fused=False, foreach=False))
    ids = torch.randint(0, args.vocab_size, (2, seq), generator=torch.Generator().manual_seed(1))

    def loss_of(logits):
        return torch.nn.functional.cross_entropy(logits[..., :args.vocab_size].flatten(0, 1),
                                                 ids.roll(-1, 1).flatten())
    for _ in range(steps):
        opt.zero_grad()
        loss_of(theirs(ids)).backward()
        opt.step()

    class TrainState:
        def state_dict(self):
            return {"step": steps, "ntokens_seen": steps * ids.numel()}

        def load_state_dict(self, state):
            pass
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"optimizer": opt, "train_state": TrainState(),
                  **ModelWrapper([theirs]).state_dict()},
                 checkpoint_id=os.path.join(tmp, f"step-{steps}"))
        toml = os.path.join(tmp, "job.toml")
        with open(toml, "w") as fh:
            fh.write(f'[model]\nname = "llama3"\nflavor = "debugmodel"\n[training]\n'
                     f'seq_len = {seq}\nlocal_batch_size = 2\nsteps = 10\n')
        from_torchtitan(os.path.join(tmp, f"step-{steps}"), os.path.join(tmp, "ck"), toml)
        flat = read_torchtitan_config(toml)
        flat.update(lr=1e-3, min_lr=1e-3, lr_warmup_iters=0, lr_decay_style="constant",
                    clip_grad=0.0, mock_data=True)
        cfg = LoomConfig.from_flat(flat).validate(1)
        mesh = ParallelMesh.single()
        ours = build_model(get_family(cfg.model.model_type), cfg.model, mesh, seed=None)
        optim = build_optimizer(ours, cfg.training, model_cfg=cfg.model)
        common = load_checkpoint(os.path.join(tmp, "ck"), [ours], optim, None, mesh, None)
        before = {n: p.detach().clone() for n, p in ours.named_parameters()}
        # torchtitan's step after, converted to loom's names the same way
        opt.zero_grad()
        loss_of(theirs(ids)).backward()
        opt.step()
        dcp.save(ModelWrapper([theirs]).state_dict(), checkpoint_id=os.path.join(tmp, "after"))
        from_torchtitan(os.path.join(tmp, "after"), os.path.join(tmp, "ck_after"), toml)
        ref = build_model(get_family(cfg.model.model_type), cfg.model, mesh, seed=None)
        load_checkpoint(os.path.join(tmp, "ck_after"), [ref], None, None, mesh, None)
    want = {n: p.detach() for n, p in ref.named_parameters()}

    def update_err(optim) -> float:  # one step of ``optim``, against torchtitan's update
        with torch.no_grad():
            for n, p in ours.named_parameters():
                p.copy_(before[n])
        for group in optim.param_groups:
            group["lr"] = 1e-3
        optim.zero_grad()
        out = ours(input_ids=ids)
        loss_of(out[0] if isinstance(out, tuple) else out).backward()
        optim.step()
        return max(float((p.detach() - want[n]).abs().max() / (want[n] - before[n]).abs().max())
                   for n, p in ours.named_parameters())
    fresh = update_err(build_optimizer(ours, cfg.training, model_cfg=cfg.model))
    update = update_err(optim)
    weights = max(float((p.detach() - want[n]).abs().max() / want[n].abs().max())
                  for n, p in ours.named_parameters())
    return dict(steps=steps, iteration=common["iteration"],
                consumed_samples=common["consumed_samples"],
                optimizer_restored=common["optimizer_restored"],
                weights_rel_err=weights, update_rel_err=update,
                update_rel_err_with_fresh_optimizer=fresh)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[1:2] == ["resume"]:
        print(json.dumps(resume_parity(argv[0])))
    elif argv[1:2] == ["all"]:
        for model, flavor in DEBUG:
            print(json.dumps(parity(argv[0], model, flavor)))
    else:  # SRC [MODEL [FLAVOR [SEQ]]]
        print(json.dumps(parity(argv[0], *argv[1:3], *map(int, argv[3:4]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
