"""Chrome trace-event JSON: valid format and required fields, one thread per stream, no overlapping
spans on a stream, compute-stream spans tiling each rank's step and summing to the breakdown, flow
events at all-to-all barriers, and ``simulate --trace`` end to end."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from conftest import SCENARIOS

from sim.api import load_scenario
from sim.cli.main import main
from sim.engine.simulate import simulate
from sim.reports.chrome_trace import category_of, flow_events, trace_events, write_chrome_trace
from sim.reports.plots import CATEGORIES

BIG = SCENARIOS / "128gpu.yaml"
# 16 GPUs, EP 16 over 2 nodes, skewed routing (waits at the barriers), ZeRO-2 with DP 16
SMALL = ["cluster.nodes=2", "model.num_layers=3", "training.grad_accum_steps=2", "training.seq_len=1024"]
REQUIRED_X = {"ph", "name", "cat", "pid", "tid", "ts", "dur", "args"}


def _run(overrides=(), comm_model="auto", scen=BIG, ranks=None):
    s = load_scenario(scen, list(overrides))
    res = simulate(s, comm_model=comm_model, trace_ranks=ranks or set(range(s.world_size)))
    return s, res, res.pop("_spans")


@pytest.fixture(scope="module")
def traced():
    return _run(SMALL)


def test_trace_is_valid_trace_event_json(traced, tmp_path):
    s, res, spans = traced
    path = tmp_path / "t.json"
    write_chrome_trace(path, spans, s, res, flows=True)
    doc = json.loads(path.read_text())
    assert set(doc) >= {"traceEvents", "displayTimeUnit"} and doc["displayTimeUnit"] in ("ms", "ns")
    ev = doc["traceEvents"]
    xs = [e for e in ev if e["ph"] == "X"]
    assert len(xs) == len(spans)
    for e in xs:
        assert set(e) >= REQUIRED_X
        assert isinstance(e["ts"], float | int) and e["dur"] > 0 and isinstance(e["args"], dict)
    named_threads = {(e["pid"], e["tid"]) for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    named_procs = {e["pid"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert {(e["pid"], e["tid"]) for e in xs} <= named_threads
    assert named_procs == {0, 1}  # one process per node
    # one thread per GPU stream: 8 GPUs x (compute, comm) per node
    assert len(named_threads) == 2 * 16
    assert {e["ph"] for e in ev} <= {"X", "M", "s", "f"}
    assert doc["otherData"]["step_time_s"] == res["step_time_s"]


def test_spans_carry_flops_and_bytes(traced):
    _, _, spans = traced
    experts = [sp for sp in spans if sp.name == "experts"]
    assert experts and all(sp.args["flops"] > 0 and sp.args["layer"] >= 0 for sp in experts)
    comm = [sp for sp in spans if sp.stream == "comm"]
    assert comm and all(sp.args["bytes"] > 0 for sp in comm)


def _streams(spans):
    by = defaultdict(list)
    for sp in spans:
        by[(sp.rank, sp.stream)].append(sp)
    return {k: sorted(v, key=lambda x: x.start) for k, v in by.items()}


@pytest.mark.parametrize("case", ["ps", "flow"])
def test_no_overlap_and_compute_stream_tiles_the_step(case, traced):
    if case == "ps":
        s, res, spans = traced
    else:  # one SimPy process per rank, every transfer through the max-min network
        s, res, spans = _run(["routing.generator=skewed", "routing.skew=1.0"], "flow", SCENARIOS / "seed-4gpu.yaml")
    ends = {}
    for (rank, stream), items in _streams(spans).items():
        for a, b in zip(items, items[1:], strict=False):
            assert b.start >= a.end - 1e-12, (rank, stream, a, b)
        if stream == "compute":
            assert items[0].start == 0.0
            gaps = sum(b.start - a.end for a, b in zip(items, items[1:], strict=False))
            assert gaps == pytest.approx(0.0, abs=1e-9)  # tiled: no idle hole on the compute stream
            ends[rank] = items[-1].end
    assert max(ends.values()) == pytest.approx(res["step_time_s"], rel=1e-12)
    assert len(ends) == s.world_size


def test_span_totals_equal_the_breakdown(traced):
    s, res, spans = traced
    tot = defaultdict(lambda: dict.fromkeys((*CATEGORIES, "grad_sync"), 0.0))
    for sp in spans:
        key = category_of(sp.name) if sp.stream == "compute" else "grad_sync"
        tot[sp.rank][key] += sp.end - sp.start
    n = s.world_size
    for cat in (*CATEGORIES, "grad_sync"):
        mean = sum(t[cat] for t in tot.values()) / n
        assert mean == pytest.approx(res["breakdown_s"][cat], rel=1e-9, abs=1e-12), cat
    c = res["critical_rank"]
    for cat in (*CATEGORIES, "grad_sync"):
        assert tot[c][cat] == pytest.approx(res["critical_rank_breakdown_s"][cat], rel=1e-9, abs=1e-12), cat
    # every rank: compute + a2a + imbalance_wait + exposed_comm + optimizer = its end
    for rank, t in tot.items():
        end = max(sp.end for sp in spans if sp.rank == rank and sp.stream == "compute")
        assert sum(t[k] for k in CATEGORIES) == pytest.approx(end, rel=1e-9)
    assert res["breakdown_s"]["imbalance_wait"] > 0  # skewed routing: the test sees real waits


def test_flow_events_point_from_the_last_arrival_to_waiting_peers(traced):
    s, _, spans = traced
    flows = flow_events(spans, s.gpus_per_node, s.ep)
    assert flows
    starts = {e["id"]: e for e in flows if e["ph"] == "s"}
    finishes = {e["id"]: e for e in flows if e["ph"] == "f"}
    assert set(starts) == set(finishes) and len(starts) == len(flows) // 2
    # in microseconds as the trace writes them (x * 1e6 / 1e6 need not give x back)
    waits = {(sp.rank, sp.end * 1e6) for sp in spans if sp.name == "imbalance_wait"}
    a2a = {(sp.rank, sp.start * 1e6) for sp in spans if sp.name in ("dispatch", "combine")}
    for fid, f in finishes.items():
        st = starts[fid]
        ts = f["ts"]
        assert f["bp"] == "e" and st["ts"] == f["ts"]
        assert (f["args"]["rank"], ts) in waits  # the target waited up to the barrier
        src = st["args"]["last_arrival"]
        assert (src, ts) in a2a and (src, ts) not in waits  # the source waited for no one
        assert src // s.ep == f["args"]["rank"] // s.ep  # same EP group


def test_events_of_a_partial_trace_name_only_traced_threads():
    s, _, spans = _run(SMALL, ranks={0, 9})
    ev = trace_events(spans, s.gpus_per_node)
    threads = {(e["pid"], e["tid"]) for e in ev if e["ph"] == "X"}
    assert threads == {(0, 0), (0, 1), (1, 2), (1, 3)}  # rank 9 = node 1, local GPU 1


def test_cli_simulate_trace(tmp_path):
    out = tmp_path / "trace.json"
    argv = ["simulate", str(BIG), *(x for o in SMALL for x in ("--set", o)), "--trace", str(out),
            "--trace-ranks", "0-3"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    ranks = {e["args"]["rank"] for e in doc["traceEvents"] if e["ph"] == "X"}
    assert ranks == {0, 1, 2, 3}
    assert not [e for e in doc["traceEvents"] if e["ph"] in ("s", "f")]  # flows only when asked
    assert main([*argv, "--trace-flows"]) == 0
    flows = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] in ("s", "f")]
    assert flows and {e["ph"] for e in flows} == {"s", "f"}


def test_cli_trace_to_an_unwritable_path_exits_2(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    argv = ["simulate", str(SCENARIOS / "cpu-2rank.yaml"), "--trace", str(blocker / "t.json")]
    assert main(argv) == 2
    assert "--trace" in capsys.readouterr().err


def test_same_step_same_trace_bytes(traced, tmp_path):
    s, res, spans = traced
    write_chrome_trace(tmp_path / "a.json", spans, s, res, flows=True)
    s2, res2, spans2 = _run(SMALL)
    write_chrome_trace(tmp_path / "b.json", spans2, s2, res2, flows=True)
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
