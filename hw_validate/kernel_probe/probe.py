"""The probe's timing and its BF16 parts (dense, grouped, sustained); FP8, attention and
TransformerEngine come from :mod:`~.fp8` and :mod:`~.modules`."""

from __future__ import annotations

import statistics
import sys
import time
import traceback
from typing import Any

from hw_validate.kernel_probe.fp8 import Fp8Parts
from hw_validate.kernel_probe.modules import ModuleParts
from hw_validate.kernel_probe.plan import ExpertCase
from hw_validate.kernel_probe.sampler import Sampler

#: (warm-up, timed) iterations of a burst: Megatron's moe_perf harness runs 5 + 20
BURST, QUICK_BURST = (5, 20), (3, 10)


class Timer:
    """CUDA events around each call (host ``perf_counter`` on the CPU smoke run)."""

    def __init__(self, torch, cuda: bool):
        self.torch, self.cuda = torch, cuda

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def _events(self, n):
        ev = self.torch.cuda.Event
        return [(ev(enable_timing=True), ev(enable_timing=True)) for _ in range(n)]

    def burst(self, fn, warmup: int, iters: int) -> tuple[list[float], float, float]:
        """ms of ``iters`` calls after ``warmup``; the host window (monotonic) of the timed calls."""
        for _ in range(warmup):
            fn()
        self.sync()
        if not self.cuda:
            out = []
            t0 = time.monotonic()
            for _ in range(iters):
                a = time.perf_counter()
                fn()
                out.append((time.perf_counter() - a) * 1e3)
            return out, t0, time.monotonic()
        evs = self._events(iters)
        t0 = time.monotonic()
        for s, e in evs:
            s.record()
            fn()
            e.record()
        self.sync()
        return [s.elapsed_time(e) for s, e in evs], t0, time.monotonic()

    def cycles(self, fns, n: int) -> tuple[list[list[float]], float, float]:
        """``n`` back-to-back cycles through ``fns`` (one untimed first): ms per call, per fn."""
        for f in fns:
            f()
        self.sync()
        out: list[list[float]] = [[] for _ in fns]
        t0 = time.monotonic()
        if not self.cuda:
            for _ in range(n):
                for i, f in enumerate(fns):
                    a = time.perf_counter()
                    f()
                    out[i].append((time.perf_counter() - a) * 1e3)
            return out, t0, time.monotonic()
        evs = [self._events(len(fns)) for _ in range(n)]
        for cyc in evs:
            for (s, e), f in zip(cyc, fns, strict=True):
                s.record()
                f()
                e.record()
        self.sync()
        for cyc in evs:
            for i, (s, e) in enumerate(cyc):
                out[i].append(s.elapsed_time(e))
        return out, t0, time.monotonic()


def _fill(row: dict, ms: list[float]) -> None:
    mean = statistics.fmean(ms)
    row.update(ms=mean, ms_median=statistics.median(ms), ms_min=min(ms), ms_max=max(ms), n=len(ms),
               ms_std=statistics.pstdev(ms) if len(ms) > 1 else 0.0)  # fmt: skip
    if row["flops"]:
        row["TFLOPs"] = row["flops"] / (mean * 1e-3) / 1e12
    if row.get("bytes"):
        row["GBps"] = row["bytes"] / (mean * 1e-3) / 1e9
    if row["predicted_ms"]:
        row["ratio"] = mean / row["predicted_ms"]
    if row.get("predicted_burst_ms"):
        row["ratio_burst"] = mean / row["predicted_burst_ms"]


