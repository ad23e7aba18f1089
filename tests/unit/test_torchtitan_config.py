"""torchtitan job configs (``--config FILE.toml``, loom/config/torchtitan.py): every distinct
train config in torchtitan's history (tests/unit/torchtitan_configs.json, 430 of them:
``python -m benchmarks.torchtitan_corpus MIRROR``) is read or refused naming its key; the
flavors are the published models; the learning rate is torchtitan's at every step;
``loom train`` and ``loom plan`` take the file."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest

from loom.cli import main
from loom.config import LoomConfig
from loom.config.torchtitan import DEFAULTS, FLAVORS, KEYS, torchtitan_fields
from loom.errors import ConfigError

CORPUS = json.loads((Path(__file__).parent / "torchtitan_configs.json").read_text())
LLAMA = ("llama", "llama2", "llama3")


def _toml(cfg: dict) -> str:
    """A TOML text of a parsed config (sections of scalars and lists, as torchtitan's are)."""
    def value(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return repr(v)

    lines = []

    def section(name, d):
        scalars = {k: v for k, v in d.items() if not isinstance(v, dict)}
        if scalars:
            lines.append(f"[{name}]")
            lines.extend(f"{k} = {value(v)}" for k, v in scalars.items())
        for k, v in d.items():
            if isinstance(v, dict):
                section(f"{name}.{k}", v)
    for name, d in cfg.items():
        section(name, d)
    return "\n".join(lines) + "\n"


def _entry(path_end: str) -> dict:
    """The newest corpus entry whose path ends so."""
    return [e for e in CORPUS if e["path"].endswith(path_end)][-1]


def test_every_config_of_torchtitans_history_is_read_or_refused_by_name():
    """353 of the 430 read and validate at their own sizes (data-parallel size 2, or as many
    as their expert parallelism needs); the other 77 are refused in one line naming
    ``[model] name`` (73: Flux, torchtitan's DeepSeek-V2 experiment, vision) or the
    key (torchtitan's SPMD experiment, TorchFT, an extension module): every Llama (2, 3, 4),
    Qwen3 (dense and MoE), DeepSeek-V3 and gpt-oss config but those is read (4 Llama 4 debug
    configs with torch.optim.Adam and weight decay: --no-decoupled-weight-decay)."""
    read, refused = 0, Counter()
    for e in CORPUS:
        name = e["config"].get("model", {}).get("name", DEFAULTS["model.name"])
        try:
            flat = torchtitan_fields(e["config"], e["path"])
        except ConfigError as err:
            msg = str(err)
            assert msg.startswith(e["path"] + ": [") and "not supported" in msg, msg
            refused["[model] name" if "[model] name" in msg else msg.split("] ")[1].split(
                " =")[0]] += 1
            assert name not in LLAMA + ("qwen3", "deepseek_v3", "llama4", "gpt_oss") or \
                "torch_spmd" in msg or "fault_tolerance" in msg or \
                "custom_args_module" in msg, msg
            continue
        tcp = flat["tensor_model_parallel_size"] * flat["context_parallel_size"]
        experts = flat.get("expert_model_parallel_size", 1) * flat.get(
            "expert_tensor_parallel_size", 1)  # EP x ETP fold over a stage's t c d ranks
        dp = max(2, math.lcm(tcp, experts) // tcp)
        LoomConfig.from_flat(flat).validate(tcp * flat["pipeline_model_parallel_size"] * dp)
        read += 1
    assert read == 353 and sum(refused.values()) == 77, (read, refused)
    assert refused["[model] name"] == 73, refused
    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    assert f"{read} of the {len(CORPUS)} distinct configs in torchtitan's history" in readme


def test_torchtitan_models_train_without_dropout():
    """torchtitan's language models have no dropout layer; Megatron's default is 0.1 for the
    hidden states and the attention probabilities: every flavor read from a torchtitan config
    sets both to 0, and a debug model built from one gives the same training-mode logits under
    two RNG states (dropout would draw different masks)."""
    import torch
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    for name in FLAVORS:
        for flavor in FLAVORS[name]:
            flat = torchtitan_fields({"model": {"name": name, "flavor": flavor},
                                      "training": {"seq_len": 256}})
            assert flat["hidden_dropout"] == 0.0 and flat["attention_dropout"] == 0.0, flavor
    cfg = LoomConfig.from_flat(torchtitan_fields({"model": {"name": "llama3", "flavor":
                                                            "debugmodel"}})).validate(1).model
    model = build_model(get_family(cfg.model_type), cfg, ParallelMesh.single(), seed=1).train()
    ids = torch.randint(0, 100, (1, 16), generator=torch.Generator().manual_seed(0))
    outs = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        with torch.no_grad():
            out = model(input_ids=ids)
        outs.append(out[0] if isinstance(out, tuple) else out)
    assert torch.equal(outs[0], outs[1])


def test_torchtitan_init_is_torchtitans_init_weights(monkeypatch):
    """A torchtitan config initializes as torchtitan v0.2.2's ``init_weights`` (its rules
    written out here: llama3/model/model.py, deepseek_v3/model/model.py, moe/moe.py): per
    tensor, the standard deviation loom draws is the rule's within sampling noise, on Llama 3's
    debug model, a tiny DeepSeek-V3 (MLA, dense first layer, routed and shared experts) and a
    tiny gpt-oss (gpt_oss/model/: every tensor of a layer at its depth std, sinks and biases
    too, the router's bias left zero). ``benchmarks/torchtitan_parity.py`` compares with
    torchtitan's own draw."""
    from loom.config import torchtitan_models as tt
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    monkeypatch.setitem(tt.FLAVORS["deepseek_v3"], "tiny", tt.deepseek(
        128, 64, 96, 32, 3, 1, 4, tt.moe(16, 4, 32, shared=1), q_lora_rank=32))
    monkeypatch.setitem(tt.FLAVORS["gpt_oss"], "tiny", tt.gpt_oss(2, 8, dim=64, inter=32,
                                                                    vocab=128))
    cut3 = 0.98658  # std of a normal cut at +-3 std, in units of its std
    for name, flavor in (("llama3", "debugmodel"), ("deepseek_v3", "tiny"), ("gpt_oss", "tiny")):
        cfg = LoomConfig.from_flat(torchtitan_fields({"model": {"name": name, "flavor": flavor},
                                                      "training": {"seq_len": 64}})
                                   ).validate(1).model
        assert cfg.torchtitan_init
        params = build_model(get_family("gpt"), cfg, ParallelMesh.single(), seed=3)
        h = cfg.hidden_size
        for pname, p in params.named_parameters():
            w = p.detach()[:cfg.vocab_size] if "embeddings" in pname or "output_layer" in pname \
                else p.detach()
            parts = pname.split(".")
            depth = 0.02 / math.sqrt(2 * (int(parts[1]) + 1)) if parts[0] == "layers" else None
            if pname.endswith("norm.weight"):
                want = [0.0]  # ones: no spread
            elif pname.endswith("expert_bias"):
                continue
            elif name == "gpt_oss" and parts[0] == "layers":  # every tensor of layer l, sinks
                want = [0.0] if pname.endswith("router.bias") else [depth]  # and biases too
            elif pname == "embedding.word_embeddings.weight":
                want = [1.0]
            elif pname == "output_layer.weight":
                want = [h ** -0.5 * cut3]
            elif parts[-2] == "linear_fc1":  # gate (w1) 0.02, up (w3) the layer's depth std
                want = [0.02, depth]
            elif parts[-2] in ("linear_proj", "linear_fc2", "router"):
                want = [depth]
            else:  # wq / wk / wv, MLA's down and up projections
                want = [0.02]
            for half, std in zip(w.chunk(len(want)), want):
                got = float(half.std())
                tol = 4 * std / math.sqrt(2 * half.numel()) + 1e-7
                assert abs(got - std) <= tol, (name, pname, got, std)
    m = LoomConfig.from_flat(torchtitan_fields({"model": {"name": "llama3"}})).validate(1)
    m.model.use_mup = True
    with pytest.raises(ConfigError, match="--torchtitan-init .* with --use-mup"):
        m.validate(1)


def test_flavors_are_the_published_models():
    """Parameter counts (untied, V unpadded: torchtitan pads no vocabulary) equal the
    Hugging Face checkpoints': Llama 3.1 8B / 70B / 405B, Llama 2 7B / 13B / 70B."""
    from loom.planner.memory import total_params
    counts = {("llama3", "8B"): 8_030_261_248, ("llama3", "70B"): 70_553_706_496,
              ("llama3", "405B"): 405_853_388_800, ("llama2", "7B"): 6_738_415_616,
              ("llama2", "13B"): 13_015_864_320, ("llama2", "70B"): 68_976_648_192}
    for (name, flavor), want in counts.items():
        flat = torchtitan_fields({"model": {"name": name, "flavor": flavor}})
        model = LoomConfig.from_flat(flat).validate(8).model
        assert total_params(model) == want, (name, flavor)
    assert FLAVORS["llama3"]["8B"]["ffn_hidden_size"] == 14336
    # Qwen3 (QK norm, tied up to 4B): loom's own model counted on the meta device
    from loom.planner.meta_count import count_rank_states
    for flavor, want in (("0.6B", 596_049_920), ("8B", 8_190_735_360)):
        cfg = LoomConfig.from_flat(torchtitan_fields(
            {"model": {"name": "qwen3", "flavor": flavor}})).validate(1)
        assert count_rank_states(cfg, 1)["params"] == want, flavor


def test_an_uneven_pipeline_split_is_torchtitans():
    """torchtitan splits L layers plus the embedding and the output (one "layer" each by
    default) over its stages, the first ``remainder`` stages one more (v0.2.2
    ``generate_llm_fqn_per_model_part``); where that is uneven loom takes the same split as a
    ``--pipeline-model-parallel-layout`` (Megatron's account-for flags need it even): its
    Llama 4 Maverick config on PP 4 (48 + 2 over 4: 12 + E, 13, 12, 11 + L), and on an
    interleaved 8 stages; an even split keeps the account-for flags."""
    from loom.config.torchtitan import torchtitan_split
    assert torchtitan_split(48, 4) == "Et*12|t*13|t*12|t*11L"
    assert torchtitan_split(48, 8) == "Et*6|t*7|t*6|t*6|t*6|t*6|t*6|t*5L"
    assert torchtitan_split(7, 2, 0, 0) == "Et*4|t*3L"
    config = {"model": {"name": "llama4", "flavor": "17bx128e"},
              "parallelism": {"pipeline_parallel_degree": 4}, "training": {"local_batch_size": 1,
                                                                         "global_batch_size": 8}}
    flat = torchtitan_fields(config)
    assert flat["pipeline_model_parallel_layout"] == "Et*12|t*13|t*12|t*11L"
    cfg = LoomConfig.from_flat(flat).validate(8)
    assert cfg.parallel.pipeline_model_parallel_layout == "Et*12|t*13|t*12|t*11L"
    even = torchtitan_fields({"model": {"name": "llama3", "flavor": "405B"},
                              "parallelism": {"pipeline_parallel_degree": 8},
                              "training": {"global_batch_size": 16}})
    assert "pipeline_model_parallel_layout" not in even and \
        even["account_for_embedding_in_pipeline_split"]


def test_moe_flavors_are_the_published_models():
    """torchtitan's MoE flavors (DeepSeek-V3 16B / 236B / 671B, Qwen3 30B-A3B / 235B-A22B) read
    as loom's MoE flags: their parameter counts are the published models' (DeepSeek-V3 671B to
    the parameter: 671,026,419,200 with its 58 x 256 expert-bias entries, which DeepSeek's
    checkpoint holds as parameters; the others to the published three digits), the
    planner's count is loom's own model on the meta device less the expert biases (debugmodel),
    and the routers are torchtitan's (score function, renormalization, scaling, node-limited
    groups, the load-balancing bias at 1e-3, shared experts, the first dense layers)."""
    from loom.planner.memory import total_params
    from loom.planner.meta_count import count_rank_states

    def model(name, flavor, **extra):
        flat = torchtitan_fields({"model": {"name": name, "flavor": flavor}, **extra})
        return LoomConfig.from_flat(flat).validate(1)
    v3 = model("deepseek_v3", "671B").model
    assert total_params(v3) + 58 * 256 == 671_026_419_200
    assert (v3.moe_router_score_function, v3.moe_router_pre_softmax,
            v3.moe_router_topk_scaling_factor, v3.moe_router_num_groups,
            v3.moe_router_group_topk, v3.moe_shared_expert_intermediate_size,
            v3.moe_layer_freq, v3.q_lora_rank) == \
        ("sigmoid", False, 2.5, 8, 4, 2048, "([0]*3+[1]*58)", 1536)
    for (name, flavor), billions in ((("deepseek_v3", "16B"), 15.7), (("deepseek_v3", "236B"),
                                                                     236),
                                     (("qwen3", "30B-A3B"), 30.5), (("qwen3", "235B-A22B"), 235)):
        m = model(name, flavor).model
        assert total_params(m) / 1e9 == pytest.approx(billions, rel=0.002), flavor
        assert m.moe_router_enable_expert_bias and m.moe_router_bias_update_rate == 1e-3
    lite = model("deepseek_v3", "16B").model  # DeepSeek-V2-Lite's shapes: softmax, no renorm
    assert lite.moe_router_pre_softmax and lite.q_lora_rank is None and \
        lite.moe_shared_expert_intermediate_size == 2 * 1408
    qwen = model("qwen3", "30B-A3B").model
    assert (qwen.moe_router_pre_softmax, qwen.num_query_groups, qwen.moe_ffn_hidden_size) == \
        (False, 4, 768) and qwen.untie_embeddings_and_output_weights
    debug = model("deepseek_v3", "debugmodel")
    assert count_rank_states(debug, 1)["params"] - 5 * 8 == total_params(debug.model)
    assert debug.model.effective_rope_type == "rope"  # MLA's default is YaRN: not here
    long = model("deepseek_v3", "16B", training={"seq_len": 8192}).model  # past 4,096: YaRN
    assert (long.effective_rope_type, long.rotary_scaling_factor, long.mscale, long.mscale_all_dim,
            long.yarn_original_max_position_embeddings) == ("yarn", 40.0, 0.7, 0.7, 4096)
    # Llama 4 (no iRoPE): Scout 17B x 16E, 107.8B (the published 109B holds the vision
    # encoder), Maverick 17B x 128E 400.7B ("400B"), both 17B active; the experts and the
    # shared expert 8,192 wide, the dense layers 16,384 (the published configs' sizes)
    for flavor, total, step in (("17bx16e", 107.77, "1"), ("17bx128e", 400.71, "([0,1]*24)")):
        m = model("llama4", flavor).model
        assert total_params(m) / 1e9 == pytest.approx(total, abs=0.01), flavor
        assert total_params(m, active=True) / 1e9 == pytest.approx(17.2, abs=0.05), flavor
        assert (m.moe_ffn_hidden_size, m.ffn_hidden_size, m.moe_layer_freq,
                m.moe_apply_probs_on_input, m.moe_router_topk) == (8192, 16384, step, True, 1)
    scout = model("llama4", "17bx16e").model
    assert scout.use_rope_scaling and (scout.rope_scaling_factor,) + scout.llama3_bands() == \
        (16.0, 1.0, 1.0, 8192)
    assert not model("llama4", "17bx128e").model.use_rope_scaling
    # iRoPE: no RoPE in layers 0, 4, 8, ... (torchtitan's layer_id % 4 == 0), the others
    # within fixed blocks (fixed_attn_block_size: --attention-chunk-size), at any seq_len
    irope = model("llama4", "17bx16e_irope", training={"seq_len": 16384}).model
    assert [irope.is_no_rope_layer(i) for i in range(8)] == [True, False, False, False] * 2
    assert [irope.is_chunked_layer(i) for i in range(4)] == [False, True, True, True]
    debug = model("llama4", "debugmodel_irope", training={"seq_len": 512}).model
    assert (debug.no_rope_freq, debug.attention_chunk_size) == ("([1,0,0,0]*1+[1,0])", 256)
    ep = torchtitan_fields({"model": {"name": "deepseek_v3", "flavor": "16B"},
                            "parallelism": {"expert_parallel_degree": 8}})
    assert (ep["expert_model_parallel_size"], ep["expert_tensor_parallel_size"]) == (8, 1)


def test_the_schedule_is_torchtitans_step_for_step():
    """torchtitan's LambdaLR (components/lr_scheduler.py: linear warm-up ``(s + 1) / w``, a
    stable phase, then decay over ``round(total x decay_ratio)`` steps, or all after the
    warm-up, linear / sqrt / cosine down to ``min_lr_factor``), written out here from its
    source, equals loom's learning rate at every step of the read config."""
    from loom.training.param_schedule import lr_at

    def torchtitan(step, warmup, total, ratio, kind, floor, lr):
        decay = total - warmup if ratio is None else min(round(total * ratio), total - warmup)
        stable_end = total + 1 - decay
        if step < warmup:
            return lr * (step + 1) / warmup
        if step < stable_end:
            return lr
        p = (step + 1 - stable_end) / decay
        c = {"linear": 1 - p, "sqrt": 1 - math.sqrt(p),
             "cosine": 0.5 * (1 + math.cos(math.pi * p))}[kind]
        return lr * (floor + (1 - floor) * c)

    for warmup, total, ratio, kind, floor in ((2, 10, 0.8, "linear", 0.0),
                                              (200, 1000, 0.8, "cosine", 0.1),
                                              (3, 20, None, "sqrt", 0.0),
                                              (0, 10, None, "linear", 0.1)):
        flat = torchtitan_fields({
            "lr_scheduler": {"warmup_steps": warmup, "decay_ratio": ratio, "decay_type": kind,
                             "min_lr_factor": floor},
            "training": {"steps": total}, "optimizer": {"lr": 3e-4}})
        if ratio is None:
            flat = torchtitan_fields({
                "lr_scheduler": {"warmup_steps": warmup, "decay_type": kind,
                                 "min_lr_factor": floor},
                "training": {"steps": total}, "optimizer": {"lr": 3e-4}})
        t = LoomConfig.from_flat(flat).training
        for s in range(total):
            assert lr_at(s, t) == pytest.approx(
                torchtitan(s, warmup, total, ratio, kind, floor, 3e-4), rel=1e-12, abs=1e-18), \
                (warmup, total, ratio, kind, s)


def test_keys_read_with_torchtitans_meaning():
    flat = torchtitan_fields({
        "training": {"local_batch_size": 4, "seq_len": 4096, "steps": 30, "max_norm": 2.0},
        "parallelism": {"tensor_parallel_degree": 2, "data_parallel_shard_degree": -1},
        "activation_checkpoint": {"mode": "full"},
        "checkpoint": {"enable": True, "folder": "ckpt", "interval": 10, "keep_latest_k": 3},
        "metrics": {"log_freq": 5, "enable_tensorboard": True},
        "job": {"dump_folder": "/runs/a"}})
    assert (flat["micro_batch_size"], flat["seq_length"], flat["train_iters"],
            flat["clip_grad"]) == (4, 4096, 30, 2.0)
    assert "global_batch_size" not in flat  # local x data-parallel size: Megatron's default
    assert flat["tensor_model_parallel_size"] == 2 and flat["sequence_parallel"]
    assert flat["use_torch_fsdp2"] and flat["bf16"]  # FSDP, bf16 parameters by default
    assert (flat["recompute_granularity"], flat["recompute_method"]) == ("full", "uniform")
    assert (flat["save"], flat["load"], flat["save_interval"], flat["keep_last"]) == (
        "/runs/a/ckpt", "/runs/a/ckpt", 10, 3)
    assert (flat["log_interval"], flat["tensorboard_dir"]) == (5, "/runs/a/tb")
    assert (flat["adam_beta2"], flat["weight_decay"], flat["lr"]) == (0.95, 0.1, 8e-4)
    assert flat["eval_iters"] == 0  # [validation] off
    # older spellings, a pipeline (FSDP there is the distributed optimizer: the same numbers)
    old = torchtitan_fields({"training": {"batch_size": 8, "pipeline_parallel_degree": 2,
                                          "data_parallel_degree": -1, "global_batch_size": 64},
                             "parallelism": {"pipeline_parallel_schedule": "Interleaved1F1B",
                                             "pipeline_parallel_microbatch_size": 2}})
    assert (old["pipeline_model_parallel_size"], old["micro_batch_size"],
            old["global_batch_size"], old["num_virtual_stages_per_pipeline_rank"]) == (
        2, 2, 64, 2)
    assert old["use_distributed_optimizer"] and old["account_for_embedding_in_pipeline_split"]
    # torchtitan's layer interval: as many layers recomputed, the first of each stage
    sel = torchtitan_fields({"model": {"flavor": "8B"},
                             "activation_checkpoint": {"selective_ac_option": "2"}})
    assert (sel["recompute_method"], sel["recompute_num_layers"]) == ("block", 16)
    # flex attention is a kernel; a block-causal mask keeps documents apart
    assert "reset_attention_mask" not in torchtitan_fields({"model": {"use_flex_attn": True}})
    assert torchtitan_fields({"model": {"attn_mask_type": "block_causal"}})[
        "reset_attention_mask"]


@pytest.mark.parametrize("config,words", [
    ({"training": {"stepz": 3}}, "[training] stepz: unknown key (did you mean [training] steps?)"),
    ({"model": {"name": "flux"}}, "[model] name = 'flux'"),
    ({"debug": {"moe_force_load_balance": True}, "model": {"name": "deepseek_v3"}},
     "round-robin expert assignment"),
    ({"checkpoint": {"initial_load_path": "/x"}}, "convert --from-torchtitan FILE.toml"),
    ({"model": {"flavor": "9B"}}, "not a flavor of torchtitan's llama3"),
    ({"parallelism": {"pipeline_parallel_degree": 2, "pipeline_parallel_schedule":
                      "DualPipeV"}}, "a schedule loom does not run"),
    ({"parallelism": {"pipeline_parallel_degree": 2, "pipeline_parallel_microbatch_size": 1},
      "training": {"local_batch_size": 4}}, "give [training] global_batch_size"),
])
def test_refusals_name_the_key_and_why(config, words):
    with pytest.raises(ConfigError) as e:
        torchtitan_fields(config, "x.toml")
    assert str(e.value).startswith("x.toml: [") and words in str(e.value), str(e.value)


def test_every_key_has_an_answer():
    """Every key of torchtitan v0.2.2's JobConfig (tests/unit/torchtitan_jobconfig_keys.json,
    149: ``python -m benchmarks.torchtitan_corpus MIRROR --jobconfig-keys v0.2.2``) and of
    every Llama config in its history has a row (FP8 / MX converter options: their
    converter's); the other models' sections are refused with the model."""
    from loom.config.torchtitan import FP8_SECTIONS, RENAMED
    v022 = json.loads((Path(__file__).parent / "torchtitan_jobconfig_keys.json").read_text())
    assert len(v022) == 149
    def flat_keys(d: dict, pre: str = ""):
        for k, v in d.items():
            yield from flat_keys(v, f"{pre}{k}.") if isinstance(v, dict) else [pre + k]
    llama_keys = {k for e in CORPUS if e["config"].get("model", {}).get("name", "llama3")
                  in LLAMA for k in flat_keys(e["config"])}
    for k in set(v022) | llama_keys:
        k = RENAMED.get(k, k)
        assert k in KEYS or k.startswith(FP8_SECTIONS), k
    assert all(rule.kind in ("read", "quiet", "note", "refuse") for rule in KEYS.values())
    assert all(k in KEYS for k in DEFAULTS)


def test_loom_train_and_plan_take_a_torchtitan_toml(tmp_path, capsys):
    """``loom train --config llama3_8b.toml --dry-run`` (torchtitan's file, 64 GPUs): Llama 3
    8B's 8,030,261,248 parameters, FSDP, the differences said once at start; ``loom plan
    --config`` plans the file's layout."""
    path = tmp_path / "llama3_8b.toml"
    path.write_text(_toml(_entry("llama3/train_configs/llama3_8b.toml")["config"]))
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(path), "--dry-run", "--world-size", "64", "--mock-data",
              "--gpu", "H100-80GB"])
    out = capsys.readouterr().out
    assert e.value.code in (0, None), out
    assert "parameters: 8030261248" in out and "zero=3" in out
    assert out.count("loom reads Megatron indexed datasets") == 1  # [training] and [validation]
    with pytest.raises(SystemExit) as e:
        main(["plan", "--config", str(path), "--gpu", "H100-80GB", "--num-gpus", "64",
              "--top", "1", "--json"])
    got = capsys.readouterr()
    lay = json.loads(got.out)["layouts"][0]
    assert e.value.code in (0, None) and (lay["tp"], lay["dp"], lay["zero"]) == (1, 64, 3)
    assert "loom plan: warning: " in got.err and "selective recompute 'op'" in got.err
    bad = tmp_path / "bad.toml"
    bad.write_text("[training]\nsteps = \n")
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(bad), "--dry-run", "--mock-data"])
    assert e.value.code == 2 and "not a valid TOML file" in capsys.readouterr().err


