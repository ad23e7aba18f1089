"""Supervised fine-tuning data: Megatron-LM's ``--sft`` with ``--tokenizer-type SFTTokenizer``
(megatron/core/tokenizers/text/libraries/sft_tokenizer.py and
megatron/training/datasets/sft_dataset.py at d98e8a6; semantics re-implemented here).

- :class:`SFTTokenizer`: a Hugging Face tokenizer (``transformers.AutoTokenizer`` over the
  local ``--tokenizer-model`` directory, no downloads) plus a prompt format
  (``--sft-tokenizer-prompt-format``): a Jinja chat template rendered by ``transformers``'
  ``apply_chat_template``, the pad id and how many assistant-prefix tokens are masked. A
  conversation becomes ``tokens`` and ``targets``: ``targets`` equal ``tokens`` on the
  assistant turns and are :data:`IGNORE_INDEX` on system, user and tool turns (each turn's
  length is that of the turn rendered alone, as Megatron measures it); format ``default``
  (the tokenizer's own template) masks nothing.
- :class:`SFTDataset`: a JSONL file, one ``{"messages": [{"role", "content"}, ...]}`` per
  line, split into train/valid/test by ``--split`` over lines (Megatron's builder), sample
  ``k`` = line ``start + k mod n`` of the part (no shuffling, as Megatron's SFTDataset). A
  sample of ``s = --seq-length``: the conversation's tokens right-truncated to ``s`` tokens
  plus one pad, or right-padded with the pad id to ``s + 1``; ``tokens = pack[:-1]``,
  ``labels = targets[1:]``, ``loss_mask`` 1 except where the label is the pad id or
  :data:`IGNORE_INDEX`, so the loss covers exactly the predictions of assistant tokens.
  Masked labels are replaced by the pad id (a valid index; their loss is multiplied by 0).

Megatron packs the conversations of one line (a new one at each ``system`` message) into one
sample with per-conversation attention (``cu_seqlens``); loom has no document-boundary
attention masking, so a line holding more than one conversation is refused (one line, exit
2). With one conversation per line the sample, the attention (causal over the conversation
and its trailing pads) and the positions (0..s-1) are Megatron's, at any context-parallel size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import torch

from loom.config.validate import SFT_PROMPT_FORMATS, check_sft
from loom.errors import ConfigError
from loom.jsonl import json_lines

IGNORE_INDEX = -100
"""Megatron's target of a token outside the loss (system, user and tool turns)."""


@dataclass(frozen=True)
class PromptFormat:
    """One ``--sft-tokenizer-prompt-format``: the chat template (None: the tokenizer's own),
    the token whose id pads (None: the tokenizer's pad, else its eos), how many tokens of each
    assistant turn are a prefix outside the loss, and whether the template masks at all."""

    template: Optional[str]
    pad_token: Optional[str]
    assistant_prefix_len: int = 0
    masks: bool = True


def _strip_think(var: str) -> str:
    return f"{var}.replace('/think', '').replace('/no_think', '').strip()"


# The formats of Megatron-LM d98e8a6 (their rendered text; written as Jinja for transformers)
PROMPT_FORMATS = {
    "nemotron-h-aligned": PromptFormat(
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'system' -%}{{ '<SPECIAL_10>System\\n' + m['content'].strip() + '\\n' }}"
        "{%- elif m['role'] == 'user' -%}"
        "{{ '<SPECIAL_11>User\\n' + m['content'].strip() + '\\n<SPECIAL_11>Assistant\\n' }}"
        "{%- elif m['role'] == 'assistant' -%}{{ m['content'].strip() + '\\n' }}"
        "{%- endif -%}{%- endfor -%}", "<SPECIAL_233>"),
    "nemotron-nano-v2": PromptFormat(
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'system' -%}{{ '<SPECIAL_10>System\\n' + "
        + _strip_think("m['content']") + " + '\\n' }}"
        "{%- elif m['role'] == 'user' -%}{{ '<SPECIAL_11>User\\n' + "
        + _strip_think("m['content']") + " + '\\n' }}"
        "{%- elif m['role'] == 'assistant' -%}"
        "{{ '<SPECIAL_11>Assistant\\n' + m['content'].strip() + '\\n<SPECIAL_12>\\n' }}"
        "{%- endif -%}{%- endfor -%}", "<unk>", assistant_prefix_len=3),
    "identity": PromptFormat("{%- for m in messages -%}{{ m['content'] }}{%- endfor -%}",
                             "<unk>"),
    "default": PromptFormat(None, None, masks=False),
}
assert tuple(PROMPT_FORMATS) == SFT_PROMPT_FORMATS


