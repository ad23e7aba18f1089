"""The planner's per-layer activation bytes of loom's own layer (:mod:`loom.planner.layer_bytes`)
equal, byte for byte, what loom's real modules hand to autograd (``saved_tensors_hooks``, one
count per storage; ``benchmarks/layer_memory.py``), on CPU, for every recompute mode, fp32 and
bf16, TP with and without sequence parallelism (rank 0 of a 2-rank ``fake`` world), RMSNorm /
LayerNorm, RoPE / learned positions, SwiGLU / GeLU, hidden dropout, at three shapes; likewise
loom's MLA layer and Mamba-2 layer (their own terms); and every named term matters in at least
one of the cases (dropping it breaks an equality).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.layer_memory import (fake_world, layer_saved_bytes, mamba_model,
                                     measure_in_worlds, mla_model, resolve)
from loom.config import ModelConfig
from loom.planner.layer_bytes import loom_layer_bytes, loom_layer_terms

# (name, model, s, b): three shapes, two layer styles
SHAPES = {
    "llama-a": (dict(style="llama", hidden_size=64, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=96), 32, 2),
    "llama-b": (dict(style="llama", hidden_size=96, num_attention_heads=6, num_query_groups=6,
                     ffn_hidden_size=160), 24, 1),
    "gpt-a": (dict(style="gpt", hidden_size=64, num_attention_heads=4, hidden_dropout=0.1), 32, 2),
}


def _model(style: str, s: int, **kw) -> ModelConfig:
    kw.setdefault("hidden_dropout", 0.0)
    make = ModelConfig.llama if style == "llama" else ModelConfig.gpt2
    return resolve(make(num_layers=2, vocab_size=128, attention_dropout=0.0, **kw), s)


# (shape, t, sp, recompute, uniform group N, dtype, c, cp comm type)
CASES = [(name, 1, False, rc, 1, dt, 1, "p2p") for name in SHAPES
         for rc in (None, "selective", "full") for dt in (torch.float32, torch.bfloat16)]
CASES += [(name, 1, False, "full", 2, torch.bfloat16, 1, "p2p") for name in ("llama-a", "gpt-a")]
CASES += [(name, 2, sp, rc, 1, torch.bfloat16, 1, "p2p") for name in ("llama-a", "gpt-a")
          for sp in (False, True) for rc in (None, "selective", "full")]
CASES += [(name, 1, False, rc, 1, dt, 2, cpt) for name in ("llama-a", "llama-b")
          for cpt in ("p2p", "allgather", "a2a") for rc in (None, "selective", "full")
          for dt in (torch.float32, torch.bfloat16)]
CASES += [("llama-a", 2, True, None, 1, torch.bfloat16, 2, cpt) for cpt in ("p2p", "allgather")]


@pytest.fixture(scope="module")
def measured() -> dict:
    """Every case measured once; the t = 2 ones inside one fake 2-rank world, torn down after."""
    torch.set_num_threads(1)

    def measure(case):
        name, t, sp, rc, n, dt, c, cpt = case
        kw, s, b = SHAPES[name]
        kw = dict(kw)
        model = _model(kw.pop("style"), s, **kw)
        return layer_saved_bytes(model, s, b, tp=t, sp=sp, cp=c, cp_comm_type=cpt,
                                 recompute=rc, num_layers=n, base_layers=n, extra_layers=n,
                                 dtype=dt)
    return measure_in_worlds(CASES, lambda case: case[1] * case[6], measure)


def _predicted(case) -> tuple[float, dict]:
    name, t, sp, rc, n, dt, c, cpt = case
    kw, s, b = SHAPES[name]
    kw = dict(kw)
    model = _model(kw.pop("style"), s, **kw)
    e = torch.finfo(dt).bits // 8
    got = loom_layer_bytes(model, s, b, t=t, cp=c, sp=int(sp), elem_bytes=e, device="cpu",
                           recompute_group=n, cp_comm_type=cpt)
    terms = loom_layer_terms(model, s, b, t=t, cp=c, sp=int(sp), elem_bytes=e, device="cpu",
                             cp_comm_type=cpt)
    return float(got[rc or "none"]), {k: float(v) for k, v in terms.items()}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-t{c[1]}{'-sp' if c[2] else ''}"
                         f"{f'-c{c[6]}-{c[7]}' if c[6] > 1 else ''}"
                         f"-{c[3]}{c[4] if c[4] > 1 else ''}-{str(c[5])[6:]}")
def test_formula_equals_saved_bytes(measured, case):
    assert _predicted(case)[0] == measured[case]


def test_every_term_is_needed(measured):
    """For each named term, a case where it is non-zero and the formula without it is wrong."""
    needed = set()
    for case in CASES:
        if case[3] == "full":
            continue
        total, terms = _predicted(case)
        needed |= {k for k, v in terms.items() if v and total - v != measured[case]}
    assert needed == set(terms), set(terms) - needed


def test_planner_counts_loom_layer_when_asked():
    """``Options(layer_memory="loom")`` makes the planner's per-layer bytes (what every held
    layer-micro-batch costs) the CUDA form of the measured formula, per recompute mode and CP
    type; the default ``"kor"`` keeps KOR table 2 (the published sources' layer)."""
    import numpy as np
    from loom.planner.layout import Options, make_layouts
    from loom.planner.memory import layer_activation_kinds
    from loom.planner.context_parallel import CP_COMM_TYPES
    kw, s, b = SHAPES["llama-a"]
    kw = dict(kw)
    model = _model(kw.pop("style"), s, **kw)
    rows = [dict(tp=t, sp=sp, cp=c, cpt=k, mbs=b, recompute=rc)
            for t, sp in ((1, 0), (2, 0), (2, 1)) for c in (1, 2) for k in range(3)
            for rc in ("none", "selective")]
    L = make_layouts(rows)
    base = layer_activation_kinds(model, s, L, Options(flash_attention=True, layer_memory="loom"))
    kor = layer_activation_kinds(model, s, L, Options(flash_attention=True))
    for i, r in enumerate(rows):
        want = loom_layer_bytes(model, s, b, t=r["tp"], cp=r["cp"], sp=r["sp"],
                                cp_comm_type=CP_COMM_TYPES[r["cpt"]])[r["recompute"]]
        assert float(base[0][0][i]) == pytest.approx(float(want), rel=1e-12), r
    assert np.all(base[0][0] > kor[0][0])  # loom's layer keeps more than KOR's count


MOE_SHAPES = {"moe-a": (dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                             num_experts=4), 32, 2),
              "moe-b": (dict(hidden_size=96, num_attention_heads=6, ffn_hidden_size=64,
                             num_experts=8, moe_router_topk=3), 24, 1),
              # --moe-latent-size; and top-1 with --moe-apply-probs-on-input, with and
              # without a shared expert (which keeps the layer's tokens) and the latent
              "moe-latent": (dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                                  num_experts=4, moe_latent_size=32), 32, 2),
              "moe-probs": (dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                                 num_experts=4, moe_router_topk=1,
                                 moe_apply_probs_on_input=True), 32, 2),
              "moe-latent-probs-shared": (dict(hidden_size=64, num_attention_heads=4,
                                               ffn_hidden_size=96, num_experts=4,
                                               moe_router_topk=1, moe_latent_size=32,
                                               moe_apply_probs_on_input=True,
                                               moe_shared_expert_intermediate_size=64), 32, 2)}


