"""The flags of Megatron-LM's derivatives are refused with what they are and loom's fix
(loom/config/foreign_flags.py): none is a flag of any Megatron-LM release, every loom flag a fix
names exists, and Megatron-DeepSpeed's parser (f4157be) is covered whole."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from loom.cli import main
from loom.config.foreign_flags import FOREIGN, foreign_fix

CONFIG = Path(__file__).resolve().parents[2] / "loom" / "config"
# microsoft/Megatron-DeepSpeed f4157be megatron/arguments.py: its flags that no Megatron-LM
# release declares (--zero-stage is loom's own, with DeepSpeed's meaning)
DEEPSPEED = """
--mlp-type --topk --expert-interval --num-key-value-heads --rotary-position-embeddings-theta
--disable-mem-efficient-ln --num-experts-switch --kill-switch-file
--log-optimizer-states-to-tensorboard --enable-zbh1-pipeline --enable-zbh1-exact-semantics
--train-tokens --random-ltd --disable-moe-token-dropping --moe-train-capacity-factor
--moe-eval-capacity-factor --moe-min-capacity --moe-loss-coeff --create-moe-param-group
--disable-moe-top2-2nd-expert-sampling --use-flash-attn-v2 --use-flash-attn-triton
--use-flash-attn-builder --ds-inference --cpu-optimizer --cpu_torch_adam --ds_fused_adam
--no-pipeline-parallel --use-tutel --inference --ds-sequence-parallel-size
--force-ds-sequence-parallel --ds-sequence-parallel-fpdt --ds-sequence-parallel-fpdt-chunk-size
--ds-sequence-parallel-fpdt-offloading --use-dataset-only --lr-decay-tokens --lr-warmup-tokens
--load-tag --no-load-lr-state --universal-checkpoint --enable-expert-tensor-parallelism
--moe-expert-parallel-size --aml-data-download-path --train-data-exact-num-epochs
--return-data-index --data-efficiency-curriculum-learning --train-idx-path --train-desc-path
--train-doc-idx-path --train-sample-idx-path --train-shuffle-idx-path --repeated-dataloader
--zero-reduce-scatter --zero-contigious-gradients --remote-device --use-pin-memory
--deepspeed-activation-checkpointing --partition-activations --contigious-checkpointing
--checkpoint-in-cpu --synchronize-each-layer --profile-backward --num-layers-teacher
--num-experts-teacher --hidden-size-teacher --num-attention-heads-teacher --mos --kd
--kd-alpha-ce --kd-beta-ce --kd-temp --reset-iteration --load-teacher
--memory-centric-tiled-linear --profile_steps --scattered-embeddings --split-transformers
--tile-factor --zero-allgather-bucket-size --zero-reduce-bucket-size
--deepspeed --deepspeed_config --deepscale --deepscale_config --deepspeed_mpi
""".split()


def _train_flags() -> set:
    from loom.training.cli import add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return set(parser._option_string_actions)


def test_no_foreign_flag_is_megatron_lms_or_looms_and_every_fix_exists():
    megatron = {f for name in ("megatron_flags.json", "megatron_removed_flags.json")
                for row in json.loads((CONFIG / name).read_text())["flags"]
                for f in row["flags"]}
    loom = _train_flags()
    assert not set(FOREIGN) & megatron and not set(FOREIGN) & loom
    assert set(DEEPSPEED) <= set(FOREIGN), sorted(set(DEEPSPEED) - set(FOREIGN))
    assert "--zero-stage" in loom  # DeepSpeed's ZeRO stage is loom's flag of that name
    for flag, (origin, fix) in FOREIGN.items():
        named = set(re.findall(r"--[a-z0-9-]+", fix))
        assert named <= loom, (flag, named - loom)


def test_a_megatron_deepspeed_script_is_refused_with_each_fix(capsys):
    """argonne-lcf/Megatron-DeepSpeed's GPT-3 MoE script's flags (shortened): one line each,
    origin and fix, exit status 2, nothing started; an underscore spelling of a foreign flag
    (Megatron-LLM's ``--use_rms_norm``) is found; a plain unknown flag stays "not supported"."""
    argv = ["train", "--dry-run", "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1",
            "--lr", "1e-3", "--mock-data", "--vocab-size", "96", "--train-iters", "2",
            "--deepspeed", "--deepspeed_config", "ds_config.json", "--zero-stage", "1",
            "--train-tokens", "300000000000", "--lr-decay-tokens", "300000000000",
            "--moe-expert-parallel-size", "2", "--moe-loss-coeff", "0.01",
            "--use_rms_norm", "--moe-top-k", "2", "--frobnicate"]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    for line in ("--deepspeed: Megatron-DeepSpeed's flag; loom is the "
                 "training engine itself",
                 "--deepspeed_config: Megatron-DeepSpeed's flag; loom reads no DeepSpeed JSON",
                 "--train-tokens: Megatron-DeepSpeed's flag; give the length "
                 "in samples: --train-samples TOKENS/--seq-length",
                 "--moe-expert-parallel-size: Megatron-DeepSpeed's flag; "
                 "--expert-model-parallel-size",
                 "--use_rms_norm: Megatron-LLM's flag; --normalization RMSNorm",
                 "--moe-top-k: megablocks' flag; --moe-router-topk",
                 "--frobnicate: not supported by loom"):
        assert line in err, line
    assert "--zero-stage" not in err.split("error:")[1].split("\n")[0]
    assert foreign_fix("--hidden-size") is None
