"""docs/megatron-defaults.md, rendered from the flag table (:mod:`loom.config.flag_table`) and
the Megatron snapshot: ``python -m loom.config.flag_docs docs/megatron-defaults.md`` writes it;
tests/unit/test_flag_table.py checks the file is up to date."""

from __future__ import annotations

import sys
from dataclasses import MISSING, fields
from typing import Any, Optional

from loom.config.fields import flag
from loom.config.flag_kinds import IMPLEMENTED, NO_EFFECT, NO_EFFECT_KIND, REFUSED
from loom.config.flag_table import (REMOVED, by_spelling, field_of, megatron_flags,
                                    removed_snapshot, removed_values, snapshot, table)
from loom.config.sections import GROUPS


def loom_defaults() -> dict:
    """``{field: dataclass default}`` over every section."""
    return {f.name: f.default for dc in GROUPS.values() for f in fields(dc)
            if f.default is not MISSING}


def expected_default(name: str) -> tuple[Any, Optional[Any]]:
    """``(Megatron's default as the snapshot has it, what loom's field must hold)`` of an
    implemented row ``name`` (``(…, None)`` for a required flag: no default stands in)."""
    mf, row = by_spelling()[name], table()[name]
    megatron = mf.megatron_default
    if row.spelled:
        return megatron, row.default
    if row.required:
        return megatron, None
    if mf.action == "storefalse" and field_of(name, row) == name[2:].replace("-", "_"):
        return megatron, False  # --no-foo / --disable-foo: loom's field is the flag, off
    return megatron, megatron


def _cell(value: Any) -> str:
    return "required" if value is _REQUIRED else f"`{value!r}`"


_REQUIRED = object()


def _implemented_rows() -> list[str]:
    defaults = loom_defaults()
    out = ["| flag | Megatron default | loom default | Megatron source | note |",
           "|---|---|---|---|---|"]
    for mf in megatron_flags():
        row = table().get(mf.name)
        if row is None or row.kind != IMPLEMENTED:
            continue
        fname = field_of(mf.name, row)
        megatron = _REQUIRED if row.required else mf.megatron_default
        ours = _REQUIRED if row.required and defaults.get(fname) is None else \
            defaults.get(fname)
        spellings = " ".join(f"`{s}`" for s in mf.flags)
        if flag(fname) not in mf.flags:
            spellings += f" (= `{flag(fname)}`)"
        note = "; ".join(x for x in (f"**loom's own default, on purpose**: {row.own}" if row.own
                                     else "", row.note,
                                     f"required: `{row.required}`" if row.required
                                     else "", "refused: " + ", ".join(
                                         f"`{v}` ({why})" for v, why in row.refuse.items())
                                     if row.refuse else "") if x)
        out.append(f"| {spellings} | {_cell(megatron)} | {_cell(ours)} | `{mf.source}` | "
                   f"{note.replace('|', '/')} |")
    return out


def _grouped(kind: str, titles: dict) -> list[str]:
    groups: dict = {}
    for mf in megatron_flags():
        row = table().get(mf.name)
        if row is not None and row.kind == kind:
            key = (row.category, row.pending or "")
            groups.setdefault(key, []).append((mf, row))
    out = []
    for (cat, pending), rows in groups.items():
        title = titles[cat] if not pending else f"{titles[cat]} (pending: branch {pending})"
        out += ["", f"**{title}** ({len(rows)}):", ""]
        for mf, row in rows:
            extra = [f"default `{mf.megatron_default!r}`", f"`{mf.source}`"]
            if row.reason:
                extra.insert(0, row.reason)
            if row.note:
                extra.append(row.note)
            if row.allow:
                extra.append("accepted: " + ", ".join(f"`{v}`" for v in row.allow))
            if row.refuse:
                extra.append("refused: " + ", ".join(f"`{v}` ({why})" for v, why in
                                                     row.refuse.items()))
            out.append(f"- `{mf.name}`: {'; '.join(extra).replace('|', '/')}")
    return out


def _removed_rows() -> list[str]:
    """One line per flag of the earlier releases: its releases and its row."""
    _, releases = removed_snapshot()
    out = []
    for mf in sorted(megatron_flags((REMOVED,)), key=lambda f: f.name.lower()):
        row = table()[mf.name]
        first, last = releases[mf.name]
        if row.kind == IMPLEMENTED:
            what = f"implemented as `{flag(field_of(mf.name, row))}`"
        elif row.kind == NO_EFFECT_KIND:
            what = "no effect: " + NO_EFFECT[row.category]
        else:
            what = "refused: " + row.why()
        extra = "; ".join(x for x in (row.note, f"`{mf.source}`") if x)
        out.append(f"- `{mf.name}` ({first} .. {last}): {what}; {extra}".replace("|", "/"))
    out += ["", "Values earlier releases offered among the choices of a flag d98e8a6 keeps, and "
                "d98e8a6 does not (parsed, then answered by the flag's row):", ""]
    for name, values in removed_values().items():
        row = table()[name]
        for v in values:
            what = (f"refused: {row.refuse[v]}" if v in row.refuse else
                    "no effect" if row.kind == NO_EFFECT_KIND else
                    "refused: " + row.why() if row.kind != IMPLEMENTED else "implemented")
            out.append(f"- `{name} {v}`: {what}".replace("|", "/"))
    return out


def _own_defaults() -> list[str]:
    """The implemented flags whose loom default differs from Megatron's on purpose."""
    return [f"- `{mf.name}`: Megatron `{mf.megatron_default!r}`, loom `{table()[mf.name].default!r}`"
            f": {table()[mf.name].own}." for mf in megatron_flags()
            if table().get(mf.name) is not None and table()[mf.name].own]


