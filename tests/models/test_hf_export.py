"""``loom checkpoint convert --to-hf`` for every family loom imports (issue 45): a random
``transformers`` model of each class (tests/models/hf_export_cases.py) is saved as the Hub
keeps it, imported (``--from-hf``) and exported again; then

* the round trip is bit-equal: the same file names, tensor names, dtypes and values;
* ``transformers`` loads the export and its logits equal loom's from the imported checkpoint
  (fp32, atol 1e-5 x max(1, max |logit|)), as do the source model's; lm-evaluation-harness's ``HFLM`` takes every causal
  family's export as written and its log-likelihoods equal ``transformers``';
* the directory is complete: ``tokenizer.json``, ``tokenizer_config.json`` naming the special
  tokens loom's tokenizer knows, their ids in ``config.json`` and ``generation_config.json``,
  files readable by group and others (umask 022);
* ``--dtype bf16`` and ``--max-shard-size`` give bf16 shards + ``model.safetensors.index.json``
  that ``transformers`` loads, and the export reads the checkpoint one layer at a time.
"""

from __future__ import annotations

import json
import math
import os
import stat

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_export_cases import CASES, V, build, word_tokenizer  # noqa: E402
from loom.checkpoint.convert import from_hf, to_hf  # noqa: E402
from testkit.numerics import rel_err
from testkit.config import tiny_config

GEMMA_ROLES = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
ROLES = {"gemma3": GEMMA_ROLES, "gemma2": GEMMA_ROLES, "gemma": GEMMA_ROLES,
         "bert": {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]",
                  "sep_token": "[SEP]", "mask_token": "[MASK]"}}
GPT_ROLES = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<pad>"}


