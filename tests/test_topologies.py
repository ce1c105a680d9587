"""Shipped hardware descriptions (topologies/*.yaml, topologies/gpus/*.yaml): each loads, each GPU kind is
described once and named by the topologies that use it, every GPU figure carries its unit and a comment
naming its source, inline GPU specs keep working, and bad references exit 2 naming file and field."""

from __future__ import annotations

import re

import pytest
import yaml

from sim.errors import InputError
from sim.inputs.topology import (
    GPU_DIR,
    TOPOLOGY_DIR,
    GpuSpec,
    available_gpus,
    available_topologies,
    load_gpu,
    load_topology,
)

#: topology -> the GPU description it names (CPU ranks and A100 stay inline)
SHARED = {"dgx-h100": "h100-sxm", "h800-cluster": "h800-sxm", "hgx-h200": "h200-sxm", "dgx-b200": "b200-sxm",
          "gb200-nvl72": "gb200", "dgx-b300": "b300-sxm", "gb300-nvl72": "gb300"}  # fmt: skip
#: a GPU description's numeric fields, each with its unit (or a count / fraction) in its name
UNIT_NAMES = {"hbm_bw_GBps", "hbm_GiB", "kernel_launch_us", "sm_count", "hbm_efficiency", "fwd_TFLOPs",
              "bwd_TFLOPs", "sustained_compute_fraction", "fp8_block_gemm_fraction", "dispatch_GBps",
              "combine_GBps", "head_dim", "state_dim", "fwd_Gheadtokens_per_s"}  # fmt: skip


def test_every_shipped_file_loads():
    assert set(SHARED) | {"cpu-host", "dgx-a100"} == set(available_topologies())
    assert set(SHARED.values()) == set(available_gpus())
    for name in available_topologies():
        topo = load_topology(name)
        if name in SHARED:
            assert topo.gpu == load_gpu(SHARED[name])
            assert yaml.safe_load((TOPOLOGY_DIR / f"{name}.yaml").read_text())["gpu"] == SHARED[name]


def test_gpu_figures_carry_units_and_sources():
    """Every number of a GPU description sits on a line with a comment, under a key that names its unit;
    peak keys are dtypes under ``peak_TFLOPs`` (one line for all is enough); GEMM points name their source."""
    for name in available_gpus():
        text = (GPU_DIR / f"{name}.yaml").read_text()
        for line in text.splitlines():
            m = re.match(r"^\s*(\w+):\s*([0-9][0-9.]*)\s*(#.*)?$", line)
            if m is None:
                continue
            key, _, comment = m.groups()
            assert key in UNIT_NAMES or key in ("nvfp4", "fp8", "mxfp8", "bf16", "fp16", "tf32", "fp32"), (name, line)
            if key in UNIT_NAMES - {"fwd_TFLOPs", "bwd_TFLOPs", "head_dim", "state_dim"}:
                assert comment, f"{name}: '{line.strip()}' needs a comment naming its source"
        gpu = load_gpu(name)
        assert gpu.sm_count and gpu.hbm_efficiency and gpu.attention is not None
        assert "fp8" in gpu.peak_TFLOPs and all(p.source and p.kernel for p in gpu.gemm_points)
        assert ("mxfp8" in gpu.peak_TFLOPs) == gpu.kind.startswith(("B200", "GB200", "B300", "GB300"))
        for what in ("datasheet", "measured"):
            assert what in text, (name, what)


def test_shipped_gpu_kinds():
    h100, h800, b200, gb200 = (load_gpu(n) for n in ("h100-sxm", "h800-sxm", "b200-sxm", "gb200"))
    assert (h100.peak_TFLOPs["bf16"], h100.peak_TFLOPs["fp8"], h100.sm_count) == (989, 1979, 132)
    assert h800.peak_TFLOPs["bf16"] == 990 and h800.gemm_points_from["bf16"] == h100
    assert (b200.peak_TFLOPs["mxfp8"], b200.sm_count, b200.hbm_bw_GBps) == (4500, 148, 8000)
    assert gb200.peak_TFLOPs["bf16"] == 2500 and gb200.gemm_points_from["mxfp8"] == b200
    topo = load_topology("gb200-nvl72")
    assert (topo.node.gpus_per_node, topo.nvlink_domain_gpus, topo.scaleout.nics_per_node) == (4, 72, 4)