PADDED_VOCABULARY = (
    "**Padded vocabulary.** As Megatron-Core, loom builds the embedding and the output layer "
    "with the padded vocabulary Vp (V rounded up to a multiple of "
    "`--make-vocab-size-divisible-by` x t, or `--padded-vocab-size`) and, by default, keeps the "
    "Vp - V padded logit columns in the softmax of the loss (Megatron-Core's "
    "`vocab_parallel_cross_entropy` has no column mask): V 250 padded to 256 gives Megatron's "
    "loss, not the 250-column one. The padded rows start at zero (loom's initialization is a "
    "function of the name, not of t; Megatron draws them at random) and train like any other "
    "row. Consequences of Megatron's semantics: the loss depends on Vp, hence on t unless "
    "`--padded-vocab-size` fixes it, and a checkpoint loaded at a layout with another Vp has "
    "its padded rows cut or zero-extended. `--exclude-padded-vocab` (loom's own flag, not "
    "Megatron's) leaves the padded columns out of the softmax, so the function is independent "
    "of the padding; models imported from Hugging Face (`loom checkpoint convert --from-hf`, "
    "the families' `*_config` builders) set it, keeping HF's softmax over V. Evaluation "
    "(`loom evaluate`, the validation loss) uses the training loss's columns; generation never "
    "samples a padded id either way. `tests/models/test_model_caps.py` checks both against "
    "Megatron-Core's cross-entropy arithmetic.")
"""The semantics of Megatron's padded vocabulary in loom (a paragraph of the page)."""


def render() -> str:
    """The whole page."""
    commit, _ = snapshot()
    count = {k: sum(1 for mf in megatron_flags() if table().get(mf.name) and
                    table()[mf.name].kind == k) for k in (IMPLEMENTED, NO_EFFECT_KIND,
                                                          "refused")}
    own = sorted(flag(n) for n in loom_defaults() if flag(n) not in by_spelling())
    lines = [
        "# Megatron-LM's command line in loom",
        "",
        "<!-- generated by `python -m loom.config.flag_docs docs/megatron-defaults.md` from "
        "loom/config/flag_rows*.py and loom/config/megatron_flags.json; do not edit -->",
        "",
        f"Every flag of Megatron-LM's `parse_args()` at commit `{commit}` (and the ModelOpt "
        f"flags pretrain_gpt.py adds) has exactly one row in loom's flag table "
        f"(`loom.config.flag_table`): **{count[IMPLEMENTED]} implemented** (a loom config field "
        f"with Megatron's name, meaning and default), **{count[NO_EFFECT_KIND]} accepted without "
        f"effect** (named once at the start of a run, with the reason) and "
        f"**{count['refused']} refused** (one line naming what loom lacks, unless given "
        f"Megatron's default). Megatron's defaults and source lines come from the snapshot "
        f"`loom/config/megatron_flags.json` (`benchmarks/megatron_flag_snapshot.py`); "
        f"`tests/unit/test_flag_table.py` checks that every Megatron flag has one row, that "
        f"every loom default equals Megatron's, and that this page is current. "
        f"`loom train --help-all` lists the same.",
        "",
        "**required**: refused when omitted, naming the flag, as Megatron refuses (a `--load` "
        "checkpoint or a `--config` YAML may give the model shape). Exceptions: a Mamba "
        "stack's depth is the length of its `--hybrid-override-pattern`; "
        "`--max-position-embeddings` is inferred from `--seq-length`; an evaluation-only run "
        "(`--skip-train`) needs no `--lr` or `--train-iters`.",
        "",
        "**Deliberate differences.** Every implemented flag takes Megatron's default (or "
        "loom's spelling of the same default), except where loom's default differs on purpose "
        "without changing what the run computes (checked by tests/unit/test_flag_table.py):",
        "",
        *_own_defaults(),
        "",
        PADDED_VOCABULARY,
        "",
        f"## Implemented ({count[IMPLEMENTED]})",
        "",
        *_implemented_rows(),
        "",
        f"## Accepted without effect ({count[NO_EFFECT_KIND]})",
        "",
        "A value other than Megatron's default is named once at start: "
        "`no effect in loom (Megatron-LM flags): ...`.",
        *_grouped(NO_EFFECT_KIND, dict(NO_EFFECT)),
        "",
        f"## Refused ({count['refused']})",
        "",
        "Given any value but Megatron's default (or one marked accepted), refused before "
        "anything starts, in one line naming the flag and the missing capability.",
        *_grouped("refused", dict(REFUSED)),
        "",
        f"## Flags of earlier Megatron-LM releases ({len(megatron_flags((REMOVED,)))})",
        "",
        "Flags that Megatron-LM's releases v1.0 .. core_v0.19.0 took and the snapshot's commit "
        "no longer has (`loom/config/megatron_removed_flags.json`, read from each release's "
        "`arguments.py` by `benchmarks/megatron_removed_flags.py`; first .. last release "
        "declaring each, in commit-date order), so that a launch script of an earlier release "
        "meets an answer, not `unrecognized argument` (`loom/config/flag_rows_removed.py`; "
        "`tests/unit/test_megatron_corpus_earlier.py` runs those releases' functional-test "
        "cases):",
        "",
        *_removed_rows(),
        "",
        "## loom's own flags",
        "",
        "Flags loom has that Megatron-LM lacks: " + ", ".join(f"`{f}`" for f in own) + ".",
        "",
    ]
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if argv:
        with open(argv[0], "w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
