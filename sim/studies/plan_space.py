"""The search space of ``moesim plan``: every layout worth simulating for a model on N GPUs.

A :class:`Candidate` is one point: Megatron-Core's degrees (tp, cp, pp with vpp, ep with etp, dp;
world = tp cp pp dp), the micro-batch size (the accumulation steps follow from the global batch),
recompute, dispatcher, framework and routing policy, plus how the layers split over the virtual
stages. :func:`enumerate_space` lists the points of a :class:`Space`, keeping only divisors that make
sense and counting every combination it drops, with the reason:

- tp within a node (a divisor of the GPUs per node) that divides the attention heads and the
  key/value heads (Megatron-Core's ``num_query_groups % tp``); etp is 1 or tp;
- cp only where each rank keeps at least :data:`MIN_TOKENS_PER_CP_RANK` of a sequence (context
  parallelism is for long sequences);
- pp from the divisors of ``world / (tp cp)`` up to the layers, vpp up to :data:`MAX_VPP` chunks
  where the layers split evenly over ``pp x vpp`` virtual stages (:func:`layer_split`; uneven
  first/last stages where nothing even exists, with vpp 1, the ends no heavier than the middle);
- ep from the divisors of the experts with ``ep x etp`` dividing a stage's ``tp cp dp`` ranks;
- micro-batch sizes 1, 2, 4, ... up to :data:`MAX_MICRO_BATCH_TOKENS` tokens, the global batch a
  multiple of ``micro x dp``.

What is left is checked as a scenario (``check_layout``) and against the memory model by
:mod:`sim.studies.plan`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from math import gcd
from typing import Any

#: virtual pipeline chunks per stage searched at most
MAX_VPP = 8
#: tokens of one micro-batch (micro x seq) searched at most
MAX_MICRO_BATCH_TOKENS = 16384
#: context parallelism only where each cp rank keeps at least this many tokens of a sequence
MIN_TOKENS_PER_CP_RANK = 4096
RECOMPUTES = ("none", "selective", "full")
DISPATCHERS = ("direct", "hierarchical", "deepep", "hybridep")
FRAMEWORKS = ("megatron", "deepspeed", "fsdp2")


@dataclass(frozen=True)
class Split:
    """How the layers split over ``pp x vpp`` virtual stages (Megatron-Core's options)."""

    embedding_as_layer: bool = False
    loss_as_layer: bool = False
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def describe(self) -> str:
        if self.first_stage_layers is not None:
            return f"first/last {self.first_stage_layers}/{self.last_stage_layers}"
        flags = [n for n, on in (("embedding", self.embedding_as_layer), ("loss", self.loss_as_layer)) if on]
        return "even" + (f" (+{' +'.join(flags)} as layers)" if flags else "")


@dataclass(frozen=True)
class Candidate:
    """One layout and its training knobs."""

    tp: int
    cp: int
    pp: int
    vpp: int
    ep: int
    etp: int
    dp: int
    micro_batch_size: int
    grad_accum_steps: int
    recompute: str
    dispatcher: str
    framework: str
    policy: str
    split: Split = Split()

    @property
    def edp(self) -> int:
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    def overrides(self) -> dict[str, Any]:
        """Scenario field paths -> values: what turns the plan's base scenario into this candidate
        (and the key of its line in the run log)."""
        sp = self.split
        return {
            "parallelism.tp": self.tp, "parallelism.cp": self.cp, "parallelism.pp": self.pp,
            "parallelism.vpp": self.vpp, "parallelism.ep": self.ep, "parallelism.etp": self.etp,
            "parallelism.dp": self.dp,
            "parallelism.pp_schedule": "interleaved" if self.vpp > 1 else "1f1b",
            "parallelism.embedding_as_layer": sp.embedding_as_layer, "parallelism.loss_as_layer": sp.loss_as_layer,
            "parallelism.first_stage_layers": sp.first_stage_layers,
            "parallelism.last_stage_layers": sp.last_stage_layers,
            "training.micro_batch_size": self.micro_batch_size,
            "training.grad_accum_steps": self.grad_accum_steps,
            "training.activation_checkpointing": self.recompute,
            "training.framework": self.framework,
            "collectives.all_to_all": self.dispatcher,
            "routing.policy": self.policy,
        }  # fmt: skip

    def layout(self) -> dict[str, Any]:
        """The ``layout`` record of the plan's JSON."""
        return {"tp": self.tp, "cp": self.cp, "pp": self.pp, "vpp": self.vpp, "ep": self.ep, "etp": self.etp,
                "dp": self.dp, "edp": self.edp, "micro_batch_size": self.micro_batch_size,
                "grad_accum_steps": self.grad_accum_steps, "recompute": self.recompute,
                "dispatcher": self.dispatcher, "framework": self.framework, "policy": self.policy,
                "layer_split": asdict(self.split)}  # fmt: skip

    @property
    def label(self) -> str:
        """``tp2 pp8 vpp4 ep32 dp16 mbs1 selective deepep megatron topk``: the degrees above 1, dp, the
        micro-batch size and every knob (:func:`short_label` leaves out those a plan did not search)."""
        return short_label(self, set())

    def key(self) -> tuple:
        return (self.tp, self.cp, self.pp, self.vpp, self.ep, self.etp, self.micro_batch_size, self.recompute,
                self.dispatcher, self.framework, self.policy)  # fmt: skip


def short_label(c: Candidate, constant: set[str]) -> str:
    """A candidate's degrees (those above 1, dp always) and the knobs not in ``constant``."""
    degrees = [f"{n}{v}" for n, v in (("tp", c.tp), ("cp", c.cp), ("pp", c.pp), ("vpp", c.vpp), ("ep", c.ep),
                                      ("etp", c.etp)) if v > 1]  # fmt: skip
    parts = [*degrees, f"dp{c.dp}", f"mbs{c.micro_batch_size}", c.recompute]
    parts += [getattr(c, k) for k in ("dispatcher", "framework", "policy") if k not in constant]
    return " ".join(parts)


@dataclass(frozen=True)
class ModelShape:
    """What the space needs to know of the model."""

    num_layers: int
    heads: int
    kv_heads: int
    num_experts: int

    @classmethod
    def of(cls, m) -> ModelShape:
        kv = m.kv_heads if m.attention == "mha" else m.num_attention_heads
        return cls(m.num_layers, m.num_attention_heads, kv, m.num_experts)


@dataclass(frozen=True)
class Space:
    """The axes of a plan: the cluster, the batch and the values of every searched knob."""

    gpus: int
    gpus_per_node: int
    global_batch: int
    seq_len: int
    recomputes: tuple[str, ...] = RECOMPUTES
    dispatchers: tuple[str, ...] = ("direct",)
    frameworks: tuple[str, ...] = ("megatron",)
    policies: tuple[str, ...] = ("topk",)
    base_split: Split = Split()
    max_vpp: int = MAX_VPP


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layer_split(layers: int, pp: int, vpp: int, base: Split) -> Split | None:
    """The layer split of ``pp x vpp`` virtual stages: ``base``'s embedding/loss accounting when the
    units split evenly with it, else the first even one of none, both, embedding, loss; with vpp 1
    and nothing even, uneven first and last stages (the middle ones ``ceil(L / pp)`` layers, else
    ``floor(L / pp)``, the rest halved between the ends and neither end heavier than a middle stage, as
    Megatron's ``num_layers_in_first/last_pipeline_stage``); else None."""
    if pp == 1:
        return Split() if vpp == 1 else None
    parts = pp * vpp
    options = [Split(base.embedding_as_layer, base.loss_as_layer), Split(), Split(True, True), Split(True, False),
               Split(False, True)]  # fmt: skip
    for sp in options:
        units = layers + sp.embedding_as_layer + sp.loss_as_layer
        if units % parts == 0 and units // parts >= 1 + max(sp.embedding_as_layer, sp.loss_as_layer):
            return sp
    if vpp > 1:
        return None
    for per in sorted({-(-layers // pp), layers // pp}, reverse=True):
        rest = layers - (pp - 2) * per
        if per >= 1 and 2 <= rest <= 2 * per:  # the ends together no heavier than two middle stages
            return Split(first_stage_layers=rest // 2, last_stage_layers=rest - rest // 2)
    return None


def enumerate_space(model: ModelShape, space: Space) -> tuple[list[Candidate], Counter]:
    """Every candidate of ``space`` for ``model``, and the combinations dropped on the way by reason
    (each counted once, under the first rule it breaks)."""
    dropped: Counter = Counter()
    out = list(_walk(model, space, dropped))
    return out, dropped


def _walk(model: ModelShape, sp: Space, dropped: Counter) -> Iterator[Candidate]:
    heads = gcd(model.heads, model.kv_heads)
    micro_sizes = [1 << i for i in range(32) if (1 << i) * sp.seq_len <= max(MAX_MICRO_BATCH_TOKENS, sp.seq_len)]
    knobs = [(r, d, f, p) for r in sp.recomputes for d in sp.dispatchers for f in sp.frameworks for p in sp.policies]
    for tp in divisors(sp.gpus_per_node):
        if heads % tp:
            dropped["tp does not divide the attention / key-value heads"] += 1
            continue
        for cp in divisors(sp.gpus // tp):
            if cp > 1 and sp.seq_len // cp < MIN_TOKENS_PER_CP_RANK:
                continue  # not counted: cp is only searched for long sequences
            for pp in divisors(sp.gpus // (tp * cp)):
                if pp > model.num_layers:
                    continue
                dp = sp.gpus // (tp * cp * pp)
                for vpp in range(1, (sp.max_vpp if pp > 1 else 1) + 1):
                    split = layer_split(model.num_layers, pp, vpp, sp.base_split)
                    if split is None:
                        if vpp == 1:
                            dropped["layers do not split over the pipeline stages"] += 1
                        continue
                    for etp in sorted({1, tp}):
                        for ep in divisors(model.num_experts):
                            if (tp * cp * dp) % (ep * etp):
                                continue  # ep x etp must divide a stage's ranks: never listed
                            for mbs in micro_sizes:
                                if sp.global_batch % (mbs * dp):
                                    dropped["global batch is not a multiple of micro-batch x dp"] += len(knobs)
                                    continue
                                m = sp.global_batch // (mbs * dp)
                                if vpp > 1 and m % pp:
                                    dropped["interleaving needs micro-batches in multiples of pp"] += len(knobs)
                                    continue
                                for r, d, f, p in knobs:
                                    yield Candidate(tp, cp, pp, vpp, ep, etp, dp, mbs, m, r, d, f, p, split)


__all__ = [
    "DISPATCHERS",
    "FRAMEWORKS",
    "MAX_MICRO_BATCH_TOKENS",
    "MAX_VPP",
    "MIN_TOKENS_PER_CP_RANK",
    "RECOMPUTES",
    "Candidate",
    "ModelShape",
    "Space",
    "Split",
    "divisors",
    "enumerate_space",
    "layer_split",
    "short_label",
]
