"""Calibration files: loading and its errors, ``apply_link_calibration`` on a multi-node cluster,
the order calibration -> faults in ``simulate``, and the cost model's calibrated fields."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from sim.api import load_scenario
from sim.errors import InputError
from sim.hardware.calibrated import apply_link_calibration
from sim.hardware.cluster import LINK_KINDS, build_cluster
from sim.hardware.costs import CostModel
from sim.inputs.calibration import (
    Calibration,
    GemmFit,
    LinkFit,
    load_calibration,
    save_calibration,
)
from sim.inputs.topology import load_topology
from tests.conftest import SCENARIOS


def _kind(cluster, name: str) -> np.ndarray:
    return cluster.link_kind_code == LINK_KINDS.index(name)


def test_apply_link_calibration_sets_classes_and_scales_leaf_links():
    base = build_cluster(load_topology("dgx-h100"), 4, 8)
    nic_bw = float(base.link_bw_Bps[_kind(base, "nic_tx")].mean())
    cal = Calibration(links={"intra": LinkFit(alpha_us=3.5, bw_GBps=300.0),
                             "inter": LinkFit(alpha_us=7.0, bw_GBps=nic_bw / 2e9)})  # fmt: skip
    c = apply_link_calibration(base, cal)
    intra, pcie = _kind(c, "intra"), _kind(c, "pcie_host")
    assert np.all(c.link_bw_Bps[intra] == 300e9) and np.allclose(c.link_latency_s[intra], 3.5e-6)
    for k in ("nic_tx", "nic_rx"):
        assert np.allclose(c.link_bw_Bps[_kind(c, k)], nic_bw / 2)
    for k in ("leaf_up", "leaf_down"):  # oversubscription kept: half the NICs' bandwidth, half the uplink
        sel = _kind(c, k)
        assert np.allclose(c.link_bw_Bps[sel], base.link_bw_Bps[sel] / 2)
        assert np.allclose(c.link_latency_s[sel], 7e-6)
    # the class the calibration lacks keeps the topology's figures, and so does the input cluster
    assert np.array_equal(c.link_bw_Bps[pcie], base.link_bw_Bps[pcie])
    assert np.array_equal(c.link_latency_s[pcie], base.link_latency_s[pcie])
    assert not np.any(base.link_bw_Bps[intra] == 300e9)
    u, v = c.link_names[int(np.flatnonzero(intra)[0])]
    assert c.graph.edges[u, v]["bw_GBps"] == pytest.approx(300.0)
    assert c.graph.edges[u, v]["latency_us"] == pytest.approx(3.5)
    assert apply_link_calibration(base, None) is base and apply_link_calibration(base, Calibration()) is base


def test_simulate_applies_calibration_before_faults(tmp_path):
    from sim.engine.simulate import _cluster

    save_calibration(tmp_path / "c.json", Calibration(links={"intra": LinkFit(alpha_us=1.0, bw_GBps=100.0)}))
    doc = yaml.safe_load((SCENARIOS / "seed-4gpu.yaml").read_text())
    doc["calibration"] = "c.json"
    doc["faults"] = {"links": [{"nvlink": {"rank": 1}, "bw_factor": 0.25}]}
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(doc))
    c = _cluster(load_scenario(p))
    intra = _kind(c, "intra")
    names = [c.link_names[i] for i in np.flatnonzero(intra)]
    bw = dict(zip(names, c.link_bw_Bps[intra], strict=True))
    hit = [n for n in names if "gpu1" in n[0] or "gpu1" in n[1]]
    assert len(hit) == 2 and all(bw[n] == pytest.approx(25e9) for n in hit)  # 0.25 x the calibrated 100
    assert all(bw[n] == pytest.approx(100e9) for n in names if n not in hit)
    assert c.healthy is not None and np.allclose(c.healthy.link_bw_Bps[intra], 100e9)


def test_load_rejects_wrong_format_version_and_link_class(tmp_path):
    good = Calibration(links={"intra": LinkFit(alpha_us=1.0, bw_GBps=2.0)}).model_dump(mode="json")
    cases = [({**good, "format": "other"}, "format"), ({**good, "version": 2}, "version"),
             ({**good, "links": {"nvlink": {"alpha_us": 1, "bw_GBps": 1}}}, "links"),
             ({**good, "links": {"intra": {"alpha_us": 1, "bw_GBps": -1}}}, "bw_GBps"),
             ({**good, "typo_field": 1}, "typo_field")]  # fmt: skip
    for i, (doc, field) in enumerate(cases):
        p = tmp_path / f"c{i}.json"
        p.write_text(json.dumps(doc))
        with pytest.raises(InputError) as exc:
            load_calibration(p)
        assert field in str(exc.value)
    p = tmp_path / "ok.json"
    save_calibration(p, Calibration(**{k: v for k, v in good.items() if k not in ("format", "version")}))
    assert load_calibration(p).links["intra"].bw_GBps == 2.0


def test_cost_model_reads_calibrated_fields():

    gpu = load_topology("cpu-host").gpu
    cal = Calibration(gemm={"fp32": GemmFit(peak_TFLOPs=0.2, m_half=10.0, nk_half=20.0)}, hbm_bw_GBps=50.0,
                      kernel_launch_us=4.0, optimizer_bytes_per_param=16.0, optimizer_step_overhead_us=300.0)  # fmt: skip
    cm = CostModel(gpu, cal)
    m, n, k = 100.0, 200.0, 300.0
    rate = 0.2e12 * (m / (m + 10)) * (n / (n + 20)) * (k / (k + 20))
    assert cm.gemm_time(m, n, k, "fp32") == pytest.approx(max(2 * m * n * k / rate, 4 * (m * k + k * n + m * n) / 50e9) + 4e-6)
    assert cm.optimizer_time(1e6) == pytest.approx(1e6 * 16 / 50e9 + 300e-6)
    assert cm.memory_time(1e6, kernels=3) == pytest.approx(1e6 / 50e9 + 3 * 4e-6)
    # without the overhead field: one launch, as before calibration knew the field
    assert CostModel(gpu, cal.model_copy(update={"optimizer_step_overhead_us": None})).optimizer_time(1e6) == (
        pytest.approx(1e6 * 16 / 50e9 + 4e-6)
    )


def test_collective_bytes_factor_scales_only_its_kind():
    """A calibrated all-gather bytes factor f: the ring all-gather's byte term grows f-fold (closed
    form on 2 ranks of one host: 2 alpha + f S/2 / bw), the other kinds and the latency stay, and it
    reaches the engine's tail through the cluster (the path ``simulate`` takes)."""
    from sim.network.comm import reduction_model
    from sim.network.nccl_tests import measure

    base = build_cluster(load_topology("cpu-host"), 1, 2)
    link = {"intra": LinkFit(alpha_us=200.0, bw_GBps=2.0)}
    plain = apply_link_calibration(base, Calibration(links=link))
    scaled = apply_link_calibration(base, Calibration(links=link, collective_bytes_factor={"all_gather": 2.5}))
    a, bw, s = 200e-6, 2e9, 4 * 2**20
    for c, f in ((plain, 1.0), (scaled, 2.5)):
        (ag,) = measure(c, "all_gather", "ring", [s])
        (ar,) = measure(c, "all_reduce", "ring", [s])
        assert ag["time_s"] == pytest.approx(2 * a + f * s / 2 / bw, rel=1e-9)
        assert ar["time_s"] == pytest.approx(4 * a + s / bw, rel=1e-9)
        per_byte, lat, _ = reduction_model(c, "all_gather", [0, 1], "ring")
        assert lat == pytest.approx(2 * a) and per_byte == pytest.approx(f / 2 / bw)
    with pytest.raises(Exception, match="collective_bytes_factor"):
        Calibration.model_validate({"collective_bytes_factor": {"all_gather": 0}})
    with pytest.raises(Exception, match="collective_bytes_factor"):
        Calibration.model_validate({"collective_bytes_factor": {"broadcast": 2.0}})
