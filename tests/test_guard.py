"""The resource guard (sim/studies/guard.py): scenarios that would exhaust this machine are refused before
anything big is allocated, with the estimate and what would fit; the shipped ones pass; the
estimate is checked against the peak RSS of real runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tracemalloc

import pytest
from conftest import ROOT, run_cli

from sim.api import load_scenario
from sim.engine.simulate import uses_lane_engine
from sim.errors import InputError
from sim.studies.guard import (
    MEMORY_FRACTION,
    Shape,
    check_resources,
    estimate,
    shape_of,
)

BIG = ROOT / "scenarios" / "128gpu.yaml"
HUGE = ["--set", "cluster.nodes=12500"]  # 100,000 H100s
GiB = float(1 << 30)


def test_100k_gpus_with_direct_all_to_all_is_refused_with_the_estimate():
    p = run_cli("simulate", str(BIG), *HUGE, "--fidelity", "full", "--json", "-", timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stdout == ""  # nothing ran, no JSON
    err = p.stderr
    assert "Traceback" not in err
    assert err.startswith(f"moesim: error: {BIG}: cluster.nodes: ") or "128gpu.yaml: cluster.nodes:" in err
    assert "100,000 GPUs" in err and "direct all-to-all" in err
    m = re.search(r"needs an estimated ~([\d.]+) (TiB|PiB) of memory", err)
    assert m, err
    # the (world x world) float64 dispatch matrix of each of the 48 x 8 (MoE layer, micro-batch) cells
    assert float(m.group(1)) * (1024 if m.group(2) == "PiB" else 1) >= 8 * 100_000**2 * 48 * 8 / 2**40
    assert "dispatch matrices" in err and "--force" in err and "fewer nodes: --set cluster.nodes=" in err
    # the analytic engine is refused too (world^2 temporaries); routing alone now fits (world x ep arrays)
    for args in (("simulate", str(BIG), *HUGE, "--engine", "analytic"),):
        q = run_cli(*args, timeout=120)
        assert q.returncode == 2 and "cluster.nodes" in q.stderr and "estimated" in q.stderr, q.stderr


def test_refusal_allocates_nothing_big():
    s = load_scenario(BIG, ["cluster.nodes=12500"])
    tracemalloc.start()
    try:
        with pytest.raises(InputError) as exc:
            check_resources(s, available_bytes=16 * GiB, limit_s=3600, fidelity="full")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5e6, peak  # closed forms only, bisection over a few shapes
    assert exc.value.field == "cluster.nodes" and exc.value.file == str(BIG)


def test_every_suggestion_in_the_message_fits():
    s = load_scenario(BIG, ["cluster.nodes=12500"])
    avail, limit = 16 * GiB, 3600.0
    with pytest.raises(InputError) as exc:
        check_resources(s, available_bytes=avail, limit_s=limit, fidelity="full")
    msg = str(exc.value)
    n = int(re.search(r"fewer nodes: --set cluster.nodes=(\d+) or less", msg).group(1))
    fit = estimate(load_scenario(BIG, [f"cluster.nodes={n}"]))
    assert fit.memory_bytes <= MEMORY_FRACTION * avail and fit.time_s <= limit
    assert (n * 8) % 16 == 0  # ep 16 still divides the world
    nxt = next(k for k in range(n + 1, n + 10) if (k * 8) % 16 == 0)
    with pytest.raises(InputError):  # the next valid layout up does not fit: n is the largest
        check_resources(load_scenario(BIG, [f"cluster.nodes={nxt}"]), available_bytes=avail, limit_s=limit,
                        fidelity="full")  # fmt: skip
    na = int(re.search(r"--engine analytic with --set cluster.nodes=(\d+) or less", msg).group(1))
    est = check_resources(load_scenario(BIG, [f"cluster.nodes={na}"]), "analytic", available_bytes=avail,
                          limit_s=limit)  # fmt: skip
    assert est.engine == "analytic" and na > n
    # force: the same scenario goes through, with its estimate
    forced = check_resources(s, force=True, available_bytes=avail, limit_s=limit, fidelity="full")
    assert forced.memory_bytes > avail


@pytest.mark.parametrize("path", sorted((ROOT / "scenarios").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_scenarios_pass(path):
    s = load_scenario(path)
    lanes_only = not s.topology.gpu.is_cpu_host and uses_lane_engine(s, "full")  # no analytic engine for it
    for engine in ("des", "route") if lanes_only else ("des", "analytic", "route"):
        est = check_resources(s, engine)
        assert 0 < est.memory_bytes < 2 * GiB and 0 < est.time_s < 600


def test_the_folded_default_reaches_100k_gpus_and_full_fidelity_does_not():
    """The lane engine's costs grow with world x ep (routing) and the lanes it follows, not world^2."""
    s = load_scenario(BIG, ["cluster.nodes=12500"])
    folded = check_resources(s, available_bytes=16 * GiB, limit_s=3600)
    assert folded.engine == "des-lanes" and folded.memory_bytes < 13 * GiB
    with pytest.raises(InputError, match="cluster.nodes"):
        check_resources(s, available_bytes=16 * GiB, limit_s=3600, fidelity="full")
    small = check_resources(load_scenario(BIG, ["cluster.nodes=1024"]), available_bytes=16 * GiB, limit_s=3600)
    assert small.memory_bytes < 4 * GiB and small.time_s < 120


