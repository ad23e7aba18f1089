"""Command line and YAML: one ``--flag`` per config field, and ``--config FILE.yaml``.

Flags get their type, ``choices`` (from the field's ``Literal``) and help text from the field;
YAML values are coerced to the field's type with a message naming ``file:line`` and the key when
they cannot be, and YAML syntax errors are reported as ``file:line:column``.
"""

from __future__ import annotations

import argparse
import functools
from types import MappingProxyType
from dataclasses import MISSING, fields
from typing import Any, Callable, Mapping, Optional, get_type_hints

import yaml

from loom.config.core import LoomConfig, field_section, flag
from loom.config.flag_args import (COMMON, add_help_all, add_megatron_only_arguments,
                                   megatron_given)
from loom.config.flag_table import (check_field_value, field_spellings, refused_values,
                                    resolve_megatron_only, yaml_key_flag, yaml_value)
from loom.config.sections import GROUPS
from loom.config.validate import base_type, check_bounds, choices_of, coerce
from loom.errors import ConfigError, UnknownOptionError, did_you_mean


def field_metadata(name: str) -> dict:
    """The ``metadata`` (help, bounds, ``auto``) of config field ``name``."""
    return next(f.metadata for dc in GROUPS.values() for f in fields(dc) if f.name == name)


def _converter(hint: Any, name: str, auto: bool = False) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        if auto and text == "auto":
            return text
        try:
            return coerce(text, hint, flag(name))
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e).split(": ", 1)[-1]) from None
    convert.__name__ = base_type(hint)[0].__name__ if hasattr(base_type(hint)[0], "__name__") \
        else "value"
    return convert


# Fields that take Megatron's blend ``W1 PREFIX1 W2 PREFIX2 ...``: several words on the command
# line (or a YAML list), stored joined by spaces (see loom.data.blended.parse_blend).
BLEND_FIELDS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")


