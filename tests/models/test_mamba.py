"""Mamba-2 and hybrid stacks (``--model-type mamba``; CPU, gloo, fp32, no dropout).

- The chunked SSD scan equals the naive sequential recurrence (outputs, final state and
  gradients, atol 1e-5) for chunk sizes that do and do not divide s.
- The gated RMSNorm of each TP shard equals the unsharded norm (per-group normalization).
- One Mamba layer at TP=2 equals TP=1 (output, input gradient, every parameter gradient), with
  exactly 1 TP all-reduce forward and 1 backward per Mamba layer, 2 + 2 for a Mamba + MLP pair.
- Loss, every gradient and the grad norm of 3 training steps equal the single-process run
  (rtol 1e-5): pure Mamba at TP=2, TP=2 + SP, DP=2, PP=2 (1F1B); a hybrid ``M*M-`` stack at
  TP=2, PP=2 and TP=2 x PP=2 (4 ranks).
- Recurrent decoding (conv + SSM state, KV cache for attention) equals the full forward pass
  token by token (logits, atol 1e-5), at TP=1 and TP=2.
- (tests/models/test_mamba_interop.py: logits equal transformers' Mamba2ForCausalLM;
  tests/models/test_mamba_compose.py: recompute, ZeRO-1, checkpoint resharding.)
- Bad configurations are refused by ``validate()`` before any process group starts.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from loom.config import ConfigError, LoomConfig, ModelConfig
from loom.models import get_family, resolve_config
from loom.models.family import StageSpec
from loom.models.mamba.model import GatedRMSNorm
from loom.models.mamba.ssd import ssd_chunked, ssd_sequential
from loom.parallel.mesh import ParallelMesh
from loom.parallel.parallelize import build_chunk, build_model
from loom.parallel.random import RNGTracker
from loom.parallel.registry import local_shard
from testkit import run_distributed

from mamba_helpers import check_parity, parity, tiny
from testkit.numerics import PARITY_RTOL, UNIT_ATOL, rel_err


# -- single process ---------------------------------------------------------------------------

def scan_inputs(s: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, H, P, G, N = 2, 4, 3, 2, 5
    x = torch.randn(b, s, H, P, generator=g)
    dt = F.softplus(torch.randn(b, s, H, generator=g))
    A = -torch.rand(H, generator=g) * 2 - 0.1
    B, C = torch.randn(b, s, G, N, generator=g), torch.randn(b, s, G, N, generator=g)
    h0 = torch.randn(b, H, P, N, generator=g)
    return [t.requires_grad_(True) for t in (x, dt, A, B, C, h0)]


@pytest.mark.parametrize("s,chunk", [(16, 4), (16, 16), (13, 4), (13, 5), (13, 32), (7, 1)])
def test_chunked_scan_equals_sequential_recurrence(s, chunk):
    inputs = scan_inputs(s)
    y_ref, h_ref = ssd_sequential(*inputs[:5], initial_state=inputs[5])
    w = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(1))
    ref_grads = torch.autograd.grad((y_ref * w).sum() + h_ref.sum(), inputs)
    y, h = ssd_chunked(*inputs[:5], chunk, initial_state=inputs[5])
    grads = torch.autograd.grad((y * w).sum() + h.sum(), inputs)
    # A's gradient sums b s H P terms and reaches ~100, where one fp32 ulp is ~1e-5 (the state
    # reaches ~20): every tensor is held to atol 1e-5 x max(1, max |ref|), i.e. absolute for
    # O(1) tensors and relative above
    for name, a, b in zip(("y", "state", "grad x", "grad dt", "grad A", "grad B", "grad C",
                           "grad h0"), (y, h, *grads), (y_ref, h_ref, *ref_grads)):
        a, b = a.detach(), b.detach()
        err = float((a - b).abs().max())
        assert err <= UNIT_ATOL * max(1.0, float(b.abs().max())), (name, err, float(b.abs().max()))


def test_scan_check_can_fail():
    """The comparison above detects a wrong scan: a slightly different decay must exceed atol."""
    x, dt, A, B, C, h0 = scan_inputs(13)
    y_ref, _ = ssd_sequential(x, dt, A, B, C, initial_state=h0)
    y, _ = ssd_chunked(x, dt, A * 1.01, B, C, 5, initial_state=h0)
    assert (y - y_ref).abs().max() > 100 * UNIT_ATOL


def test_gated_norm_of_each_group_shard_equals_unsharded():
    """Per-group RMSNorm (group = d_inner / G channels): the shards of t = 2 and 4 ranks (G/t
    groups each) give the unsharded output; a norm over the whole shard (group = d_inner / t)
    would not, which is why Mamba-2's grouped norm is what makes TP exact. Not bitwise: the
    shard's reductions run over tensors of another shape, whose vectorization (and so the
    summation order) depends on the CPU (4.8e-7 on an AMD EPYC): rtol 1e-5, tests/README.md."""
    g = torch.Generator().manual_seed(0)
    d_inner, groups = 64, 4
    y, z, w = (torch.randn(3, d_inner, generator=g), torch.randn(3, d_inner, generator=g),
               torch.randn(d_inner, generator=g))
    full = GatedRMSNorm(d_inner, d_inner // groups, 1e-5)
    full.weight.data.copy_(w)
    out = full(y, z)
    for t in (2, 4):
        for r in range(t):
            part = GatedRMSNorm(d_inner // t, d_inner // groups, 1e-5)
            part.weight.data.copy_(w.chunk(t)[r])
            torch.testing.assert_close(part(y.chunk(t, -1)[r], z.chunk(t, -1)[r]),
                                       out.chunk(t, -1)[r], atol=1e-6, rtol=1e-5)
    whole_shard = GatedRMSNorm(d_inner // 2, d_inner // 2, 1e-5)
    whole_shard.weight.data.copy_(w.chunk(2)[0])
    wrong = whole_shard(y.chunk(2, -1)[0], z.chunk(2, -1)[0])
    assert (wrong - out.chunk(2, -1)[0]).abs().max() > 1e-3


def decode_errors(model) -> dict:
    """Max |logits| difference between the full forward pass and prompt + one-token decoding."""
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(5))
    model.eval()
    with torch.no_grad():
        full = model(input_ids=ids)  # [b, s, Vp/t]
        cache = model.allocate_cache(2, ids.shape[1])
        steps = [model(input_ids=ids[:, :5], cache=cache)]
        cache.length += 5
        for i in range(5, ids.shape[1]):
            steps.append(model(input_ids=ids[:, i:i + 1], cache=cache))
            cache.length += 1
    dec = torch.cat(steps, dim=1)
    return {"err": float((dec - full).abs().max()), "scale": float(full.abs().max()),
            "mamba_states": len(cache.ssm), "kv": len(cache.keys)}


@pytest.mark.parametrize("pattern", [None, "M*M-"])
def test_recurrent_decoding_equals_full_forward(pattern):
    model = build_model(get_family("mamba"), tiny(pattern), ParallelMesh.single())
    r = decode_errors(model)
    assert r["mamba_states"] == (4 if pattern is None else 2)
    assert r["kv"] == (0 if pattern is None else 1)
    assert r["err"] < UNIT_ATOL and r["scale"] > 0.1, r


def test_generate_runs_on_hybrid_and_matches_greedy_without_cache():
    from loom.inference.generate import SamplingConfig, generate
    model = build_model(get_family("mamba"), tiny("M*M-"), ParallelMesh.single())
    prompt = [3, 14, 15, 92, 65]
    out = generate(model, prompt, 6, SamplingConfig(greedy=True))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(input_ids=torch.tensor([ids]))[0, -1, :100].argmax()))
    assert out == ids[len(prompt):]


HEADS = dict(mamba_num_heads=6, mamba_head_dim=6)  # d_inner 36, h 32: independent of h


def test_mamba_heads_independent_of_hidden_size_match_nemotron_h():
    """--mamba-num-heads H x --mamba-head-dim P with H P not a multiple of h (Nemotron-H 47B /
    56B, Nemotron-Nano-9B-v2; Megatron's ``MambaMixer``: d_inner = H P): loom's mixer equals
    ``transformers``' ``NemotronHMamba2Mixer`` (its PyTorch path, d_inner = H P by
    construction) with the same weights, h 20 and d_inner 6 x 4 = 24."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    from loom.models.mamba.model import MambaMixer
    cfg = tiny(num_layers=1, hidden_size=20, mamba_num_heads=6, mamba_head_dim=4,
               norm_epsilon=1e-5)
    assert cfg.mamba_d_inner == 24 and cfg.mamba_d_inner % cfg.hidden_size
    hf_cfg = transformers.NemotronHConfig(
        hidden_size=20, mamba_num_heads=6, mamba_head_dim=4, n_groups=2, ssm_state_size=8,
        conv_kernel=4, chunk_size=5, layer_norm_epsilon=1e-5, use_bias=False,
        use_conv_bias=True, time_step_min=0.0,  # dt clamped to >= 0 only: no clamp
        num_hidden_layers=1, layers_block_type=["mamba"], vocab_size=64, num_attention_heads=4,
        num_key_value_heads=4)
    torch.manual_seed(0)
    hf = NemotronHMamba2Mixer(hf_cfg, layer_idx=0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        hf.A_log.copy_(torch.rand(6) + 0.1)
    mine = MambaMixer(cfg, 0)
    mine.load_state_dict({k: v.squeeze(1) if k == "conv1d.weight" else v
                          for k, v in hf.state_dict().items()})
    x = torch.randn(2, 12, 20)
    with torch.no_grad():
        want = hf(x)
        got = mine(x.transpose(0, 1)).transpose(0, 1)
    assert rel_err(got, want) < 1e-5
    mine.D.data += 0.1  # the check can fail
    with torch.no_grad():
        assert rel_err(mine(x.transpose(0, 1)).transpose(0, 1), want) > 1e-3


@pytest.mark.parametrize("changes,flag", [
    (dict(tp=2, model=dict(mamba_num_groups=1)), "--mamba-num-groups"),
    (dict(tp=2, model=dict(mamba_expand=3, mamba_head_dim=32, mamba_num_groups=1)),
     r"3 Mamba heads .* not divisible by --tensor-model-parallel-size 2"),
    (dict(model=dict(hybrid_override_pattern="M*E")), "--hybrid-override-pattern"),  # MoE (E)
    (dict(model=dict(hybrid_override_pattern="M*MX")), "--hybrid-override-pattern"),
    (dict(model=dict(model_type="gpt", hybrid_override_pattern="MMMM")),
     "--hybrid-override-pattern"),
    (dict(cp=16), "--context-parallel-size"),  # 8 heads: not divisible by t c
    (dict(cp=2, model=dict(mamba_num_heads=6, mamba_num_groups=3)),  # 3 groups vs CP 2
     "--context-parallel-size"),
    (dict(model=dict(mamba_head_dim=24)), "--mamba-head-dim"),
])
def test_bad_configs_are_refused_before_any_process_group(changes, flag):
    cfg = LoomConfig(model=tiny(**changes.get("model", {})))
    cfg.training.micro_batch_size, cfg.training.train_iters, cfg.training.lr = 2, 10, 1e-3
    cfg.parallel.tensor_model_parallel_size = changes.get("tp", 1)
    cfg.parallel.context_parallel_size = changes.get("cp", 1)
    world = changes.get("tp", 1) * changes.get("cp", 1)
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match=flag):
        resolve_config(cfg, world)