def _write(path, data) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_gpu_by_name_from_anywhere_by_path_or_inline(tmp_path):
    data = yaml.safe_load((TOPOLOGY_DIR / "dgx-h100.yaml").read_text())
    # a copy elsewhere still finds the shipped description by name
    assert load_topology(_write(tmp_path / "copy.yaml", data)).gpu == load_gpu("h100-sxm")
    # a path, relative to the topology file, to a user's own description that borrows a shipped one
    own = yaml.safe_load((GPU_DIR / "h100-sxm.yaml").read_text())
    own.update(kind="H100-custom", gemm_points=[], gemm_points_from={"bf16": "h100-sxm"})
    (tmp_path / "gpus").mkdir()
    _write(tmp_path / "gpus" / "mine.yaml", own)
    topo = load_topology(_write(tmp_path / "rel.yaml", {**data, "gpu": "gpus/mine.yaml"}))
    assert topo.gpu.kind == "H100-custom" and topo.gpu.gemm_points_from["bf16"] == load_gpu("h100-sxm")
    # inline, as before
    inline = {**data, "gpu": {"kind": "X", "peak_TFLOPs": {"bf16": 100}, "hbm_bw_GBps": 1000, "hbm_GiB": 10}}
    gpu = load_topology(_write(tmp_path / "inline.yaml", inline)).gpu
    assert isinstance(gpu, GpuSpec) and gpu.gemm_points == [] and gpu.sm_count is None


def test_bad_gpu_references_name_file_and_field(tmp_path):
    data = yaml.safe_load((TOPOLOGY_DIR / "dgx-h100.yaml").read_text())
    with pytest.raises(InputError) as exc:
        load_topology(_write(tmp_path / "typo.yaml", {**data, "gpu": "h100-smx"}))
    assert exc.value.field == "gpu" and "did you mean 'h100-sxm'" in exc.value.message
    assert exc.value.file == str(tmp_path / "typo.yaml")
    # a loop of borrowed points
    a = yaml.safe_load((GPU_DIR / "h100-sxm.yaml").read_text())
    _write(tmp_path / "a.yaml", {**a, "gemm_points_from": {"bf16": "b.yaml"}})
    _write(tmp_path / "b.yaml", {**a, "gemm_points_from": {"bf16": "a.yaml"}})
    with pytest.raises(InputError, match="form a loop: a -> b -> a"):
        load_topology(_write(tmp_path / "loop.yaml", {**data, "gpu": "a.yaml"}))
    # a bad figure inside a description names that file
    _write(tmp_path / "bad.yaml", {**a, "sm_count": 0})
    with pytest.raises(InputError) as exc:
        load_topology(_write(tmp_path / "t.yaml", {**data, "gpu": "bad.yaml"}))
    assert exc.value.file == str((tmp_path / "bad.yaml").resolve()) and "sm_count" in str(exc.value)


def test_nvlink_domain_holds_whole_nodes(tmp_path):
    data = yaml.safe_load((TOPOLOGY_DIR / "gb200-nvl72.yaml").read_text())
    with pytest.raises(InputError) as exc:
        load_topology(_write(tmp_path / "odd.yaml", {**data, "nvlink_domain_gpus": 70}))
    assert "nvlink_domain_gpus" in str(exc.value) and "multiple of node.gpus_per_node" in str(exc.value)
    assert load_topology("dgx-h100").nvlink_domain_gpus is None


# ---- Blackwell Ultra (B300, GB300): docs/research/gpu-figures.md, "Blackwell Ultra (B300, GB300)" ----------
def test_blackwell_ultra_kinds():
    """BF16 / FP8 dense peaks are Blackwell's (only NVFP4 and the SFU rose); HBM and SMs device-reported; GEMM
    curves borrowed (GB300 -> B300 -> B200); GB300's attention is GB200's scaled by the measured cuDNN ratio."""
    b200, gb200, b300, gb300 = (load_gpu(n) for n in ("b200-sxm", "gb200", "b300-sxm", "gb300"))
    for ultra, base in ((b300, b200), (gb300, gb200)):
        assert {k: v for k, v in ultra.peak_TFLOPs.items() if k != "nvfp4"} == {
            k: v for k, v in base.peak_TFLOPs.items() if k != "nvfp4"}  # fmt: skip
        assert ultra.peak_TFLOPs["nvfp4"] / base.peak_TFLOPs["nvfp4"] == pytest.approx(1.5, abs=0.06)  # 14 / 9, 15 / 10
        assert (ultra.hbm_bw_GBps, ultra.sm_count) == (8000, 148)
    assert (b300.kind, b300.hbm_GiB, gb300.kind, gb300.hbm_GiB) == ("B300-SXM", 268.6, "GB300", 277.5)
    # nvidia-smi's memory.total in MiB, as GiB
    assert (b300.hbm_GiB, gb300.hbm_GiB) == (round(275040 / 1024, 1), round(284208 / 1024, 1))
    assert b300.gemm_points_from["bf16"] == b200 and gb300.gemm_points_from["fp8"] == b300
    assert {p.dtype for p in b300.gemm_points} == {"bf16", "fp8"} and not gb300.gemm_points
    assert gb300.attention.fwd_TFLOPs == pytest.approx(gb200.attention.fwd_TFLOPs * 1703 / 1408, abs=0.05)
    assert gb300.attention.bwd_TFLOPs == pytest.approx(gb200.attention.bwd_TFLOPs * 1248 / 1148, abs=0.05)
    assert b300.attention.fwd_TFLOPs == gb300.attention.fwd_TFLOPs  # same die
    assert b300.sustained_compute_fraction == b200.sustained_compute_fraction  # no B300 fit rows