class Probe(Fp8Parts, ModuleParts):
    """Runs the plan's rows on one device; every row is guarded (an exception is its ``error``)."""

    def __init__(self, torch, device, rows, cases, attn, args, log):
        self.torch, self.device, self.rows, self.cases, self.attn, self.args = (
            torch,
            device,
            rows,
            cases,
            attn,
            args,
        )
        self.cuda = device.type == "cuda"
        self.timer = Timer(torch, self.cuda)
        self.sampler: Sampler | None = None
        self.log = log
        self.warmup, self.iters = QUICK_BURST if args.quick else BURST
        self.t_start = time.monotonic()
        self.budget_s = args.budget_s
        self.errors: list[str] = []

    # -- guards ---------------------------------------------------------------------------------
    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.t_start)

    def fail(self, rows, exc: BaseException) -> None:
        msg = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]
        for r in rows:
            r["error"] = msg
        self.errors.append(f"{rows[0]['part']} {rows[0]['kernel']} {rows[0]['case']} {rows[0]['role']}: {msg}"
                           if rows else msg)  # fmt: skip
        self.log(f"  failed: {msg}")
        tb = traceback.format_exc()
        if tb and tb.strip() != "NoneType: None":  # the traceback's end, lines cut (some messages run long)
            print("\n".join(line[:300] for line in tb.splitlines()[-12:]), file=sys.stderr)
        if self.cuda and "out of memory" in str(exc).lower():
            self.torch.cuda.empty_cache()

    def burst(self, row: dict, fn) -> None:
        if row["ms"] is not None or row["error"]:
            return
        if self.left_s() < 5:
            row["error"] = "skipped: time budget"
            return
        try:
            ms, t0, t1 = self.timer.burst(fn, self.warmup, self.iters)
            _fill(row, ms)
            row["samples"] = self.sampler.summary(t0, t1) if self.sampler else "unavailable"
        except Exception as exc:  # noqa: BLE001
            self.fail([row], exc)

    def find(self, **kw) -> list[dict]:
        return [r for r in self.rows if all(r.get(k) == v for k, v in kw.items())]

    # -- tensors --------------------------------------------------------------------------------
    def tensors(self, c: ExpertCase, data: str) -> dict:
        """Per expert GEMM: ``X [G*m, k]``, ``W [G, n, k]``, ``DY [G*m, n]`` in BF16, and the offsets."""
        torch, dev = self.torch, self.device
        make = torch.randn if data == "randn" else torch.zeros
        G, m = c.experts, c.tokens
        out: dict[str, Any] = {"offs": torch.arange(1, G + 1, device=dev, dtype=torch.int32) * m}
        for g in c.gemms:
            out[g.name] = {"X": make(G * m, g.k, device=dev, dtype=torch.bfloat16),
                           "W": make(G, g.n, g.k, device=dev, dtype=torch.bfloat16),
                           "DY": make(G * m, g.n, device=dev, dtype=torch.bfloat16)}  # fmt: skip
        return out

    def gemm_fn(self, impl: str, c: ExpertCase, t: dict, gname: str, role: str):
        torch, m, G = self.torch, c.tokens, c.experts
        X, W, DY, offs = t[gname]["X"], t[gname]["W"], t[gname]["DY"], t["offs"]
        if impl == "dense":
            x, w, dy = X[:m], W[0], DY[:m]
            return {"fwd": lambda: torch.matmul(x, w.t()), "dgrad": lambda: torch.matmul(dy, w),
                    "wgrad": lambda: torch.matmul(x.t(), dy)}[role]  # fmt: skip
        if impl == "grouped":
            gm = torch._grouped_mm
            return {"fwd": lambda: gm(X, W.transpose(-2, -1), offs=offs), "dgrad": lambda: gm(DY, W, offs=offs),
                    "wgrad": lambda: gm(X.t(), DY, offs=offs)}[role]  # fmt: skip
        if impl == "loop":
            sl = [slice(e * m, (e + 1) * m) for e in range(G)]
            if role == "fwd":
                return lambda: [torch.matmul(X[s], W[e].t()) for e, s in enumerate(sl)]
            if role == "dgrad":
                return lambda: [torch.matmul(DY[s], W[e]) for e, s in enumerate(sl)]
            return lambda: [torch.matmul(X[s].t(), DY[s]) for s in sl]
        raise ValueError(impl)

    # -- parts a, b and the sustained runs -------------------------------------------------------
    def run_bf16(self, c: ExpertCase) -> None:
        torch = self.torch
        has_grouped = hasattr(torch, "_grouped_mm")
        if not has_grouped:
            for r in self.find(case=c.name, impl="grouped"):
                r["kernel"] = f"loop of {c.experts} torch.matmul (torch._grouped_mm unavailable)"
                r["impl_used"] = "loop"
        t = {}
        try:
            for data in ("randn", "zeros"):
                t[data] = self.tensors(c, data)
        except Exception as exc:  # noqa: BLE001
            self.fail(self.find(case=c.name, dtype="bf16", part="a") + self.find(case=c.name, dtype="bf16", part="b"),
                      exc)  # fmt: skip
            return
        for impl in ("dense", "grouped", "loop"):
            used = "loop" if impl == "grouped" and not has_grouped else impl
            for r in self.find(case=c.name, impl=impl, mode="burst"):
                gname, role = r["role"].rsplit(".", 1)
                self.log(f"  {r['part']} {impl} {r['role']} {r['data']} {r['shape']}")
                try:
                    fn = self.gemm_fn(used, c, t[r["data"]], gname, role)
                except Exception as exc:  # noqa: BLE001
                    self.fail([r], exc)
                    continue
                self.burst(r, fn)
        # sustained: each (impl, data) group runs the layer's six GEMMs back to back
        groups = sorted({r["group"] for r in self.rows if r["mode"] == "sustained"})
        share = self.args.seconds / max(1, len(groups))
        grouped_failed = all(r["ms"] is None for r in self.find(case=c.name, impl="grouped", mode="burst"))
        for impl in ("dense", "grouped"):
            used = "loop" if impl == "grouped" and not has_grouped else impl
            if impl == "grouped" and has_grouped and grouped_failed:  # the kernel does not run here
                used = "loop"
                for r in self.find(case=c.name, impl="grouped", mode="sustained"):
                    r["kernel"] = f"loop of {c.experts} torch.matmul (torch._grouped_mm failed in burst)"
                    r["impl_used"] = "loop"
            for data in ("randn", "zeros"):
                rows = self.find(case=c.name, impl=impl, mode="sustained", data=data)
                if rows:
                    self.sustained(c, rows, used, t[data], share)
        del t
        if self.cuda:
            torch.cuda.empty_cache()

    def sustained(self, c: ExpertCase, rows: list[dict], impl: str, t: dict, seconds: float) -> None:
        seconds = min(seconds, self.left_s() - 20)
        if seconds < 0.01:
            for r in rows:
                r["error"] = "skipped: time budget" if self.args.seconds > 0 else "skipped: --seconds 0"
            return
        self.log(f"  sustained {rows[0]['group']} for {seconds:.1f} s")
        try:
            fns = [self.gemm_fn(impl, c, t, *r["role"].rsplit(".", 1)) for r in rows]
            est = 0.0
            for r in rows:  # the cycle's length from the bursts (else moesim's figure)
                b = self.find(case=c.name, impl=r["impl"], mode="burst", data=r["data"], role=r["role"])
                est += (b[0]["ms"] if b and b[0]["ms"] else r["predicted_ms"]) or 1.0
            n = int(max(3, min(seconds * 1e3 / est, 40000 / (2 * len(fns)))))
            ms, t0, t1 = self.timer.cycles(fns, n)
        except Exception as exc:  # noqa: BLE001
            self.fail(rows, exc)
            return
        q = max(1, n // 4)
        full = self.sampler.summary(t0, t1, series=True) if self.sampler else "unavailable"
        last = self.sampler.summary(t0 + 0.75 * (t1 - t0), t1) if self.sampler else "unavailable"
        for r, x in zip(rows, ms, strict=True):
            _fill(r, x)
            r.update(cycles=n, wall_s=t1 - t0, ms_first_tenth=statistics.fmean(x[: max(1, n // 10)]),
                     ms_last_quarter=statistics.fmean(x[-q:]), samples=full, samples_last_quarter=last)  # fmt: skip
