"""``moesim sweep``: --vary parsing, product order, runs equal simulate(), the JSONL log (resume,
a killed sweep, a cut last line, another sweep's log), process pool = in-process, Ray, plot."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, SCENARIOS

from sim.api import load_scenario
from sim.cli.main import main
from sim.engine.simulate import simulate
from sim.errors import InputError
from sim.studies.sweep import parse_varies, parse_vary, product, read_log, split_values, sweep_header

BIG = str(SCENARIOS / "128gpu.yaml")
TINY = str(SCENARIOS / "cpu-2rank.yaml")
SMALL = ["cluster.nodes=2", "model.num_layers=2", "training.grad_accum_steps=1", "training.seq_len=512"]


def _sets(overrides):
    return [x for o in overrides for x in ("--set", o)]


def test_split_values_respects_brackets_and_quotes():
    assert split_values("1,2, 3") == ["1", "2", "3"]
    assert split_values("[1,2],{a: 1, b: 2},'x,y'") == ["[1,2]", "{a: 1, b: 2}", "'x,y'"]


def test_parse_vary_types_values_like_set():
    path, vals = parse_vary("routing.capacity_factor=1.0,null,2")
    assert path == "routing.capacity_factor"
    assert vals == [("1.0", 1.0), ("null", None), ("2", 2)]
    for bad in ("cluster.nodes", "cluster.nodes=", "cluster.nodes=1,,2", "cluster.nodes=2,2", "nope.x=1,2"):
        with pytest.raises(InputError) as exc:
            parse_vary(bad)
        assert exc.value.field == "--vary"
    with pytest.raises(InputError, match="varied twice"):
        parse_varies(["cluster.nodes=1,2", "cluster.nodes=4"])


def test_product_order_last_key_fastest():
    pts = product(parse_varies(["cluster.nodes=2,4", "routing.policy=topk,node_limited:M=1"]))
    assert [p.texts for p in pts] == [
        ("cluster.nodes=2", "routing.policy=topk"), ("cluster.nodes=2", "routing.policy=node_limited:M=1"),
        ("cluster.nodes=4", "routing.policy=topk"), ("cluster.nodes=4", "routing.policy=node_limited:M=1"),
    ]  # fmt: skip
    assert pts[1].values == {"cluster.nodes": 2, "routing.policy": "node_limited:M=1"}
    assert len({p.key for p in pts}) == 4


def _sweep(tmp_path, *args, name="s"):
    out = tmp_path / f"{name}.json"
    code = main(["sweep", BIG, *_sets(SMALL), *args, "--no-progress", "--json", str(out)])
    return code, (json.loads(out.read_text()) if code == 0 else None), out


def test_runs_equal_simulate_and_json_keys(tmp_path, capsys):
    code, doc, out = _sweep(tmp_path, "--vary", "cluster.nodes=2,4", "--vary", "routing.skew=0,1", "--jobs", "1")
    assert code == 0
    assert [r["overrides"] for r in doc["runs"]] == [
        {"cluster.nodes": 2, "routing.skew": 0}, {"cluster.nodes": 2, "routing.skew": 1},
        {"cluster.nodes": 4, "routing.skew": 0}, {"cluster.nodes": 4, "routing.skew": 1},
    ]  # fmt: skip
    for r in doc["runs"]:
        o = r["overrides"]
        ref = simulate(load_scenario(BIG, [*SMALL, f"cluster.nodes={o['cluster.nodes']}", f"routing.skew={o['routing.skew']}"]))
        assert r["step_time_s"] == ref["step_time_s"] and r["num_gpus"] == 8 * o["cluster.nodes"]
        assert r["breakdown_s"] == ref["breakdown_s"] and r["traffic"]["a2a_bytes"] == ref["traffic"]["a2a_bytes"]
    assert doc["vary"] == {"cluster.nodes": [2, 4], "routing.skew": [0, 1]}
    log = out.with_suffix(".jsonl").read_text().splitlines()
    assert len(log) == 5 and json.loads(log[0])["moesim_sweep"] == 1
    table = capsys.readouterr().out
    assert "4 runs (0 from the log)" in table and "tokens/s/GPU" in table


def test_resume_skips_done_points_and_gives_the_same_json(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    code, _, _ = _sweep(tmp_path, "--vary", "routing.seed=0,1", "--jsonl", str(log), "--jobs", "1", name="a")
    assert code == 0
    code, doc, out = _sweep(tmp_path, "--vary", "routing.seed=0,1,2", "--jsonl", str(log), "--jobs", "1", name="b")
    assert code == 0
    assert "3 runs (2 from the log)" in capsys.readouterr().out
    assert len(log.read_text().splitlines()) == 1 + 3
    code, fresh, fresh_out = _sweep(tmp_path, "--vary", "routing.seed=0,1,2", "--jsonl", str(tmp_path / "f.jsonl"),
                                    "--jobs", "1", name="c")  # fmt: skip
    assert out.read_bytes() == fresh_out.read_bytes()  # resumed JSON = uninterrupted JSON, byte for byte


def test_cut_last_line_is_dropped_and_a_foreign_log_refused(tmp_path):
    header = sweep_header(TINY, [], "des", "auto")
    log = tmp_path / "x.jsonl"
    good = json.dumps({"overrides": {"routing.seed": 0}, "step_time_s": 1.0})
    log.write_text(json.dumps(header) + "\n" + good + "\n" + '{"overrides": {"routing.se')
    done = read_log(log, header)
    assert list(done) == ['{"routing.seed":0}']
    assert log.read_text().endswith(good + "\n")  # the cut line is gone, the rest kept
    other = {**header, "engine": "analytic"}
    with pytest.raises(InputError, match="belongs to another sweep"):
        read_log(log, other)
    log.write_text("hello\n")
    with pytest.raises(InputError, match="not a moesim sweep log"):
        read_log(log, header)


def test_killed_sweep_of_20_points_resumes(tmp_path):
    log = tmp_path / "kill.jsonl"
    argv = [sys.executable, "-m", "sim", "sweep", TINY, "--vary", "routing.seed=" + ",".join(map(str, range(20))),
            "--vary", "training.micro_batch_size=4", "--jobs", "1", "--jsonl", str(log), "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and len(log.read_bytes().splitlines()) >= 1 + 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()  # killed mid-sweep, not finished
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stderr.close()
    before = len(log.read_bytes().splitlines()) - 1
    assert 3 <= before < 20
    res = subprocess.run([*argv, "--json", str(tmp_path / "kill.json")], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert f"20 runs ({before} from the log)" in res.stdout
    lines = log.read_text().splitlines()[1:]
    keys = [json.dumps(json.loads(x)["overrides"], sort_keys=True) for x in lines]
    assert len(keys) == 20 and len(set(keys)) == 20
    doc = json.loads((tmp_path / "kill.json").read_text())
    assert [r["overrides"]["routing.seed"] for r in doc["runs"]] == list(range(20))


def test_process_pool_equals_in_process(tmp_path):
    args = ["--vary", "routing.seed=0,1,2", "--vary", "routing.skew=0,0.5"]
    code1, _, one = _sweep(tmp_path, *args, "--jobs", "1", name="one")
    code2, _, two = _sweep(tmp_path, *args, "--jobs", "2", name="two")
    assert code1 == code2 == 0
    assert one.read_bytes() == two.read_bytes()


def test_plot_and_x_axis(tmp_path):
    from test_compare import png_size

    png = tmp_path / "scale.png"
    code, _, _ = _sweep(tmp_path, "--vary", "cluster.nodes=2,4", "--vary", "routing.policy=topk,node_limited:M=1",
                        "--plot", str(png), "--jobs", "1")  # fmt: skip
    assert code == 0
    w, h = png_size(png)
    assert w >= 1200 and h >= 500


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ([], "at least one --vary"),
        (["--vary", "cluster.nodes=2,3"], "(at sweep point cluster.nodes=3)"),
        (["--vary", "routing.policy=topk,node_limited:M=1", "--plot", "p.png"], "numeric"),
        (["--vary", "cluster.nodes=2", "--plot", "p.png", "--x", "routing.skew"], "--x"),
        (["--vary", "cluster.nodes=2", "--address", "auto"], "needs --backend ray"),
        (["--vary", "cluster.nodes=2", "--jobs", "0"], "--jobs"),
    ],
)
def test_bad_input_exits_2(args, needle, capsys, tmp_path):
    argv = ["sweep", BIG, *_sets(SMALL), *args, "--no-progress", "--jsonl", str(tmp_path / "l.jsonl")]
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_ray_backend_missing_names_the_extra(capsys, tmp_path):
    try:
        import ray  # noqa: F401
    except ImportError:
        argv = ["sweep", TINY, "--vary", "routing.seed=0,1", "--backend", "ray", "--jsonl", str(tmp_path / "r.jsonl")]
        assert main(argv) == 2
        assert "pip install 'moesim[cluster]'" in capsys.readouterr().err
    else:
        pytest.skip("ray is installed; see test_ray_backend_equals_local")


def test_ray_backend_equals_local(tmp_path):
    pytest.importorskip("ray")
    args = ["--vary", "routing.seed=0,1,2", "--jobs", "2"]
    code1, _, local = _sweep(tmp_path, *args, name="local")
    code2, _, ray_out = _sweep(tmp_path, *args, "--backend", "ray", name="ray")
    assert code1 == code2 == 0
    assert local.read_bytes() == ray_out.read_bytes()


def test_resource_guard_refuses_a_point_and_force_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOESIM_TIME_LIMIT_S", "0.000001")
    code, _, _ = _sweep(tmp_path, "--vary", "routing.seed=0,1", "--jobs", "1")
    assert code == 2
    err = capsys.readouterr().err
    assert "time limit" in err and "(at sweep point routing.seed=0)" in err
    code, doc, _ = _sweep(tmp_path, "--vary", "routing.seed=0,1", "--jobs", "1", "--force")
    assert code == 0 and len(doc["runs"]) == 2
