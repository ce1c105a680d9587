"""The layout jobs' quantities (hw_validate/layout/quantities.py) on hand-made timelines with known
answers, and the simulator's side of the same quantities against the engine's own figures: the
bubble against ``breakdown_s.pipeline_bubble``, the p2p transfer against the calibrated link's
alpha-beta time of one activation, TP collectives against ``breakdown_s.tp_comm`` and the ring's
closed form. No torch: the real jobs are in test_layout_jobs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hw_validate.layout import quantities as Q
from hw_validate.layout.compare import compare, layer_stages, predict
from hw_validate.layout.record import FORMAT, VERSION, check
from sim.api import load_scenario
from sim.engine.simulate import uses_lane_engine
from sim.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = ROOT / "scenarios" / "accuracy" / "layout"
PP2, PPI, TP2 = LAYOUT / "pp2-1f1b.yaml", LAYOUT / "pp2-interleaved.yaml", LAYOUT / "tp2-sp.yaml"
CALIB = json.loads((ROOT / "calibrations" / "cpu-host-2rank.json").read_text())


def _alpha_beta(nbytes: float, links: int = 2) -> float:
    """The calibrated intra link: ``links`` hops of alpha, bytes over the link bandwidth."""
    link = CALIB["links"]["intra"]
    return links * link["alpha_us"] * 1e-6 + nbytes / (link["bw_GBps"] * 1e9)


def _span(name, a, b, **x):
    return [name, a, b, x]


def test_cpu_layouts_take_the_lane_engine_and_plain_cpu_keeps_the_per_rank_one():
    for f in (PP2, PPI, TP2):
        assert uses_lane_engine(load_scenario(f), "folded")
    assert not uses_lane_engine(load_scenario(ROOT / "scenarios" / "cpu-2rank.yaml"), "folded")
    assert not uses_lane_engine(load_scenario(ROOT / "scenarios" / "cpu-2rank.yaml"), "full")


def test_measured_pipeline_on_a_hand_made_1f1b_step():
    # rank 0 (stage 0): F0 [0,10] send F0; F1 [10,20] send F1 + post recv B0; wait B0 until 47; B0 [47,67]; ...
    r0 = [
        _span("forward", 0, 10, micro=0, chunk=0, stage=0),
        _span("send_issue", 10, 10, dir="F", micro=0, chunk=0, stage=0, bytes=8),
        _span("p2p_post", 10, 10.5, ops=1),
        _span("forward", 10.5, 20, micro=1, chunk=0, stage=0),
        _span("send_issue", 20, 20, dir="F", micro=1, chunk=0, stage=0, bytes=8),
        _span("recv_issue", 20, 20, dir="B", micro=0, chunk=0, stage=0, bytes=8),
        _span("recv_wait", 21, 47, dir="B", micro=0, chunk=0, stage=0, blocked=True),
        _span("backward", 47, 67, micro=0, chunk=0, stage=0),
        _span("optimizer", 67, 70),
        _span("step", 0, 70),
    ]
    # rank 1 (stage 1): posts recv F0 at 0, gets it at 11; F0 [11,21]; loss [21,22]; B0 [22,45] sends B0 at 45
    r1 = [
        _span("recv_issue", 0, 0, dir="F", micro=0, chunk=0, stage=1, bytes=8),
        _span("recv_wait", 0, 11, dir="F", micro=0, chunk=0, stage=1, blocked=True),
        _span("forward", 11, 21, micro=0, chunk=0, stage=1),
        _span("loss", 21, 22, micro=0),
        _span("backward", 22, 45, micro=0, chunk=0, stage=1),
        _span("send_issue", 45, 45, dir="B", micro=0, chunk=0, stage=1, bytes=8),
        _span("optimizer", 45, 48),
        _span("step", 0, 48),
    ]
    q = Q.measured_pipeline([r0, r1])
    assert q["step_s"] == 70
    assert q["ranks"][0]["compute_s"] == pytest.approx(39.5) and q["ranks"][0]["bubble_s"] == pytest.approx(27.5)
    assert q["ranks"][0]["recv_wait_s"] == 26 and q["ranks"][0]["post_s"] == pytest.approx(0.5)
    assert q["ranks"][1]["compute_s"] == 34 and q["ranks"][1]["bubble_s"] == 33  # 11 waiting + 22 idle at the end
    assert q["bubble_s"] == pytest.approx((27.5 + 33) / 2)
    msgs = {(m["dir"], m["micro"]): m for m in q["messages"]}
    assert msgs[("F", 0)]["transfer_s"] == 1 and msgs[("F", 0)]["after_pass_s"] == 1  # sent at 10, there at 11
    assert msgs[("B", 0)]["transfer_s"] == 2 and msgs[("B", 0)]["after_pass_s"] == 2  # sent at 45, there at 47
    assert q["pass_s"] == {"B0": 20, "B1": 23, "F0": pytest.approx(9.75), "F1": 11}  # the loss in the last forward
    assert q["ranks"][0]["late_post_wait_s"] == q["ranks"][1]["late_post_wait_s"] == 0  # both posted before the send
    r1[0] = _span("recv_issue", 10.5, 10.5, dir="F", micro=0, chunk=0, stage=1, bytes=8)  # posted after the send
    r1[1] = _span("recv_wait", 10.6, 11, dir="F", micro=0, chunk=0, stage=1, blocked=True)
    late = Q.measured_pipeline([r0, r1])
    assert late["ranks"][1]["late_post_wait_s"] == pytest.approx(0.4)
    assert {(m["dir"], m["micro"]): m["transfer_s"] for m in late["messages"]}[("F", 0)] == pytest.approx(0.5)


@pytest.mark.parametrize("path", [PP2, PPI], ids=["1f1b", "interleaved"])
def test_simulated_pipeline_matches_the_engine(path):
    s = load_scenario(path)
    p = predict("pipeline", s)
    assert p["bubble_s"] == pytest.approx(p["breakdown_s"]["pipeline_bubble"], rel=1e-9)
    assert p["simulator"]["lane_engine"]
    send = s.training.micro_batch_size * s.training.seq_len * s.model.hidden_size * 4
    assert p["p2p_transfer_s"] == pytest.approx(_alpha_beta(send), rel=1e-9)  # rank -> host switch -> rank
    chunks = s.parallelism.pp * s.parallelism.vpp
    assert sorted(p["pass_s"]) == sorted(f"{k}{v}" for k in "FB" for v in range(chunks))
    assert all(v > 0 for v in p["pass_s"].values())


def test_layer_stages_follow_the_simulators_split():
    s = load_scenario(PPI)
    st = layer_stages(s)
    assert st == {-1: 0, 0: 0, 1: 1, 2: 2, 3: 3, 4: 3}  # embedding with layer 0, head with layer 3


def test_simulated_tp_matches_the_engine_and_the_ring():
    s = load_scenario(TP2)
    p = predict("tensor_parallel", s)
    assert p["calls"] == 8 * s.model.num_layers  # AG, RS before/after attention and MLP, forward and backward
    # the layers' collectives, plus the embedding's, the LM head's and the vocab-parallel loss's (outside the layers)
    outside = p["not_modelled_s"]
    assert {k.split(":")[1] for k in outside} == {"embedding", "output"}
    assert p["tp_comm_s"] + sum(outside.values()) == pytest.approx(p["breakdown_s"]["tp_comm"], rel=1e-9)
    act = s.training.micro_batch_size * s.training.seq_len * s.model.hidden_size * 4
    ring = _alpha_beta(act / 2)  # 2 ranks: one ring step of half the activation
    assert set(p["per_call_first_s"]) == {f"{k}:{ph}" for k in ("tp_all_gather", "tp_reduce_scatter") for ph in ("fwd", "bwd")}
    for v in p["per_call_first_s"].values():  # last entry -> first exit: the transfer alone
        assert v == pytest.approx(ring, rel=1e-9)
    for v in p["per_call_s"].values():  # a rank's own span: plus its wait for the other (host effects, lane_host)
        assert v >= ring * (1 - 1e-9)
    assert set(p["compute_s"]) == {"attention:fwd", "attention:bwd", "mlp:fwd", "mlp:bwd"}


def test_measured_tp_pairs_calls_across_ranks():
    def ranks(shift):
        return [
            _span("tp_all_gather", 0 + shift, 3, phase="fwd", region="attention", layer=0, bytes=4),
            _span("attention", 0 + shift, 8, phase="fwd", layer=0, comm_s=3 - shift + 2),
            _span("tp_reduce_scatter", 6, 8 + shift, phase="fwd", region="attention", layer=0, bytes=4),
            _span("tp_all_gather", 9, 10, phase="fwd", region="head", layer=4, bytes=4),
            _span("step", 0, 12),
        ]

    q = Q.measured_tp([ranks(0), ranks(1)])
    assert q["calls"] == 2
    assert q["per_call_first_s"]["tp_all_gather:fwd"] == 2  # last entry at 1, first exit at 3
    assert q["per_call_own_s"]["tp_reduce_scatter:fwd"] == 3  # last entry at 6, last exit at 9
    assert q["per_call_s"]["tp_all_gather:fwd"] == pytest.approx(2.5)  # ranks: 3 and 2
    assert q["tp_comm_s"] == pytest.approx(2.5 + 2.5)
    assert q["not_modelled_s"] == {"tp_all_gather:output:fwd": 1}  # the head under the simulator's unit name
    assert q["compute_s"]["attention:fwd"] == pytest.approx(3)  # windows 8 - 5 and 7 - 4
    with pytest.raises(ValueError, match="different numbers"):
        Q.measured_tp([ranks(0), ranks(0)[1:]])


def test_compare_flags_what_misses_15_percent():
    m = {"bubble_s": 1.0, "bubble_fraction": 0.2,
         "ranks": [{"bubble_s": 1.0, "compute_s": 3, "optimizer_s": 1, "late_post_wait_s": 0.0}],
         "p2p_transfer_s": 0.001, "p2p_after_pass_s": 0.002, "step_s": 5, "pass_s": {"F0": 1}}
    p = {**m, "bubble_s": 1.1, "p2p_transfer_s": 0.002}
    rows, err = compare("pipeline", m, p)
    assert err["compared"]["pipeline_bubble"] == pytest.approx(0.1)
    assert err["missed"] == ["p2p_send"] and err["worst"] == "p2p_send"
    assert all(r["error_rel"] is not None for r in rows if r["compared"])


def test_record_check_names_what_is_wrong():
    good = {"format": FORMAT, "version": VERSION, "job": "pipeline", "scenario": "x", "environment": {"world_size": 2},
            "config": {}, "steps": 1, "warmup_steps": 0, "measured_steps": [0], "spans": [[[], []]], "loss": [1.0]}
    check(good)
    for bad, msg in (({**good, "format": "other"}, "not a"), ({**good, "version": 9}, "version 9"),
                     ({**good, "job": "fsdp"}, "job must be"), ({**good, "spans": [[[]]]}, "1 ranks"),
                     ({k: v for k, v in good.items() if k != "loss"}, "missing keys: loss")):  # fmt: skip
        with pytest.raises(InputError, match=msg):
            check(bad, "m.json")
