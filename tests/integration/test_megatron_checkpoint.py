"""Checkpoints written by Megatron-Core itself (0.16.1 on CPU, ``testkit.megatron``) in
Megatron-LM's layout, read by loom: ``loom train --load`` resumes one saved at TP=2 at TP=1 x
DP=2 (weights, Adam states, iteration, consumed samples; the model's shape from its saved args)
and trains with a finite, falling loss; ``--ckpt-format torch`` files at TP=2 and PP=2 read to
the same tensors; ``loom checkpoint inspect`` names each as Megatron's; the distributed
optimizer's default (``dp_reshardable``) layout is refused without ``--no-load-optim`` in one
line; ``convert --to-hf`` / ``--from-megatron`` work on them; ``--moe-use-upcycling`` makes an
MoE model of the dense one; foreign and damaged directories get a one-line diagnosis.

One spawned world of 2 gloo ranks writes every checkpoint and then runs ``loom train`` on the
same ranks; the tests read its files.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil

import pytest
import torch

pytest.importorskip("megatron.core")

from loom.cli import main  # noqa: E402
from loom.config import ModelConfig  # noqa: E402
from testkit import logged_losses, run_distributed  # noqa: E402
from testkit.numerics import PARITY_RTOL, rel_err

CFG = ModelConfig.llama(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                        ffn_hidden_size=64, vocab_size=256, seq_length=16,
                        max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)
TRAIN = ["--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3",
         "--train-iters", "9", "--log-interval", "1", "--eval-iters", "0", "--no-progress-bar",
         "--lr-decay-style", "constant", "--adam-beta2", "0.95", "--split", "100,0,0"]


def byte_dataset(prefix: str) -> list[str]:
    """Text bytes (V 256: the checkpoint's vocabulary) of Python's fixed Zen, as ``--data-path``
    flags: learnable, unlike ``--mock-data``'s uniform tokens."""
    import codecs
    import contextlib
    import io

    from loom.data.indexed import IndexedDatasetBuilder
    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints it
        import this
    b = IndexedDatasetBuilder(prefix)
    for line in codecs.decode(this.s, "rot13").splitlines():
        if line.strip():
            b.add_document(list(line.encode("utf-8")))
    b.finalize()
    with open(f"{prefix}.meta.json", "w") as fh:
        json.dump({"vocab_size": 256}, fh)
    return ["--data-path", prefix]


def megatron_args(tp: int, pp: int = 1, distributed_optimizer: bool = False):
    """The ``args`` Megatron-LM's ``save_checkpoint`` pickles (its argument names; the
    tokenizer's V is not saved: ``vocab_size`` None, ``padded_vocab_size`` set), with one of
    Megatron's own enums inside, as real checkpoints have."""
    from megatron.core.transformer.enums import AttnBackend
    return argparse.Namespace(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
        group_query_attention=True, num_query_groups=2, kv_channels=8, seq_length=16,
        max_position_embeddings=16, position_embedding_type="rope", rotary_base=10000,
        rotary_percent=1.0, normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True,
        add_bias_linear=False, add_qkv_bias=False, untie_embeddings_and_output_weights=True,
        qk_layernorm=False, vocab_size=None, padded_vocab_size=256,
        make_vocab_size_divisible_by=128, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, expert_model_parallel_size=1, num_experts=None,
        consumed_train_samples=4, consumed_valid_samples=0, train_iters=100,
        global_batch_size=4, micro_batch_size=2, lr=3e-3, min_lr=0.0, lr_decay_style="constant",
        use_distributed_optimizer=distributed_optimizer, ckpt_format="torch_dist",
        params_dtype=torch.float32, attention_backend=AttnBackend.auto, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.02, tokenizer_type="NullTokenizer")


def _pointer(root: str, iteration: int) -> None:
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write(str(iteration))


def _train_and_save(root: str, tp: int, distributed_optimizer: bool) -> None:
    """Megatron-LM's loop in small: one Adam step of GPTModel (DDP, Megatron's optimizer and
    scheduler), then ``save_checkpoint``'s torch_dist state dict into ``root/iter_0000001``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from testkit.megatron import init_megatron_parallel, megatron_gpt, save_megatron
    init_megatron_parallel(tp=tp)
    model = megatron_gpt(CFG, tp=tp)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer), model)
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=3e-3, use_distributed_optimizer=distributed_optimizer,
        clip_grad=1.0), [ddp])
    sched = OptimizerParamScheduler(opt, 3e-3, 3e-3, 0.0, 0, 100, "constant", 0.0, 0.0, 100,
                                    "constant")
    g = torch.Generator().manual_seed(5 + dist.get_rank())
    tokens = torch.randint(0, 256, (2, 16), generator=g)
    ddp.zero_grad_buffer()
    ddp(tokens, torch.arange(16).expand(2, 16), None,
        labels=torch.roll(tokens, -1, 1)).float().mean().backward()
    finalize_model_grads([ddp])
    opt.step()
    sched.step(4)
    msd = model.sharded_state_dict()
    meta = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True,
            "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    rng = ShardedObject("rng_state", [{"torch_rng_state": torch.get_rng_state()}], (1, tp),
                        (0, ps.get_tensor_model_parallel_rank()),
                        replica_id=ps.get_data_parallel_rank())
    save_megatron(model, os.path.join(root, "iter_0000001"), {
        "optimizer": opt.sharded_state_dict(msd, metadata=meta if distributed_optimizer
                                            else None),
        "args": megatron_args(tp, distributed_optimizer=distributed_optimizer),
        "checkpoint_version": 3.0, "iteration": 1, "opt_param_scheduler": sched.state_dict(),
        "num_floating_point_operations_so_far": 0, "rng_state": rng})
    if dist.get_rank() == 0:
        _pointer(root, 1)
    return model


def _save_torch_format(model, root: str, tp_rank: int, pp_rank, tp: int, pp: int) -> None:
    """``--ckpt-format torch``: ``mp_rank_TT[_PPP]/model_optim_rng.pt`` of this rank."""
    name = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
    path = os.path.join(root, "iter_0000001", name)
    os.makedirs(path, exist_ok=True)
    torch.save({"model": model.state_dict_for_save_checkpoint(), "iteration": 1,
                "args": megatron_args(tp, pp), "checkpoint_version": 3.0},
               os.path.join(path, "model_optim_rng.pt"))
    _pointer(root, 1)


def world(tmp: str) -> dict:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from testkit.megatron import init_megatron_parallel, megatron_gpt, megatron_on_cpu
    rank = dist.get_rank()
    with megatron_on_cpu():
        model = _train_and_save(os.path.join(tmp, "dist_tp2"), tp=2, distributed_optimizer=False)
        _save_torch_format(model, os.path.join(tmp, "torch_tp2"), rank, 0, 2, 1)
        init_megatron_parallel(pp=2)  # Megatron reshards its own checkpoint to PP=2
        model = megatron_gpt(CFG, pp=2)
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()},
                                         os.path.join(tmp, "dist_tp2", "iter_0000001"))
        model.load_state_dict(loaded["model"])
        _save_torch_format(model, os.path.join(tmp, "torch_pp2"), 0, rank, 1, 2)
        _train_and_save(os.path.join(tmp, "dist_dpr"), tp=1, distributed_optimizer=True)
        ps.destroy_model_parallel()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")  # (the group exists already)
    log = os.path.join(tmp, "resume.jsonl")
    try:  # loom train --load at TP=1 x DP=2: every model flag from the checkpoint's args
        main(["train", "--load", os.path.join(tmp, "dist_tp2"), "--log-json", log,
              "--data-path", os.path.join(tmp, "zen")] + TRAIN)
    except SystemExit as e:
        return {"exit": e.code}
    return {"exit": 0}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("megatron_ckpt"))
    byte_dataset(os.path.join(tmp, "zen"))
    return tmp, run_distributed(2, world, tmp, timeout=600)


def run(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out + out.err


def test_megatron_tp2_checkpoint_resumes_at_tp1_dp2_and_trains(written):
    tmp, results = written
    assert all(r["exit"] == 0 for r in results), results
    losses = logged_losses(os.path.join(tmp, "resume.jsonl"))
    assert min(losses) == 2 and max(losses) == 9, losses  # resumed after iteration 1
    values = [losses[i] for i in sorted(losses)]
    assert all(math.isfinite(v) for v in values), values
    assert values[-1] < values[0] - 0.1, values


def test_adam_states_iteration_and_samples_come_from_the_checkpoint(written):
    from loom.checkpoint.io import open_checkpoint, read_common
    ckpt = os.path.join(written[0], "dist_tp2", "iter_0000001")
    common = read_common(ckpt)
    assert (common["iteration"], common["consumed_samples"]) == (1, 4)
    assert common["config"]["num_query_groups"] == 2 and common["config"]["swiglu"]
    index = open_checkpoint(ckpt)
    names = [n for n in index.names if index.has_optimizer_state(n)]
    assert names == index.names
    _, states, rng = index.load(names[:3], names[:3])
    assert rng is None
    for n in names[:3]:
        assert float(states[n]["step"]) == 1.0 and states[n]["exp_avg"].abs().max() > 0, n


def test_torch_format_at_tp2_and_pp2_reads_the_same_tensors(written):
    from loom.checkpoint.io import open_checkpoint
    tmp = written[0]
    ref = open_checkpoint(os.path.join(tmp, "dist_tp2", "iter_0000001"))
    want, _, _ = ref.load(ref.names)
    for d in ("torch_tp2", "torch_pp2"):
        index = open_checkpoint(os.path.join(tmp, d, "iter_0000001"))
        index.check_complete()
        got, _, _ = index.load(index.names)
        assert set(got) == set(want), d
        for n in want:
            assert torch.equal(got[n], want[n]), (d, n)


def test_inspect_names_megatron_checkpoints(written, capsys):
    tmp = written[0]
    code, out = run(["checkpoint", "inspect", os.path.join(tmp, "dist_tp2"), "--json"], capsys)
    assert code == 0, out
    info = json.loads(out)
    assert info["format"] == "Megatron torch_dist" and info["iteration"] == 1
    assert info["layout"]["tp"] == 2 and info["layout"]["pp"] == 1
    assert info["parameters"]["decoder.layers.self_attention.linear_qkv.weight"]["shape"] == \
        [2, 64, 32]
    assert info["optimizer"].startswith("maps"), info["optimizer"]
    code, out = run(["checkpoint", "inspect", os.path.join(tmp, "torch_pp2")], capsys)
    assert code == 0 and "Megatron torch" in out and "'pp': 2" in out, out
    assert "decoder.layers.1.mlp.linear_fc1.weight" in out, out


def test_distributed_optimizer_buckets_need_no_load_optim(written, capsys):
    root = os.path.join(written[0], "dist_dpr")
    code, out = run(["train", "--load", root, "--data-path", os.path.join(written[0], "zen")]
                    + TRAIN, capsys)
    assert code == 2 and "--no-load-optim" in out and "dp_reshardable" in out, out
    assert "Traceback" not in out and len(out.strip().splitlines()) == 1, out
    code, out = run(["checkpoint", "inspect", root], capsys)
    assert code == 0 and "does not map" in out, out


def test_convert_to_hf_and_from_megatron(written, tmp_path, capsys):
    root = os.path.join(written[0], "dist_tp2")
    code, out = run(["checkpoint", "convert", "--to-hf", root, str(tmp_path / "hf")], capsys)
    assert code == 0 and (tmp_path / "hf" / "model.safetensors").exists(), out
    with open(tmp_path / "hf" / "config.json") as fh:
        assert json.load(fh)["num_key_value_heads"] == 2
    code, out = run(["checkpoint", "convert", "--from-megatron", root, "--save",
                     str(tmp_path / "loom")], capsys)
    assert code == 0, out
    code, out = run(["checkpoint", "inspect", str(tmp_path / "loom"), "--json"], capsys)
    info = json.loads(out)
    assert code == 0 and info["iteration"] == 1 and info["consumed_samples"] == 4, info


def test_foreign_and_damaged_directories_get_one_line(written, tmp_path, capsys):
    src = os.path.join(written[0], "dist_tp2", "iter_0000001")
    cases = {}
    bare = tmp_path / "bare_dcp"  # Megatron's torch_dcp / another program's DCP directory
    bare.mkdir()
    for f in os.listdir(src):
        if f.endswith(".distcp") or f == ".metadata":
            shutil.copy(os.path.join(src, f), bare / f)
    cases["torch.distributed.checkpoint directory"] = (bare, 2)
    no_index = tmp_path / "no_index"
    shutil.copytree(src, no_index)
    os.remove(no_index / ".metadata")
    cases["missing .metadata"] = (no_index, 2)
    cut = tmp_path / "truncated"
    shutil.copytree(src, cut)
    victim = sorted(f for f in os.listdir(cut) if f.endswith(".distcp"))[0]
    with open(cut / victim, "r+b") as fh:
        fh.truncate(100)
    cases["truncated"] = (cut, 1)
    (tmp_path / "empty").mkdir()
    cases["no checkpoint there"] = (tmp_path / "empty", 2)
    for words, (path, want) in cases.items():
        code, out = run(["checkpoint", "inspect", str(path)], capsys)
        assert code == want and words in out and "Traceback" not in out, (words, code, out)
        if want == 2:
            assert len(out.strip().splitlines()) == 1, out
    code, out = run(["checkpoint", "convert", "--to-hf", str(bare), str(tmp_path / "x")], capsys)
    assert code == 2 and "Traceback" not in out and "KeyError" not in out, out


def _megatron_logits(ckpt: str, cfg: ModelConfig, tokens: torch.Tensor, tmp) -> torch.Tensor:
    """Megatron-Core (one gloo rank in this process) loading ``ckpt``: its logits."""
    import torch.distributed as dist

    from testkit.megatron import init_megatron_parallel, megatron_gpt, megatron_on_cpu
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
    try:
        with megatron_on_cpu():
            from megatron.core import dist_checkpointing
            init_megatron_parallel()
            model = megatron_gpt(cfg).eval()
            model.load_state_dict(dist_checkpointing.load({"model": model.sharded_state_dict()},
                                                          ckpt)["model"])
            with torch.no_grad():
                return model(tokens, torch.arange(16).expand(len(tokens), 16), None)
    finally:
        from megatron.core import parallel_state as ps
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def test_train_ckpt_format_torch_dist_writes_megatrons_format(written, tmp_path, capsys):
    """``loom train --ckpt-format torch_dist --save``: Megatron-Core loads the checkpoint with
    loom's logits, and loom resumes from it (weights, Adam states, iteration, schedule)."""
    from loom.checkpoint.io import open_checkpoint
    from loom.interop.hf import load_full_state_dict
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    data = ["--data-path", os.path.join(written[0], "zen")]
    shape = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "64",
             "--seq-length", "16", "--vocab-size", "256", "--normalization", "RMSNorm",
             "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
             "--position-embedding-type", "rope", "--hidden-dropout", "0",
             "--attention-dropout", "0"]
    save = str(tmp_path / "ckpt")
    train = [a if a != "9" else "3" for a in TRAIN]
    code, out = run(["train", "--ckpt-format", "torch_dist", "--save", save, "--save-interval",
                     "3"] + shape + data + train, capsys)
    assert code == 0, out
    ckpt = os.path.join(save, "iter_0000003")
    with open(os.path.join(ckpt, "metadata.json")) as fh:
        assert json.load(fh)["sharded_backend"] == "torch_dist"
    model = build_model(get_family("gpt"), CFG, ParallelMesh.single()).eval()
    index = open_checkpoint(ckpt)
    load_full_state_dict(model, index.load(index.names)[0])
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(tokens)
    got = _megatron_logits(ckpt, CFG, tokens, tmp_path)
    assert rel_err(got, want) < PARITY_RTOL
    log = tmp_path / "again.jsonl"
    code, out = run(["train", "--load", save, "--log-json", str(log)] + data +
                    [a if a != "9" else "5" for a in TRAIN], capsys)
    assert code == 0, out
    assert sorted(logged_losses(log)) == [4, 5], out