@pytest.mark.parametrize("name", sorted(MOE_SHAPES))
def test_moe_layer_formula_equals_saved_bytes(name):
    """loom's MoE layer (one rank holding every expert, Megatron's default router): the dense
    layer's attention side plus :func:`loom_moe_mlp_terms` instead of the dense MLP and its
    input, exactly;
    every MoE term non-zero here, so dropping one breaks the equality."""
    from loom.planner.layer_bytes import loom_moe_mlp_terms
    torch.set_num_threads(1)
    kw, s, b = MOE_SHAPES[name]
    model = resolve(ModelConfig.mixtral(num_layers=2, vocab_size=128, hidden_dropout=0.0,
                                        attention_dropout=0.0, **kw), s)
    got = layer_saved_bytes(model, s, b, dtype=torch.bfloat16)
    att = loom_layer_terms(model, s, b, elem_bytes=2, device="cpu")
    moe = loom_moe_mlp_terms(model, s, b, elem_bytes=2)
    want = (sum(float(v) for n, v in att.items() if n not in ("mlp", "fc1_input"))
            + sum(map(float, moe.values())))
    assert want == got, (want - got, {n: float(v) for n, v in moe.items()})
    off = {"shared_expert", "latent", "probs_on_input"} | (
        {"combine"} if model.moe_apply_probs_on_input else set())
    assert all(float(v) > 0 for n, v in moe.items() if n not in off)