class _JoinWords(argparse.Action):
    """Store the words of an ``nargs='+'`` flag joined by single spaces."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, " ".join(str(v) for v in values))


class _OnOff(argparse.Action):
    """A boolean flag: ``--foo`` stores True, ``--no-foo`` (and Megatron's store_false spellings
    of the field, ``off``) False."""

    def __init__(self, option_strings, dest, off=(), **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)
        self.off = set(off)

    def __call__(self, parser, namespace, values, option_string=None):
        # the field's own flag turns it on (also a field named no_*: --no-load-optim)
        off = option_string != flag(self.dest) and (
            option_string in self.off or option_string == "--no-" + flag(self.dest)[2:])
        setattr(namespace, self.dest, not off)


@functools.lru_cache(maxsize=None)
def field_hints() -> Mapping[str, tuple]:
    """``{field name: (dataclass Field, type hint)}`` over every section (computed once)."""
    return MappingProxyType({f.name: (f, hints[f.name]) for dc in GROUPS.values()
                             for hints in (get_type_hints(dc),) for f in fields(dc)})


def _help(f) -> str:
    text = f.metadata.get("help", "")
    if f.default is not MISSING and f.default is not None and "default" not in text:
        text += f" (default: {f.default})"
    return text.replace("%", "%%")  # argparse %-formats help when it renders it


def _add_field(grp, parser, f, hint, hidden: bool = False) -> None:
    """The argparse action of config field ``f`` (type hint ``hint``) in group ``grp``, with
    Megatron's other spellings of it (flag table, or the field's ``spellings`` metadata) and
    the Megatron values loom refuses accepted by argparse (refused with their reason by
    :func:`config_from_args`); ``hidden``: listed by ``--help-all`` only."""
    on, off = field_spellings().get(f.name, ((), ()))
    on = (*on, *f.metadata.get("spellings", ()))
    names = [n for n in (flag(f.name), *on, *off) if n not in parser._option_string_actions]
    if flag(f.name) not in names:  # the command's own (loom plan's --zero-stage 0-3)
        return
    text = _help(f)
    kwargs: dict = {"dest": f.name, "default": None,
                    "help": argparse.SUPPRESS if hidden else text}
    choices = choices_of(hint)
    if base_type(hint)[0] is bool:
        no = "--no-" + flag(f.name)[2:]  # turns off a YAML `true`
        if not f.name.startswith("no_") and no not in parser._option_string_actions and \
                no not in names:  # (a Megatron spelling of its own: --no-yarn-correction-...)
            names.append(no)
        kwargs.update(action=_OnOff, off=off)
    elif f.name in BLEND_FIELDS or f.metadata.get("words"):
        kwargs.update(nargs="+", action=_JoinWords,
                      metavar="[W] PREFIX" if f.name in BLEND_FIELDS else "VALUE")
    elif choices is not None:
        refused = tuple(v for v in refused_values(f.name) if v not in choices)
        kwargs.update(choices=choices + refused)
        if all(type(c) is int for c in choices):  # Literal[0, 1, 2, 3]
            kwargs["type"] = int
    else:
        kwargs.update(type=_converter(hint, f.name, f.metadata.get("auto", False)),
                      metavar=f.metadata.get("metavar") or {int: "N", float: "X"}.get(
                          base_type(hint)[0], _text_metavar(f.name)))
        if f.metadata.get("many"):
            kwargs["nargs"] = "+"
    action = grp.add_argument(*names, **kwargs)
    if hidden:
        action.loom_help = text


_PATH_WORDS = ("path", "dir", "file", "load", "save", "checkpoint", "model", "timeline", "json",
               "fault", "cluster", "schedule", "cfg")


def _text_metavar(name: str) -> str:
    """``PATH`` for a text field that names a file or directory (``--save``, ``--data-path``,
    ``--tokenizer-model``, ...), else ``STR`` (``--window-size``, ``--wandb-project``, a
    pattern, a token)."""
    return "PATH" if any(w in name for w in _PATH_WORDS) else "STR"


def add_config_arguments(parser: argparse.ArgumentParser, common: tuple = COMMON,
                         shown: Optional[set] = None, config_file: bool = True) -> None:
    """Add one ``--flag`` per config field (default None = "not given"), plus ``--config``
    (``config_file``); each boolean ``--foo`` also gets ``--no-foo`` (False: turns off ``foo:
    true`` of the YAML). Every other flag of Megatron-LM's command line comes from the flag
    table (:mod:`loom.config.flag_args`): another spelling of a field, or a flag accepted
    without effect or refused (hidden from ``--help``, listed by ``--help-all``).

    ``--help`` lists the ``common`` flags first (default: training's,
    :data:`~loom.config.flag_args.COMMON`), then each section; with ``shown`` (a command that
    uses a few fields) only those, the rest behind ``--help-all``. Help texts are the fields'
    ``help`` metadata written plainly (``80%``): ``%`` is escaped here, the one place, since
    argparse %-formats help when it renders ``--help``."""
    if config_file:
        act = parser.add_argument("--torchtitan-set", action="append", default=None,
                                  metavar="SECTION.KEY=VALUE", help=argparse.SUPPRESS)
        act.loom_help = ("one torchtitan setting over a --config FILE.toml; torchtitan's "
                         "--section.key VALUE is written to it")
        parser.add_argument("--config", default=None, metavar="FILE.yaml",
                            help="YAML file of the same keys (flat, or grouped by section "
                                 "name), or a torchtitan job config (.toml); flags given on "
                                 "the command line override it")
    add_help_all(parser)
    every = field_hints()
    if common:
        grp = parser.add_argument_group("common flags")
        for name in common:
            _add_field(grp, parser, *every[name])
    for gname, dc in GROUPS.items():
        grp = parser.add_argument_group(gname, (dc.__doc__ or "").strip().splitlines()[0])
        for f in fields(dc):
            if f.name not in common:
                _add_field(grp, parser, *every[f.name],
                           hidden=shown is not None and f.name not in shown)
    add_megatron_only_arguments(parser)


def add_fields(parser: argparse.ArgumentParser, names: tuple, title: str) -> None:
    """The flags of config fields ``names`` only, in group ``title`` (a command that takes a
    few of them: ``loom evaluate``'s ``--load``, ``--seed``, ...): one declaration, the same
    help, type, bounds and Megatron spellings as ``loom train``'s."""
    grp = parser.add_argument_group(title)
    every = field_hints()
    for name in names:
        _add_field(grp, parser, *every[name])


def field_defaults(args: argparse.Namespace, names: tuple, **command: Any) -> None:
    """Fill the fields ``names`` not given in ``args`` with their declared default (``command``:
    the command's own default of a field, e.g. ``micro_batch_size=4`` where training requires
    it), and check every value against its field's bounds (ConfigError naming the flag)."""
    every = field_hints()
    for name in names:
        if getattr(args, name, None) is None:
            f = every[name][0]
            setattr(args, name, command.get(name, None if f.default is MISSING else f.default))
        check_bounds(name, getattr(args, name), every[name][0].metadata)


def add_options(parser: argparse.ArgumentParser, options: type, title: str) -> None:
    """One ``--flag`` per field of a command's options dataclass (fields declared with
    ``opt()`` as the config sections are: help, bounds, ``spellings``), in group ``title``."""
    grp = parser.add_argument_group(title)
    hints = get_type_hints(options)
    for f in fields(options):
        _add_field(grp, parser, f, hints[f.name])


def options_from_args(args: argparse.Namespace, options: type) -> Any:
    """The options dataclass of a command from its parsed flags (defaults where not given),
    each value checked against its field's type, choices and bounds; ConfigError names the
    flag (and its other spellings)."""
    hints = get_type_hints(options)
    values = {}
    for f in fields(options):
        value = getattr(args, f.name, None)
        if value is None:
            continue
        names = " / ".join((flag(f.name), *f.metadata.get("spellings", ())))
        if f.metadata.get("many"):
            value = [coerce(v, base_type(hints[f.name])[0], names) for v in value]
        else:
            value = coerce(value, hints[f.name], names)
            try:
                check_bounds(f.name, value, f.metadata)
            except ConfigError as e:
                raise ConfigError(str(e).replace(flag(f.name), names, 1)) from None
        values[f.name] = value
    return options(**values)


def _read_yaml_nodes(path: str) -> list[tuple[str, Any, int]]:
    """``[(key, value node, line)]`` of a YAML config; grouped sections are flattened."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {path}: not a UTF-8 text file") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: YAML syntax error: {what} (--config)") from None
    if root is None:
        return []
    out: list[tuple[str, Any, int]] = []

    def walk(node: Any, section: str = "") -> None:
        if not isinstance(node, yaml.MappingNode):
            raise ConfigError(f"{path}:{node.start_mark.line + 1}: --config must hold a mapping "
                              f"of flag names to values (key: value)")
        for key_node, value_node in node.value:
            key = str(key_node.value).replace("-", "_")
            line = key_node.start_mark.line + 1
            if not section and key in GROUPS and isinstance(value_node, yaml.MappingNode):
                walk(value_node, key)
            else:
                out.append((key, value_node, line))
    walk(root)
    return out


def read_yaml_config(path: str, lines: dict | None = None,
                     megatron: dict | None = None, notes: list | None = None,
                     overrides: list | None = None) -> dict:
    """Flat ``{field: value}`` of a YAML config, each value coerced to its field's type;
    ``lines`` (if given) receives ``{field: line number}``, ``megatron`` (if given) the
    Megatron-only flags of the file (``transformer_impl: local``: ``{"--transformer-impl":
    "local"}``; no effect or refused, :mod:`loom.config.flag_table`), which are otherwise
    unknown keys. A Megatron value loom refuses is refused naming ``file:line``.

    Raises ConfigError with ``file:line`` for syntax errors, repeated keys and values of the
    wrong type; UnknownOptionError (a ConfigError) for an unknown key, with at most one
    suggestion (:func:`loom.errors.closest`: a typo of a known key, else "not supported by
    loom"); ``loom`` appends "see `loom COMMAND --help`" naming the command that ran.

    A ``.toml`` file is a torchtitan job config (:mod:`loom.config.torchtitan`): read as
    torchtitan reads it, its keys answered there; ``notes`` (if given) receives what loom says
    about it at start; ``overrides``: torchtitan's ``section.key=value`` command-line
    settings over it (``--torchtitan-set``, :func:`loom.config.torchtitan.torchtitan_argv`).
    """
    from loom.config.torchtitan import is_torchtitan_config, read_torchtitan_config
    if is_torchtitan_config(path):
        return read_torchtitan_config(path, lines, notes, overrides)
    if overrides:
        raise ConfigError(f"--{overrides[0].partition('=')[0]}: torchtitan's command line "
                          f"applies to a torchtitan config: give --job.config_file FILE.toml "
                          f"(or --config FILE.toml), or loom's own flag")
    known = field_section()
    hints = {f.name: get_type_hints(dc)[f.name] for dc in GROUPS.values() for f in fields(dc)}
    constructor = yaml.SafeLoader("")
    values: dict = {}
    lines = {} if lines is None else lines
    alias = {s[2:].replace("-", "_"): (name, s in off) for name, (on, off) in
             field_spellings().items() for s in on + off}  # Megatron's other spellings
    for key, node, line in _read_yaml_nodes(path):
        if key not in known and key in alias:  # layernorm_epsilon: norm_epsilon's other name
            key, inverted = alias[key]
            if inverted:  # a --no-x spelling of a boolean field: x: true means the field off
                node = yaml.ScalarNode("tag:yaml.org,2002:bool", str(
                    not constructor.construct_object(node, deep=True)).lower())
        if key not in known and megatron is not None and yaml_key_flag(key):
            name = yaml_key_flag(key)
            megatron[name] = yaml_value(name, constructor.construct_object(node, deep=True))
            continue
        if key not in known:
            hint = did_you_mean(key, known) or ": not supported by loom"
            raise UnknownOptionError(f"{path}:{line}: unknown option {flag(key)} (key {key!r})"
                                     f"{hint}")
        if key in lines:
            raise ConfigError(f"{path}:{line}: key {key!r} given twice (first on line "
                              f"{lines[key]})")
        try:
            raw = constructor.construct_object(node, deep=True)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}:{line}: {key}: {e}") from None
        if (key in BLEND_FIELDS or field_metadata(key).get("words")) and isinstance(raw, list):
            raw = " ".join(str(w) for w in raw)
        try:
            check_field_value(key, raw)
        except ConfigError as e:
            raise ConfigError(f"{path}:{line}: {e}") from None
        auto = raw == "auto" and field_metadata(key).get("auto")
        values[key] = raw if auto else coerce(raw, hints[key], f"{path}:{line}: {key}")
        lines[key] = line
    return values


def config_from_args(args: argparse.Namespace) -> LoomConfig:
    """YAML (``--config``) first, then every flag given on the command line.

    The Megatron flags loom refuses (a refused row, or a refused value) are refused here, one
    line naming the flag and the capability; those accepted without effect are kept in
    :attr:`LoomConfig.megatron_no_effect` (reported at start, never stored). Raises ConfigError
    (file:line for YAML problems, the flag otherwise). Does not validate: call
    :meth:`LoomConfig.validate`.
    """
    values: dict = {}
    lines: dict = {}
    megatron: dict = {}
    notes: list = []
    if getattr(args, "config", None):
        values.update(read_yaml_config(args.config, lines, megatron, notes,
                                       getattr(args, "torchtitan_set", None)))
    elif getattr(args, "torchtitan_set", None):
        read_yaml_config("", overrides=args.torchtitan_set)  # refused: no torchtitan file
    megatron.update(megatron_given(args))
    known = field_section()
    for k, v in vars(args).items():
        if k in known and v is not None:
            check_field_value(k, v)
            values[k] = v
            lines.pop(k, None)
    no_effect = resolve_megatron_only(megatron)
    if values.get("train_iters") is not None and values.get("train_samples") is not None:
        raise ConfigError("--train-iters and --train-samples both set the length of training: "
                          "give one (Megatron's rule)")
    meta = {f.name: f.metadata for dc in GROUPS.values() for f in fields(dc)}
    for k in values:  # Megatron reads 0 as off (``if args.exit_interval and ...``)
        if meta[k].get("zero_is_off") and values[k] == 0 and not isinstance(values[k], bool):
            values[k] = None
    for k, line in lines.items():  # bounds of the values the file still provides, with file:line
        if values[k] == "auto" and meta[k].get("auto"):
            continue
        try:
            check_bounds(k, values[k], meta[k])
        except ConfigError as e:
            raise ConfigError(f"{args.config}:{line}: {e}") from None
    cfg = LoomConfig.from_flat(values)
    cfg.megatron_no_effect = no_effect
    cfg.config_notes = notes
    return cfg
