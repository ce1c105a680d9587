"""SM clock, power, temperature and throttle reasons of the GPU, sampled in a thread while the probe runs."""

from __future__ import annotations

import contextlib
import shutil
import statistics
import subprocess
import threading
import time
from typing import Any

#: NVML clock-event (throttle) reason bits
REASONS = {
    0x1: "gpu_idle", 0x2: "applications_clocks", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
    0x10: "sync_boost", 0x20: "sw_thermal", 0x40: "hw_thermal", 0x80: "hw_power_brake", 0x100: "display_clock",
}  # fmt: skip


def _reasons(bits) -> list[str]:
    if bits is None:
        return []
    return [name for bit, name in REASONS.items() if bits & bit] or ["none"]


class Sampler:
    """SM clock (MHz), power (W), temperature (C) and throttle-reason bits every ``period_s``, in a
    thread: pynvml, else ``nvidia-smi -lms``, else ``source == 'unavailable'``."""

    def __init__(self, target: str | int = 0, period_s: float = 0.05):
        self.period_s, self.target = period_s, target
        self.samples: list[tuple] = []  # (monotonic t, sm_MHz, power_W, temp_C, reasons bits)
        self.source, self.static, self.error = "unavailable", {}, None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc = None

    def start(self) -> Sampler:
        for how in (self._start_nvml, self._start_smi):
            try:
                if how():
                    return self
            except Exception as exc:  # noqa: BLE001
                self.error = f"{how.__name__}: {type(exc).__name__}: {exc}"
        return self

    def _start_nvml(self) -> bool:
        import pynvml as nv

        nv.nvmlInit()
        h = None
        if isinstance(self.target, str):
            for arg in (self.target.encode(), self.target):  # bindings differ on bytes / str
                try:
                    h = nv.nvmlDeviceGetHandleByPciBusId(arg)
                    break
                except Exception:  # noqa: BLE001
                    h = None
        if h is None:
            h = nv.nvmlDeviceGetHandleByIndex(self.target if isinstance(self.target, int) else 0)
        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )

        def read():
            sm = nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)
            pw = nv.nvmlDeviceGetPowerUsage(h) / 1000.0
            tc = nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)
            rb = reasons(h) if reasons else None
            return float(sm), float(pw), float(tc), rb

        read()
        for key, get in (("name", lambda: nv.nvmlDeviceGetName(h)),
                         ("sm_MHz_max", lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM)),
                         ("power_limit_W", lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0),
                         ("driver", lambda: nv.nvmlSystemGetDriverVersion())):  # fmt: skip
            try:
                v = get()
                self.static[key] = v.decode() if isinstance(v, bytes) else v
            except Exception:  # noqa: BLE001
                pass

        def loop():
            while not self._stop.is_set():
                with contextlib.suppress(Exception):
                    self.samples.append((time.monotonic(), *read()))
                self._stop.wait(self.period_s)

        self.source = "pynvml"
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return True

    def _start_smi(self) -> bool:
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return False
        target = str(self.target)
        fields = None
        for extra in ("clocks_event_reasons.active", "clocks_throttle_reasons.active", None):
            f = ["clocks.sm", "power.draw", "temperature.gpu"] + ([extra] if extra else [])
            p = subprocess.run([smi, "-i", target, "--query-gpu=" + ",".join(f), "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=15)  # fmt: skip
            if p.returncode == 0 and p.stdout.strip():
                fields = f
                break
        if fields is None:
            return False
        p = subprocess.run([smi, "-i", target, "--query-gpu=name,clocks.max.sm,power.limit,driver_version",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=15)  # fmt: skip
        if p.returncode == 0 and p.stdout.strip():
            parts = [x.strip() for x in p.stdout.strip().splitlines()[0].split(",")]
            self.static = dict(zip(("name", "sm_MHz_max", "power_limit_W", "driver"), parts, strict=False))
        ms = max(20, int(self.period_s * 1000))
        self._proc = subprocess.Popen([smi, "-i", target, "--query-gpu=" + ",".join(fields),
                                       "--format=csv,noheader,nounits", "-lms", str(ms)],
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip

        def num(x):
            try:
                return float(x)
            except ValueError:
                return float("nan")

        def loop():
            assert self._proc is not None and self._proc.stdout is not None
            for line in self._proc.stdout:
                v = [x.strip() for x in line.split(",")]
                if len(v) < 3:
                    continue
                bits = None
                if len(v) > 3:
                    try:
                        bits = int(v[3], 16)
                    except ValueError:
                        bits = None
                self.samples.append((time.monotonic(), num(v[0]), num(v[1]), num(v[2]), bits))

        self.source = "nvidia-smi"
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def summary(self, t0: float, t1: float, series: bool = False) -> dict | str:
        """The samples of ``[t0, t1]`` (the nearest one where none fell inside), summarised."""
        if self.source == "unavailable":
            return "unavailable"
        snap = list(self.samples)
        pts = [s for s in snap if t0 <= s[0] <= t1]
        nearest = False
        if not pts and snap:
            mid = 0.5 * (t0 + t1)
            pts, nearest = [min(snap, key=lambda s: abs(s[0] - mid))], True
        if not pts:
            return {"source": self.source, "n": 0}

        def clean(i):
            return [p[i] for p in pts if p[i] == p[i]]

        sm, pw, tc = clean(1), clean(2), clean(3)
        bits = 0
        seen = False
        for p in pts:
            if p[4] is not None:
                bits, seen = bits | p[4], True
        out: dict[str, Any] = {
            "source": self.source, "n": len(pts), "nearest": nearest,
            "sm_MHz_median": statistics.median(sm) if sm else None, "sm_MHz_min": min(sm) if sm else None,
            "sm_MHz_max": max(sm) if sm else None, "power_W_mean": statistics.fmean(pw) if pw else None,
            "power_W_max": max(pw) if pw else None, "temp_C_max": max(tc) if tc else None,
            "reasons": _reasons(bits) if seen else "unavailable",
        }  # fmt: skip
        if series:
            out["series"] = [
                [round(p[0] - t0, 3), p[1], p[2], p[3], None if p[4] is None else hex(p[4])] for p in pts
            ]
            out["series_columns"] = ["t_s", "sm_MHz", "power_W", "temp_C", "reasons"]
        return out
