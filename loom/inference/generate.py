"""Autoregressive generation with a KV cache.

The prompt is run once (prefill), then one token at a time attends to the cached keys/values of
every earlier position. Under tensor parallelism each rank holds a vocabulary shard of the
logits; they are gathered (``[1, Vp/t] -> [1, Vp]``) and every rank samples with the same seeded
generator, so all ranks pick the same token without another collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from loom.errors import ConfigError
from loom.parallel.mappings import gather_from_tensor_parallel_region


@dataclass
class SamplingConfig:
    """``greedy`` (argmax) or sampling at ``temperature`` from the ``top_k`` most likely tokens
    (0 = all) within nucleus mass ``top_p`` (1.0 = all) (Holtzman et al. 2019)."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


def sample_next(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator) -> int:
    """One token id from ``logits [V]`` (fp32)."""
    if cfg.greedy or cfg.temperature <= 0:
        return int(logits.argmax())
    logits = logits / cfg.temperature
    if cfg.top_k > 0:
        kth = torch.topk(logits, min(cfg.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > cfg.top_p  # keep the first token past top_p
        logits = logits.index_fill(0, order[drop], float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(model, prompt_ids: Sequence[int], max_new_tokens: int,
             sampling: Optional[SamplingConfig] = None, stop_ids: Sequence[int] = (),
             logprobs: Optional[dict] = None, top_n: int = 0) -> list[int]:
    """Continue ``prompt_ids`` by up to ``max_new_tokens`` tokens; returns only the new ids.
    ``logprobs`` (a dict, filled in): ``prompt_log_probs`` (log p of each prompt token after
    the first, given the ones before) and ``generated_log_probs`` (of each new token), the
    model's raw log-softmax over the vocabulary (Megatron's ``--return-log-probs``); with
    ``top_n`` also ``top_n_logprobs``: the ``top_n`` most likely ids and their log p at each
    generated position (``--top-n-logprobs``).

    Raises ConfigError (a ValueError: ``loom generate`` prints it as one line) if the prompt
    plus the new tokens exceed ``--max-position-embeddings`` with learned positions, or if the
    model is split into pipeline stages.
    """
    if not (model.pre_process and model.post_process):
        raise ConfigError("generation needs the whole model on each rank (pipeline size 1)")
    sampling = sampling or SamplingConfig()
    cfg, mesh = model.cfg, model.mesh
    total = len(prompt_ids) + max_new_tokens
    if cfg.position_embedding_type == "learned_absolute" and total > cfg.max_positions:
        raise ConfigError(f"the prompt ({len(prompt_ids)} tokens) + --max-new-tokens "
                          f"({max_new_tokens}) exceed the model's --max-position-embeddings "
                          f"{cfg.max_positions}: shorten --prompt or lower --max-new-tokens to "
                          f"at most {max(cfg.max_positions - len(prompt_ids), 0)}")
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(sampling.seed)
    cache = model.allocate_cache(1, total)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=mesh.device)
    out: list[int] = []
    for step in range(max_new_tokens):
        logits = model(input_ids=ids, cache=cache)  # [1, s, Vp/t]
        cache.length += ids.shape[1]
        if logprobs is not None and step == 0:
            whole = gather_from_tensor_parallel_region(logits[0, :-1].float(),
                                                       mesh.groups["tp"])[:, :cfg.vocab_size]
            logprobs["prompt_log_probs"] = whole.log_softmax(-1).gather(
                1, ids[0, 1:, None]).squeeze(1).tolist()
            logprobs["generated_log_probs"] = []
        last = gather_from_tensor_parallel_region(logits[:, -1].float(), mesh.groups["tp"])
        nxt = sample_next(last[0, :cfg.vocab_size].cpu(), sampling, gen)  # never a padded id
        if logprobs is not None:
            lp = last[0, :cfg.vocab_size].log_softmax(-1)
            logprobs["generated_log_probs"].append(float(lp[nxt]))
            if top_n:
                best = torch.topk(lp, min(top_n, lp.numel()))
                logprobs.setdefault("top_n_logprobs", []).append(
                    [[int(i), float(v)] for v, i in zip(best.values, best.indices)])
        out.append(nxt)
        if nxt in stop_ids:
            break
        ids = torch.tensor([[nxt]], dtype=torch.long, device=mesh.device)
    model.train(was_training)
    return out