def loom_logits(ckpt: str, ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[b, s, V]`` of the loom checkpoint ``ckpt`` (iteration dir), one process."""
    from loom.checkpoint.io import latest_checkpoint, load_model_weights, open_checkpoint, \
        read_common
    from loom.config import LoomConfig
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    path = latest_checkpoint(ckpt)
    cfg = LoomConfig.from_flat(read_common(path)["config"]).model
    mesh = ParallelMesh.single()
    model = build_model(get_family(cfg.model_type), cfg, mesh, seed=None).eval()
    load_model_weights(open_checkpoint(path), [model], mesh)
    with torch.no_grad():
        out = model(input_ids=ids)
    return (out[0] if isinstance(out, tuple) else out)[..., :V]


def hf_model(path: str, name: str):
    auto = transformers.AutoModelForMaskedLM if name == "bert" else \
        transformers.AutoModelForCausalLM
    return auto.from_pretrained(path, attn_implementation="eager").eval()


def export_case(name: str, root) -> dict:
    from safetensors.torch import load_file
    hf, specials = build(name)
    src, ck, out = root / f"{name}-hf", root / f"{name}-ck", root / f"{name}-out"
    hf.save_pretrained(src)
    word_tokenizer(specials).save(str(src / "tokenizer.json"))
    from_hf(str(src), str(ck))
    to_hf(str(ck), str(out))
    a, b = load_file(src / "model.safetensors"), load_file(out / "model.safetensors")
    ids = torch.randint(5, V, (2, 12), generator=torch.Generator().manual_seed(1))
    ours = loom_logits(str(ck), ids)
    with torch.no_grad():
        theirs = hf_model(str(out), name)(ids).logits
        source = hf(ids).logits  # the model imported: nothing of its config lost on the way
    return {"source_logits": rel_err(ours, source, floor=1.0),
            "hflm": None if name == "bert" else hflm_scores(out),
            "names": sorted(a) == sorted(b),
            "unequal": [k for k in a if k in b and not (
                a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))],
            "gain_ulp": max((float((a[k] - b[k]).abs().max()) for k in a
                             if k in b and k.endswith("norm.weight")), default=0.0),
            "logits": rel_err(ours, theirs, floor=1.0),
            "scale": float(theirs.abs().max()),
            "files": sorted(os.listdir(out)),
            "modes": {f: stat.S_IMODE(os.stat(out / f).st_mode) for f in os.listdir(out)},
            "tokenizer_config": json.loads((out / "tokenizer_config.json").read_text()),
            "config": json.loads((out / "config.json").read_text()),
            "generation": json.loads((out / "generation_config.json").read_text())
            if (out / "generation_config.json").exists() else None,
            "tokenizer": transformers.AutoTokenizer.from_pretrained(str(out))}


def hflm_scores(out) -> tuple:
    """lm-evaluation-harness's ``HFLM`` on the export as written (no edit of its files): its
    log-likelihood of a continuation, and the same sum from ``transformers``' logits (the
    context's ids after the BOS token where HFLM adds one, e.g. Gemma). The tokenizer is the
    class the export's ``tokenizer_config.json`` names (``PreTrainedTokenizerFast``):
    transformers 5 maps some model types to their own tokenizer class first (a qwen2 config to
    ``Qwen2Tokenizer``, which rebuilds a BPE and drops this test's word-level tokenizer; a real
    Qwen2 export carries Qwen's BPE)."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(out))
    lm = HFLM(pretrained=str(out), tokenizer=tok, batch_size=1, device="cpu", dtype="float32")
    ctx, cont = "w3 w9 w4 w7", " w5 w8"
    ((ll, _),) = lm.loglikelihood([Instance(request_type="loglikelihood", doc={},
                                            arguments=(ctx, cont), idx=0)])
    head = [tok.bos_token_id] if getattr(lm, "add_bos_token", False) else []
    c_ids = head + tok.encode(ctx, add_special_tokens=False)
    t_ids = tok.encode(cont, add_special_tokens=False)
    with torch.no_grad():
        logp = lm.model(torch.tensor([c_ids + t_ids])).logits.float().log_softmax(-1)[0]
    want = sum(float(logp[len(c_ids) - 1 + i, t]) for i, t in enumerate(t_ids))
    return ll, want, lm_eval.__version__


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    old = os.umask(0o022)
    try:
        return {name: export_case(name, root) for name in CASES}
    finally:
        os.umask(old)


ZERO_CENTRED = {"nemotron", "qwen3_next"}
"""Cases whose norm weights are zero-centred (``1 + w``) in HF but the gain itself in loom's GPT
family: ``(w + 1) - 1`` rounds at the bits of 1.0 (an fp32 ulp of 1 is 1.2e-7), the one
inexact step of a round trip."""


@pytest.mark.parametrize("name", CASES)
def test_round_trip_is_bit_equal(exports, name):
    r = exports[name]
    unequal = [k for k in r["unequal"]
               if not (name in ZERO_CENTRED and k.endswith("norm.weight"))]
    assert r["names"] and not unequal, unequal
    assert r["gain_ulp"] <= (2.0 ** -23 if name in ZERO_CENTRED else 0.0), r["gain_ulp"]


@pytest.mark.parametrize("name", CASES)
def test_transformers_logits_equal_looms(exports, name):
    """The export's logits in transformers and the imported model's (the source's: a config
    option the import dropped, such as Mistral's sliding window, would pass the round trip of
    tensors but not this) equal loom's."""
    r = exports[name]
    assert r["logits"] < 1e-5 and r["scale"] > 0.1, (r["logits"], r["scale"])
    assert r["source_logits"] < 1e-5, r["source_logits"]


@pytest.mark.parametrize("name", [c for c in CASES if c != "bert"])  # HFLM: causal LMs
def test_lm_eval_scores_the_export_as_written(exports, name):
    ll, want, _ = exports[name]["hflm"]
    assert math.isfinite(ll) and ll == pytest.approx(want, rel=1e-5, abs=1e-5), (ll, want)


@pytest.mark.parametrize("name", CASES)
def test_export_is_complete_and_readable(exports, name):
    r = exports[name]
    assert {"config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(r["files"])
    assert all(mode & 0o044 == 0o044 for mode in r["modes"].values()), r["modes"]
    roles = ROLES.get(name, GPT_ROLES)
    assert {k: r["tokenizer_config"].get(k) for k in roles} == roles
    tok = r["tokenizer"]
    for role, text in roles.items():  # transformers reads the roles back
        assert getattr(tok, role) == text
    if name == "bert":
        assert r["generation"] is None and "eos_token_id" not in r["config"]
        return
    ids = {k: tok.convert_tokens_to_ids(roles[k.replace("_id", "")])
           for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    assert {k: r["config"][k] for k in ids} == ids
    assert {k: r["generation"][k] for k in ids} == ids


def test_perturbed_weights_are_seen(tmp_path):
    """The logit comparison fails for a mapping mistake: gate and up of one layer swapped."""
    from safetensors.torch import load_file, save_file
    hf, specials = build("llama")
    src, ck, out = tmp_path / "hf", tmp_path / "ck", tmp_path / "out"
    hf.save_pretrained(src)
    from_hf(str(src), str(ck))
    to_hf(str(ck), str(out))
    sd = load_file(out / "model.safetensors")
    m = "model.layers.1.mlp."
    sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"] = sd[m + "up_proj.weight"], \
        sd[m + "gate_proj.weight"]
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    ids = torch.randint(5, V, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        err = float((loom_logits(str(ck), ids) - hf_model(str(out), "llama")(ids).logits)
                    .abs().max())
    assert err > 1e-4  # 40x the tolerance


def test_bf16_sharded_export_streams_one_layer_at_a_time(tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from loom.checkpoint.reader import DcpIndex
    hf, specials = build("mixtral")
    src, ck, out = tmp_path / "hf", tmp_path / "ck", tmp_path / "out"
    hf.save_pretrained(src)
    from_hf(str(src), str(ck))
    reads = []
    real = DcpIndex.load
    monkeypatch.setattr(DcpIndex, "load", lambda self, names, *a, **k: (
        reads.append(sorted({n.split(".")[1] if n.startswith("layers.") else "rest"
                             for n in names})), real(self, names, *a, **k))[1])
    to_hf(str(ck), str(out), dtype="bf16", max_shard_size="20KB")
    assert sorted(map(tuple, reads)) == [("0",), ("1",), ("rest",)]  # one group per read
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (out / "model.safetensors").exists()
    a = load_file(src / "model.safetensors")
    got = {}
    for f in files:
        assert os.path.getsize(out / f) < 20_000 + 2_000  # the limit, plus its header
        got.update(load_file(out / f))
    assert sorted(got) == sorted(index["weight_map"]) == sorted(a)
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, a[k].bfloat16())
               for k, v in got.items())
    assert index["metadata"]["total_size"] == 2 * sum(v.numel() for v in got.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    again = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert next(again.parameters()).dtype == torch.bfloat16
    to_hf(str(ck), str(out), overwrite=True)  # one shard again: the old shards go
    assert sorted(f for f in os.listdir(out) if "safetensors" in f) == ["model.safetensors"]


def test_bad_dtype_and_shard_size_are_refused(tmp_path, capsys):
    from loom.cli import main
    for flags, needle in ((["--max-shard-size", "5 parsecs"], "--max-shard-size"),
                          (["--dtype", "fp8"], "--dtype")):
        with pytest.raises(SystemExit) as e:
            main(["checkpoint", "convert", "--to-hf", str(tmp_path), str(tmp_path / "o")]
                 + flags)
        assert e.value.code == 2 and needle in capsys.readouterr().err


def layout_cfg(tp: int = 1, pp: int = 1, ep: int = 1):
    """A tiny LLaMA-MoE (Mixtral layout: GQA, 4 experts, top-2) on mock data at t x p x e; V 100
    is padded to 128 x t rows, which the export drops."""
    return tiny_config("llama", num_layers=4, vocab_size=V, num_experts=4, moe_router_topk=2,
                       moe_ffn_hidden_size=24, ffn_hidden_size=24,
                       tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                       expert_model_parallel_size=ep, micro_batch_size=1, global_batch_size=4,
                       train_iters=1, seed=7, no_progress_bar=True, world=max(tp * pp, ep))


def save_layouts(root: str) -> None:
    """Two ranks save the same initial weights at TP 2, PP 2 and EP 2 (a checkpoint each)."""
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    for name, kw in (("tp2", dict(tp=2)), ("pp2", dict(pp=2)), ("ep2", dict(ep=2))):
        Trainer(layout_cfg(**kw), mesh=ParallelMesh.build(**kw)).save(os.path.join(root, name))


def test_export_from_tp_pp_ep_checkpoints_is_the_same(tmp_path):
    """The export reads any layout: checkpoints of the same weights saved at TP 2, PP 2 and
    EP 2 export to the very bytes of the one-process checkpoint's export."""
    from loom.parallel.mesh import ParallelMesh
    from loom.training.trainer import Trainer
    from testkit import run_distributed
    run_distributed(2, save_layouts, str(tmp_path), timeout=300, start_method="fork")
    Trainer(layout_cfg(), mesh=ParallelMesh.single()).save(str(tmp_path / "one"))
    files = {}
    for name in ("one", "tp2", "pp2", "ep2"):
        to_hf(str(tmp_path / name), str(tmp_path / f"{name}-hf"))
        files[name] = (tmp_path / f"{name}-hf" / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "one-hf" / "config.json").read_text())["model_type"] == \
        "mixtral"
    assert all(files[name] == files["one"] for name in ("tp2", "pp2", "ep2"))


def test_sliding_windows_loom_does_not_place_are_refused():
    """Qwen2's, Qwen2-MoE's and Qwen3-MoE's ``use_sliding_window`` (windows from
    ``max_window_layers`` on) is refused naming it, not imported as full attention; Mistral's
    and Mixtral's window on every layer imports (the export cases above)."""
    from loom.errors import ConfigError
    from loom.models.gpt.hf import read_config
    c = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, use_sliding_window=True,
             sliding_window=6)
    for config in (transformers.Qwen2Config(**c), transformers.Qwen2MoeConfig(**c),
                   transformers.Qwen3MoeConfig(**c)):
        with pytest.raises(ConfigError, match="use_sliding_window"):
            read_config(config.to_dict(), "config.json")
    window = read_config(transformers.MistralConfig(**c).to_dict(), "config.json").window_size
    assert window == "5,0"


def test_phi3_longrope_is_refused_naming_it():
    """Phi-3's 128K models scale RoPE by ``longrope`` (per-frequency short / long factors),
    which loom does not compute: refused naming it, not imported unscaled."""
    from loom.errors import ConfigError
    from loom.models.gpt.hf import read_config
    hf = transformers.Phi3Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=1,
        original_max_position_embeddings=32,
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
                         "long_factor": [2.0] * 4}).to_dict()
    with pytest.raises(ConfigError, match="longrope"):
        read_config(hf, "config.json")


def export_refuses(hf: dict, cases) -> None:
    """Each ``(field, value, needle)``: the model of ``hf`` with that field changed is refused
    at export, the message naming ``needle``."""
    from loom.errors import ConfigError
    from loom.models.gpt.hf import hf_config, read_config
    for field, value, needle in cases:
        changed = read_config(hf, "config.json")
        setattr(changed, field, value)
        with pytest.raises(ConfigError, match=needle):
            hf_config(changed)


def deepseek_v2(**kw):
    """A tiny random ``DeepseekV2ForCausalLM`` (one dense layer, one MoE layer of 8 experts)."""
    c = dict(vocab_size=V, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
             num_hidden_layers=2, num_attention_heads=4, n_shared_experts=1, n_routed_experts=8,
             routed_scaling_factor=1.5, kv_lora_rank=12, qk_rope_head_dim=4, v_head_dim=6,
             qk_nope_head_dim=8, first_k_dense_replace=1, max_position_embeddings=64,
             rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    torch.manual_seed(0)
    from hf_export_cases import _perturb
    return _perturb(transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
        **{**c, **kw}))).eval()


