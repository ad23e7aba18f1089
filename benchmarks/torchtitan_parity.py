"""loom against torchtitan's own Llama 3 code: a torchtitan model built and initialized by
torchtitan, saved as torchtitan saves it (DCP), converted with ``loom checkpoint convert
--from-torchtitan``, and both models' logits compared on the same tokens. Not a test: it needs
torchtitan's package, which loom does not depend on. Set-up (CPU, no triton)::

    pip download torchtitan==0.2.2 --no-deps -d /tmp/tt && cd /tmp/tt && \\
        unzip -q torchtitan-0.2.2-py3-none-any.whl -d src
    pip install --no-deps --target /tmp/tt/deps torchdata
    PYTHONPATH=/tmp/tt/deps python -m benchmarks.torchtitan_parity /tmp/tt/src [FLAVOR]

torchtitan's package ``__init__`` imports its whole config and quantization stack (tyro, triton
kernels); this script imports only its Llama model modules (the package's directory as a
namespace; its triton MoE kernel module, which the dense Llama does not call, stubbed).
Prints JSON: the flavor, the parameter counts, and ``max |loom - torchtitan| / max
|torchtitan|`` of the logits. Measured (2026-11-29, debugmodel, s 48, b 2): 2.7e-7, 6,163,712
parameters each.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import types
import warnings


def parity(src: str, flavor: str = "debugmodel", seq: int = 48) -> dict:
    """Build torchtitan's ``llama3`` ``flavor`` from the unpacked package at ``src``, convert
    its DCP checkpoint with loom, compare logits (module docstring)."""
    import torch
    import torch.distributed.checkpoint as dcp
    pkg = types.ModuleType("torchtitan")
    pkg.__path__ = [os.path.join(src, "torchtitan")]
    sys.modules.setdefault("torchtitan", pkg)
    kernels = types.ModuleType("torchtitan.models.moe.kernels")
    kernels.generate_permute_indices = None  # triton; MoE only
    sys.modules.setdefault("torchtitan.models.moe.kernels", kernels)
    from torchtitan.models.llama3 import llama3_args
    from torchtitan.models.llama3.model.model import Transformer

    from loom.checkpoint.convert import from_torchtitan
    from loom.checkpoint.io import latest_checkpoint, load_model_weights, open_checkpoint, \
        read_common
    from loom.config import LoomConfig
    from loom.models import get_family
    from loom.parallel.mesh import ParallelMesh
    from loom.parallel.parallelize import build_model
    args = copy.deepcopy(llama3_args[flavor])
    args.max_seq_len = seq
    torch.manual_seed(0)
    theirs = Transformer(args)
    with torch.no_grad():
        theirs.init_weights()
    theirs.eval()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP without a process group: one process
        state = {k: v.detach() for k, v in theirs.state_dict().items() if "freqs_cis" not in k}
        dcp.save(state, checkpoint_id=os.path.join(tmp, "step-1"))
        toml = os.path.join(tmp, "job.toml")
        with open(toml, "w") as fh:
            fh.write(f'[model]\nname = "llama3"\nflavor = "{flavor}"\n'
                     f'[training]\nseq_len = {seq}\n')
        from_torchtitan(os.path.join(tmp, "step-1"), os.path.join(tmp, "ck"), toml)
        path = latest_checkpoint(os.path.join(tmp, "ck"))
        cfg = LoomConfig.from_flat(read_common(path)["config"]).model
        mesh = ParallelMesh.single()
        ours = build_model(get_family(cfg.model_type), cfg, mesh, seed=None).eval()
        load_model_weights(open_checkpoint(path), [ours], mesh)
    ids = torch.randint(0, args.vocab_size, (2, seq), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = theirs(ids)
        out = ours(input_ids=ids)
    out = (out[0] if isinstance(out, tuple) else out)[..., :args.vocab_size]
    return dict(flavor=flavor, params_torchtitan=sum(p.numel() for p in theirs.parameters()),
                params_loom=sum(p.numel() for p in ours.parameters()),
                rel_err=float((out - ref).abs().max() / ref.abs().max()))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    print(json.dumps(parity(argv[0], *argv[1:2])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