def test_attention_and_mlp_only_pattern_allows_context_parallelism():
    cfg = LoomConfig(model=tiny("*-*-"))
    cfg.training.micro_batch_size, cfg.training.train_iters, cfg.training.lr = 2, 10, 1e-3
    cfg.parallel.context_parallel_size = 2
    cfg = cfg.validate(2)


# -- distributed --------------------------------------------------------------------------------

def layer_case(cfg: ModelConfig, layer_numbers: list, count_only: bool = False) -> dict:
    """Layers ``layer_numbers`` at TP = world vs TP = 1: output, input grad and parameter grads
    (relative errors), and the TP all-reduces of one forward and one backward."""
    family = get_family("mamba")
    mesh = ParallelMesh.build(tp=dist.get_world_size())
    tracker = RNGTracker(mesh.device)
    tracker.seed(0)
    stage = StageSpec(layer_numbers, False, False)
    par, ref = (build_chunk(family, cfg, stage, m, tracker) for m in (mesh, ParallelMesh.single()))
    x = torch.randn(16, 2, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    calls = {"forward": [], "backward": []}
    phase, original = ["forward"], dist.all_reduce

    def counting(tensor, *args, **kwargs):
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        if group is mesh.groups["tp"]:
            calls[phase[0]].append(tensor.numel())
        return original(tensor, *args, **kwargs)

    outs = []
    for model in (par, ref):
        xi = x.clone().requires_grad_(True)
        dist.all_reduce = counting if model is par else original
        try:
            phase[0] = "forward"
            y = xi
            for layer in model.layers.values():
                y = layer(y)
            phase[0] = "backward"
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        finally:
            dist.all_reduce = original
        outs.append((y.detach(), xi.grad))
    ref_params = dict(ref.named_parameters())
    grad = max(rel_err(p.grad, local_shard(ref_params[n].grad, par.registry[n], mesh.tp_rank,
                                           mesh.tp_size)) for n, p in par.named_parameters())
    sharded = sorted(n for n, m in par.registry.items() if m.shard is not None)
    return {"out": rel_err(outs[0][0], outs[1][0]), "dx": rel_err(outs[0][1], outs[1][1]),
            "grad": grad, "calls": calls, "sbh": x.numel(), "sharded": sharded}


def world2() -> dict:
    res = {"layer-M": layer_case(tiny("M-M*"), [0]), "layer-M-": layer_case(tiny("M-M*"), [0, 1])}
    res["parity-mamba"] = parity(tiny(), {"tp2": (2, 1, 1, False), "tp2sp": (2, 1, 1, True),
                                          "dp2": (1, 1, 2, False), "pp2": (1, 2, 1, False)})
    res["parity-hybrid"] = parity(tiny("M*M-"), {"tp2": (2, 1, 1, False),
                                                 "tp2sp": (2, 1, 1, True),
                                                 "pp2": (1, 2, 1, False)})
    res["parity-heads"] = parity(tiny("M*M-", **HEADS), {"tp2": (2, 1, 1, False),
                                                         "pp2": (1, 2, 1, False)})
    mesh = ParallelMesh.build(tp=2)
    res["decode-tp2"] = decode_errors(build_model(get_family("mamba"), tiny("M*M-"), mesh))
    return res


def world4() -> dict:
    # cp2xdp2: 2 groups per rank split over CP; tp2xcp2: 1 group per TP rank, copied to both CP
    # ranks (each takes 2 of its 4 heads); tokens in the load-balanced CP order for attention
    return {"parity-hybrid": parity(tiny("M*M-"), {"tp2xpp2": (2, 2, 1, False),
                                                   "tp2xdp2": (2, 1, 2, False),
                                                   "cp2xdp2": (1, 1, 2, False, 2),
                                                   "tp2xcp2": (2, 1, 1, False, 2)})}


@pytest.fixture(scope="module")
def results2():
    return run_distributed(2, world2)


def test_mamba_layer_tp2_equals_tp1_and_counts_collectives(results2):
    for r in results2:
        one, pair = r["layer-M"], r["layer-M-"]
        for case in (one, pair):
            assert case["out"] < PARITY_RTOL and case["dx"] < PARITY_RTOL \
                and case["grad"] < PARITY_RTOL, case
        # the per-channel parameters are registered as TP shards, not replicated
        assert {"layers.0.mixer.A_log", "layers.0.mixer.D", "layers.0.mixer.dt_bias",
                "layers.0.mixer.conv1d.weight", "layers.0.mixer.conv1d.bias",
                "layers.0.mixer.norm.weight", "layers.0.mixer.in_proj.weight",
                "layers.0.mixer.out_proj.weight"} <= set(one["sharded"])
        # a Mamba layer: out-projection g forward, in-projection f backward, one [s, b, h] each
        assert one["calls"] == {"forward": [one["sbh"]], "backward": [one["sbh"]]}, one["calls"]
        # a Mamba + MLP pair: 2 forward and 2 backward, like a transformer layer
        assert pair["calls"] == {"forward": [pair["sbh"]] * 2, "backward": [pair["sbh"]] * 2}


@pytest.mark.parametrize("model,layout", [("parity-mamba", "tp2"), ("parity-mamba", "tp2sp"),
                                          ("parity-mamba", "dp2"), ("parity-mamba", "pp2"),
                                          ("parity-hybrid", "tp2"), ("parity-hybrid", "tp2sp"),
                                          ("parity-hybrid", "pp2"), ("parity-heads", "tp2"),
                                          ("parity-heads", "pp2")])
def test_training_parity_two_ranks(results2, model, layout):
    """``parity-heads``: --mamba-num-heads 6 x --mamba-head-dim 6 = d_inner 36 with h 32 (not a
    multiple of h, as Nemotron-H's shapes), 3 heads and 1 group per TP rank."""
    for r in results2:
        case = r[model][layout]
        assert case["compared"] > 10, case
        assert (case["sp_params"] > 0) == layout.endswith("sp"), case
        check_parity(case)


def test_recurrent_decoding_tp2(results2):
    for r in results2:
        assert r["decode-tp2"]["err"] < UNIT_ATOL and r["decode-tp2"]["mamba_states"] == 2, r


def test_hybrid_tp2_x_pp2_tp2_x_dp2_and_context_parallel_four_ranks():
    """Context parallelism (CP 2, and TP 2 x CP 2): the Mamba scans run over CP (2 layers
    wrapped; 2 all-to-alls forward and 2 backward per Mamba layer, micro-batch and step), loss
    and every gradient equal to one process."""
    for r in run_distributed(4, world4):
        for name, case in r["parity-hybrid"].items():
            assert case["compared"] > 5, case
            check_parity(case)
            cp = "cp2" in name
            assert case["cp_scans"] == (2 if cp else 0), (name, case)
            # 3 steps x 4 micro-batches / dp x 2 Mamba layers x (2 forward + 2 backward)
            assert case["a2a"] == (3 * (4 // (2 if "dp2" in name else 1)) * 2 * 4 if cp
                                   else 0), (name, case)