def test_the_command_lines_flags_override_the_file(tmp_path, capsys):
    """Flags given with ``--config FILE.toml`` win, as over a YAML: torchtitan's debug model
    without FSDP."""
    path = tmp_path / "debug.toml"
    path.write_text(_toml(_entry("llama3/train_configs/debug_model.toml")["config"]))
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", str(path), "--dry-run", "--world-size", "2", "--mock-data",
              "--train-iters", "3", "--no-use-torch-fsdp2"])
    out = capsys.readouterr().out
    assert e.value.code in (0, None) and "zero=0" in out, out


def test_torchtitans_command_line_spelling(tmp_path, capsys):
    """``--job.config_file FILE.toml`` and ``--section.key VALUE`` over it, as torchtitan's
    run_train.sh passes them (hyphens or underscores, ``=VALUE``, a bare flag true; values
    typed as TOML where they are one); without a torchtitan file they are refused."""
    from loom.config.torchtitan import torchtitan_argv
    assert torchtitan_argv(["--job.config_file", "a.toml", "--training.steps", "5",
                            "--parallelism.tensor-parallel-degree=2", "--checkpoint.enable",
                            "--mock-data", "--model.flavor", "8B"]) == [
        "--config", "a.toml", "--torchtitan-set", "training.steps=5",
        "--torchtitan-set", "parallelism.tensor_parallel_degree=2",
        "--torchtitan-set", "checkpoint.enable=true", "--mock-data",
        "--torchtitan-set", "model.flavor=8B"]
    path = tmp_path / "debug.toml"
    path.write_text(_toml(_entry("llama3/train_configs/debug_model.toml")["config"]))
    from loom.config.torchtitan import read_torchtitan_config
    got = read_torchtitan_config(str(path), overrides=["training.steps=3", "optimizer.lr=1e-3",
                                                       "model.flavor=8B"])
    assert (got["train_iters"], got["lr"], got["num_layers"]) == (3, 1e-3, 32)
    with pytest.raises(SystemExit) as e:
        main(["train", "--job.config_file", str(path), "--training.steps", "3",
              "--parallelism.data_parallel_shard_degree", "1", "--dry-run", "--world-size",
              "2", "--mock-data"])
    out = capsys.readouterr().out
    assert e.value.code in (0, None) and "zero=0" in out, out
    with pytest.raises(SystemExit) as e:
        main(["train", "--training.steps", "3", "--mock-data", "--dry-run"])
    assert e.value.code == 2 and "give --job.config_file FILE.toml" in capsys.readouterr().err


def test_the_docs_page_is_the_table():
    """docs/torchtitan.md is generated from the key table (``python -m loom.config.torchtitan
    docs/torchtitan.md``) and names every key."""
    from loom.config.torchtitan import docs_markdown
    doc = (Path(__file__).resolve().parents[2] / "docs" / "torchtitan.md").read_text()
    assert doc == docs_markdown(), "docs/torchtitan.md is stale: python -m " \
        "loom.config.torchtitan docs/torchtitan.md"
    for key in KEYS:
        sec, _, name = key.rpartition(".")
        assert f"`[{sec}] {name}`" in doc
