"""Megatron-LM's whole command line, declared once: every flag of Megatron-LM's ``parse_args()``
at the snapshot's commit (``loom/config/megatron_flags.json``, written by
``benchmarks/megatron_flag_snapshot.py``: each flag's spellings, dest, default, type, nargs,
choices and source ``file:line``) has exactly one row (:mod:`loom.config.flag_rows`,
:mod:`loom.config.flag_rows_other`): implemented by a loom config field, accepted without effect
for a stated reason, or refused naming what loom lacks (:mod:`loom.config.flag_kinds`). So has
every flag of Megatron-LM's earlier releases that the snapshot's commit no longer takes
(``loom/config/megatron_removed_flags.json``, ``benchmarks/megatron_removed_flags.py``; parser
``"removed"``; rows in :mod:`loom.config.flag_rows_removed`): a launch script written for an
earlier release meets the same three answers.

Everything Megatron-related reads this table: argparse (:mod:`loom.config.flag_args`), the
``--help`` groups, the start-of-run report, docs/megatron-defaults.md
(:mod:`loom.config.flag_docs`) and the tests (tests/unit/test_flag_table.py: no flag without a
row, none with two, every field default equal to Megatron's).
"""

from __future__ import annotations

import functools
import json
import os
from types import MappingProxyType
from typing import Any, Mapping, NamedTuple, Optional

from loom.config.flag_kinds import IMPLEMENTED, NO_EFFECT, NO_EFFECT_KIND, REFUSED_KIND, Row
from loom.config.flag_rows import IMPLEMENTED_ROWS, PENDING_ROWS
from loom.config.flag_rows_other import NO_EFFECT_ROWS, REFUSED_ROWS
from loom.config.flag_rows_removed import REMOVED_ROWS
from loom.errors import ConfigError

SNAPSHOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_flags.json")
REMOVED_SNAPSHOT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "megatron_removed_flags.json")
TRAINING_PARSERS = ("pretrain", "modelopt")
"""The snapshot's parsers a training command line takes (``parse_args()`` and the ModelOpt
``extra_args_provider`` of pretrain_gpt.py); ``inference``: the inference entry scripts'."""
REMOVED = "removed"
"""The parser of the flags earlier releases took and the snapshot's commit does not."""
ACCEPTED_PARSERS = TRAINING_PARSERS + (REMOVED,)
"""What ``loom train`` parses: the snapshot's training flags and the earlier releases'."""

ROW_PAIRS = IMPLEMENTED_ROWS + PENDING_ROWS + NO_EFFECT_ROWS + REFUSED_ROWS + REMOVED_ROWS
"""Every ``(Megatron flag, row)`` of the table, in declaration order."""


class MegatronFlag(NamedTuple):
    """One argparse action of Megatron's parser, as the snapshot recorded it."""

    flags: tuple
    dest: str
    default: Any
    action: str
    type: Optional[str]
    nargs: Any
    choices: Optional[tuple]
    group: str
    source: str
    parser: str

    @property
    def name(self) -> str:
        """The first spelling (the table's key)."""
        return self.flags[0]

    @property
    def takes_value(self) -> bool:
        return self.nargs != 0

    def value_of(self, raw: Any) -> Any:
        """A snapshot value (default or choice) as loom parses it: an enum as its name, a
        list as a tuple, an unrepresentable object as None."""
        if isinstance(raw, dict):
            return raw["enum"].split(".", 1)[1] if "enum" in raw else None
        if isinstance(raw, list):
            return tuple(self.value_of(v) for v in raw)
        return raw

    @property
    def megatron_default(self) -> Any:
        return self.value_of(self.default)

    @property
    def choice_values(self) -> Optional[tuple]:
        return None if self.choices is None else tuple(self.value_of(c) for c in self.choices)


def _flags(records: list) -> tuple[MegatronFlag, ...]:
    return tuple(MegatronFlag(tuple(f["flags"]), f["dest"], f["default"], f["action"],
                              f["type"], f["nargs"], None if f["choices"] is None
                              else tuple(f["choices"]), f["group"], f["source"], f["parser"])
                 for f in records)


@functools.lru_cache(maxsize=None)
def snapshot() -> tuple[str, tuple[MegatronFlag, ...]]:
    """``(commit, flags)`` of the snapshot file."""
    with open(SNAPSHOT, encoding="utf-8") as fh:
        data = json.load(fh)
    return data["commit"], _flags(data["flags"])


@functools.lru_cache(maxsize=None)
def _removed_data() -> dict:
    with open(REMOVED_SNAPSHOT, encoding="utf-8") as fh:
        return json.load(fh)


