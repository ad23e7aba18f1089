"""``loom checkpoint convert``: a model trained in loom leaves as Hugging Face safetensors that
``transformers`` loads with the same logits (GPT2LMHeadModel, LlamaForCausalLM), and comes back
(``--from-hf``) with identical weights: loom -> HF -> loom gives identical logits."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from loom.cli import main  # noqa: E402

COMMON = ["train",  # pinned: loom's defaults before Megatron's (issue 21)
         "--lr", "3e-4", "--adam-beta2", "0.95", "--lr-decay-style", "cosine", "--log-interval",
         "10", "--eval-iters", "10", "--mock-data", "--vocab-size", "100", "--num-layers", "2", "--hidden-size",
          "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
          "--train-iters", "2", "--no-progress-bar", "--hidden-dropout", "0",
          "--attention-dropout", "0"]
LAYOUTS = {"gpt2": [], "llama": ["--normalization", "RMSNorm", "--position-embedding-type", "rope",
                                 "--swiglu", "--num-query-groups", "2",
                                 "--untie-embeddings-and-output-weights", "--disable-bias-linear"]}


def cli(argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0


def loom_logits(ckpt_dir, ids) -> torch.Tensor:
    from loom.checkpoint.io import latest_checkpoint, load_model_weights, open_checkpoint, read_common
    from loom.config import LoomConfig
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    ckpt = latest_checkpoint(str(ckpt_dir))
    cfg = LoomConfig.from_flat(read_common(ckpt)["config"]).model
    mesh = ParallelMesh.single()
    model = build_model(get_family("gpt"), cfg, mesh, seed=None).eval()
    load_model_weights(open_checkpoint(ckpt), [model], mesh)
    with torch.no_grad():
        return model(ids)[..., :100]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_loom_to_hf_to_loom(tmp_path, layout):
    ck, hf, back = tmp_path / "ck", tmp_path / "hf", tmp_path / "back"
    cli(COMMON + LAYOUTS[layout] + ["--save", str(ck)])
    cli(["checkpoint", "convert", "--to-hf", str(ck), str(hf)])
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    ours = loom_logits(ck, ids)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(hf)).eval()
    with torch.no_grad():
        hf_logits = theirs(ids).logits
    assert float((hf_logits - ours).abs().max()) < 1e-5
    cli(["checkpoint", "convert", "--from-hf", str(hf), str(back)])
    assert torch.equal(loom_logits(back, ids), ours)
