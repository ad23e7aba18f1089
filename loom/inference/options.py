"""``loom generate``'s flags, declared once: its own options (Megatron-LM's inference flags with
their names and defaults, ``megatron/inference/utils.py``, and loom's earlier spellings), the
config fields it uses (``--load``, ``--ckpt-step``, ``--tensor-model-parallel-size``,
``--seed``), and a row for each other flag of Megatron's inference scripts (the snapshot's
``inference`` parser): accepted without effect, or refused naming what loom lacks. Every flag of
Megatron's training command line is taken too (an inference script's command line holds them):
the model's shape is checked against the checkpoint (taken from it with
``--use-checkpoint-args``), the rest has no effect on generation and is said once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from loom.config.fields import opt
from loom.config.flag_kinds import no_effect, refused, words


@dataclass
class GenerateOptions:
    """What to generate from (Megatron's inference flags)."""

    prompts: Optional[str] = opt(None, "prompts to continue, each one word (quote it)",
                                 many=True, spellings=("--prompt",), metavar="TEXT")
    prompt_file: Optional[str] = opt(None, "a .jsonl file of prompts, the \"text\" field of "
                                           "each line (instead of --prompts)")
    prompt_file_num_truncate: Optional[int] = opt(None, "the first N prompts of "
                                                        "--prompt-file only", ge=1)
    num_tokens_to_generate: int = opt(30, "tokens to generate after each prompt",
                                      ge=1, spellings=("--max-new-tokens",))
    temperature: float = opt(1.0, "divide the logits by this before sampling", gt=0)
    top_k: int = opt(1, "sample among the k most likely tokens; 1 = greedy (Megatron's "
                        "default), 0 = all", ge=0, spellings=("--top_k",))
    top_p: float = opt(0.0, "nucleus sampling: the smallest set of tokens with this much "
                            "probability, in [0, 1]; 0 = off", ge=0, spellings=("--top_p",))
    greedy: bool = opt(False, "take the most likely token (= --top-k 1)")
    termination_id: Optional[int] = opt(None, "token id that ends a generation (default: the "
                                              "tokenizer's end of document; -1: none)")
    return_log_probs: bool = opt(False, "with --output-path: the log-probability of each "
                                        "prompt and generated token")
    top_n_logprobs: int = opt(0, "with --output-path: the N most likely tokens and their "
                                 "log-probabilities at each generated position", ge=0)
    stop_words: Optional[str] = opt(None, "end a generation at the first of these words "
                                          "(each one word; quote it)", many=True,
                                    metavar="WORD")
    output_path: Optional[str] = opt(None, "write the generations as JSON here")
    output_every_n_results: int = opt(1, "with --output-path: write every N-th result only",
                                      ge=1)


USED_FIELDS = ("load", "ckpt_step", "tensor_model_parallel_size", "seed")
"""Config fields ``loom generate`` uses (the checkpoint's config gives the model)."""

INFERENCE_ROWS = (
    *((f, no_effect("inference_engine")) for f in words("""
        --incoming-requests-per-step --incoming-requests-per-sec --incoming-requests-duration
        --skip-prompt-log-probs --no-record-throughput --suspend-resume-interval
        --suspend-timeout --inference-repeat-n --throughput-check-only --drain-between-batches
        --batch-boundaries --max-batch-size --stream --async-mode""")),
    ("--use-flashinfer-fused-rope", no_effect("kernel")),
    ("--inference-ckpt-non-strict", no_effect("ckpt_io")),
    ("--model-provider", no_effect("internal", note="loom reads the model family from the "
                                                    "checkpoint")),
    ("--num-tokens-to-prompt", refused("inference", "synthetic prompts of random length")),
    ("--num-tokens-from-file", refused("inference", "per-prompt generation lengths")),
    ("--output-request-events", refused("extra_logs", "request event log")),
    ("--coordinator-schedule-output-path", refused("extra_logs", "coordinator schedule log")),
    ("--moe-routing-trace-max-inference-steps", refused("dumps")),
    *((f, no_effect("inference_engine")) for f in words(  # the same generations, served
        "--use-coordinator --coordinator-host --coordinator-port")),
)
"""Rows of the inference scripts' own flags loom generate does not implement."""

GENERATE_OVERRIDES = {  # rows of training's table that read otherwise for generation
    "--transformer-impl": no_effect("kernel"),  # inference_optimized: a kernel choice here
    "--moe-enable-routing-replay": no_effect("inference_engine"),  # recorded for RL training
    "--rl-kv-cache-management-mode": no_effect("inference_engine"),  # a suspended engine's
    "--rl-persist-cuda-graphs": no_effect("inference_engine"),       # memory
}