def test_deepseek_v2_greedy_routing_imports_as_transformers_computes_it(tmp_path, monkeypatch):
    """DeepSeek-V2's ``greedy`` top-3 of a softmax over all 8 experts, kept unnormalized and
    scaled (the export case routes in groups without q_lora): loom's logits equal the source's,
    its router is Megatron's pre-softmax one with the sequence-wise balance loss; imported
    without ``--moe-router-pre-softmax`` (top-k weights renormalized) the logits differ."""
    from loom.checkpoint.io import latest_checkpoint, read_common
    from loom.config import LoomConfig
    from loom.models.gpt import hf_deepseek
    hf = deepseek_v2(q_lora_rank=16, num_experts_per_tok=3, topk_method="greedy")
    hf.save_pretrained(tmp_path / "src")
    from_hf(str(tmp_path / "src"), str(tmp_path / "ck"))
    cfg = LoomConfig.from_flat(read_common(latest_checkpoint(str(tmp_path / "ck")))["config"])\
        .model
    assert (cfg.moe_router_score_function, cfg.moe_router_pre_softmax,
            cfg.moe_router_topk_scaling_factor, cfg.moe_router_load_balancing_type,
            cfg.moe_aux_loss_coeff, cfg.moe_router_num_groups) == \
        ("softmax", True, 1.5, "seq_aux_loss", 0.001, None)
    ids = torch.randint(5, V, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        source = hf(ids).logits
    assert rel_err(loom_logits(str(tmp_path / "ck"), ids), source, floor=1.0) < 1e-5
    real = hf_deepseek._moe_v2
    monkeypatch.setattr(hf_deepseek, "_moe_v2", lambda *args: {
        **real(*args), "moe_router_pre_softmax": False})
    from_hf(str(tmp_path / "src"), str(tmp_path / "wrong"))
    assert rel_err(loom_logits(str(tmp_path / "wrong"), ids), source, floor=1.0) > 1e-4


def test_deepseek_routing_transformers_and_loom_compute_differently_is_refused(tmp_path):
    """Refused at import naming the option: a group score other than Megatron's
    (DeepSeek-V2's ``group_limited_greedy`` scores a group by its best expert, V3 by its top 2;
    Megatron and loom by the sum of its top k / group_topk: the full DeepSeek-V2's 6 / 3), an
    unknown ``topk_method``, ``moe_layer_freq`` other than 1; the planner (``loom plan
    --from-hf``) reads such a group score as Megatron's, as Megatron-Bridge does. Exporting a
    softmax router that normalizes the top k or carries an expert bias is refused too."""
    from loom.errors import ConfigError
    from loom.models.gpt import hf_deepseek
    from loom.models.gpt.hf import hf_config, read_config
    base = dict(q_lora_rank=None, n_group=4, topk_group=2, topk_method="group_limited_greedy")
    good = deepseek_v2(num_experts_per_tok=3, **base).config.to_dict()
    cfg = hf_deepseek.read_config(good, "config.json", exact=True)
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk) == (4, 2)
    assert hf_config(cfg)["model_type"] == "deepseek_v2"
    v3 = build("deepseek_v3")[0].config.to_dict()
    for hf, bad, needle in ((good, {"num_experts_per_tok": 4}, "group_limited_greedy"),
                            (v3, {"num_experts_per_tok": 2}, "top-2"),
                            (good, {"topk_method": "noaux_tc"}, "topk_method"),
                            (v3, {"moe_layer_freq": 2}, "moe_layer_freq")):
        with pytest.raises(ConfigError, match=needle):
            hf_deepseek.to_loom({**hf, **bad}, {}, "config.json")
    planned = read_config({**good, "num_experts_per_tok": 4}, "config.json")
    assert (planned.moe_router_topk, planned.moe_router_group_topk) == (4, 2)
    export_refuses(good, (("moe_router_pre_softmax", False, "--moe-router-pre-softmax"),
                        ("moe_router_enable_expert_bias", True, "expert-bias"),
                        ("moe_router_group_topk", 1, "--moe-router-group-topk")))
    sigmoid = read_config(good, "config.json")
    sigmoid.moe_router_score_function = "sigmoid"
    assert hf_config(sigmoid)["model_type"] == "deepseek_v3"


