"""Gemma 3 (issue 12 items 2 and 4), no download: random-weight ``transformers``
``Gemma3ForCausalLM`` models with local and global layers and a sliding window shorter than the
sequence.

- loom's logits and loss equal HF's (fp32, atol 1e-5) at TP=1 and TP=2, for grouped KV heads,
  a single KV head (replicated over TP) and soft-capping;
- ``loom checkpoint convert --from-hf`` then ``--to-hf`` gives back identical tensors, the
  tokenizer travels with the checkpoint;
- a GGUF that is not Gemma 3 (or no GGUF at all) and a non-Gemma HF directory are refused;
- parity: TP=2 (replicated KV + soft-capping), TP=2 + SP, PP=2 and CP=2 vs one process,
  3 steps;
- fine-tuning: the converted model trains at TP=2 x DP=2 from ``loom train --load`` with no
  model flags, its first loss equal to HF's on the same batch.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import struct

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.gemma3")

from loom.cli import main  # noqa: E402
from loom.config import LoomConfig, ModelConfig  # noqa: E402
from loom.interop.hf import load_full_state_dict  # noqa: E402
from loom.models.gemma3.hf import gemma3_config, gemma3_to_loom  # noqa: E402
from loom.models import get_family, resolve_config  # noqa: E402
from loom.parallel.mappings import gather_from_tensor_parallel_region  # noqa: E402
from loom.parallel.mesh import ParallelMesh  # noqa: E402
from loom.parallel.parallelize import build_model  # noqa: E402
from loom.parallel.registry import local_shard  # noqa: E402
from testkit import run_distributed  # noqa: E402
from testkit.numerics import PARAM_RTOL, rel_err
from testkit.config import PARITY_ADAM_EPS, PARITY_SHAPE, tiny_config

V = 100
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
CASES = {"gqa": {}, "mqa": {"kv": 1}, "softcap": {"softcap": True}}


def hf_model(kv: int = 2, softcap: bool = False, vocab: int = V):
    """A random Gemma3ForCausalLM: 4 layers (L L G L), window 4, linear RoPE scaling on the
    global layer, query_pre_attn_scalar != head dim, random (non-zero) norm weights. (Its
    attention never soft-caps: transformers' Gemma3Attention does not pass
    attn_logit_softcapping on; loom's core is checked against HF's eager attention below.)"""
    config = transformers.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=kv, head_dim=16, sliding_window=4,
        layer_types=LAYER_TYPES, query_pre_attn_scalar=24, max_position_embeddings=64,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        final_logit_softcapping=5.0 if softcap else None, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    return model


def loom_model(hf, mesh: ParallelMesh):
    cfg = gemma3_config(hf.config.to_dict())
    model = build_model(get_family("gemma3"), cfg, mesh, seed=None).eval()
    load_full_state_dict(model, gemma3_to_loom(hf.state_dict(), cfg))
    return model


def compare(mesh: ParallelMesh) -> dict:
    """Max |logit difference| and |loss difference| against HF for every case."""
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))
    out = {}
    for name, kw in CASES.items():
        hf = hf_model(**kw)
        ours = loom_model(hf, mesh)
        with torch.no_grad():
            ref = hf(ids, labels=ids)
            logits = gather_from_tensor_parallel_region(ours(ids), mesh.groups["tp"])[..., :V]
            loss = ours(ids[:, :-1], labels=ids[:, 1:]).mean()
        out[name] = (float((logits - ref.logits).abs().max()), float(abs(loss - ref.loss)))
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_attention_core_softcap_matches_hf_eager(window):
    """loom's core (GQA, sliding window, soft-capped scores) against transformers' Gemma 3
    eager attention function called with the same mask and softcap."""
    from types import SimpleNamespace

    from loom.models.gemma3.model import GemmaAttentionCore
    from transformers.models.gemma3.modeling_gemma3 import eager_attention_forward
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 7, 8, generator=g) * 3 for n in (4, 2, 2))
    core = GemmaAttentionCore(24 ** -0.5, window, softcap=2.0)
    mask = core.mask(torch.arange(7), 7)
    additive = torch.zeros(7, 7).masked_fill(~mask, float("-inf"))
    module = SimpleNamespace(num_key_value_groups=2, head_dim=8, training=False)
    ref, _ = eager_attention_forward(module, q, k, v, additive, scaling=24 ** -0.5, softcap=2.0)
    assert float((core(q, k, v).transpose(1, 2) - ref).abs().max()) < 1e-6
    if window:
        assert not mask[6, 3] and mask[6, 4] and not mask[2, 3]


def compare_tp2() -> dict:
    return compare(ParallelMesh.build(tp=2))


def test_config_from_hf():
    cfg = gemma3_config(hf_model().config.to_dict())
    assert (cfg.model_type, cfg.layer_types, cfg.sliding_window) == ("gemma3", "LLGL", 4)
    assert (cfg.rotary_base, cfg.rotary_base_local, cfg.rotary_scaling_factor) == (1e6, 1e4, 2.0)
    assert cfg.query_pre_attn_scalar == 24 and cfg.openai_gelu and cfg.num_kv_groups == 2
    default = ModelConfig(model_type="gemma3", num_layers=12)
    assert default.attention_layer_types == "LLLLLG" * 2  # 5 local : 1 global
    every_third = ModelConfig(model_type="gemma3", num_layers=6, sliding_window_pattern=3)
    assert every_third.attention_layer_types == "LLGLLG"  # --sliding-window-pattern 3


def test_logits_match_transformers_single_process():
    for name, (logits, loss) in compare(ParallelMesh.single()).items():
        assert logits < 1e-5 and loss < 1e-5, (name, logits, loss)


def test_logits_match_transformers_tp2():
    for rank in run_distributed(2, compare_tp2):
        for name, (logits, loss) in rank.items():
            assert logits < 1e-5 and loss < 1e-5, (name, logits, loss)


def greedy_tp(tp: int = 2) -> list[int]:
    from loom.inference.generate import SamplingConfig, generate
    mesh = ParallelMesh.build(tp=tp) if tp > 1 else ParallelMesh.single()
    model = loom_model(hf_model(kv=1), mesh)
    return generate(model, [5, 17, 3, 42, 8], 14, SamplingConfig(greedy=True))


def test_greedy_generation_with_kv_cache_matches_transformers():
    """KV-cached decoding past the sliding window (5 + 14 tokens, window 4) at TP=1 and TP=2
    (replicated KV head) continues exactly as greedy decoding by transformers' full forward."""
    hf = hf_model(kv=1)
    ids = [5, 17, 3, 42, 8]
    with torch.no_grad():
        for _ in range(14):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    ref = ids[5:]
    assert greedy_tp(1) == ref
    assert run_distributed(2, greedy_tp, 2) == [ref, ref]


