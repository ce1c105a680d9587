"""The ``faults`` section of a scenario: the schema only; :mod:`sim.hardware.faults` applies it to a cluster.

::

    faults:
      links:                                   # degraded (bw_factor) or failed links and NICs
        - {nic: {node: 3, rail: 0}, bw_factor: 0.5}   # NIC 0 of node 3 at half speed (both directions)
        - {nic: {node: 5, rail: 2}, failed: true}     # NIC down: its GPUs go through another NIC (NVLink)
        - {nvlink: {rank: 5}, bw_factor: 0.25}        # rank 5's link to the NVSwitch (both directions)
        - {pcie: {rank: 9}, bw_factor: 0.5}           # rank 9's PCIe link to host memory (offload)
        - {leaf: {rail: 1, leaf: 0}, failed: true}    # the uplinks of leaf 0 of rail 1 to the spine
        - {link: "n3/nic0 -> leaf/r0/0", bw_factor: 0.5}  # one directed link by name; '<->' = both
      stragglers:
        - {rank: 7, compute_factor: 1.3}       # every kernel of rank 7 takes 1.3x as long
      jitter: {kernel_cv: 0.05, seed: 1}       # lognormal kernel-time noise, mean 1, deterministic

Shapes and ranges are checked here (``0 < bw_factor <= 1``, ``compute_factor >= 1``, one target
per entry); whether a target exists in the cluster and whether failures partition it is checked
by :func:`sim.hardware.faults.apply_faults` when the scenario is loaded.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from sim.inputs.sections import _STRICT
from sim.inputs.yamlio import StrictModel, field_error

#: The keys that name what a link fault hits.
TARGETS = ("nic", "nvlink", "pcie", "leaf", "link")


class NicRef(StrictModel):
    """A NIC: node index and rail (NIC index inside the node)."""

    model_config = _STRICT
    node: int = Field(ge=0, description="node index, 0-based")
    rail: int = Field(ge=0, description="NIC index in the node (= rail of a rail-optimized fat tree)")


class RankRef(StrictModel):
    """A GPU by global rank."""

    model_config = _STRICT
    rank: int = Field(ge=0, description="global rank, 0-based")


class LeafRef(StrictModel):
    """A leaf switch of a rail fat tree: its rail and its index along the rail."""

    model_config = _STRICT
    rail: int = Field(ge=0)
    leaf: int = Field(default=0, ge=0, description="leaf index on the rail (node // nodes_per_leaf)")


class LinkFault(StrictModel):
    """One degraded or failed link (or NIC): exactly one target and either bw_factor or failed."""

    model_config = _STRICT
    nic: NicRef | None = Field(default=None, description="a NIC: its fabric port, both directions")
    nvlink: RankRef | None = Field(default=None, description="a GPU's link to the node switch, both ways")
    pcie: RankRef | None = Field(default=None, description="a GPU's PCIe link to host memory, both ways")
    leaf: LeafRef | None = Field(default=None, description="a leaf's uplinks to the spine, both ways")
    link: str | None = Field(default=None, description="one link by name, 'u -> v' (or 'u <-> v')")
    bw_factor: float | None = Field(default=None, gt=0, le=1, description="bandwidth x this factor")
    failed: bool = Field(default=False, description="the link carries nothing; traffic is rerouted")

    @model_validator(mode="after")
    def _one_target(self) -> LinkFault:
        given = [t for t in TARGETS if getattr(self, t) is not None]
        if len(given) != 1:
            what = "none" if not given else ", ".join(given)
            raise field_error("target", f"give exactly one of {', '.join(TARGETS)} (got {what})")
        if self.failed and self.bw_factor is not None:
            raise field_error("bw_factor", "a failed link has no bandwidth: give bw_factor or failed: true")
        if not self.failed and self.bw_factor is None:
            raise field_error("bw_factor", "give bw_factor (0 < f <= 1) for a degraded link, or failed: true")
        if self.failed and self.pcie is not None:
            raise field_error(
                "failed", "a failed host PCIe link is not modelled (offload has no other path); use bw_factor"
            )
        return self

    @property
    def target(self) -> str:
        return next(t for t in TARGETS if getattr(self, t) is not None)


class Straggler(StrictModel):
    """A slow GPU: every kernel it runs takes ``compute_factor`` times as long."""

    model_config = _STRICT
    rank: int = Field(ge=0)
    compute_factor: float = Field(ge=1, le=1000, description="kernel time multiplier, >= 1")


class Jitter(StrictModel):
    """Lognormal noise on every kernel time: mean 1, coefficient of variation ``kernel_cv``."""

    model_config = _STRICT
    kernel_cv: float = Field(ge=0, le=10, description="std / mean of the kernel-time factor")
    seed: int = Field(default=0, ge=0)


class FaultsConfig(StrictModel):
    """Simulated faults: degraded or failed links and NICs, straggler GPUs, kernel-time jitter."""

    model_config = _STRICT
    links: list[LinkFault] = Field(default_factory=list)
    stragglers: list[Straggler] = Field(default_factory=list)
    jitter: Jitter | None = None

    @model_validator(mode="after")
    def _unique_stragglers(self) -> FaultsConfig:
        seen: set[int] = set()
        for i, s in enumerate(self.stragglers):
            if s.rank in seen:
                raise field_error(f"stragglers.{i}.rank", f"rank {s.rank} is listed twice")
            seen.add(s.rank)
        return self

    @property
    def any(self) -> bool:
        return bool(self.links or self.stragglers or (self.jitter and self.jitter.kernel_cv > 0))

    def summary(self) -> str:
        if not self.any:
            return "none"
        failed = sum(f.failed for f in self.links)
        parts = []
        if self.links:
            parts.append(f"{len(self.links) - failed} degraded, {failed} failed link(s)")
        if self.stragglers:
            parts.append(f"{len(self.stragglers)} straggler(s)")
        if self.jitter and self.jitter.kernel_cv > 0:
            parts.append(f"kernel jitter cv {self.jitter.kernel_cv:g}")
        return "; ".join(parts)


__all__ = ["TARGETS", "FaultsConfig", "Jitter", "LeafRef", "LinkFault", "NicRef", "RankRef", "Straggler"]
