"""``moesim sweep``: the cartesian product of ``--vary`` values, run locally or on Ray, resumable.

Every finished run is appended (one JSON line, flushed and fsynced) to a JSONL file whose first
line names the sweep: the scenario file (path and SHA-256), the ``--set`` overrides, the engine and
the comm model. Running the same sweep again reads that file and skips every point already in it,
so a sweep killed half-way resumes where it stopped; a last line cut short by the kill is dropped.
Points are keyed by their overrides (``{"cluster.nodes": 4, ...}``, values parsed as YAML), so
widening a ``--vary`` list later reuses the points already run.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from sim.api import load_scenario
from sim.errors import InputError
from sim.inputs.scenario import Scenario
from sim.inputs.scenario_file import apply_override
from sim.reports.progress import part, report, reporting

JSONL_VERSION = 1


# ---- --vary parsing ------------------------------------------------------------------------------
def split_values(text: str) -> list[str]:
    """Split ``'1,2,[3,4]'`` on the commas outside brackets, braces and quotes."""
    out, cur, depth, quote = [], [], 0, None
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    out.append("".join(cur).strip())
    return out


def parse_vary(text: str, field_name: str = "--vary") -> tuple[str, list[tuple[str, Any]]]:
    """``'cluster.nodes=2,4,8'`` -> ``('cluster.nodes', [('2', 2), ('4', 4), ('8', 8)])``:
    each value as typed and as parsed (YAML, like ``--set``); the path must exist in the schema."""
    if "=" not in text:
        raise InputError(f"'{text}' must look like path=v1,v2,..., e.g. cluster.nodes=2,4,8", field=field_name)
    path, raw = (p.strip() for p in text.split("=", 1))
    values = split_values(raw)
    if not path or not raw.strip() or any(v == "" for v in values):
        raise InputError(f"'{text}' needs a path and non-empty values, e.g. cluster.nodes=2,4,8", field=field_name)
    try:
        apply_override({}, path, None)  # unknown paths: InputError naming the allowed keys
    except InputError as exc:
        exc.field = field_name
        raise
    parsed = []
    for v in values:
        try:
            parsed.append((v, yaml.safe_load(v)))
        except yaml.YAMLError:
            parsed.append((v, v))
    seen = [json.dumps(p, sort_keys=True, default=str) for _, p in parsed]
    if len(set(seen)) != len(seen):
        raise InputError(f"'{text}' repeats a value", field=field_name)
    return path, parsed


def parse_varies(texts: list[str], field_name: str = "--vary") -> list[tuple[str, list[tuple[str, Any]]]]:
    varies = [parse_vary(t, field_name) for t in texts]
    paths = [p for p, _ in varies]
    dup = sorted({p for p in paths if paths.count(p) > 1})
    if dup:
        raise InputError(f"'{dup[0]}' is varied twice; give all its values in one {field_name}", field=field_name)
    return varies


@dataclass(frozen=True)
class Point:
    """One sweep point: its overrides as typed (for ``load_scenario``) and as parsed (for JSON)."""

    texts: tuple[str, ...]  # ('cluster.nodes=4', ...)
    values: dict[str, Any] = field(hash=False, compare=False)

    @property
    def key(self) -> str:
        return point_key(self.values)

    @property
    def label(self) -> str:
        return ", ".join(self.texts)


def point_key(values: dict[str, Any]) -> str:
    return json.dumps(values, sort_keys=True, separators=(",", ":"), default=str)


def product(varies: list[tuple[str, list[tuple[str, Any]]]]) -> list[Point]:
    """The cartesian product in ``--vary`` order (the last key varies fastest)."""
    paths = [p for p, _ in varies]
    points = []
    for combo in itertools.product(*(vals for _, vals in varies)):
        points.append(Point(tuple(f"{p}={raw}" for p, (raw, _) in zip(paths, combo, strict=True)),
                            {p: val for p, (_, val) in zip(paths, combo, strict=True)}))  # fmt: skip
    return points


def load_points(
    path: str | Path, base: list[str], points: list[Point], guard: dict[str, Any] | None = None
) -> list[Scenario]:
    """Load and validate every point before anything runs: a bad combination exits 2 up front. With
    ``guard`` (keyword arguments of :func:`sim.studies.guard.check_resources`) each point must also fit the
    resource guard."""
    out = []
    for pt in points:
        try:
            s = load_scenario(path, [*base, *pt.texts])
            if guard is not None:
                from sim.studies.guard import check_resources

                check_resources(s, **guard)
            out.append(s)
        except InputError as exc:
            if pt.texts:
                exc.message = f"{exc.message} (at sweep point {pt.label})"
            raise
    return out


def guard_args(engine: str, comm_model: str, force: bool, backend: str, jobs: int, address: str | None,
               points: int) -> dict[str, Any] | None:  # fmt: skip
    """The resource guard for this machine's share of a sweep: the runs in flight at once share its
    memory; runs on a remote Ray cluster (``--address``) are not this machine's to guard."""
    if force or (backend == "ray" and address):
        return None
    from sim.studies.guard import available_memory_bytes

    avail = available_memory_bytes()
    share = max(1, min(jobs, points))
    return {"engine": engine, "comm_model": comm_model,
            "available_bytes": None if avail is None else avail / share}  # fmt: skip