def test_loom_plan_names_the_activations_term_under_either_layer(capsys):
    """``loom plan`` at Llama 3 405B's published 8K layout without full recompute: it does not
    fit under KOR's layer (``--layer-memory kor``: activations 82.1 GB, 28.9 GB too much) nor,
    by more, under loom's own (the default: 88.8 GB; 178.0 GB while loom's SP GEMMs saved the
    gathered input and its SwiGLU the SiLU output), and says so by term."""
    from loom.cli import main
    argv = ["plan", "llama3-405b", "--gpu", "H100-80GB", "--num-gpus", "8192",
            "--global-batch-size", "2048", "--tensor-model-parallel-size", "8",
            "--pipeline-model-parallel-size", "16", "--context-parallel-size", "1",
            "--micro-batch-size", "1", "--recompute-granularity", "selective",
            "--sequence-parallel", "--decoder-first-pipeline-num-layers", "7",
            "--decoder-last-pipeline-num-layers", "7",
            "--num-layers-per-virtual-pipeline-stage", "2"]
    got = {}
    for lm in ("kor", "loom"):
        with pytest.raises(SystemExit):
            main(argv + ["--layer-memory", lm])
        out = capsys.readouterr()
        got[lm] = out.out + out.err
    assert "largest term is activations 82.1 GB" in got["kor"] and "28.9 GB too much" in got["kor"]
    assert "largest term is activations 88.8 GB" in got["loom"]


# -- MLA and Mamba-2 layers ---------------------------------------------------------------------

def _mla(q: int = 16, ln: bool = True, **kw) -> ModelConfig:
    """h 32, a 4, q 16 (0: a full query projection), r 12, dn 8, dr 4, dv 6 (dq != dv)."""
    return mla_model(q_lora_rank=q or None, qk_layernorm=ln, **kw)


def _mamba(**kw) -> ModelConfig:
    """h 32, P 8, d_inner 64 -> H 8, G 2, N 4, k 4, Q 8 (s 16: two chunks)."""
    return mamba_model(**kw)


YARN = dict(rope_type="yarn", rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0,
            yarn_original_max_position_embeddings=8)
FAMILY_SHAPES = {
    "mla": (_mla, {}),
    "mla-noq-noln": (_mla, dict(q=0, ln=False)),
    "mla-yarn": (_mla, YARN),
    "mamba": (_mamba, {}),
    "mamba-g1": (_mamba, dict(mamba_num_groups=1, mamba_state_dim=8, mamba_chunk_size=4)),
    "mamba-h6-1chunk": (_mamba, dict(mamba_num_heads=6, mamba_head_dim=4, mamba_chunk_size=16)),
}
BF, FP = torch.bfloat16, torch.float32
# (shape, t, sp, recompute, dtype); s 16, b 2
FAMILY_CASES = [
    ("mla", 1, False, None, BF), ("mla", 1, False, None, FP), ("mla", 1, False, "selective", BF),
    ("mla", 1, False, "full", BF), ("mla", 2, False, None, BF), ("mla", 2, True, "selective", BF),
    ("mla-noq-noln", 1, False, None, FP), ("mla-noq-noln", 2, True, None, BF),
    ("mla-yarn", 1, False, "selective", BF),
    ("mamba", 1, False, None, BF), ("mamba", 1, False, None, FP),
    ("mamba", 1, False, "selective", BF), ("mamba", 1, False, "full", BF),
    ("mamba", 2, True, None, BF), ("mamba", 2, False, None, FP),
    ("mamba-g1", 1, False, None, BF), ("mamba-h6-1chunk", 1, False, None, FP),
]


def _family_bytes(case) -> tuple[float, dict, ModelConfig]:
    from loom.planner.layer_bytes import (mamba_layer_bytes, mamba_layer_terms,
                                          mla_layer_bytes, mla_layer_terms)
    name, t, sp, rc, dt = case
    make, kw = FAMILY_SHAPES[name]
    model = resolve(make(**kw), 16)
    mla = name.startswith("mla")
    e = torch.finfo(dt).bits // 8
    got = (mla_layer_bytes if mla else mamba_layer_bytes)(model, 16, 2, t=t, sp=int(sp),
                                                          elem_bytes=e, device="cpu")
    terms = (mla_layer_terms if mla else mamba_layer_terms)(model, 16, 2, t=t, sp=int(sp),
                                                            elem_bytes=e, device="cpu")
    return float(got[rc or "none"]), {k: float(v) for k, v in terms.items()}, model