def test_dgx_b300_inter_node_bandwidth_per_gpu():
    """2 nodes: a GPU's traffic to the other node leaves through its own 800G ConnectX-8 at 800 / 8 x 0.97 GB/s;
    the GPU <-> NIC PCIe Gen6 link does not cap it; the bisection is 8 NICs."""
    from sim.hardware.cluster import bisection_GBps, build_cluster

    topo = load_topology("dgx-b300")
    assert topo.scaleout.nic_bw_GBps == pytest.approx(800 / 8 * 0.97) == pytest.approx(97.0)
    c = build_cluster(topo, 2)
    assert (c.world_size, c.gpus_per_node, c.nics_per_node, c.nodes_per_domain) == (16, 8, 8, 1)
    for dst in (8, 15):  # same rail, and another rail (PXN over NVLink first)
        assert c.link_bw_Bps[list(c.path(0, dst))].min() == pytest.approx(97.0e9)
    assert c.link_bw_Bps[list(c.path(0, 1))].min() == pytest.approx(720e9)  # NVLink5, NCCL's model
    assert bisection_GBps(c) == pytest.approx(8 * 97.0)


def test_gb300_nvl72_rack_is_one_nvlink_domain():
    """18 trays of 4 GPUs are one 72-GPU NVLink domain (every pair over NVLink, 2 hops); 36 trays are two
    such domains, joined by one 800G ConnectX-8 per GPU."""
    from sim.hardware.cluster import build_cluster

    topo = load_topology("gb300-nvl72")
    rack = build_cluster(topo, 18)
    assert (rack.world_size, rack.gpus_per_node, rack.gpus_per_domain) == (72, 4, 72)
    assert rack.nodes_per_domain == 18 and {rack.domain_of(r) for r in range(72)} == {0}
    inside = list(rack.path(0, 71))  # tray 0 to tray 17: through the rack's NVLink switch
    assert len(inside) == 2 and rack.link_bw_Bps[inside].min() == pytest.approx(720e9)
    two = build_cluster(topo, 36)
    assert (two.world_size, two.gpus_per_domain) == (144, 72)
    assert [two.domain_of(r) for r in (0, 71, 72, 143)] == [0, 0, 1, 1]
    assert two.link_bw_Bps[list(two.path(0, 72))].min() == pytest.approx(97.0e9)


@pytest.mark.parametrize(
    ("topology", "sets", "gpus", "crosses_nics"),
    [
        ("dgx-b300", ["cluster.nodes=2", "training.global_batch_size=128"], 8, True),  # EP 8 over 2 x 4 GPUs
        ("gb300-nvl72", ["cluster.nodes=2", "training.global_batch_size=128"], 8, False),  # 2 trays, one rack
    ],
)
def test_simulate_small_moe_on_blackwell_ultra(cli, topology, sets, gpus, crosses_nics):
    """``moesim simulate`` of the 8-expert seed scenario runs on each new topology: EP 8 over two DGX B300
    nodes sends its all-to-all through the NICs, over two GB300 trays it stays on the rack's NVLink."""
    import json

    args = [x for s in [f"cluster.topology={topology}", "parallelism.ep=8", *sets] for x in ("--set", s)]
    r = cli("simulate", "scenarios/seed-4gpu.yaml", *args, "--json", "-")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["num_gpus"] == gpus and data["step_time_s"] > 0 and data["memory"]["fits"]
    assert (data["link_bytes_by_kind"]["nic_tx"] > 0) == crosses_nics
