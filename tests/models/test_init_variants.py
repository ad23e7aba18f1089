"""``--embedding-init-method-std`` and ``--init-method-xavier-uniform`` (:mod:`loom.config.
model_variants`, :func:`loom.models.init.linear_inits`) against Megatron-Core's
``TransformerConfig`` and ``torch.nn.init``.

Megatron-Core resolves its ``embedding_init_method`` from ``init_method`` and the two stds
(``TransformerConfig.__post_init__``); loom's choice of the embeddings' initializer must agree
in each case, and draw the same numbers as Megatron's initializer from the same generator
state. Xavier: every weight of the built model is ``torch.nn.init.xavier_uniform_`` of the full
matrix (the fused ``[Q; K; V]`` and SwiGLU ``[gate; up]`` rows count as one matrix, as in
Megatron's single projection), from the same generator; the built tensors reach the bound and
stay within it.
"""

from __future__ import annotations

import math

import pytest
import torch

from loom.models import get_family
from loom.models.init import linear_inits
from loom.parallel.mesh import ParallelMesh
from loom.parallel.parallelize import build_model
from loom.parallel.registry import param_seed
from testkit.config import tiny_config, tiny_model


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("xavier,emb_std", [(False, None), (False, 0.5), (True, None),
                                            (True, 0.02), (True, 0.5)])