def test_time_limit_and_force_on_the_cli(tmp_path):
    scen = str(ROOT / "scenarios" / "cpu-2rank.yaml")
    env = {"MOESIM_TIME_LIMIT_S": "0.001"}
    p = _cli_env(env, "simulate", scen)
    assert p.returncode == 2 and "time limit" in p.stderr and "--force" in p.stderr, p.stderr
    out = tmp_path / "r.json"
    p = _cli_env(env, "simulate", scen, "--force", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert json.loads(out.read_text())["num_gpus"] == 2
    p = _cli_env({"MOESIM_TIME_LIMIT_S": "soon"}, "simulate", scen)
    assert p.returncode == 2 and "MOESIM_TIME_LIMIT_S" in p.stderr


def _cli_env(env: dict, *args: str) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "sim", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **env})  # fmt: skip


def test_estimate_grows_with_nodes_layers_and_micro_batches():
    sh = shape_of(load_scenario(BIG))
    for engine in ("des", "analytic", "route"):
        for attr in ("nodes", "layers", "micro"):
            a = estimate(sh, engine)
            b = estimate(Shape(**{**sh.__dict__, attr: getattr(sh, attr) * 2}), engine)
            assert b.memory_bytes > a.memory_bytes and b.time_s > a.time_s, (engine, attr)
    # the DES keeps one world x world float64 matrix per (MoE layer, micro-batch)
    est = estimate(sh, "des")
    assert est.memory_parts["per-(layer, micro-batch) dispatch matrices"] == 8 * 128**2 * 48 * 8


_MEASURE = """
import json, sys
from sim.api import load_scenario
from sim.engine.simulate import simulate
s = load_scenario(sys.argv[1], sys.argv[3:])
r = simulate(s, engine=sys.argv[2])
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"peak": hwm, "world": s.world_size}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
@pytest.mark.parametrize(
    "engine,overrides",
    [
        ("des", ["cluster.nodes=24", "training.grad_accum_steps=4"]),  # 192 GPUs: world^2 matrices, ring DAG
        ("analytic", ["cluster.nodes=32", "model.num_layers=8"]),
        ("des", ["cluster.nodes=2", "model.num_layers=4", "collectives.all_to_all=hierarchical"]),
    ],
)
def test_memory_estimate_against_the_peak_rss_of_a_real_run(engine, overrides):
    p = subprocess.run([sys.executable, "-c", _MEASURE, str(BIG), engine, *overrides], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr
    peak = json.loads(p.stdout)["peak"]
    est = estimate(load_scenario(BIG, overrides), engine)
    # conservative, and not by much (measured 0.96-1.4x on the 2-core CI VM)
    assert 0.8 * peak <= est.memory_bytes <= 2.5 * peak, (peak, est.memory_bytes, est.memory_parts)
