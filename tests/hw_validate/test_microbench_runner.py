"""The microbenchmark job's supervision (hw_validate/microbenchmarks/runner.py): the cause of a
failure kept in the output's tail through a progress bar's redraws, and a rank that dies a
JobError naming it."""

from __future__ import annotations

import pytest

from hw_validate.microbenchmarks.runner import _ByteTail, _cause


def test_failure_cause_survives_a_progress_bar_after_it():
    tail = _ByteTail(limit=16384)
    tail.append(b"[rank1]: Traceback (most recent call last):\n[rank1]: ValueError: unknown collective x\n")
    for i in range(300):  # tqdm redraws in tiny chunks; the old 64-chunk tail lost the line above
        tail.append(f"\rmicrobenchmarks: {i}%".encode())
    tail.append(b"\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n")
    assert _cause(tail) == "rank 1: ValueError: unknown collective x"
    for _ in range(3000):  # 30 KB of other output pushes it out
        tail.append(b"x" * 10)
    assert tail.size <= 16384 + 10 and _cause(tail) is None



@pytest.mark.slow
def test_rank_that_dies_is_a_job_error_with_its_cause(tmp_path):
    pytest.importorskip("torch")
    from hw_validate.launch import JobError
    from hw_validate.microbenchmarks.runner import run_microbench
    from hw_validate.microbenchmarks.spec import build_spec

    spec = build_spec(None, "gloo", quick=True)
    spec["comm"]["kinds"] = ["all_to_all", "broadcast_v"]  # a collective the bench does not know
    with pytest.raises(JobError) as exc:
        run_microbench(spec, 2, timeout_s=120, echo=False, work_dir=tmp_path)
    first = str(exc.value).splitlines()[0]
    assert "calibration job failed" in first and "unknown collective broadcast_v" in first
    assert "last lines of the job" in str(exc.value)
