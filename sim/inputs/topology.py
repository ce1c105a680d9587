"""Hardware descriptions (``topologies/*.yaml``): a GPU kind, the node fabric and the scale-out fabric.

Every number carries its unit in its name. Link sections give the datasheet line rate and an
``efficiency`` (the fraction of line rate achieved in measurements, e.g. nccl-tests busbw); the
simulator uses ``line * efficiency``. The YAML files say in comments where each figure comes from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from sim.errors import InputError
from sim.inputs.yamlio import StrictModel, field_error, load_yaml_mapping, validate_model

_STRICT = ConfigDict(extra="forbid", frozen=True)

#: Folder of the shipped topology files (next to ``sim/`` in the source tree).
TOPOLOGY_DIR = Path(__file__).resolve().parents[2] / "topologies"

#: Upper bound on rates, sizes and latencies (GB/s, TFLOP/s, GiB, us): far past any hardware, and
#: small enough that unit conversions (x 1e9, x 1e12) stay finite.
_BIG = 1e9

Dtype = Literal["fp8", "bf16", "fp16", "tf32", "fp32"]


class GpuSpec(StrictModel):
    """One accelerator (or one CPU rank): peak math rates, HBM bandwidth and capacity."""

    model_config = _STRICT
    kind: str = Field(description="device name, e.g. H100-SXM")
    peak_TFLOPs: dict[Dtype, float] = Field(description="dense peak per dtype (no sparsity), TFLOP/s")
    hbm_bw_GBps: float = Field(gt=0, le=_BIG, description="memory bandwidth, GB/s (1e9 B/s)")
    hbm_GiB: float = Field(gt=0, le=_BIG, description="usable device memory, GiB")
    kernel_launch_us: float = Field(default=4.0, ge=0, le=_BIG, description="fixed cost per kernel, us")
    async_comm: bool = Field(
        default=True,
        description="collectives run on their own stream, concurrently with compute (CUDA streams); "
        "false for CPU ranks, where DeepSpeed's overlap_comm has no stream to overlap on and every "
        "gradient reduction blocks the backward",
    )

    @model_validator(mode="after")
    def _positive_peaks(self) -> GpuSpec:
        if not self.peak_TFLOPs:
            raise field_error(
                "peak_TFLOPs", "peak_TFLOPs needs at least one dtype (fp8, bf16, fp16, tf32, fp32)"
            )
        for dtype, value in self.peak_TFLOPs.items():
            if not 0 < value <= _BIG:
                raise field_error(f"peak_TFLOPs.{dtype}", f"must be > 0 and <= {_BIG:g}")
        return self

    def peak_flops(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype`` (fp32 falls back to tf32 tensor cores if no fp32 figure)."""
        if dtype in self.peak_TFLOPs:
            return self.peak_TFLOPs[dtype] * 1e12  # type: ignore[index]
        for fallback in ("bf16", "fp16", "tf32", "fp32"):
            if fallback in self.peak_TFLOPs:
                return self.peak_TFLOPs[fallback] * 1e12  # type: ignore[index]
        raise KeyError(dtype)

    @property
    def is_cpu_host(self) -> bool:
        """CPU ranks (``kind: cpu``), whose host effects a calibration measures (:mod:`sim.host`)."""
        return self.kind.lower() == "cpu"


class LinkSpec(StrictModel):
    """A link class: line rate per direction, achieved fraction and per-hop latency."""

    model_config = _STRICT
    line_bw_GBps: float = Field(gt=0, le=_BIG, description="line rate per direction, GB/s")
    efficiency: float = Field(default=1.0, gt=0, le=1, description="achieved fraction of line rate")
    latency_us: float = Field(default=1.0, ge=0, le=_BIG, description="latency per hop, us")

    @property
    def bw_GBps(self) -> float:
        """Effective bandwidth the simulator uses: line rate x efficiency."""
        return self.line_bw_GBps * self.efficiency


class CpuSpec(StrictModel):
    """The host side, for optimizer offload (DeepSpeed ZeRO-Offload / DeepSpeedCPUAdam)."""

    model_config = _STRICT
    adam_Gparams_per_s: float = Field(
        default=1.0, gt=0, description="CPU Adam update rate per node, 1e9 params/s"
    )
    mem_GiB: float = Field(default=1024, gt=0, le=_BIG, description="host memory per node, GiB")


