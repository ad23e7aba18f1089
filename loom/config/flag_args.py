"""argparse from the Megatron flag table (:mod:`loom.config.flag_table`): the Megatron-only
flags (no effect, refused) parsed exactly as Megatron parses them (its spellings, nargs, type
and choices, from the snapshot), their values collected by :func:`megatron_given`, and
``--help`` / ``--help-all``: ``--help`` shows the common flags first, then loom's sections;
``--help-all`` also shows the no-effect flags by reason and the refused ones by capability.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any, Callable, Mapping, Optional

from loom.config.flag_kinds import IMPLEMENTED, NO_EFFECT, NO_EFFECT_KIND, REFUSED
from loom.config.flag_table import (ACCEPTED_PARSERS, MegatronFlag, megatron_flags,
                                    removed_values, table)

DEST_PREFIX = "megatron:"
"""argparse dest of a Megatron-only flag: this prefix and its first spelling."""

COMMON = ("model_type", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
          "group_query_attention", "num_query_groups", "seq_length", "max_position_embeddings",
          "vocab_size", "normalization", "position_embedding_type", "swiglu",
          "untie_embeddings_and_output_weights", "disable_bias_linear", "num_experts",
          "moe_router_topk", "tensor_model_parallel_size", "pipeline_model_parallel_size",
          "context_parallel_size", "sequence_parallel", "expert_model_parallel_size",
          "num_layers_per_virtual_pipeline_stage", "micro_batch_size", "global_batch_size",
          "train_iters", "lr", "min_lr", "lr_warmup_iters", "lr_decay_style", "weight_decay",
          "clip_grad", "bf16", "use_distributed_optimizer", "recompute_granularity", "seed",
          "data_path", "split", "tokenizer_type", "mock_data", "log_interval", "eval_interval",
          "eval_iters", "tensorboard_dir", "save", "load", "save_interval")
"""The ~40 flags ``--help`` lists first (loom config fields)."""


class _Switch(argparse.Action):
    """A Megatron flag without a value: stores what Megatron's dest gets for the spelling
    given (store_true: True, store_false: False, ``--no-x`` of a BooleanOptionalAction:
    False)."""

    def __init__(self, option_strings, dest, values_by_spelling=None, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)
        self.values_by_spelling = values_by_spelling or {}

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.values_by_spelling.get(option_string, True))


def _converter(mf: MegatronFlag) -> Callable[[str], Any]:
    kind = {"int": int, "float": float}.get(mf.type, str)

    def convert(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    convert.__name__ = kind.__name__
    return convert


def help_text(mf: MegatronFlag, row) -> str:
    """The ``--help-all`` line of a Megatron-only flag: its row's reason (and note)."""
    text = ("no effect: " + NO_EFFECT[row.category]) if row.kind == NO_EFFECT_KIND \
        else "refused: " + row.why()
    if row.refuse:
        text += "; refused: " + ", ".join(str(v) for v in row.refuse)
    return (text + (f"; {row.note}" if row.note else "")).replace("%", "%%")


def _specs(rows: Mapping, parsers: tuple) -> tuple:
    """``(group title, group description, spellings, action class, kwargs, --help-all text)``
    of every no-effect or refused row of ``rows`` among the snapshot's ``parsers``."""
    out = []
    for mf in megatron_flags(parsers):
        row = rows.get(mf.name)
        if row is None or row.kind == IMPLEMENTED:
            continue
        title = (f"no effect in loom: {row.category}" if row.kind == NO_EFFECT_KIND
                 else f"refused: {row.category}")
        described = NO_EFFECT.get(row.category) or REFUSED.get(row.category)
        kwargs: dict = {"dest": DEST_PREFIX + mf.name, "default": None,
                        "help": argparse.SUPPRESS}
        if not mf.takes_value:
            off = mf.action == "storefalse"
            kwargs.update(values_by_spelling={
                s: (not s.startswith("--no-")) if mf.action == "booleanoptional" else not off
                for s in mf.flags})
        else:
            choices = mf.choice_values  # and the values earlier releases offered
            if choices is not None:
                choices += tuple(v for v in removed_values().get(mf.name, ()) if v not in choices)
            kwargs.update(nargs=mf.nargs, type=_converter(mf), choices=choices,
                          metavar=mf.dest.upper())
        cls = _Switch if not mf.takes_value else argparse._StoreAction
        out.append((title, described, mf.flags, cls, kwargs, help_text(mf, row)))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _training_specs() -> tuple:
    return _specs(table(), ACCEPTED_PARSERS)


def add_megatron_only_arguments(parser: argparse.ArgumentParser, rows: Optional[Mapping] = None,
                                parsers: tuple = ACCEPTED_PARSERS) -> None:
    """One argparse action per no-effect or refused row (of ``rows``, default the training
    table, among the snapshot's ``parsers``), with every Megatron spelling the parser does not
    have yet; hidden from ``--help`` (``--help-all`` shows them, grouped by reason or
    capability)."""
    groups: dict = {}
    have = parser._option_string_actions
    specs = _training_specs() if rows is None else _specs(rows, parsers)
    for title, described, flags, cls, kwargs, text in specs:
        spellings = [s for s in flags if s not in have]
        if not spellings:
            continue
        if title not in groups:
            groups[title] = parser.add_argument_group(title)
            groups[title].loom_description = described
        action = cls(spellings, **kwargs)  # what add_argument builds, without re-deriving
        action.loom_help = text            # names and dashes per parser (900 flags, each run)
        groups[title]._add_action(action)


def megatron_given(args: argparse.Namespace) -> dict:
    """``{first spelling: value}`` of the Megatron-only flags given (lists as tuples)."""
    out = {}
    for key, value in vars(args).items():
        if key.startswith(DEST_PREFIX) and value is not None:
            out[key[len(DEST_PREFIX):]] = tuple(value) if isinstance(value, list) else value
    return out


class _HelpAll(argparse.Action):
    """``--help-all``: ``--help`` with the Megatron flags loom accepts without effect and the
    ones it refuses, by reason."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        for action in parser._actions:
            if hasattr(action, "loom_help"):
                action.help = action.loom_help
        for group in parser._action_groups:
            if hasattr(group, "loom_description"):
                group.description = group.loom_description
        parser.print_help()
        parser.exit()


def add_help_all(parser: argparse.ArgumentParser) -> None:
    """``--help-all`` (once per parser)."""
    if "--help-all" not in parser._option_string_actions:
        parser.add_argument("--help-all", action=_HelpAll,
                            help="also list the Megatron-LM flags loom accepts without effect "
                                 "and those it refuses, with the reason of each")
