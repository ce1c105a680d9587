"""Layers of each pipeline stage, as Megatron-Core splits them (``get_num_layers_to_build``).

A model of L transformer layers runs on ``pp`` pipeline ranks with ``vpp`` chunks each, i.e. ``pp x
vpp`` virtual stages; virtual stage ``v = chunk x pp + rank`` holds consecutive layers, in order of
``v``. Without uneven settings every virtual stage holds ``L / (pp vpp)`` layers (an error unless it
divides). ``embedding_as_layer`` / ``loss_as_layer`` count the embedding and the LM head + loss as a
layer each in that split (``account_for_*_in_pipeline_split``); ``first_stage_layers`` /
``last_stage_layers`` fix the layers of pipeline rank 0 and pp-1 (split over their vpp chunks, the
first chunks taking one more where they do not divide) and spread the rest evenly over the middle ranks. The embedding is on virtual stage 0, the LM head,
loss and MTP modules on the last. DualPipe (``pp_schedule: dualpipe``) splits the model into pp
stages and keeps two copies of the parameters: rank r holds stage r (chunk 0, for micro-batches
entering at rank 0) and stage pp - 1 - r (chunk 1, for those entering at rank pp - 1).

``pipeline_layout`` is Megatron-Core's custom layout (``--pipeline-model-parallel-layout``,
``PipelineParallelLayerLayout``): the ``pp x vpp`` virtual stages in model order, ``|``-separated, each
a string of E (embedding), t (decoder layer), m (MTP layer) and L (loss), with ``(...)*n`` and ``x*n``
repeats and commas ignored, e.g. ``Et*4|(t*4|)*14tmL``. The embedding must be on virtual stage 0 and
the loss and MTP layers on the last (Megatron's standalone MTP is not modelled); stages may be empty.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache

from sim.errors import InputError


@dataclass(frozen=True)
class VirtualStage:
    """One model chunk: its index in model order, the pipeline rank and chunk that run it, its layers."""

    index: int
    rank: int
    chunk: int
    layers: tuple[int, ...]
    embedding: bool = False
    head: bool = False  # LM head and loss (and the MTP modules)
    extra: dict = field(default_factory=dict, compare=False)


def chunks_per_rank(s) -> int:
    p = s.parallelism
    return 2 if p.schedule == "dualpipe" else p.vpp


def model_chunks(s) -> int:
    """Model stages the layers are split into: pp x vpp (DualPipe: pp, each held twice)."""
    p = s.parallelism
    return p.pp if p.schedule == "dualpipe" else p.pp * p.vpp


def _even(units: int, parts: int, field_name: str, what: str) -> int:
    if parts <= 0 or units % parts:
        raise InputError(f"{what}: {units} units do not split evenly over {parts} virtual stages", field=field_name)
    return units // parts


#: pipeline_layout's characters (Megatron-Core's LayerType)
LAYOUT_CHARS = {"E": "embedding", "t": "decoder layer", "m": "MTP layer", "L": "loss"}
_LAYOUT_FIELD = "parallelism.pipeline_layout"
_MAX_UNROLLED = 1_000_000  # characters a layout may unroll to: far past any model
_SYNTAX = "E embedding, t decoder layer, m MTP layer, L loss, '|' between stages, (...)*n and x*n repeat"


@lru_cache(maxsize=64)
def parse_layout(text: str) -> tuple[str, ...]:
    """The virtual stages of a layout string, each a string of E/t/m/L (Megatron-Core's
    ``PipelineParallelLayerLayout.parse_str_to_list``: commas removed, ``(...)*n`` then ``x*n`` unrolled,
    split on ``|``): ``"Ettt|(tt|)*29,m|L"`` -> ``("Ettt", "tt", ... "tt", "m", "L")``, 32 stages.
    Raises ``ValueError`` naming the bad character."""
    flat, total = text.replace(",", ""), 0

    def unroll(m: re.Match) -> str:
        nonlocal total
        total += len(m.group(1)) * int(m.group(2))
        if total > _MAX_UNROLLED:
            raise ValueError(f"pipeline_layout unrolls to more than {_MAX_UNROLLED:,} characters")
        return m.group(1) * int(m.group(2))

    for pattern in (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)"):
        flat = re.sub(pattern, unroll, flat)
    stages = tuple(flat.split("|"))
    for i, stage in enumerate(stages):
        bad = next((c for c in stage if c not in LAYOUT_CHARS), None)
        if bad is not None:
            shown = stage if len(stage) <= 60 else stage[:57] + "..."
            raise ValueError(f"invalid character {bad!r} in virtual stage {i} ({shown!r}); {_SYNTAX}")
    return stages


def _layout_counts(s) -> list[int]:
    """Decoder layers per virtual stage of ``parallelism.pipeline_layout``, checked against the model
    as Megatron-Core's ``validate_layer_layout`` does, plus where this simulator puts the embedding,
    the loss and the MTP modules."""
    p, m = s.parallelism, s.model

    def bad(message: str) -> InputError:
        return InputError(f"pipeline_layout {p.pipeline_layout!r}: {message}", field=_LAYOUT_FIELD)

    stages = parse_layout(p.pipeline_layout)  # syntax, stage count and dualpipe: ParallelismConfig checked them
    flat = "".join(stages)
    if flat[:1] != "E" or flat[-1:] != "L":
        raise bad(f"the first layer must be E (embedding) and the last L (loss), got {flat[:1]!r} and {flat[-1:]!r}")  # fmt: skip
    if flat.count("E") != 1 or flat.count("L") != 1:
        raise bad(f"E and L must appear once each, got {flat.count('E')} E and {flat.count('L')} L")
    if flat.count("t") != m.num_layers:
        raise bad(f"{flat.count('t')} decoder layers (t), model.num_layers is {m.num_layers}")
    if flat.count("m") != m.mtp_layers:
        raise bad(f"{flat.count('m')} MTP layers (m), model.mtp_layers is {m.mtp_layers}")
    if "m" in flat and "t" in flat[flat.index("m") :]:
        raise bad("decoder layers (t) must all come before the MTP layers (m)")
    for char, what, want in (("E", "E (embedding)", 0), ("L", "L (loss)", len(stages) - 1)):
        at = next(i for i, st in enumerate(stages) if char in st)
        if at != want:
            raise bad(f"{what} is in virtual stage {at}; the simulator puts the embedding on virtual stage 0 and "
                      f"the LM head and loss on the last ({len(stages) - 1}): no empty stage before E or after L")  # fmt: skip
    mtp_at = [i for i, st in enumerate(stages[:-1]) if "m" in st]
    if mtp_at:
        raise bad(f"MTP layers (m) in virtual stage {mtp_at[0]}, not the last ({len(stages) - 1}): standalone MTP "
                  "(Megatron-Core's mtp_standalone) is not modelled; the simulator runs the MTP modules with the "
                  "LM head and loss, so put every m in the last stage, before L (e.g. ...|tmL)")  # fmt: skip
    return [st.count("t") for st in stages]


def stage_layers(s) -> list[VirtualStage]:
    """The virtual stages of scenario ``s`` in model order (``len = pp x chunks``)."""
    p, layers = s.parallelism, s.model.num_layers
    dualpipe = p.schedule == "dualpipe"
    vpp = 1 if dualpipe else p.vpp
    n_virtual = p.pp * vpp

    def owner(v: int) -> tuple[int, int]:
        return v % p.pp, v // p.pp

    counts: list[int]
    if p.pipeline_layout is not None:
        counts = _layout_counts(s)
    elif p.first_stage_layers is None and p.last_stage_layers is None:
        units = layers + int(p.embedding_as_layer) + int(p.loss_as_layer)
        what = f"{layers} layers" + (" + embedding" if p.embedding_as_layer else "") + (
            " + loss" if p.loss_as_layer else "")  # fmt: skip
        per = _even(units, n_virtual, "model.num_layers", what)
        counts = [per] * n_virtual
        if p.embedding_as_layer:
            counts[0] -= 1
        if p.loss_as_layer:
            counts[-1] -= 1
        if min(counts) < 0:
            raise InputError(f"{what} leave a virtual stage with fewer than 0 layers", field="model.num_layers")
    else:
        first = p.first_stage_layers
        last = p.last_stage_layers
        middle_ranks = p.pp - (first is not None) - (last is not None)
        rest = layers - (first or 0) - (last or 0)
        if rest < 0:
            raise InputError(
                f"first_stage_layers + last_stage_layers ({(first or 0) + (last or 0)}) exceed num_layers ({layers})",
                field="parallelism.first_stage_layers",
            )
        if middle_ranks == 0 and rest:
            raise InputError(f"{rest} layers are left for no middle stage", field="parallelism.first_stage_layers")
        per_rank = [0] * p.pp
        for r in range(p.pp):
            if r == 0 and first is not None:
                per_rank[r] = first
            elif r == p.pp - 1 and last is not None:
                per_rank[r] = last
            else:
                per_rank[r] = _even(rest, middle_ranks, "model.num_layers", f"{rest} middle layers")
        counts = [0] * n_virtual
        for r, n in enumerate(per_rank):  # a rank's layers over its chunks, the first chunks one more
            for c in range(vpp):
                counts[c * p.pp + r] = n // vpp + (c < n % vpp)
    out, at = [], 0
    for v, n in enumerate(counts):
        rank, chunk = owner(v)
        out.append(VirtualStage(v, rank, chunk, tuple(range(at, at + n)), embedding=v == 0, head=v == n_virtual - 1))
        at += n
    return out


def rank_chunks(s) -> list[list[VirtualStage]]:
    """Per pipeline rank, the model stages it runs, indexed by chunk (DualPipe: [stage r, stage pp-1-r])."""
    stages = stage_layers(s)
    pp = s.parallelism.pp
    if s.parallelism.schedule == "dualpipe":
        return [[stages[r], stages[pp - 1 - r]] for r in range(pp)]
    by_rank: list[list[VirtualStage]] = [[] for _ in range(pp)]
    for vs in stages:
        by_rank[vs.rank].append(vs)
    for lst in by_rank:
        lst.sort(key=lambda v: v.chunk)
    return by_rank


__all__ = [
    "LAYOUT_CHARS",
    "VirtualStage",
    "chunks_per_rank",
    "model_chunks",
    "parse_layout",
    "rank_chunks",
    "stage_layers",
]