class NodeSpec(StrictModel):
    """One server: GPUs, their interconnect (NVSwitch, PCIe switch or shared memory) and the host."""

    model_config = _STRICT
    gpus_per_node: int = Field(ge=1, le=1024)
    intra_kind: Literal["nvswitch", "pcie_switch", "shared_memory"] = "nvswitch"
    intra: LinkSpec = Field(description="GPU <-> node switch, per GPU and direction")
    pcie_host: LinkSpec = Field(description="GPU <-> host memory (offload), per GPU and direction")
    cpu: CpuSpec = CpuSpec()


class ScaleOutSpec(StrictModel):
    """Between nodes: a rail-optimized fat tree (one NIC per GPU, one leaf per rail, a spine), one switch, or none."""

    model_config = _STRICT
    kind: Literal["rail_fat_tree", "single_switch", "none"] = "rail_fat_tree"
    nics_per_node: int = Field(default=8, ge=1, le=1024)
    nic_line_Gbps: float = Field(default=400, gt=0, le=_BIG, description="NIC line rate per direction, Gb/s")
    efficiency: float = Field(default=1.0, gt=0, le=1, description="achieved fraction of NIC line rate")
    latency_us: float = Field(default=2.0, ge=0, le=_BIG, description="latency per switch hop, us")
    nodes_per_leaf: int = Field(
        default=32, ge=1, le=1_000_000, description="nodes one leaf switch of a rail serves"
    )
    oversubscription: float = Field(
        default=1.0, ge=1, le=1_000_000, description="leaf downlink : uplink bandwidth ratio"
    )

    @property
    def nic_bw_GBps(self) -> float:
        """Effective NIC bandwidth per direction, GB/s (Gb/s / 8 x efficiency)."""
        return self.nic_line_Gbps / 8.0 * self.efficiency


class Topology(StrictModel):
    """A whole hardware description; ``cluster.nodes`` in the scenario says how many nodes."""

    model_config = _STRICT
    name: str
    description: str = ""
    gpu: GpuSpec
    node: NodeSpec
    scaleout: ScaleOutSpec = ScaleOutSpec(kind="none")

    @model_validator(mode="after")
    def _nics(self) -> Topology:
        so = self.scaleout
        if so.kind == "rail_fat_tree" and so.nics_per_node != self.node.gpus_per_node:
            raise field_error(
                "scaleout.nics_per_node",
                f"scaleout.nics_per_node ({so.nics_per_node}) must equal node.gpus_per_node "
                f"({self.node.gpus_per_node}) for a rail-optimized fat tree (one NIC per GPU)",
            )
        return self


def available_topologies() -> list[str]:
    """Names of the shipped topology files."""
    return sorted(p.stem for p in TOPOLOGY_DIR.glob("*.yaml"))


def resolve_topology_path(name_or_path: str, base_dir: Path | None = None) -> Path:
    """A topology given as a shipped name (``dgx-h100``) or a path (relative to ``base_dir``)."""
    candidates = []
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or "/" in name_or_path:
        if not p.is_absolute() and base_dir is not None:
            candidates.append(base_dir / p)
        candidates.append(p)
    else:
        candidates.append(TOPOLOGY_DIR / f"{name_or_path}.yaml")
    for c in candidates:
        if c.exists():
            return c
    if len(candidates) == 1 and candidates[0].parent == TOPOLOGY_DIR:
        from sim.errors import did_you_mean

        hint = did_you_mean(name_or_path, available_topologies())
        raise InputError(
            f"unknown topology '{name_or_path}'{hint}; shipped: {', '.join(available_topologies())}, "
            "or give a path to a .yaml file",
            field="cluster.topology",
        )
    raise InputError(f"topology file '{name_or_path}' not found", field="cluster.topology")


def load_topology(name_or_path: str, base_dir: Path | None = None) -> Topology:
    """Load and validate a topology by name or path."""
    path = resolve_topology_path(name_or_path, base_dir)
    data = load_yaml_mapping(path, "topology file")
    return validate_model(Topology, data, str(path))