def cli(argv, code: int = 0, capsys=None) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr() if capsys is not None else None
    text = (out.out + out.err) if out is not None else ""
    assert e.value.code == code, text
    return text


def tiny_tokenizer(path):
    from loom.data.tokenizer import train_byte_level_bpe
    text = ["the quick brown fox jumps over the lazy dog " * 3, "pack my box with five dozen "
            "liquor jugs", "how vexingly quick daft zebras jump"] * 20
    tok = train_byte_level_bpe(text, 300)
    tok.save(str(path))
    return tok


def test_import_export_round_trip_identical(tmp_path):
    from safetensors.torch import load_file
    hf = hf_model(kv=1, softcap=True)
    src, ck, back = tmp_path / "hf", tmp_path / "ck", tmp_path / "back"
    hf.save_pretrained(src)
    tiny_tokenizer(src / "tokenizer.json")
    cli(["checkpoint", "convert", "--from-hf", str(src), str(ck)])
    assert (ck / "iter_0000000" / "tokenizer.json").read_text() == \
        (src / "tokenizer.json").read_text()
    cli(["checkpoint", "convert", "--to-hf", str(ck), str(back)])
    a, b = load_file(src / "model.safetensors"), load_file(back / "model.safetensors")
    a.pop("lm_head.weight", None)
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert (back / "tokenizer.json").exists()
    again = transformers.AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager")
    assert json.loads((back / "config.json").read_text())["layer_types"] == LAYER_TYPES
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf(ids).logits)


def fake_gguf(path, arch: str) -> None:
    """A GGUF v3 header (0 tensors) whose first key is an array, then general.architecture."""
    def s(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()
    body = s("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 3) + struct.pack("<3f", 1, 2, 3)
    body += s("general.architecture") + struct.pack("<I", 8) + s(arch)
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + body)


@pytest.mark.parametrize("kind,expected", [
    ("llama-gguf", "architecture 'llama', not Gemma 3"),
    ("not-gguf", "not a GGUF file"),
    ("truncated", "truncated or malformed GGUF header"),
    ("phi-dir", "model_type 'phi'"),  # Phi-1 / Phi-2 (Phi-3's phi3 imports)
])
def test_bad_from_hf_refused(tmp_path, capsys, kind, expected):
    src = tmp_path / "model.gguf"
    if kind == "llama-gguf":
        fake_gguf(src, "llama")
    elif kind == "not-gguf":
        src.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    elif kind == "truncated":
        src.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 5))
    else:
        src = tmp_path / "phi"
        transformers.PhiForCausalLM(transformers.PhiConfig(
            vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2)).save_pretrained(src)
    out = cli(["checkpoint", "convert", "--from-hf", str(src), str(tmp_path / "out")], 2, capsys)
    assert expected in out and "Traceback" not in out, out
    assert not (tmp_path / "out").exists()