@pytest.fixture(scope="module")
def family_measured() -> dict:
    """Every MLA / Mamba case measured once (the t = 2 ones in one fake 2-rank world)."""
    torch.set_num_threads(1)
    out = {}
    for world in (1, 2):
        with fake_world(world):
            for case in FAMILY_CASES:
                if case[1] == world:
                    name, t, sp, rc, dt = case
                    out[case] = layer_saved_bytes(_family_bytes(case)[2], 16, 2, tp=t, sp=sp,
                                                  recompute=rc, dtype=dt)
    return out


@pytest.mark.parametrize("case", FAMILY_CASES, ids=lambda c: f"{c[0]}-t{c[1]}"
                         f"{'-sp' if c[2] else ''}-{c[3]}-{str(c[4])[6:]}")
def test_mla_and_mamba_formula_equals_saved_bytes(family_measured, case):
    """:func:`mla_layer_bytes` / :func:`mamba_layer_bytes` (CPU form) equal what loom's MLA
    layer (low-rank and full queries, latent norms or none, YaRN's scaled queries) and Mamba-2
    layer (groups 2 and 1, one and two chunks) save, byte for byte."""
    assert _family_bytes(case)[0] == family_measured[case]


def test_every_mla_and_mamba_term_is_needed(family_measured):
    """For each named MLA and Mamba term, a case where it is non-zero and the formula without
    it is wrong."""
    needed, names = set(), set()
    for case in FAMILY_CASES:
        total, terms, _ = _family_bytes(case)
        prefix = "mla:" if case[0].startswith("mla") else "mamba:"
        names |= {prefix + k for k in terms if k != "dropout_masks"}  # no dropout here
        if case[3] == "full":
            continue
        needed |= {prefix + k for k, v in terms.items()
                   if v and total - v != family_measured[case]}
    assert needed == names, names - needed


def test_planner_counts_loom_mla_and_mamba_layers_when_asked():
    """``Options(layer_memory="loom")``: the planner's per-layer bytes of an MLA layer are
    :func:`mla_layer_bytes`' CUDA form (KOR's count on CP rows, whose MLA form is not
    derived), of a hybrid stack's Mamba layer :func:`mamba_layer_bytes`', and its attention
    and MLP layers add up to loom's dense layer; ``"kor"`` keeps the planner's own counts."""
    import numpy as np
    from loom.planner.layer_bytes import mamba_layer_bytes, mla_layer_bytes
    from loom.planner.layout import Options, make_layouts
    from loom.planner.memory import layer_activation_kinds
    loom, kor = Options(flash_attention=True, layer_memory="loom"), Options(flash_attention=True)
    rows = [dict(tp=t, sp=sp, cp=1, mbs=2, recompute=rc) for t, sp in ((1, 0), (2, 0), (2, 1))
            for rc in ("none", "selective")]
    L = make_layouts(rows)
    mla = resolve(_mla(**YARN), 16)
    got = layer_activation_kinds(mla, 16, L, loom)[0][0]
    for i, r in enumerate(rows):
        want = mla_layer_bytes(mla, 16, 2, t=r["tp"], sp=r["sp"])[r["recompute"]]
        assert float(got[i]) == pytest.approx(float(want), rel=1e-12), r
    Lc = make_layouts([dict(tp=1, sp=0, cp=2, mbs=2, recompute="none")])
    assert float(layer_activation_kinds(mla, 16, Lc, loom)[0][0][0]) == \
        float(layer_activation_kinds(mla, 16, Lc, kor)[0][0][0])
    hybrid = resolve(_mamba(hybrid_override_pattern="M*-M", ffn_hidden_size=48,
                            num_query_groups=2), 16)
    mine = layer_activation_kinds(hybrid, 16, L, loom)[0]  # kinds M, *, -
    theirs = layer_activation_kinds(hybrid, 16, L, kor)[0]
    for i, r in enumerate(rows):
        want = mamba_layer_bytes(hybrid, 16, 2, t=r["tp"], sp=r["sp"])[r["recompute"]]
        assert float(mine[0][i]) == pytest.approx(float(want), rel=1e-12), r
        dense = loom_layer_bytes(hybrid, 16, 2, t=r["tp"], sp=r["sp"])[r["recompute"]]
        assert float(mine[1][i] + mine[2][i]) == pytest.approx(float(dense), rel=1e-12), r
    assert np.all(mine[0] > theirs[0])  # loom's plain-PyTorch scan keeps more than the count
