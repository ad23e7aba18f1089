"""One entry point: ``loom train | preprocess | data | generate | evaluate | checkpoint | plot |
plan | fetch-corpus | demo``.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args)``;
modules are imported only when their subcommand runs, so ``loom plan`` never imports torch's
distributed machinery and ``--help`` is fast.

Bad input (an unknown or abbreviated flag, a value of the wrong type, a refused configuration:
:class:`~loom.errors.ConfigError`) prints one line ``loom COMMAND: error: ...`` without a
traceback and exits with status 2; several unknown flags get one more line each, with at most
one "did you mean" (:func:`~loom.errors.closest`: a typo only) or "not supported by loom". An
unknown YAML key (:class:`~loom.errors.UnknownOptionError`) ends with "see `loom COMMAND
--help`" naming the command that ran. Under torchrun every rank validates before any process group
starts, only rank 0 prints, and every rank exits 2. A checkpoint the filesystem refuses
(:class:`~loom.errors.CheckpointWriteError`) prints its message and exits 1, as do weights
that differ across data-parallel replicas (:class:`~loom.errors.WeightHashMismatch`) and a
path the filesystem refuses (an ``OSError`` naming a file: exit 2 for a path that cannot be
used, such as one too long). A collective that fails because another rank died is one line
from every surviving rank naming the dead one (:mod:`loom.training.peers`), exit 1. Any
other exception keeps its traceback. A process group the command started is ended before
it exits (:func:`teardown_process_group`).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import sys
from types import ModuleType
from typing import Callable, NamedTuple

from loom import __version__
from loom.errors import (CheckpointWriteError, ConfigError, NonFiniteError, RerunExit,
                         UnknownOptionError, WeightHashMismatch, closest, did_you_mean)
from loom.parallel.agent_store import agent_store


class Subcommand(NamedTuple):
    """A subcommand: ``load()`` imports its module (``add_arguments(parser)``, ``run(args)``),
    by a literal name the layout guards can read; ``help`` is its line in ``loom --help``."""

    load: Callable[[], ModuleType]
    help: str


SUBCOMMANDS = {
    "train": Subcommand(lambda: importlib.import_module("loom.training.cli"),
                        "train a model (Megatron-style flags; torchrun for many ranks)"),
    "preprocess": Subcommand(lambda: importlib.import_module("loom.data.preprocess"),
                             "tokenize .txt/.jsonl into an indexed dataset"),
    "data": Subcommand(lambda: importlib.import_module("loom.data.check_cli"),
                       "check a dataset: checksums, index, every token id < V"),
    "generate": Subcommand(lambda: importlib.import_module("loom.inference.cli"),
                           "generate text from a checkpoint"),
    "evaluate": Subcommand(lambda: importlib.import_module("loom.evaluation.cli"),
                           "zero-shot evaluation of a checkpoint: perplexity, cloze accuracy, "
                           "lm-evaluation-harness tasks (any TP/PP layout)"),
    "checkpoint": Subcommand(lambda: importlib.import_module("loom.checkpoint.cli"),
                             "inspect a checkpoint (iteration, layout, tensors), or convert it "
                             "to / from Hugging Face (--to-hf, --from-hf) and Megatron-LM "
                             "(--to-megatron, --from-megatron)"),
    "plot": Subcommand(lambda: importlib.import_module("loom.training.plot"),
                       "plot a --log-json file: loss, validation loss, lr, throughput (PNG)"),
    "plan": Subcommand(lambda: importlib.import_module("loom.planner.cli"),
                       "predict memory and speed of parallel layouts; pick the best"),
    "fetch-corpus": Subcommand(lambda: importlib.import_module("loom.data.corpus"),
                               "fetch the offline demo corpus (Wikipedia, C4, TinyStories)"),
    "demo": Subcommand(lambda: importlib.import_module("loom.demo"),
                       "fetch, tokenize, train TP=2 x DP=2 on CPU, evaluate, generate"),
}


def reporting_rank() -> bool:
    """True on the rank that prints refusals: rank 0 of a torchrun job, or a single process."""
    return os.environ.get("RANK", "0") == "0"


MAX_UNKNOWN_LINES = 10  # unrecognized flags listed one per line; the rest are counted
REFUSAL_WAIT_S = 20  # seconds the other ranks wait for rank 0's message under torchrun


def _agent_store():
    """A client of torchrun's agent store (None outside torchrun or if it cannot be reached;
    :func:`loom.parallel.agent_store.agent_store`)."""
    return agent_store(REFUSAL_WAIT_S)


def refuse(prog: str, message: str, code: int = 2) -> None:
    """Print ``PROG: error: MESSAGE`` once and exit with ``code`` on every rank.

    Rank 0 prints. Under torchrun the other ranks wait (up to ``REFUSAL_WAIT_S`` seconds) on the
    agent's store until rank 0 has printed, so the launcher does not stop rank 0 before its
    message is out; a rank that does not hear from rank 0 (it alone met the problem) prints the
    message itself, naming its rank.
    """
    key = f"loom/refused/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if reporting_rank():
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
        store = _agent_store()
        if store is not None:
            store.set(key, "printed")
        sys.exit(code)
    store = _agent_store()
    if store is not None:
        try:
            store.wait([key])
            sys.exit(code)
        except Exception:  # noqa: BLE001 - rank 0 never refused: this rank reports
            print(f"{prog}: error (rank {os.environ.get('RANK')}): {message}", file=sys.stderr,
                  flush=True)
    sys.exit(code)


def short_usage(parser: argparse.ArgumentParser) -> str:
    """``PROG [REQUIRED FLAGS] [options] [POSITIONALS]``: the usage on one short line (the
    full one of ``loom train`` lists every flag)."""
    parts = [parser.prog]
    for a in parser._actions:
        if a.option_strings and a.required:
            parts.append(f"{a.option_strings[0]} {a.metavar or a.dest.upper()}")
    parts.append("[options]")
    for a in parser._actions:
        if not a.option_strings and a.help != argparse.SUPPRESS and \
                not isinstance(a, argparse._SubParsersAction):
            parts.append(f"[{a.metavar or a.dest}]" if a.nargs == "?" else str(a.metavar or a.dest))
    if any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
        parts.append("COMMAND")
    return " ".join(parts)


class LoomArgumentParser(argparse.ArgumentParser):
    """argparse without abbreviations whose errors are one line, rank 0 only: the message, a
    "did you mean" for an unknown flag or command, and the short usage."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def unknown(self, extras: list[str]) -> None:
        """Refuse unrecognized arguments ``extras``: one line each, naming the flag and at most
        one suggestion (:func:`~loom.errors.closest`: only a typo of a flag of this command);
        a flag of a Megatron derivative (Megatron-DeepSpeed's ``--deepspeed``) names its origin
        and loom's fix (:mod:`loom.config.foreign_flags`); any other reads "not supported by
        loom". At most ``MAX_UNKNOWN_LINES`` lines, then a count of the rest."""
        from loom.config.foreign_flags import foreign_fix
        flags = [a for a in self._option_string_actions if a.startswith("--")]
        notes = []
        for word in dict.fromkeys(w.split("=")[0] if w.startswith("-") else w for w in extras):
            if not word.startswith("-"):
                notes.append(f"{word!r}: a value without a flag")
                continue
            fork = foreign_fix(word)  # a Megatron derivative's own flag, with loom's fix
            guess = closest(word, flags) if word.startswith("--") and not fork else None
            notes.append(fork or (f"{word}: did you mean {guess}?" if guess
                                  else f"{word}: not supported by loom"))
        if len(notes) == 1:
            self.error(f"unrecognized argument {notes[0]}")
        shown = notes[:MAX_UNKNOWN_LINES]
        if len(notes) > len(shown):
            shown.append(f"... and {len(notes) - len(shown)} more")
        self.error(f"{len(notes)} unrecognized arguments", ":" + "".join(f"\n  {n}" for n in shown))

    def error(self, message: str, details: str = "") -> None:
        """Refuse with ``PROG: error: MESSAGE (usage: ...; see `PROG --help`)`` and exit 2;
        ``details`` (lines starting with a newline) follow that line."""
        if "invalid choice" in message and "argument COMMAND" in message:
            word = message.split("'")[1] if "'" in message else ""
            message += did_you_mean(word, SUBCOMMANDS)
        refuse(self.prog, f"{message} (usage: {short_usage(self)}; see `{self.prog} --help`)"
                          f"{details}")