def test_gguf_directory_is_found(tmp_path, capsys):
    fake_gguf(tmp_path / "m.gguf", "qwen2")
    out = cli(["checkpoint", "convert", "--from-hf", str(tmp_path), str(tmp_path / "o")], 2,
              capsys)
    assert "architecture 'qwen2', not Gemma 3" in out


# -- parity with the single-process run ------------------------------------------------------

def gemma_cfg(tp: int, dp: int = 1, pp: int = 1, sp: bool = False, kv: int = 2,
              softcap: bool = False, cp: int = 1, gemma1: bool = False) -> LoomConfig:
    """Gemma 3's layers (``gemma1``: Gemma 1's, no QK norm or post-norms, all global)."""
    layers = dict(gemma_qk_norm=False, gemma_post_norms=False, layer_types="GGGG",
                  query_pre_attn_scalar=16) if gemma1 else \
        dict(sliding_window=5, layer_types="LLGL", query_pre_attn_scalar=24)
    return tiny_config(
        "gpt", PARITY_SHAPE,  # the same padded softmax columns at every t
        model_type="gemma3", num_layers=4, num_query_groups=kv, kv_channels=16,
        ffn_hidden_size=96, openai_gelu=True, **layers,
        attn_logit_softcapping=20.0 if softcap else None,
        final_logit_softcapping=5.0 if softcap else None, init_method_std=0.05,
        mock_data=False, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        sequence_parallel=sp, context_parallel_size=cp, global_batch_size=8,
        adam_eps=PARITY_ADAM_EPS, clip_grad=0.5,
        adam_beta2=0.95, lr_decay_style="cosine",  # loom's old defaults
        log_interval=10**9, world=tp * dp * pp * cp)


def parity_case(**kw) -> dict:
    """3 steps at a layout and at one process side by side: worst relative errors."""
    from loom.training.trainer import Trainer
    cfg = gemma_cfg(**kw)
    p = cfg.parallel
    mesh = ParallelMesh.build(tp=p.tensor_model_parallel_size,
                              pp=p.pipeline_model_parallel_size, cp=p.context_parallel_size)
    par = Trainer(cfg, mesh=mesh)
    ref_cfg = copy.deepcopy(cfg)
    ref_cfg.parallel.tensor_model_parallel_size = ref_cfg.parallel.pipeline_model_parallel_size = 1
    ref_cfg.parallel.sequence_parallel = False
    ref_cfg.parallel.context_parallel_size = 1
    ref = Trainer(resolve_config(ref_cfg, 1), mesh=ParallelMesh.single())
    out = {"loss": 0.0, "grad": 0.0, "param": 0.0, "norm": 0.0, "nparams": 0}
    for _ in range(3):
        lp = par.global_loss(par.forward_backward(par.batches(par.train_ds, par.consumed_samples)))
        lr_ = float(ref.forward_backward(ref.batches(ref.train_ds, ref.consumed_samples)))
        out["loss"] = max(out["loss"], abs(lp - lr_) / abs(lr_))
        ref_params = dict(ref.model_chunks[0].named_parameters())
        for name, prm in par.model_chunks[0].named_parameters():
            want = local_shard(ref_params[name].grad, par.registry[name], mesh.tp_rank,
                               mesh.tp_size)
            out["grad"] = max(out["grad"], rel_err(prm.grad, want))
            out["nparams"] += 1
        np_, nr = par.optimizer_step(), ref.optimizer_step()
        out["norm"] = max(out["norm"], abs(np_ - nr) / nr)
        par.consumed_samples += par.global_batch
        ref.consumed_samples += ref.global_batch
    ref_params = dict(ref.model_chunks[0].named_parameters())
    for name, prm in par.model_chunks[0].named_parameters():
        want = local_shard(ref_params[name].detach(), par.registry[name], mesh.tp_rank,
                           mesh.tp_size)
        out["param"] = max(out["param"], rel_err(prm.detach(), want))
    return out