@functools.lru_cache(maxsize=None)
def removed_snapshot() -> tuple[tuple[MegatronFlag, ...], Mapping[str, tuple]]:
    """``(flags, {first spelling: (first release, last release)})`` of the flags Megatron-LM's
    earlier releases took and the snapshot's commit does not (parser :data:`REMOVED`; each as
    the last release declaring it had it, ``source`` ``"release:file:line"``)."""
    data = _removed_data()
    return _flags(data["flags"]), MappingProxyType(
        {f["flags"][0]: tuple(f["releases"]) for f in data["flags"]})


@functools.lru_cache(maxsize=None)
def removed_values() -> Mapping[str, tuple]:
    """``{first spelling: values}``: the values earlier releases offered among the choices of
    a flag the snapshot still has, and the snapshot no longer offers (``--ckpt-format zarr``).
    Parsed (not argparse's "invalid choice"): a no-effect or refused row answers them as any
    value, an implemented row must refuse each with a reason (tests/unit/test_flag_rows_removed.py)."""
    out: dict = {}
    for v in _removed_data()["values"]:
        out[v["flag"]] = out.get(v["flag"], ()) + (v["value"],)
    return MappingProxyType(out)


def megatron_flags(parsers: tuple = TRAINING_PARSERS) -> tuple[MegatronFlag, ...]:
    """The flags of ``parsers``: the snapshot's, and the earlier releases' with
    :data:`REMOVED`."""
    return tuple(f for f in snapshot()[1] + removed_snapshot()[0] if f.parser in parsers)


@functools.lru_cache(maxsize=None)
def by_spelling() -> Mapping[str, MegatronFlag]:
    """``{any spelling: MegatronFlag}`` over the whole snapshot and the earlier releases'
    flags."""
    return MappingProxyType({o: f for f in snapshot()[1] + removed_snapshot()[0]
                             for o in f.flags})


@functools.lru_cache(maxsize=None)
def table() -> Mapping[str, Row]:
    """``{first spelling: row}`` (a flag declared twice keeps its last row; the tests refuse
    that)."""
    spell = by_spelling()
    return MappingProxyType({spell[f].name if f in spell else f: row for f, row in ROW_PAIRS})


def rows_with(extra: tuple = (), overrides: Optional[Mapping] = None) -> Mapping[str, Row]:
    """The table of a command other than ``loom train``: :func:`table`, the ``(flag, row)``
    pairs of ``extra`` (rows of the inference scripts' own flags) and ``overrides`` (``{flag:
    row}``: a row that reads otherwise for the command)."""
    spell = by_spelling()
    out = dict(table())
    out.update({spell[f].name: row for f, row in extra})
    out.update({spell[f].name: row for f, row in (overrides or {}).items()})
    return MappingProxyType(out)


def row_of(spelling: str, rows: Optional[Mapping] = None) -> tuple[Optional[MegatronFlag],
                                                                   Optional[Row]]:
    """``(MegatronFlag, Row)`` of one spelling in ``rows`` (default: :func:`table`); ``(None,
    None)`` for a flag Megatron lacks."""
    mf = by_spelling().get(spelling)
    return (mf, (table() if rows is None else rows).get(mf.name)) if mf else (None, None)


def field_of(name: str, row: Row) -> str:
    """The loom field an implemented row names (its own, or the flag's name)."""
    return row.field or name[2:].replace("-", "_")


@functools.lru_cache(maxsize=None)
def field_spellings() -> Mapping[str, tuple]:
    """``{loom field: (Megatron spellings, store_false spellings)}`` of the implemented rows:
    every spelling of the Megatron action (a flag loom adds beside the field's own), and those
    that turn a boolean off (``--bert-no-binary-head``)."""
    out: dict = {}
    for name, row in table().items():
        if row.kind != IMPLEMENTED:
            continue
        mf = by_spelling()[name]
        on, off = out.get(field_of(name, row), ((), ()))
        field_flag = "--" + field_of(name, row).replace("_", "-")
        extra = tuple(s for s in mf.flags if s != field_flag)
        if mf.action == "storefalse" and name != field_flag:
            off += extra
        else:
            on += extra
        out[field_of(name, row)] = (on, off)
    return MappingProxyType(out)


