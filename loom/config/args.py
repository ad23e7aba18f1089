"""Command line and YAML: one ``--flag`` per config field, and ``--config FILE.yaml``.

Flags get their type, ``choices`` (from the field's ``Literal``) and help text from the field;
YAML values are coerced to the field's type with a message naming ``file:line`` and the key when
they cannot be, and YAML syntax errors are reported as ``file:line:column``.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from typing import Any, Callable, get_type_hints

import yaml

from loom.config.core import LoomConfig, field_section, flag
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
    """A boolean flag: ``--foo`` stores True, ``--no-foo`` stores False."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        # the field's own flag (or an alias) turns it on (also a field named no_*:
        # --no-load-optim); only --no-FIELD turns it off
        setattr(namespace, self.dest, option_string != "--no-" + flag(self.dest)[2:])


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one ``--flag`` per config field (default None = "not given"), plus ``--config``;
    each boolean ``--foo`` also gets ``--no-foo`` (False: turns off ``foo: true`` of the YAML).

    Help texts are the fields' ``help`` metadata written plainly (``80%``): ``%`` is escaped
    here, the one place, since argparse %-formats help when it renders ``--help``."""
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="YAML file of the same keys (flat, or grouped by section name); "
                             "flags given on the command line override it")
    for gname, dc in GROUPS.items():
        grp = parser.add_argument_group(gname, (dc.__doc__ or "").strip().splitlines()[0])
        hints = get_type_hints(dc)
        for f in fields(dc):
            if flag(f.name) in parser._option_string_actions:  # the command's own (loom plan's
                continue                                       # --zero-stage 0-3)
            hint = hints[f.name]
            text = f.metadata.get("help", "")
            if f.default is not MISSING and f.default is not None and "default" not in text:
                text += f" (default: {f.default})"
            text = text.replace("%", "%%")  # argparse %-formats help when it renders it
            if base_type(hint)[0] is bool:
                off = "--no-" + flag(f.name)[2:]  # turns off a YAML `true`
                offer = not f.name.startswith("no_") and off not in parser._option_string_actions
                grp.add_argument(flag(f.name), *([off] if offer else []),
                                 *f.metadata.get("aliases", ()), dest=f.name,
                                 action=_OnOff, default=None, help=text)
                continue
            choices = choices_of(hint)
            if f.name in BLEND_FIELDS or f.metadata.get("words"):
                grp.add_argument(flag(f.name), dest=f.name, nargs="+", action=_JoinWords,
                                 default=None, help=text,
                                 metavar="[W] PREFIX" if f.name in BLEND_FIELDS else "VALUE")
            elif choices is not None:
                grp.add_argument(flag(f.name), dest=f.name, choices=choices, default=None,
                                 help=text)
            else:
                grp.add_argument(flag(f.name), dest=f.name,
                                 type=_converter(hint, f.name, f.metadata.get("auto", False)),
                                 default=None, help=text,
                                 metavar={int: "N", float: "X"}.get(base_type(hint)[0],
                                                                    "STR" if f.name == "split"
                                                                    else "PATH"))


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


def read_yaml_config(path: str, lines: dict | None = None) -> dict:
    """Flat ``{field: value}`` of a YAML config, each value coerced to its field's type;
    ``lines`` (if given) receives ``{field: line number}``.

    Raises ConfigError with ``file:line`` for syntax errors, repeated keys and values of the
    wrong type; UnknownOptionError (a ConfigError) for an unknown key, with at most one
    suggestion (:func:`loom.errors.closest`: a typo of a known key, else "not supported by
    loom"); ``loom`` appends "see `loom COMMAND --help`" naming the command that ran.
    """
    known = field_section()
    hints = {f.name: get_type_hints(dc)[f.name] for dc in GROUPS.values() for f in fields(dc)}
    constructor = yaml.SafeLoader("")
    values: dict = {}
    lines = {} if lines is None else lines
    for key, node, line in _read_yaml_nodes(path):
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
        auto = raw == "auto" and field_metadata(key).get("auto")
        values[key] = raw if auto else coerce(raw, hints[key], f"{path}:{line}: {key}")
        lines[key] = line
    return values


def config_from_args(args: argparse.Namespace) -> LoomConfig:
    """YAML (``--config``) first, then every flag given on the command line.

    Raises ConfigError (file:line for YAML problems, the flag otherwise). Does not validate:
    call :meth:`LoomConfig.validate`.
    """
    values: dict = {}
    lines: dict = {}
    if getattr(args, "config", None):
        values.update(read_yaml_config(args.config, lines))
    known = field_section()
    for k, v in vars(args).items():
        if k in known and v is not None:
            values[k] = v
            lines.pop(k, None)
    if values.get("train_iters") is not None and values.get("train_samples") is not None:
        raise ConfigError("--train-iters and --train-samples both set the length of training: "
                          "give one (Megatron's rule)")
    meta = {f.name: f.metadata for dc in GROUPS.values() for f in fields(dc)}
    for k, line in lines.items():  # bounds of the values the file still provides, with file:line
        if values[k] == "auto" and meta[k].get("auto"):
            continue
        try:
            check_bounds(k, values[k], meta[k])
        except ConfigError as e:
            raise ConfigError(f"{args.config}:{line}: {e}") from None
    return LoomConfig.from_flat(values)