def parity_world2() -> dict:
    return {"tp2-mqa-softcap": parity_case(tp=2, kv=1, softcap=True),
            "tp2-sp": parity_case(tp=2, sp=True),
            "tp2-sp-gemma1": parity_case(tp=2, sp=True, gemma1=True),
            "pp2": parity_case(tp=1, pp=2),
            "cp2": parity_case(tp=1, cp=2)}  # sliding window over all-gathered keys


def test_parity_tp2_sp_pp2_cp2():
    for rank in run_distributed(2, parity_world2):
        # Gemma 1's layers were built: no QK norms, no post-norms (4 tensors a layer fewer)
        assert rank["tp2-sp-gemma1"]["nparams"] == rank["tp2-sp"]["nparams"] - 3 * 4 * 4
        for name, case in rank.items():
            assert case["nparams"] > 10, (name, case)
            for key in ("loss", "grad", "norm"):
                assert case[key] < 1e-5, (name, key, case)
            assert case["param"] < PARAM_RTOL, (name, case)


# -- fine-tuning the imported model at TP=2 x DP=2 ---------------------------------------------

def finetune_rank(argv: list[str]) -> dict:
    from loom.training.cli import add_arguments, prepare
    from loom.training.trainer import Trainer
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    cfg = prepare(parser.parse_args(argv))
    trainer = Trainer(cfg)
    losses = [trainer.train_step()["loss"] for _ in range(3)]
    return {"losses": losses, "cfg": cfg, "sizes": trainer.mesh.sizes,
            "tp_rank": dist.get_rank() % 2}


CORPUS = "\n".join(f"the lazy dog {i} jumps over the quick brown fox; pack my box with {i} "
                   f"dozen jugs" for i in range(200))


def pretrain(hf, tok, steps: int = 40) -> None:
    """A few Adam steps of the HF model on the corpus, so its loss is well below ln(V)."""
    ids = torch.tensor(tok.encode(CORPUS))
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(hf.parameters(), lr=3e-3)
    hf.train()
    for _ in range(steps):
        start = torch.randint(0, len(ids) - 17, (8,), generator=g)
        x = torch.stack([ids[s:s + 17] for s in start.tolist()])
        hf(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    hf.eval()


def test_finetune_converted_model_tp2_dp2(tmp_path):
    """`loom checkpoint convert --from-hf`, `loom preprocess --tokenizer-from CKPT`, then
    `loom train --load CKPT` at TP=2 x DP=2 with no model flags: the shape comes from the
    checkpoint, the first loss is HF's on the same batch (the pretrained level, not ln V)."""
    import math

    from loom.data.blended import build_datasets
    from loom.data.sampler import get_batch
    src, ck = tmp_path / "hf", tmp_path / "ck"
    src.mkdir()
    tok = tiny_tokenizer(src / "tokenizer.json")
    hf = hf_model(kv=1, vocab=tok.vocab_size)
    pretrain(hf, tok)
    hf.save_pretrained(src)
    cli(["checkpoint", "convert", "--from-hf", str(src), str(ck)])
    (tmp_path / "corpus.txt").write_text(CORPUS)
    cli(["preprocess", "--input", str(tmp_path / "corpus.txt"), "--output-prefix",
         str(tmp_path / "d"), "--tokenizer-from", str(ck), "--append-eod"])
    argv = ["--load", str(ck), "--data-path", str(tmp_path / "d"), "--split", "100,0,0",
            "--tensor-model-parallel-size", "2", "--seq-length", "16", "--micro-batch-size",
            "2", "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-4",
            "--no-progress-bar", "--log-interval", "100"]
    ranks = run_distributed(4, finetune_rank, argv)
    cfg = ranks[0]["cfg"]
    assert ranks[0]["sizes"]["tp"] == 2 and ranks[0]["sizes"]["dp"] == 2
    m = cfg.model
    assert (m.model_type, m.num_layers, m.hidden_size, m.num_query_groups, m.layer_types,
            m.vocab_size) == ("gemma3", 4, 64, 1, "LLGL", tok.vocab_size)
    train, _, _ = build_datasets(cfg.data, m.seq_length, cfg.training.seed)
    batch = get_batch(train, range(8))  # the first global batch, all DP ranks
    with torch.no_grad():
        logits = hf(batch["tokens"]).logits
    want = float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                   batch["labels"].reshape(-1)))
    losses = ranks[0]["losses"]
    assert abs(losses[0] - want) < 1e-4 * want, (losses, want)
    assert losses[0] < 0.6 * math.log(tok.vocab_size), (losses, tok.vocab_size)
    assert losses[-1] < losses[0], losses
    assert all(r["losses"] == losses for r in ranks)