def test_upcycling_reads_a_megatron_dense_checkpoint(written, tmp_path, capsys):
    """``--moe-use-upcycling`` from Megatron-Core's own torch_dist checkpoint (saved at TP=2,
    fused ``linear_fc1``, the model's shape from its saved args): every expert of the upcycled
    MoE model holds the dense MLP (granularity 1), the other tensors are the dense ones, the
    router is fresh; loom writes the upcycled model at iteration 1 and trains on from it."""
    from loom.checkpoint.io import open_checkpoint
    dense_dir = os.path.join(written[0], "dist_tp2")
    save = tmp_path / "moe"
    code, out = run(["train", "--load", dense_dir, "--moe-use-upcycling", "--num-experts", "4",
                     "--moe-router-topk", "2", "--save", str(save), "--data-path",
                     os.path.join(written[0], "zen")] + TRAIN + ["--train-iters", "2"], capsys)
    assert code == 0, out
    assert sorted(os.listdir(save)) == ["iter_0000001", "iter_0000002",
                                        "latest_checkpointed_iteration.txt"], os.listdir(save)
    dense = open_checkpoint(os.path.join(dense_dir, "iter_0000001"))
    dense_t, _, _ = dense.load(dense.names)
    moe = open_checkpoint(str(save / "iter_0000001"))
    moe_t, _, _ = moe.load(moe.names)
    experts = [n for n in moe_t if ".experts." in n]
    assert len(experts) == 2 * 4 * 2, sorted(moe_t)  # 2 layers x 4 experts x fc1, fc2
    for name in experts:  # layers.L.mlp.experts.E.linear_fcK.weight <- layers.L.mlp.linear_fcK
        layer, fc = name.split(".mlp.")[0], name.rsplit(".", 2)[-2]
        src = f"{layer}.mlp.{fc}.weight"
        assert torch.equal(moe_t[name], dense_t[src]), (name, src)
    shared = [n for n in dense_t if ".mlp." not in n]
    assert shared and all(torch.equal(moe_t[n], dense_t[n]) for n in shared), shared
    assert any(n.endswith("router.weight") for n in moe_t)