def _shown(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return " ".join(str(v) for v in value)
    return str(value)


def _given(mf: MegatronFlag, value: Any) -> str:
    """How a given value reads in a message: the flag alone for a switch, else flag value."""
    return mf.name if not mf.takes_value else f"{mf.name} {_shown(value)}"


@functools.lru_cache(maxsize=None)
def _refused_by_field() -> Mapping[str, Mapping]:
    out: dict = {}
    for name, row in table().items():
        if row.kind == IMPLEMENTED and row.refuse:
            out.setdefault(field_of(name, row), {}).update(row.refuse)
    return MappingProxyType(out)


def refused_values(field_name: str) -> tuple:
    """The Megatron values of an implemented field loom refuses (the row's ``refuse``)."""
    return tuple(_refused_by_field().get(field_name, ()))


def check_field_value(field_name: str, value: Any) -> None:
    """Refuse a Megatron value of an implemented field that loom does not take (the row's
    ``refuse``); ConfigError naming the flag, the value and the reason."""
    refuse = _refused_by_field().get(field_name)
    if refuse:
        key = value.strip() if isinstance(value, str) else value
        if key in refuse:
            raise ConfigError(f"--{field_name.replace('_', '-')} {value}: {refuse[key]}")


def resolve_megatron_only(given: Mapping[str, Any], rows: Optional[Mapping] = None) -> dict:
    """The Megatron-only flags of a command line ``{first spelling: value}`` (no-effect and
    refused rows): refuses, with a ConfigError naming the flag and the capability, a refused
    flag given another value than Megatron's default or an ``allow`` value, and a no-effect
    flag's refused values; returns the no-effect flags given a non-default value (what
    :func:`no_effect_report` names)."""
    kept = {}
    for name, value in given.items():
        mf, row = row_of(name, rows)
        if row is None or value is None:
            continue
        if value in row.refuse:
            raise ConfigError(f"{_given(mf, value)}: {row.refuse[value]}")
        if value == mf.megatron_default or (row.kind == REFUSED_KIND and value in row.allow):
            continue
        if row.kind == REFUSED_KIND:
            raise ConfigError(f"{_given(mf, value)}: {row.why()}")
        if row.kind == NO_EFFECT_KIND:
            kept[name] = value
    return kept


def no_effect_report(given: Mapping[str, Any], rows: Optional[Mapping] = None,
                     command: str = "loom") -> Optional[str]:
    """One line naming every no-effect flag of ``given`` (``{spelling: value}``, as
    :func:`resolve_megatron_only` returns) by reason, or None: what ``loom train`` prints once
    at start."""
    by_category: dict = {}
    for name, value in given.items():
        mf, row = row_of(name, rows)
        if row is None or row.kind != NO_EFFECT_KIND:
            continue
        by_category.setdefault(row.category, []).append(_given(mf, value))
    if not by_category:
        return None
    parts = [f"{', '.join(flags)} ({NO_EFFECT[cat].split(' (')[0]})"
             for cat, flags in by_category.items()]
    return f"no effect in {command} (Megatron-LM flags): " + "; ".join(parts)


def yaml_value(name: str, raw: Any) -> Any:
    """The value a YAML key of Megatron-only flag ``name`` stands for: a switch's ``true`` is
    the flag given (what argparse stores for it), ``false`` not given (None); a list a
    tuple."""
    mf = by_spelling()[name]
    if not mf.takes_value:
        return (mf.action != "storefalse") if raw is True else None
    return tuple(raw) if isinstance(raw, list) else raw


def yaml_key_flag(key: str) -> Optional[str]:
    """The Megatron-only flag a YAML key names (``transformer_impl`` -> ``--transformer-impl``),
    or None."""
    mf, row = row_of("--" + key.replace("_", "-"))
    return mf.name if row is not None and row.kind != IMPLEMENTED else None


def coverage(flags: tuple, row_pairs: tuple, field_names: set) -> dict:
    """What is wrong with a table ``row_pairs`` over Megatron's ``flags`` and loom's config
    ``field_names`` (each a sorted list, all empty for a sound table): ``missing`` (a flag
    without a row), ``twice`` (a flag with two rows, or a no-effect / refused row for a flag a
    config field also declares), ``unknown`` (a row for a flag Megatron lacks) and
    ``no_field`` (an implemented row naming no config field)."""
    spell = {s: f.name for f in flags for s in f.flags}
    counts: dict = {}
    unknown, no_field = [], []
    for name, row in row_pairs:
        if name not in spell:
            unknown.append(name)
            continue
        counts[spell[name]] = counts.get(spell[name], 0) + 1
        if row.kind == IMPLEMENTED and field_of(name, row) not in field_names:
            no_field.append(name)
    for f in flags:  # a field named like a no-effect / refused flag declares it a second time
        row = dict(row_pairs).get(f.name)
        if row is not None and row.kind != IMPLEMENTED and any(
                s[2:].replace("-", "_") in field_names for s in f.flags):
            counts[f.name] = counts.get(f.name, 0) + 1
    return {"missing": sorted(f.name for f in flags if f.name not in counts),
            "twice": sorted(n for n, c in counts.items() if c > 1),
            "unknown": sorted(unknown), "no_field": sorted(no_field)}
