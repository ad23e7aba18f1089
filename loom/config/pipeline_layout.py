"""Megatron-LM's ``--pipeline-model-parallel-layout``, torch-free: any split of the layers over
the (virtual) pipeline stages.

The string names what every virtual stage holds, stages separated by ``|``, in pipeline order
(virtual stage ``j = k p + r`` is chunk ``k`` of pipeline rank ``r``, so a string of ``p v``
stages means ``v`` chunks per rank): ``E`` the embedding, ``t`` one transformer (decoder) layer,
``m`` one multi-token-prediction layer, ``L`` the output layer and the loss. ``X*n`` repeats a
character, ``(...)*n`` a group (both unrolled before the split at ``|``); commas are cosmetic.
Examples (Megatron-LM ``arguments.py``, ``pipeline_parallel_layer_layout.py``): ``"Ettt|(tt|)*29,
m|L"``; Llama 3 405B's 126 layers over 16 stages, one layer fewer on the first and the last
(arXiv 2407.21783 sec 3.3.2): ``"Et*7|(t*8|)*14,t*7L"``; 28 layers over 16 stages:
``"Et|t|(tt|)*12,t|tL"``.

Rules checked by :func:`parse_layout` / :meth:`PipelineLayout.validate` (Megatron's, plus loom's
placement of the ends): the number of stages is a multiple of ``p``; ``E`` exactly once, at the
start of virtual stage 0; ``L`` exactly once, at the end of the last virtual stage; as many
``t`` as ``--num-layers`` and as many ``m`` as ``--mtp-num-layers``, every ``m`` after every
``t``. A stage may be empty (it passes activations on).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CHARS = {"E": "embedding", "L": "loss", "t": "decoder", "m": "mtp"}


class LayoutError(ValueError):
    """A layout string that cannot be parsed or does not fit the model / pipeline size."""


def _unroll(text: str) -> str:
    """Commas removed, ``(...)*n`` then ``X*n`` unrolled (Megatron's order)."""
    text = text.replace(",", "").replace(" ", "")
    text = re.sub(r"\(([^()]+)\)\*(\d+)", lambda g: g.group(1) * int(g.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda g: g.group(1) * int(g.group(2)), text)
    return text


@dataclass(frozen=True)
class PipelineLayout:
    """What each virtual stage holds: ``stages[j]`` a string over ``E t m L`` (pipeline order,
    ``p v`` entries). ``v_shape``: ZB-V's placement (two chunks per rank, chunk 0 = virtual stage
    ``r``, chunk 1 = virtual stage ``2p - 1 - r``, the loss on rank 0) instead of the
    interleaved one (chunk ``k`` of rank ``r`` = virtual stage ``k p + r``)."""

    pp: int
    stages: tuple
    v_shape: bool = False

    @property
    def vp(self) -> int:
        return len(self.stages) // self.pp

    @property
    def num_layers(self) -> int:
        return sum(s.count("t") for s in self.stages)

    def counts(self) -> tuple:
        """Transformer layers of every virtual stage (pipeline order)."""
        return tuple(s.count("t") for s in self.stages)

    def rank_chunks(self, rank: int) -> list[int]:
        """Virtual stages of pipeline rank ``rank``, chunk order."""
        if self.v_shape:
            return [rank, 2 * self.pp - 1 - rank]
        return [k * self.pp + rank for k in range(self.vp)]

    def rank_of(self, vstage: int) -> int:
        """The pipeline rank holding virtual stage ``vstage``."""
        if self.v_shape:
            return vstage if vstage < self.pp else 2 * self.pp - 1 - vstage
        return vstage % self.pp

    def virtual_stage_layers(self) -> list[list[int]]:
        """Global transformer-layer indices of every virtual stage, in pipeline order."""
        out, start = [], 0
        for c in self.counts():
            out.append(list(range(start, start + c)))
            start += c
        return out

    def chunk_layers(self, rank: int) -> list[list[int]]:
        """Transformer layers of each of ``rank``'s chunks."""
        vs = self.virtual_stage_layers()
        return [vs[j] for j in self.rank_chunks(rank)]

    def rank_layer_counts(self) -> list[int]:
        """Transformer layers per pipeline rank (all chunks)."""
        c = self.counts()
        return [sum(c[j] for j in self.rank_chunks(r)) for r in range(self.pp)]

    def validate(self, num_layers: int, mtp_layers: int | None = 0) -> "PipelineLayout":
        """Raise :class:`LayoutError` unless the layout holds exactly this model (module rules;
        ``mtp_layers`` None: any number of ``m``); returns self."""
        flat = "".join(self.stages)
        if flat.count("E") != 1 or not self.stages[0].startswith("E"):
            raise LayoutError("the layout must hold the embedding 'E' exactly once, at the start "
                              "of the first stage")
        if flat.count("L") != 1 or not self.stages[-1].endswith("L"):
            raise LayoutError("the layout must hold the loss 'L' exactly once, at the end of the "
                              "last stage")
        if flat.count("t") != num_layers:
            raise LayoutError(f"the layout holds {flat.count('t')} transformer layers 't', the "
                              f"model has --num-layers {num_layers}")
        if mtp_layers is not None and flat.count("m") != mtp_layers:
            raise LayoutError(f"the layout holds {flat.count('m')} MTP layers 'm', the model has "
                              f"--mtp-num-layers {mtp_layers or 0}")
        if "m" in flat and "t" in flat[flat.index("m"):]:
            raise LayoutError("every MTP layer 'm' must come after every transformer layer 't'")
        return self

    def to_string(self) -> str:
        """The layout in Megatron's syntax, runs of equal stages as ``(...|)*n`` and runs of 3+
        equal layers as ``t*n`` (parses back to the same stages)."""
        def stage(s: str) -> str:
            return re.sub(r"(t{3,}|m{3,})", lambda g: f"{g.group(1)[0]}*{len(g.group(1))}", s)
        parts, i, st = [], 0, self.stages
        while i < len(st):
            j = i
            while j + 1 < len(st) and st[j + 1] == st[i]:
                j += 1
            n = j - i + 1
            last = j == len(st) - 1
            if n >= 3:
                if last:  # the group cannot carry the final stage's missing separator
                    parts.append(f"({stage(st[i])}|)*{n - 1},{stage(st[i])}")
                else:
                    parts.append(f"({stage(st[i])}|)*{n},")
            else:
                parts.extend(stage(s) + ("" if i + k == len(st) - 1 else "|")
                             for k, s in enumerate(st[i:j + 1]))
            i = j + 1
        return "".join(parts).rstrip(",")

    def __str__(self) -> str:
        return self.to_string()


def parse_layout(text: str, pp: int) -> PipelineLayout:
    """A :class:`PipelineLayout` from Megatron's string at pipeline size ``pp``. Raises
    :class:`LayoutError` for an unknown character or a stage count not divisible by ``pp``."""
    if pp < 1:
        raise LayoutError(f"pipeline size {pp} must be >= 1")
    flat = _unroll(text)
    bad = sorted(set(flat) - set(CHARS) - {"|"})
    if bad:
        raise LayoutError(f"unknown character(s) {''.join(bad)!r} in the layout {text!r}: use "
                          f"E (embedding), t (transformer layer), m (MTP layer), L (loss), '|' "
                          f"between stages, X*n and (...)*n to repeat")
    stages = tuple(flat.split("|"))
    if len(stages) % pp:
        raise LayoutError(f"the layout {text!r} has {len(stages)} stages, not a multiple of "
                          f"--pipeline-model-parallel-size {pp}")
    return PipelineLayout(pp, stages)


def layout_from_counts(counts, pp: int, mtp_layers: int = 0,
                       v_shape: bool = False) -> PipelineLayout:
    """The layout whose virtual stages (pipeline order) hold ``counts`` transformer layers, the
    embedding on the first, MTP layers and the loss on the last."""
    counts = [int(c) for c in counts]
    stages = ["t" * c for c in counts]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "m" * int(mtp_layers or 0) + "L"
    return PipelineLayout(pp, tuple(stages), v_shape)


def rank_counts_to_chunks(rank_counts, vp: int) -> list[int]:
    """Virtual-stage counts (pipeline order) splitting each rank's layers over ``vp`` chunks as
    evenly as possible, the extra layers on the later chunks (the earlier chunks hold more
    micro-batches in flight on the first ranks of the interleaved schedule)."""
    pp = len(rank_counts)
    out = [0] * (pp * vp)
    for r, n in enumerate(rank_counts):
        q, rem = divmod(int(n), vp)
        for k in range(vp):
            out[k * pp + r] = q + (1 if k >= vp - rem else 0)
    return out


def standard_layout(num_layers: int, pp: int, vp: int = 1, first=None, last=None,
                    mtp_layers: int = 0, v_shape: bool = False) -> PipelineLayout:
    """The layout of loom's / Megatron's flags: the even split, or ``--decoder-first/last-
    pipeline-num-layers`` with the rest even (Megatron: each rank's layers split evenly over
    its ``vp`` chunks). Raises :class:`LayoutError` when the flags do not divide."""
    counts: list = [None] * pp
    if pp > 1 and first is not None:
        counts[0] = int(first)
    if pp > 1 and last is not None:
        counts[-1] = int(last)
    free = [i for i, c in enumerate(counts) if c is None]
    rest = num_layers - sum(c for c in counts if c is not None)
    if free:
        if rest % len(free) or rest // len(free) < 0:
            raise LayoutError(f"{rest} layers do not split evenly over {len(free)} stages")
        for i in free:
            counts[i] = rest // len(free)
    elif rest:
        raise LayoutError(f"the stage sizes leave {rest} layers")
    if v_shape:
        if num_layers % (2 * pp):
            raise LayoutError(f"ZB-V needs {num_layers} layers divisible by 2 x {pp}")
        return layout_from_counts([num_layers // (2 * pp)] * (2 * pp), pp, mtp_layers, True)
    if any(c % vp for c in counts):
        raise LayoutError(f"stage sizes {counts} are not divisible by {vp} chunks")
    return layout_from_counts(rank_counts_to_chunks(counts, vp), pp, mtp_layers)
