"""``loom evaluate --lm-eval-tasks NAMES``: lm-evaluation-harness tasks scored by the loom
checkpoint itself, at any ``--tensor-model-parallel-size`` x ``--pipeline-model-parallel-size``
(the remaining ranks split the windows as data-parallel replicas), without exporting.

:class:`LoomLM` is lm-eval's ``TemplateLM`` over loom's evaluation runner: lm-eval turns each
task into requests (its own prompts, splits and metrics); loom tokenizes them with the
checkpoint's tokenizer and scores every ``(context, continuation)`` as one window of
``--seq-length`` tokens (the last ``seq_length + 1`` tokens of context + continuation, as
``HFLM`` truncates), continuation positions masked in, through
:func:`~loom.evaluation.runner.score_each`: per window the log-likelihood of the continuation
and whether it is the greedy one. Rolling log-likelihoods (perplexity tasks) use lm-eval's own
windows (``get_rolling_token_windows``, context 1). The prefix token of an empty context is the
end-of-document token, the BOS ``--to-hf`` names (so the numbers equal ``HFLM``'s on the
export). Every rank runs lm-eval on the same requests in the same order (the forward passes are
collective); rank 0 prints. Generation tasks (``generate_until``) are refused: export with
``--to-hf`` and use ``lm_eval --model hf``.
"""

from __future__ import annotations

import torch
from lm_eval.api.model import TemplateLM

from loom.errors import ConfigError
from loom.evaluation import causal
from loom.evaluation.datasets import make_sample
from loom.evaluation.tasks import Task


def _score(logits: torch.Tensor, batch: dict) -> dict:
    """Per window: ``logprob`` of the masked-in labels (nats) and ``greedy`` (1 when each is
    the argmax)."""
    mask = batch["loss_mask"]
    hit = (logits.argmax(-1) == batch["labels"]).float()
    return {"logprob": -(causal.token_losses(logits, batch["labels"]) * mask).sum(-1),
            "greedy": ((hit * mask).sum(-1) == mask.sum(-1)).double()}


WINDOWS = Task(name="lm-eval", stats=("logprob", "greedy"), samples=None,
               forward=causal.forward, score=_score, report=None)


class LoomLM(TemplateLM):
    """lm-eval's model interface over one loaded :class:`~loom.evaluation.runner.EvalModel`
    and its tokenizer; ``micro_batch``: windows per forward pass."""

    def __init__(self, model, tokenizer, micro_batch: int):
        super().__init__()
        self.model, self.tok, self.micro_batch = model, tokenizer, micro_batch
        self.seq_length = model.cfg.model.seq_length

    @property
    def eot_token_id(self) -> int:
        return self.tok.eod

    @property
    def max_length(self) -> int:
        return self.seq_length

    def tok_encode(self, string: str, add_special_tokens=None, **kwargs) -> list[int]:
        return self.tok.encode(string)

    def _window(self, context: list, continuation: list):
        ids = (context + continuation)[-(self.seq_length + 1):]
        n = len(ids) - 1  # predictions in the window
        mask = [0] * self.seq_length
        for i in range(n - len(continuation), n):
            mask[i] = 1
        return make_sample(ids + [self.tok.eod] * (self.seq_length + 1 - len(ids)), mask)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        from loom.evaluation.runner import score_each
        samples = [self._window(ctx, cont) for _, ctx, cont in requests]
        if not samples:
            return []
        table = score_each(self.model, WINDOWS, samples, self.micro_batch).tolist()
        return [(logprob, bool(greedy)) for logprob, greedy in table]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
        windows, owner = [], []
        for k, (text,) in enumerate(req.args for req in requests):
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.seq_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[k] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise ConfigError("--lm-eval-tasks scores log-likelihood tasks only; for generation "
                          "tasks export with `loom checkpoint convert --to-hf` and run "
                          "`lm_eval --model hf`")


def run_tasks(model, tokenizer, args, manager) -> dict:
    """lm-eval's ``simple_evaluate`` of ``args.lm_eval_tasks`` (comma-separated names, found by
    lm-eval's TaskManager ``manager``; ``args.lm_eval_limit`` documents per task) on
    ``model``: lm-eval's results dict (``results``, ``versions``, ``n-shot``, ...)."""
    import lm_eval
    names = [t.strip() for t in args.lm_eval_tasks.split(",") if t.strip()]
    lm = LoomLM(model, tokenizer, args.micro_batch_size)
    return lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager,
                                   limit=args.lm_eval_limit, log_samples=False)