def test_glm4_moe_what_transformers_computes_otherwise_is_refused():
    """GLM-4.5: a group score other than Megatron's (transformers sums a group's top 2 experts,
    Megatron and loom its top k / group_topk) is refused at import (read as Megatron's by the
    planner) and at export; so are a loom model with MTP layers (not exported) and a gated
    shared expert; a sigmoid router without the expert bias exports with a zero one."""
    from loom.errors import ConfigError
    from loom.models.gpt import hf_glm4_moe
    from loom.models.gpt.hf import loom_to_hf, read_config
    hf = build("glm4_moe")[0].config.to_dict()
    with pytest.raises(ConfigError, match="top-2"):
        hf_glm4_moe.to_loom({**hf, "num_experts_per_tok": 2}, {}, "config.json")
    assert read_config({**hf, "num_experts_per_tok": 2}, "config.json").moe_router_topk == 2
    cfg = read_config(hf, "config.json")
    export_refuses(hf, (("moe_router_group_topk", 1, "--moe-router-group-topk"),
                        ("mtp_num_layers", 1, "--mtp-num-layers"),
                        ("moe_shared_expert_gate", True, "shared-expert-gate")))
    model = build("glm4_moe")[0]
    full = {k: v for k, v in hf_glm4_moe.glm4_moe_to_loom(model.state_dict(), cfg).items()
            if not k.endswith("expert_bias")}
    cfg.moe_router_enable_expert_bias = False
    bias = loom_to_hf(full, cfg)["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(bias, torch.zeros(8))


def test_qwen3_next_what_its_class_lacks_is_refused():
    """Qwen3-Next: attention biases (on o_proj too) refused at import; at export, a router
    other than softmax top-k, a shared expert without its sigmoid gate, attention without
    Q/K norms (Qwen3NextAttention always has them), MTP layers."""
    from loom.errors import ConfigError
    from loom.models.gpt.hf import layout_of, read_config
    hf = build("qwen3_next")[0].config.to_dict()
    with pytest.raises(ConfigError, match="attention_bias"):
        read_config({**hf, "attention_bias": True}, "config.json")
    cfg = read_config(hf, "config.json")
    assert layout_of(cfg) == "qwen3_next" and cfg.moe_layer_freq == "[0, 1, 1, 1]"
    assert [cfg.is_gdn_layer(i) for i in range(4)] == [True, False, True, False]
    export_refuses(hf, (("moe_router_score_function", "sigmoid", "softmax top-k"),
                        ("moe_shared_expert_gate", False, "sigmoid gate"),
                        ("qk_layernorm", False, "--qk-layernorm"),
                        ("mtp_num_layers", 1, "--mtp-num-layers")))


def test_kimi_k2_imports_as_deepseek_v3(tmp_path):
    """Moonshot's Kimi K2 ``config.json`` says ``model_type: kimi_k2`` over DeepSeek-V3's
    architecture (other trainers ask users to edit it to deepseek_v3): it imports as is, its
    logits those of transformers' DeepseekV3ForCausalLM on the same weights."""
    hf, _ = build("deepseek_v3")
    hf.save_pretrained(tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    (tmp_path / "src" / "config.json").write_text(json.dumps({**config,
                                                              "model_type": "kimi_k2"}))
    from_hf(str(tmp_path / "src"), str(tmp_path / "ck"))
    ids = torch.randint(5, V, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        source = hf(ids).logits
    assert rel_err(loom_logits(str(tmp_path / "ck"), ids), source, floor=1.0) < 1e-5
