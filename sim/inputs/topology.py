"""Hardware descriptions (``topologies/*.yaml``): a GPU kind, the node fabric, the NVLink domain and
the scale-out fabric.

Every number carries its unit in its name. Link sections give the datasheet line rate and an
``efficiency`` (the fraction of line rate achieved in measurements, e.g. nccl-tests busbw); the
simulator uses ``line * efficiency``. The YAML files say in comments where each figure comes from.

A topology's ``gpu:`` is either a GPU description written inline or the name of one shared file in
``topologies/gpus/`` (``gpu: h100-sxm``; a path to a ``.yaml`` file also works, relative to the
topology file). A GPU description holds the public figures of its kind: datasheet peaks, HBM, SM
count, the achieved HBM fraction, a fused-attention figure and the measured GEMM points that
:mod:`sim.hardware.costs` fits its GEMM efficiency curve to; ``gemm_points_from`` names, per dtype,
the GPU description whose points (as fractions of that GPU's peak) join this one's fit: how a kind
without measurements of its own borrows another's curve (resolved here, when the file is loaded).

``nvlink_domain_gpus`` is the number of GPUs one NVLink/NVSwitch fabric joins (default: a node's).
In a GB200 NVL72 rack it is 72 while a node (a compute tray) holds 4: GPUs of one domain talk over
NVLink whatever their node, and only traffic between domains takes the scale-out fabric.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from sim.errors import InputError
from sim.inputs.gpu_figures import (
    AttentionFigure,
    AttentionShapes,
    DispatcherSMFigure,
    Dtype,
    GemmPoint,
    SsdFigure,
)
from sim.inputs.yamlio import StrictModel, field_error, load_yaml_mapping, validate_model

_STRICT = ConfigDict(extra="forbid", frozen=True)

#: Folder of the shipped topology files (next to ``sim/`` in the source tree).
TOPOLOGY_DIR = Path(__file__).resolve().parents[2] / "topologies"
#: Folder of the shipped GPU descriptions a topology names in ``gpu:``.
GPU_DIR = TOPOLOGY_DIR / "gpus"

#: Upper bound on rates, sizes and latencies (GB/s, TFLOP/s, GiB, us): far past any hardware, and
#: small enough that unit conversions (x 1e9, x 1e12) stay finite.
_BIG = 1e9



class GpuSpec(StrictModel):
    """One accelerator (or one CPU rank): peak math rates, HBM bandwidth and capacity, and the public
    measurements the cost model fits its efficiency curves to (:mod:`sim.hardware.costs`)."""

    model_config = _STRICT
    kind: str = Field(description="device name, e.g. H100-SXM")
    peak_TFLOPs: dict[Dtype, float] = Field(description="dense peak per dtype (no sparsity), TFLOP/s")
    hbm_bw_GBps: float = Field(gt=0, le=_BIG, description="memory bandwidth, GB/s (1e9 B/s)")
    hbm_GiB: float = Field(gt=0, le=_BIG, description="usable device memory, GiB")
    kernel_launch_us: float = Field(default=4.0, ge=0, le=_BIG, description="fixed cost per kernel, us")
    sm_count: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="streaming multiprocessors (a dispatcher's SMs are a share)",
    )
    hbm_efficiency: float | None = Field(
        default=None, gt=0, le=1, description="achieved fraction of hbm_bw_GBps by streaming kernels"
    )
    attention: AttentionFigure | None = Field(default=None, description="measured fused-attention throughput")
    attention_shapes: AttentionShapes | None = Field(
        default=None, description="measured attention rates per shape and precision (MLA, sliding windows, FP8)"
    )
    ssd: SsdFigure | None = Field(
        default=None, description="measured Mamba-2 SSD forward throughput (hybrid models' Mamba layers need it)"
    )
    deepep_GBps_per_sm: DispatcherSMFigure | None = Field(
        default=None,
        description="DeepEP's normal intranode kernels: bandwidth per SM they hold; caps an all-to-all inside "
        "one NVLink domain at SMs x this (unset: only the links limit it)",
    )
    fp8_block_gemm_fraction: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="GEMMs with 1x128 / 128x128 block scales run at this share of the per-tensor FP8 rate "
        "(Hopper, where cuBLAS runs them natively); unset: block scaling runs as MXFP8 where the GPU has it, "
        "else at the FP8 rate",
    )
    gemm_rate_over_fp8: dict[Literal["mxfp8", "nvfp4"], float] | None = Field(
        default=None,
        description="block-scaled formats' GEMMs at this multiple of the per-tensor FP8 curve's rate (kernel "
        "times, same shapes, no quantization: TransformerEngine's GEMM profiling guide); unset for a format: "
        "its own fitted curve",
    )
    sustained_compute_fraction: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="share of the isolated-microbenchmark GEMM and attention rates (gemm_points, attention) "
        "that kernels keep inside a training step, where the GPU runs at its power limit without pause; "
        "fitted to dense training runs (benchmarks/fit_sustained.py)",
    )
    gemm_points: list[GemmPoint] = Field(default=[], description="published GEMM measurements to fit")
    gemm_points_from: dict[Dtype, str | GpuSpec] = Field(
        default={},
        description="per dtype, the GPU description whose GEMM points also enter this one's fit, as "
        "fractions of its peak (a name in topologies/gpus/ or a path; replaced by it when loaded)",
    )
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
    alltoall_efficiency: float | None = Field(
        default=None, gt=0, le=1,
        description="achieved fraction of line rate in all-to-all traffic (every peer at once), where it "
        "was measured apart from the ring figure; None: `efficiency`",
    )  # fmt: skip
    latency_us: float = Field(default=1.0, ge=0, le=_BIG, description="latency per hop, us")

    @property
    def bw_GBps(self) -> float:
        """Effective bandwidth the simulator uses: line rate x efficiency."""
        return self.line_bw_GBps * self.efficiency

    @property
    def alltoall_bw_GBps(self) -> float:
        """Effective bandwidth of all-to-all traffic: line rate x ``alltoall_efficiency`` (else ``efficiency``)."""
        return self.line_bw_GBps * (self.alltoall_efficiency or self.efficiency)


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
    nvlink_domain_gpus: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="GPUs one NVLink/NVSwitch fabric joins, whole nodes (default: node.gpus_per_node)",
    )
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
        domain = self.nvlink_domain_gpus
        if domain is not None and domain % self.node.gpus_per_node:
            raise field_error(
                "nvlink_domain_gpus",
                f"nvlink_domain_gpus ({domain}) must be a multiple of node.gpus_per_node "
                f"({self.node.gpus_per_node}): an NVLink domain joins whole nodes",
            )
        return self


def available_topologies() -> list[str]:
    """Names of the shipped topology files."""
    return sorted(p.stem for p in TOPOLOGY_DIR.glob("*.yaml"))


def available_gpus() -> list[str]:
    """Names of the shipped GPU descriptions."""
    return sorted(p.stem for p in GPU_DIR.glob("*.yaml"))


def _is_path(name: str) -> bool:
    return Path(name).suffix in (".yaml", ".yml") or "/" in name


def resolve_gpu_path(name_or_path: str, base_dir: Path | None = None, field: str = "gpu") -> Path:
    """A GPU description given as a shipped name (``h100-sxm``) or a path (relative to ``base_dir``)."""
    if not _is_path(name_or_path):
        path = GPU_DIR / f"{name_or_path}.yaml"
        if path.exists():
            return path
        from sim.errors import did_you_mean

        hint = did_you_mean(name_or_path, available_gpus())
        raise InputError(
            f"unknown GPU description '{name_or_path}'{hint}; shipped: {', '.join(available_gpus())}, "
            "or give a path to a .yaml file, or write the GPU's fields inline",
            field=field,
        )
    p = Path(name_or_path)
    for c in ([base_dir / p] if not p.is_absolute() and base_dir is not None else []) + [p]:
        if c.exists():
            return c
    raise InputError(f"GPU description file '{name_or_path}' not found", field=field)


def load_gpu(name_or_path: str, base_dir: Path | None = None, field: str = "gpu") -> GpuSpec:
    """Load and validate a GPU description by name or path, its ``gemm_points_from`` entries resolved."""
    return _load_gpu(resolve_gpu_path(name_or_path, base_dir, field).resolve(), ())


def _load_gpu(path: Path, chain: tuple[Path, ...]) -> GpuSpec:
    if path in chain:
        loop = " -> ".join(p.stem for p in (*chain, path))
        raise InputError(
            f"gemm_points_from entries form a loop: {loop}", file=str(path), field="gemm_points_from"
        )
    data = load_yaml_mapping(path, "GPU description")
    return _resolve_lenders(validate_model(GpuSpec, data, str(path)), path.parent, (*chain, path), str(path))


def _resolve_lenders(gpu: GpuSpec, base_dir: Path, chain: tuple[Path, ...], file: str) -> GpuSpec:
    """``gpu`` with every ``gemm_points_from`` name replaced by the description it names."""
    if not any(isinstance(v, str) for v in gpu.gemm_points_from.values()):
        return gpu
    resolved: dict[str, GpuSpec] = {}
    for dtype, ref in gpu.gemm_points_from.items():
        if isinstance(ref, GpuSpec):
            resolved[dtype] = ref
            continue
        field = f"gemm_points_from.{dtype}"
        try:
            resolved[dtype] = _load_gpu(resolve_gpu_path(ref, base_dir, field).resolve(), chain)
        except InputError as exc:
            raise exc.with_file(file) from None
    return gpu.model_copy(update={"gemm_points_from": resolved})


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
    """Load and validate a topology by name or path; a ``gpu:`` name loads that GPU description."""
    path = resolve_topology_path(name_or_path, base_dir)
    data = load_yaml_mapping(path, "topology file")
    gpu = data.get("gpu")
    if isinstance(gpu, str):
        try:
            data = {**data, "gpu": load_gpu(gpu, path.parent)}
        except InputError as exc:
            raise exc.with_file(str(path)) from None
    topology = validate_model(Topology, data, str(path))
    chain = (path.resolve(),)
    return topology.model_copy(update={"gpu": _resolve_lenders(topology.gpu, path.parent, chain, str(path))})
