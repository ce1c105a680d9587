"""``moesim collective`` through a real subprocess: nccl-tests rows, size parsing, exit codes."""

from __future__ import annotations

import json

import pytest

from sim.cli.collective import parse_sizes
from sim.errors import InputError


def test_parse_sizes_powers_of_two():
    assert parse_sizes("8,1K,1M,64M,1G,2KiB") == [8, 1024, 2**20, 64 * 2**20, 2**30, 2048]
    for bad in ("1X", "", "0", "1.5"):
        with pytest.raises(InputError, match="--bytes"):
            parse_sizes(bad)


def test_all_to_all_two_nodes_is_nic_bound(cli):
    r = cli(
        "collective",
        "all_to_all",
        "--topology",
        "dgx-h100",
        "--nodes",
        "2",
        "--bytes",
        "1K,1M,64M,1G",
        "--json",
        "-",
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["ranks"] == 16 and data["algo"] == "direct"
    rows = data["rows"]
    assert [row["bytes"] for row in rows] == [1024, 2**20, 64 * 2**20, 2**30]
    times = [row["time_s"] for row in rows]
    assert times == sorted(times)
    # latency-bound at 1 KiB: one PXN path latency (NVLink + PCIe + 2 fabric hops + PCIe)
    assert times[0] == pytest.approx(19e-6, rel=0.01)
    # flat at the bottleneck: busbw -> 2 x NIC x (n-1)/n (nccl-tests #130) at large sizes
    assert rows[-1]["busbw_GBps"] == pytest.approx(2 * 48.5 * 15 / 16, rel=0.005)
    for row in rows:
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / row["time_s"] / 1e9)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 15 / 16)


def test_all_to_all_on_b200_says_its_nvlink_figure(cli):
    """One B200 node: the all-to-all runs NVLink at the GPU's all-to-all figure (0.7146 of 900), and says so."""
    r = cli("collective", "all_to_all", "--topology", "dgx-b200", "--nodes", "1", "--bytes", "1G")
    assert r.returncode == 0, r.stderr
    assert "# NVLink at the GPU's all-to-all figure: 643.1 GB/s per direction (ring collectives: 720.0)" in r.stdout
    j = cli("collective", "all_to_all", "--topology", "dgx-b200", "--nodes", "1", "--bytes", "1G", "--json", "-")
    data = json.loads(j.stdout)
    assert data["intra_GBps"] == pytest.approx(900 * 0.7146)
    wire = 2**30 * 7 / 8  # each GPU sends (n-1)/n of its buffer; one NVLink path latency, 2 x 2.5 us
    assert data["rows"][0]["busbw_GBps"] == pytest.approx(wire / (5e-6 + wire / 643.14e9) / 1e9, rel=1e-6)
    ring = cli("collective", "all_reduce", "--topology", "dgx-b200", "--nodes", "1", "--bytes", "1G", "--json", "-")
    assert json.loads(ring.stdout)["intra_GBps"] == pytest.approx(720.0)


def test_all_reduce_table(cli):
    r = cli("collective", "all_reduce", "--topology", "dgx-h100", "--nodes", "2", "--bytes", "1M,1G")
    assert r.returncode == 0, r.stderr
    lines = [ln.split() for ln in r.stdout.splitlines() if not ln.startswith("#")]
    assert [int(ln[0]) for ln in lines] == [2**20, 2**30]
    busbw_1g = float(lines[1][3])
    # 8 rings, each NVLink shared by 8 of them: min(369 / 8, 48.5) x 8 = 369 GB/s upper bound
    assert 355 < busbw_1g <= 369.0
    assert float(lines[0][3]) < 0.1 * busbw_1g  # latency-bound at 1 MiB


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["all_reduce", "--topology", "dgx-h100", "--nodes", "2", "--bytes", "1M", "--algo", "tree"],
            "--algo: all_reduce has no algorithm 'tree'",
        ),
        (
            ["all_reduce", "--topology", "nope", "--nodes", "2", "--bytes", "1M"],
            "--topology: unknown topology 'nope'",
        ),
        (
            ["all_gather", "--topology", "cpu-host", "--nodes", "3", "--bytes", "1M"],
            "--nodes: topology 'cpu-host'",
        ),
        (
            ["all_gather", "--topology", "dgx-h100", "--nodes", "1", "--bytes", "1Q"],
            "--bytes: cannot read size '1Q'",
        ),
    ],
)
def test_collective_bad_input_exits_2(cli, args, message):
    r = cli("collective", *args)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr


def test_unknown_kind_is_a_usage_error(cli):
    r = cli("collective", "broadcast", "--topology", "dgx-h100", "--nodes", "1", "--bytes", "1M")
    assert r.returncode == 2 and "invalid choice" in r.stderr