def test_embedding_init_follows_megatron_core(xavier, emb_std):
    """Megatron's embeddings take ``init_method`` (Xavier) unless a different std is given,
    else N(0, std^2); the draws equal Megatron's initializer's on the same RNG state."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    ref = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                            init_method_std=0.02, embedding_init_method_std=emb_std,
                            init_method=torch.nn.init.xavier_uniform_ if xavier else None)
    cfg = tiny_model("llama", init_method_xavier_uniform=xavier,
                     embedding_init_method_std=emb_std)
    assert (cfg.embedding_std is None) == (ref.embedding_init_method is ref.init_method)
    shape = (100, 32)
    torch.manual_seed(11)
    want = ref.embedding_init_method(torch.empty(shape))
    got = linear_inits(cfg).embedding(shape, _gen(11))
    assert torch.equal(got, want)
    if not xavier:  # the other weights keep --init-method-std (and Megatron's hidden init)
        torch.manual_seed(12)
        assert torch.equal(linear_inits(cfg).hidden(shape, _gen(12)),
                           ref.init_method(torch.empty(shape)))


def _built(**kw):
    cfg = tiny_model("llama", vocab_size=600, hidden_size=64, **kw)
    model = build_model(get_family("gpt"), cfg, ParallelMesh.single(), seed=5)
    return cfg, model.requires_grad_(False)


def test_embedding_std_in_the_built_models():
    """Word and position tables at the embedding std; QKV, the output projections and an
    untied output layer (Megatron's ``init_method``) keep ``--init-method-std``; under muP the
    untied output layer follows the embeddings (Megatron's GPTModel). The padded rows stay
    zero."""
    cfg, model = _built(embedding_init_method_std=0.5)
    word = model.embedding.word_embeddings.weight
    assert abs(float(word[:600].std()) - 0.5) < 0.02 and not word[600:].any()
    assert abs(float(model.output_layer.weight[:600].std()) - 0.02) < 0.002
    assert abs(float(model.layers["0"].self_attention.linear_qkv.weight.std()) - 0.02) < 0.002
    scaled = 0.02 / math.sqrt(2 * cfg.num_layers)
    assert abs(float(model.layers["1"].mlp.linear_fc2.weight.std()) - scaled) < 0.001
    _, mup = _built(embedding_init_method_std=0.5, use_mup=True, mup_base_hidden_size=32)
    assert abs(float(mup.output_layer.weight[:600].std()) - 0.5) < 0.02
    cfg = tiny_model("gpt", vocab_size=600, embedding_init_method_std=0.5, seq_length=512)
    positions = build_model(get_family("gpt"), cfg, ParallelMesh.single(), seed=5) \
        .embedding.position_embeddings.weight.detach()
    assert abs(float(positions.std()) - 0.5) < 0.02


def test_xavier_uniform_is_torchs_on_the_full_matrices():
    """Every weight matrix of a GQA / SwiGLU / untied LLaMA: loom's initializer equals
    ``torch.nn.init.xavier_uniform_`` on the full shape (the vocabulary's true rows) from the
    generator loom seeds by the parameter's name; the built weights reach the bound
    ``sqrt(6 / (fan_in + fan_out))`` and stay within it."""
    cfg, model = _built(init_method_xavier_uniform=True)
    init = get_family("gpt").init(cfg)
    checked = 0
    for name, p in model.named_parameters():
        if p.ndim < 2:
            continue
        rows = cfg.vocab_size if "word_embeddings" in name or "output_layer" in name \
            else p.shape[0]
        want = torch.nn.init.xavier_uniform_(torch.empty(rows, p.shape[1]),
                                             generator=_gen(param_seed(5, name)))
        got = init(name)(tuple(p.shape), _gen(param_seed(5, name)))
        assert torch.equal(got[:rows], want) and not got[rows:].any(), name
        assert torch.equal(p.detach(), got), name  # what the built model holds
        bound = math.sqrt(6.0 / (rows + p.shape[1]))
        assert 0.95 * bound < float(p.abs().max()) <= bound, name
        checked += 1
    assert checked == 2 + 4 * cfg.num_layers  # embedding, output layer, qkv/proj/fc1/fc2 each
    qkv = model.layers["0"].self_attention.linear_qkv.weight  # fans of the fused rows
    assert qkv.shape == ((4 + 2 * 2) * 16, 64)


def test_xavier_needs_a_matrix():
    with pytest.raises(ValueError, match="needs a matrix"):
        linear_inits(tiny_model("gpt", init_method_xavier_uniform=True)).hidden((8,), _gen(0))


@pytest.mark.parametrize("family,kw", [("gpt", dict(model_type="bert")),
                                       ("mamba", dict(padded_vocab_size=640)),
                                       ("gpt", dict(model_type="gemma3"))])
def test_embedding_std_in_the_other_families(family, kw):
    """BERT (word, position and token-type tables), Mamba and Gemma 3 take the embedding std
    too (Megatron's BertModel and MambaModel read the same ``embedding_init_method``); their
    other weights keep ``--init-method-std``."""
    cfg = tiny_config(family, world=1, vocab_size=600, embedding_init_method_std=0.5,
                      **kw).model
    model = build_model(get_family(cfg.model_type), cfg, ParallelMesh.single(), seed=5)
    tables = 0
    for name, p in model.requires_grad_(False).named_parameters():
        if "embeddings" in name:
            assert abs(float(p[:600].std()) - 0.5) < 0.1, name  # 2 x 32 token-type entries
            tables += 1
        elif name.endswith("linear_qkv.weight") or name.endswith("in_proj.weight"):
            assert abs(float(p.std()) - 0.02) < 0.003, name
    assert tables == (3 if cfg.model_type == "bert" else 1)


@pytest.mark.parametrize("pattern", [None, "M*-M*-"])
def test_output_projection_std_of_a_hybrid_stack_is_megatron_cores(pattern):
    """Megatron sets ``is_hybrid_model`` from the hybrid pattern, and its output projections
    then draw N(0, sigma^2 / L) instead of sigma^2 / (2 L) (``TransformerConfig``'s
    ``output_layer_init_method``): the same numbers as loom's from the same generator."""
    from megatron.core.transformer.transformer_config import TransformerConfig
    cfg = tiny_model("mamba", hybrid_override_pattern=pattern)
    ref = TransformerConfig(num_layers=cfg.num_layers, hidden_size=32, num_attention_heads=4,
                            init_method_std=0.02, is_hybrid_model=pattern is not None)
    want = torch.empty(64, 32)
    torch.manual_seed(0)
    ref.output_layer_init_method(want)
    torch.manual_seed(0)
    got = torch.empty(64, 32).normal_(0.0, 1.0)
    std = (want / got).mean().item()  # the same standard normal draws, scaled
    assert std == pytest.approx(0.02 / math.sqrt((1 if pattern else 2) * cfg.num_layers),
                                rel=1e-5)
    g = linear_inits(cfg).output((4000, 32), _gen(1))
    assert g.std().item() == pytest.approx(std, rel=0.03)