def hyphenated(argv: list[str], known) -> tuple[list[str], list[str]]:
    """``argv`` with each unknown flag spelled with underscores (``--hidden_size``: epfLLM's
    Megatron-LLM renamed Megatron-LM's flags so) replaced by the known flag it spells
    (``--hidden-size``), up to a ``--``; and ``"--a_b as --a-b"`` for each one replaced. A flag
    of loom's own underscore spelling (``--use-checkpoint-opt_param-scheduler``) is known and
    kept."""
    end = argv.index("--") if "--" in argv else len(argv)
    out, spelled = list(argv), []
    for k in range(1, end):
        name, eq, value = argv[k].partition("=")
        dashed = "--" + name[2:].replace("_", "-")
        if name.startswith("--") and "_" in name and name not in known and dashed in known:
            out[k] = dashed + eq + value
            spelled.append(f"{name} as {dashed}")
    return out, list(dict.fromkeys(spelled))


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, exit with its status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("train", "plan"):  # torchtitan's --job.config_file, --a.b VALUE
        from loom.config.torchtitan import torchtitan_argv
        argv = [argv[0], *torchtitan_argv(argv[1:])]
    parser = LoomArgumentParser(prog="loom")
    parser.add_argument("--version", action="version", version=f"loom {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = argv[0] if argv else None
    parsers = {}
    for name, (load, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == chosen:
            load().add_arguments(p)
        parsers[name] = p
    if chosen in parsers:  # an unknown flag first, before "required" or type errors
        known = parsers[chosen]._option_string_actions
        argv, spelled = hyphenated(argv, known)
        if spelled and reporting_rank():
            print(f"loom {chosen}: note: read {', '.join(spelled)} (Megatron-LLM's underscore "
                  f"spelling of Megatron-LM's flags)", flush=True,
                  file=sys.stderr if "--json" in argv else sys.stdout)
        words = argv[1:argv.index("--")] if "--" in argv else argv[1:]
        unknown = [w for w in words if w.startswith("--") and w.split("=")[0] not in known]
        if unknown:
            parsers[chosen].unknown(unknown)
        given = [w.split("=")[0] for w in words if w.startswith("--")]
        twice = sorted({f for f in given if given.count(f) > 1})
        if twice and reporting_rank():  # argparse keeps the last silently: say so
            print(f"loom {chosen}: warning: {', '.join(twice)} given more than once: the last "
                  f"value counts", flush=True,  # stdout: a refusal stays stderr's one line,
                  file=sys.stderr if "--json" in given else sys.stdout)  # --json: stdout parses
    args, extras = parser.parse_known_args(argv)
    if extras:  # the subcommand's parser names its own flags and usage
        parsers[args.command].unknown(extras)
    prog = f"loom {args.command}"
    owned = not _group_initialized()  # a process group the command starts is its to end
    clean = False
    try:
        rc = SUBCOMMANDS[args.command].load().run(args)
        clean = True
    except UnknownOptionError as e:  # a YAML key: the accepted keys are this command's flags
        refuse(prog, f"{e} (see `loom {args.command} --help` for the accepted flags)")
    except ConfigError as e:
        refuse(prog, str(e))
    except (CheckpointWriteError, NonFiniteError, WeightHashMismatch) as e:
        refuse(prog, str(e), code=1)
    except RerunExit as e:  # Megatron's rerun state machine: status 16 or 17
        refuse(prog, str(e), code=e.code)
    except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
        if out_of_memory(e):
            refuse(prog, f"out of memory ({str(e).splitlines()[0][:200]}): the model or batch "
                         f"does not fit this machine; see the memory per rank with `{prog} ... "
                         f"--dry-run` or pick a layout with `loom plan`", code=1)
        from loom.training.peers import is_peer_failure, peer_failure_message
        if not (_group_initialized() and is_peer_failure(e)):
            raise
        # every survivor says it (rank 0 may be the one that died)
        print(f"{prog}: error (rank {os.environ.get('RANK', '0')}): "
              f"{peer_failure_message(e)}", file=sys.stderr, flush=True)
        sys.exit(1)
    except BrokenPipeError:  # `loom plan ... | head`: the reader left; end as a Unix tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error at exit
        sys.exit(128 + 13)  # the shell's status for SIGPIPE, silently
    except OSError as e:  # a path the filesystem refused: name it (CheckpointWriteError above)
        if e.filename is None:
            raise
        refuse(prog, f"{e.strerror or e}: {e.filename}",
               code=2 if e.errno in USER_PATH_ERRORS else 1)
    finally:
        if owned:
            teardown_process_group(clean)
    sys.exit(rc or 0)


# errno values of a path the user gave that cannot be used (exit status 2, as bad input)
USER_PATH_ERRORS = (errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EROFS,
                    errno.ENOENT, errno.EEXIST, errno.ELOOP)


def _group_initialized() -> bool:
    """Whether a default process group exists (without importing torch when no command did)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def teardown_process_group(clean: bool) -> None:
    """End the default process group a command started, before the interpreter exits (left
    to exit, gloo's threads can abort the process after its result was printed: "terminate
    called without an active exception", exit 1). ``clean``: the command succeeded on this
    rank, so every rank reaches this point: they first meet in a barrier (monitored, 60 s, on
    gloo), so no rank closes its connections while another still uses them. Never raises."""
    if not _group_initialized():
        return
    import datetime

    import torch.distributed as dist
    try:
        if clean and dist.get_world_size() > 1:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
            else:
                dist.barrier()
    except Exception:  # noqa: BLE001 - a rank that already failed: end this one anyway
        pass
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is an allocation failure: Python's MemoryError, torch's OutOfMemoryError
    (CUDA) or the CPU allocator's "can't allocate memory" / size-overflow RuntimeError."""
    return isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or (
        "can't allocate memory" in str(e) or "not enough memory" in str(e)
        or "Storage size calculation overflowed" in str(e))