class SFTTokenizer:
    """Megatron's SFTTokenizer over the Hugging Face tokenizer directory ``path`` (local files:
    tokenizer.json and tokenizer_config.json) with prompt format ``prompt_format``.

    Attributes: ``vocab_size`` (``len`` of the tokenizer, added tokens included), ``eod`` (its
    eos id), ``pad`` (the format's pad id). Raises ConfigError naming
    ``--tokenizer-model`` / ``--sft-tokenizer-prompt-format``."""

    def __init__(self, path: Optional[str], prompt_format: str):
        check_sft(SimpleNamespace(sft=True, tokenizer_type="SFTTokenizer", mock_data=False,
                                  sft_tokenizer_prompt_format=prompt_format))
        if not path or not os.path.isdir(path):
            raise ConfigError(f"--tokenizer-type SFTTokenizer needs --tokenizer-model DIR, a "
                              f"local Hugging Face tokenizer directory (got {path})")
        import transformers
        try:
            self.hf = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--tokenizer-model {path}: not a Hugging Face tokenizer "
                              f"directory ({str(e).splitlines()[0]})") from None
        self.format_name, self.format = prompt_format, PROMPT_FORMATS[prompt_format]
        self.template = self.format.template or self.hf.chat_template
        if self.template is None:
            raise ConfigError(f"--sft-tokenizer-prompt-format default: the tokenizer "
                              f"{path} has no chat template; choose another format")
        self.vocab_size = len(self.hf)
        self.eod = self.hf.eos_token_id
        if self.format.pad_token is None:
            self.pad = self.hf.pad_token_id if self.hf.pad_token_id is not None else self.eod
        else:
            self.pad = self.hf.convert_tokens_to_ids(self.format.pad_token)
        if self.pad is None:
            raise ConfigError(f"--sft-tokenizer-prompt-format {prompt_format}: the tokenizer "
                              f"{path} has no pad token {self.format.pad_token or '(pad/eos)'}")
        self.pad = int(self.pad)

    def _ids(self, messages: list) -> list[int]:
        text = self.hf.apply_chat_template(messages, tokenize=False, chat_template=self.template)
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def tokenize_conversation(self, conversation: list) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens, targets)`` int64 of one conversation (see the module docstring). Raises
        ValueError for what :func:`conversation_error` finds, or a template whose turns do not
        tokenize apart."""
        tokens = np.asarray(self._ids(conversation), dtype=np.int64)
        targets = tokens.copy()
        if not self.format.masks:
            return tokens, targets
        at = 0
        why = conversation_error(conversation)
        if why:
            raise ValueError(why)
        for i, turn in enumerate(conversation):
            role = turn["role"].lower()
            own = self._ids([turn])
            if tokens[at:at + len(own)].tolist() != own:
                raise ValueError(f"turn {i} tokenizes differently inside the conversation")
            if role == "assistant":
                targets[at:at + self.format.assistant_prefix_len] = IGNORE_INDEX
            else:
                targets[at:at + len(own)] = IGNORE_INDEX
            at += len(own)
        if at != len(tokens):
            raise ValueError("the turns do not add up to the conversation")
        return tokens, targets


def conversation_error(conversation: list) -> Optional[str]:
    """What Megatron's SFTTokenizer refuses in a conversation (an empty assistant turn, one
    not after a user or tool turn, a role other than system, user, tool, assistant), or None."""
    for i, turn in enumerate(conversation):
        role = turn["role"].lower()
        if role == "assistant":
            if not turn["content"]:
                return f"turn {i} is an empty assistant turn"
            if i == 0 or conversation[i - 1]["role"].lower() not in ("user", "tool"):
                return f"turn {i}, an assistant turn, does not follow a user or tool turn"
        elif role not in ("system", "user", "tool"):
            return f"turn {i} has role {turn['role']!r} (system, user, tool or assistant)"
    return None


def read_conversations(path: str, flag: str = "--data-path") -> list[list[dict]]:
    """The conversations of JSONL file ``path``, one per line (blank lines skipped). Raises
    ConfigError naming ``flag``, the file and the line for a missing file, a line that is not
    JSON, lacks a ``messages`` list of ``{"role", "content"}`` objects, holds a turn Megatron
    refuses (:func:`conversation_error`) or packs more than one conversation (a second
    ``system`` message)."""
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: no such file (--sft reads a JSONL file of "
                          f"{{\"messages\": [...]}} lines)")
    out = []
    with open(path, encoding="utf-8") as f:
        for n, obj in json_lines(enumerate(f, 1), f"{flag} {path}"):
            msgs = obj.get("messages") if isinstance(obj, dict) else None
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str) for m in msgs):
                raise ConfigError(f"{flag} {path}: line {n} is not an object with a "
                                  f"\"messages\" list of {{\"role\", \"content\"}} strings")
            why = conversation_error(msgs)
            if why:
                raise ConfigError(f"{flag} {path}: line {n}: {why}")
            starts = sum(m["role"] == "system" and i > 0 for i, m in enumerate(msgs))
            if starts:
                raise ConfigError(f"{flag} {path}: line {n} packs {starts + 1} conversations "
                                  f"(a new one at each system message); loom has no "
                                  f"document-boundary attention masking: one conversation "
                                  f"per line")
            out.append(msgs)
    if not out:
        raise ConfigError(f"{flag} {path}: no conversations")
    return out


class SFTDataset:
    """Samples ``{"tokens", "labels", "loss_mask"}`` (``[s]``; int64, int64, fp32) of
    conversations ``[start, end)`` (see the module docstring); index ``k`` >= 0 wraps."""

    def __init__(self, conversations: list, document_range: tuple[int, int],
                 tokenizer: SFTTokenizer, seq_length: int):
        self.conversations = conversations
        self.start, self.end = document_range
        self.tokenizer, self.seq_length = tokenizer, int(seq_length)

    def __len__(self) -> int:
        return self.end - self.start

    def __getitem__(self, k: int) -> dict[str, torch.Tensor]:
        if k < 0:
            raise IndexError(k)
        s, pad = self.seq_length, self.tokenizer.pad
        conv = self.conversations[self.start + k % len(self)]
        try:
            tokens, targets = self.tokenizer.tokenize_conversation(conv)
        except ValueError as e:
            raise ConfigError(f"--sft: conversation {self.start + k % len(self)}: {e}") from None
        if len(tokens) >= s + 1:
            tokens = np.append(tokens[:s], pad)
            targets = np.append(targets[:s], pad)
        else:
            fill = np.full(s + 1 - len(tokens), pad, dtype=np.int64)
            tokens, targets = np.concatenate([tokens, fill]), np.concatenate([targets, fill])
        labels = torch.from_numpy(targets[1:].copy())
        mask = ((labels != pad) & (labels != IGNORE_INDEX)).float()
        return {"tokens": torch.from_numpy(tokens[:-1].copy()),
                "labels": labels.masked_fill(labels == IGNORE_INDEX, pad), "loss_mask": mask}


def sft_tokenizer(data: Any) -> SFTTokenizer:
    """The SFTTokenizer a DataConfig names."""
    return SFTTokenizer(data.tokenizer_model, data.sft_tokenizer_prompt_format)


def sft_datasets(data: Any, seq_length: int) -> tuple:
    """(train, valid, test) SFT datasets of a DataConfig (``--data-path FILE.jsonl`` split by
    ``--split``, or ``--train/valid/test-data-path`` files whole); None for an empty part."""
    from loom.data.split import split_document_ranges
    tok = sft_tokenizer(data)
    sets: list = [None, None, None]
    if data.data_path:
        paths = data.data_path.split()
        if len(paths) != 1:
            raise ConfigError(f"--sft --data-path {data.data_path}: give one JSONL file (loom "
                              f"blends no SFT datasets)")
        convs = read_conversations(paths[0])
        for i, (a, b) in enumerate(split_document_ranges(len(convs),
                                                         data.split or "969, 30, 1")):
            sets[i] = SFTDataset(convs, (a, b), tok, seq_length) if b > a else None
    for i, (flag, path) in enumerate((("--train-data-path", data.train_data_path),
                                      ("--valid-data-path", data.valid_data_path),
                                      ("--test-data-path", data.test_data_path))):
        if path:
            convs = read_conversations(path, flag)
            sets[i] = SFTDataset(convs, (0, len(convs)), tok, seq_length)
    return tuple(sets)