def test_gemma2_is_gemma3_without_qk_norm():
    """A Gemma 2 config imports as --model-type gemma3 with ``gemma_qk_norm`` off: its layers
    build no QK norm (a Gemma 3 config's do), ``--no-gemma-qk-norm`` spells it on the command
    line, the other families refuse it, and Gemma 2's export refuses the two RoPE bases it
    cannot hold. The logits: tests/models/test_hf_export.py, case gemma2."""
    from loom.config import add_config_arguments, config_from_args
    from loom.errors import ConfigError
    from loom.models.gemma3.hf import hf_gemma3_config
    hf = transformers.Gemma2Config(vocab_size=V, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=8, sliding_window=4,
                                   max_position_embeddings=32).to_dict()
    cfg = gemma3_config(hf)
    assert not cfg.gemma_qk_norm and cfg.rotary_base == cfg.rotary_base_local == 10000.0
    assert cfg.attention_layer_types == "LG" and cfg.attn_logit_softcapping == 50.0
    for qk_norm in (False, True):
        m = build_model(get_family("gemma3"), dataclasses.replace(cfg, gemma_qk_norm=qk_norm),
                        ParallelMesh.single())
        norms = [n for n, _ in m.named_parameters() if "q_layernorm" in n]
        assert len(norms) == (2 if qk_norm else 0)
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    assert not config_from_args(parser.parse_args(["--no-gemma-qk-norm"])).model.gemma_qk_norm
    assert hf_gemma3_config(cfg)["model_type"] == "gemma2"
    with pytest.raises(ConfigError, match="one base and no scaling"):
        hf_gemma3_config(dataclasses.replace(cfg, rotary_base_local=5000.0))
    with pytest.raises(ConfigError, match="drop --no-gemma-qk-norm"):
        resolve_config(tiny_config(model=ModelConfig.llama(
            num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128,
            seq_length=16, gemma_qk_norm=False), train_iters=2), 1)


def test_gemma1_is_gemma3_without_qk_norm_and_post_norms():
    """A Gemma 1 config imports as --model-type gemma3 with ``gemma_qk_norm`` and
    ``gemma_post_norms`` off: every layer global, the attention scale the head dim's, its
    layers build two norms (a Gemma 3 config's four and the QK norms), ``--no-gemma-post-norms``
    spells it on the command line, the other families refuse it, and the Gemma 1 export
    refuses what Gemma 1 has not (local layers, soft-capping). The logits:
    tests/models/test_hf_export.py, case gemma; parity at TP 2 + SP: case gemma1 above."""
    from loom.config import add_config_arguments, config_from_args
    from loom.errors import ConfigError
    from loom.models.gemma3.hf import hf_gemma3_config
    hf = transformers.GemmaConfig(vocab_size=V, hidden_size=32, intermediate_size=48,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=1, head_dim=12,
                                  max_position_embeddings=32).to_dict()
    cfg = gemma3_config(hf)
    assert not cfg.gemma_qk_norm and not cfg.gemma_post_norms
    assert cfg.attention_layer_types == "GG" and cfg.query_pre_attn_scalar == 12
    for post in (False, True):
        m = build_model(get_family("gemma3"), dataclasses.replace(cfg, gemma_post_norms=post),
                        ParallelMesh.single())
        norms = [n for n, _ in m.named_parameters() if n.startswith("layers.0.")
                 and "layernorm" in n]
        assert len(norms) == (4 if post else 2), norms
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = config_from_args(parser.parse_args(["--no-gemma-post-norms"])).model
    assert not args.gemma_post_norms and args.gemma_qk_norm
    assert hf_gemma3_config(cfg)["model_type"] == "gemma"
    for bad, needle in ((dict(layer_types="LG", sliding_window=4), "local layers"),
                        (dict(attn_logit_softcapping=50.0), "--attn-logit-softcapping"),
                        (dict(gemma_qk_norm=True), "--gemma-qk-norm")):
        with pytest.raises(ConfigError, match=needle):
            hf_gemma3_config(dataclasses.replace(cfg, **bad))
    with pytest.raises(ConfigError, match="drop --no-gemma-post-norms"):
        resolve_config(tiny_config(model=ModelConfig.llama(
            num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128,
            seq_length=16, gemma_post_norms=False), train_iters=2), 1)
