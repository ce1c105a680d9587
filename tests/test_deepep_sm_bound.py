"""DeepEP's normal kernels inside one NVLink domain move at most SMs x the GPU's ``deepep_GBps_per_sm``
(``sim.engine.a2a_timing.A2ATiming._sm_bound``; B200's figure from validation/published/C5). Closed
forms: the benchmark's bandwidth is exactly SMs x the figure while that is below the links' bound, and
the links' bound above it; HybridEP, GPUs without the figure and groups with RDMA traffic keep the
links' bound."""

from __future__ import annotations

import pytest

from sim.inputs.topology import load_gpu
from sim.studies.a2a_bench import a2a_rows, dispatcher_bandwidth
from sim.studies.published import entries


@pytest.fixture(scope="module")
def published():
    return {e["id"]: e for e in entries()}


def _bw(entry, **point):
    return dispatcher_bandwidth(entry["scenario"], point, entry)


def test_figure_is_c5_at_16_sms():
    fig = load_gpu("b200-sxm").deepep_GBps_per_sm
    assert (fig.dispatch_GBps, fig.combine_GBps) == (348 / 16, 302 / 16)
    gb = load_gpu("gb200").deepep_GBps_per_sm  # B200's (same die)
    assert (gb.dispatch_GBps, gb.combine_GBps) == (fig.dispatch_GBps, fig.combine_GBps)
    assert load_gpu("h800-sxm").deepep_GBps_per_sm is None


@pytest.mark.parametrize("sms", [8, 16, 24, 32])
def test_deepep_on_b200_is_sms_times_the_figure(published, sms):
    """8 ranks of one DGX B200: the links carry ~808 GB/s of the benchmark's bytes, so up to 32 SMs
    (696 / 604 GB/s) the kernel is the limit and the bandwidth is exactly SMs x the figure."""
    bw = _bw(published["C5"], ep=8, nodes=1, kernel="deepep", sms=sms)
    assert bw["dispatch_GBps"] == pytest.approx(sms * 21.75, rel=1e-9)
    assert bw["combine_GBps"] == pytest.approx(sms * 18.875, rel=1e-9)


def test_many_sms_leave_the_links_bound_and_hybridep_adds_its_copy(published):
    """DeepEP with 64 SMs runs at the links' bound (64 x 21.75 is above it). HybridEP is not capped by its
    SMs (4 or 16 the same) and its Torch API adds a device-to-device copy of the rank's tokens: its time
    is the links' time plus (read + write) the bytes at the GPU's HBM rate, exactly."""
    many = _bw(published["C5"], ep=8, nodes=1, kernel="deepep", sms=64)
    hyb = _bw(published["C5"], ep=8, nodes=1, kernel="hybridep", sms=16)
    assert hyb == _bw(published["C5"], ep=8, nodes=1, kernel="hybridep", sms=4)
    assert 16 * 21.75 < many["dispatch_GBps"] < 64 * 21.75
    hbm_Bps = 8000e9 * 0.81  # topologies/gpus/b200-sxm.yaml: hbm_bw_GBps x hbm_efficiency
    for d in ("dispatch", "combine"):
        bytes_ = many[f"{d}_GBps"] * 1e9 * many[f"{d}_s"]  # the benchmark's bytes (the same for both kernels)
        assert hyb[f"{d}_s"] == pytest.approx(many[f"{d}_s"] + 2 * bytes_ / hbm_Bps, rel=1e-9)


def test_gpu_without_the_figure_and_rdma_groups_are_unchanged(published):
    """H800 has no per-SM figure: C1 (8 ranks, one node) is the same at 4 and 64 SMs; C2's EP16 over
    two H800 nodes likewise (RDMA-bound, and the cap is for groups inside one NVLink domain)."""
    assert _bw(published["C1"], ep=8, nodes=1, sms=4) == _bw(published["C1"], ep=8, nodes=1, sms=64)
    assert _bw(published["C2"], ep=16, nodes=2, sms=4) == _bw(published["C2"], ep=16, nodes=2, sms=64)


def test_nvl72_trays_use_the_nvlink_metric_and_the_cap(published):
    """C8: 16 ranks on 4 GB200 trays are one NVLink domain: the bandwidth counts NVLink bytes received
    (as one node would) and DeepEP at 16 SMs is capped exactly as on B200."""
    bw = _bw(published["C8"], ep=16, nodes=4, kernel="deepep", sms=16)
    assert bw["dispatch_GBps"] == pytest.approx(16 * 21.75, rel=1e-9)
    rows = {r.metric: r for r in a2a_rows(published["C8"])}
    assert rows["dispatch_bf16_GBps@ep8 deepep 24 SMs"].predicted == pytest.approx(24 * 21.75, rel=1e-9)
    assert len(rows) == 2 * 19  # every measured point, not only those the scenario lists