# ---- the JSONL log -------------------------------------------------------------------------------
def sweep_header(scenario_path: str | Path, base: list[str], engine: str, comm_model: str) -> dict[str, Any]:
    p = Path(scenario_path)
    return {
        "moesim_sweep": JSONL_VERSION,
        "scenario": str(p),
        "scenario_sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
        "set": list(base),
        "engine": engine,
        "comm_model": comm_model,
    }


def default_jsonl(json_path: str | None, header: dict[str, Any]) -> Path:
    """Next to ``--json P`` (``P`` with suffix ``.jsonl``); else ``runs/sweep-<stem>-<hash>.jsonl``."""
    if json_path and json_path != "-":
        return Path(json_path).with_suffix(".jsonl")
    ident = json.dumps({k: header[k] for k in ("scenario_sha256", "set", "engine", "comm_model")}, sort_keys=True)
    digest = hashlib.sha256(ident.encode()).hexdigest()[:10]
    return Path("runs") / f"sweep-{Path(header['scenario']).stem}-{digest}.jsonl"


def read_log(path: Path, header: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Runs already in ``path`` by point key; checks that the file belongs to this sweep. A last line
    without its newline (the writer was killed mid-line) is cut off the file."""
    if not path.exists():
        return {}
    data = path.read_bytes()
    if not data:
        return {}
    if not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(path, "r+b") as fh:
            fh.truncate(cut)
        data = data[:cut]
    lines = data.decode("utf-8", errors="replace").splitlines()
    if not lines:
        return {}
    try:
        head = json.loads(lines[0])
    except json.JSONDecodeError:
        head = None
    if not isinstance(head, dict) or head.get("moesim_sweep") != JSONL_VERSION:
        raise InputError("is not a moesim sweep log; give another --jsonl or remove the file", file=str(path))
    for k in ("scenario_sha256", "set", "engine", "comm_model"):
        if head.get(k) != header[k]:
            raise InputError(
                f"belongs to another sweep ({k} was {head.get(k)!r}, now {header[k]!r}); "
                "give another --jsonl, or --fresh to start over",
                file=str(path),
                field="--jsonl",
            )
    done: dict[str, dict[str, Any]] = {}
    for n, line in enumerate(lines[1:], start=2):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise InputError(f"line {n} is not JSON; the log is damaged", file=str(path)) from None
        done[point_key(rec["overrides"])] = rec
    return done


class RunLog:
    """Append-only JSONL: header on creation, one line per finished run, fsynced."""

    def __init__(self, path: Path, header: dict[str, Any], fresh: bool = False):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if fresh or not path.exists() or path.stat().st_size == 0:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(json.dumps(header, sort_keys=True) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        self.fh = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def append(self, record: dict[str, Any]) -> None:
        from sim.ioutil import _clean

        self.fh.write(json.dumps(_clean(record), sort_keys=True, allow_nan=False) + "\n")
        self.fh.flush()
        os.fsync(self.fh.fileno())

    def close(self) -> None:
        self.fh.close()


# ---- running -------------------------------------------------------------------------------------
def run_point(scenario: Scenario, engine: str, comm_model: str) -> dict[str, Any]:
    """One simulate() call (a worker's job: picklable in, JSON-ready out)."""
    from sim.engine.simulate import simulate

    result = simulate(scenario, engine=engine, comm_model=comm_model)
    result.pop("_spans", None)
    return json.loads(json.dumps(_json_ready(result)))


def _json_ready(obj: Any) -> Any:
    from sim.ioutil import _clean

    return _clean(obj)


def _ignore_sigint() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def map_local(fn: Callable[[Scenario], dict[str, Any]], jobs: list[tuple[int, Scenario]], workers: int,
              on_result: Callable[[int, dict[str, Any]], None]) -> None:  # fmt: skip
    """``fn(scenario)`` for each job (index, scenario), in this process (``workers == 1``) or on a
    spawned process pool (``fn`` picklable); ``on_result(index, result)`` as each finishes."""
    if workers <= 1 or len(jobs) <= 1:
        for j, (i, s) in enumerate(jobs):
            with part(j, len(jobs)):  # the engine's progress inside run j of the bar
                result = fn(s)
            on_result(i, result)
        return
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    pool = ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=mp.get_context("spawn"),
                               initializer=_ignore_sigint)  # fmt: skip
    try:
        pending = {pool.submit(fn, s): i for i, s in jobs}
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                on_result(pending.pop(fut), fut.result())
    except BaseException:
        procs = list(getattr(pool, "_processes", {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for p in procs:  # stop runs in flight now, not when they finish
            p.terminate()
        raise
    pool.shutdown()


def run_local(
    jobs: list[tuple[int, Scenario]], engine: str, comm_model: str, workers: int,
    on_result: Callable[[int, dict[str, Any]], None],
) -> None:  # fmt: skip
    """Simulate ``jobs`` (index, scenario) in-process (``workers == 1``) or on a spawned process pool."""
    map_local(partial(run_point, engine=engine, comm_model=comm_model), jobs, workers, on_result)


def run_sweep(
    scenario_path: str | Path,
    base: list[str],
    varies: list[tuple[str, list[tuple[str, Any]]]],
    *,
    engine: str = "des",
    comm_model: str = "auto",
    backend: str = "local",
    jobs: int = 1,
    address: str | None = None,
    jsonl: Path,
    fresh: bool = False,
    progress: bool = True,
    force: bool = False,
) -> dict[str, Any]:
    """Run every point not yet in ``jsonl``; returns ``{"runs": [...], ...}`` with the runs in
    product order, plus ``_resumed`` (points found in the log) and ``_jsonl`` for the caller."""
    points = product(varies)
    guard = guard_args(engine, comm_model, force, backend, jobs, address, len(points))
    scenarios = load_points(scenario_path, base, points, guard)
    header = sweep_header(scenario_path, base, engine, comm_model)
    done = {} if fresh else read_log(jsonl, header)
    resumed = sum(pt.key in done for pt in points)
    todo = [(i, s) for i, (pt, s) in enumerate(zip(points, scenarios, strict=True)) if pt.key not in done]
    results: dict[int, dict[str, Any]] = {}
    log = RunLog(jsonl, header, fresh=fresh)

    def on_result(i: int, result: dict[str, Any]) -> None:
        rec = {"overrides": points[i].values, **result}
        log.append(rec)
        results[i] = rec
        report(len(results), points[i].label)

    with reporting("sweep", total=len(todo), unit="runs", enabled=progress), contextlib.closing(log):
        if backend == "ray":
            from sim.studies.sweep_ray import run_ray

            run_ray(todo, engine, comm_model, jobs, address, on_result, run_point)
        elif backend == "local":
            run_local(todo, engine, comm_model, jobs, on_result)
        else:
            raise InputError(f"backend must be local or ray, not {backend!r}", field="--backend")
    runs = [results[i] if i in results else done[pt.key] for i, pt in enumerate(points)]
    return {
        "scenario": scenarios[0].name if scenarios else None,
        "scenario_file": str(scenario_path),
        "set": list(base),
        "vary": {p: [v for _, v in vals] for p, vals in varies},
        "engine": engine,
        "comm_model": comm_model,
        "runs": runs,
        "_resumed": resumed,  # not part of the JSON result (a resumed sweep writes the same JSON)
        "_jsonl": str(jsonl),
    }


__all__ = [
    "Point",
    "RunLog",
    "default_jsonl",
    "guard_args",
    "load_points",
    "parse_vary",
    "parse_varies",
    "point_key",
    "product",
    "read_log",
    "map_local",
    "run_local",
    "run_point",
    "run_sweep",
    "split_values",
    "sweep_header",
]
