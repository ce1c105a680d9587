"""Calibration files (``moesim calibrate`` writes them, ``calibration:`` in a scenario reads them).

Schema (JSON, ``format: moesim.calibration``, ``version: 1``); every section is optional and
replaces the topology's defaults where present::

    {
      "format": "moesim.calibration", "version": 1,
      "hardware": {"device": "cpu", "backend": "gloo", "world_size": 2, "host": "...", "torch": "..."},
      "gemm": {                       # achieved TFLOP/s(M, N, K) = peak_TFLOPs * h(M; m_half) * h(N; nk_half) * h(K; nk_half)
        "bf16": {"peak_TFLOPs": 700.0, "m_half": 400.0, "nk_half": 96.0, "fit_rel_err": 0.05},
        "fp32": {...}
      },                              # h(x; c) = x / (x + c): small-M expert GEMMs reach a fraction of peak
      "attention_efficiency": 0.6,    # attention-core throughput / achieved GEMM peak
      "hbm_bw_GBps": 2900.0,          # achieved device-memory bandwidth (elementwise, optimizer)
      "kernel_launch_us": 6.0,        # fixed cost per kernel (launch + framework dispatch)
      "links": {                      # alpha-beta fits per link class: time = alpha + bytes / bw
        "intra": {"alpha_us": 12.0, "bw_GBps": 310.0, "fit_rel_err": 0.04},
        "inter": {"alpha_us": 20.0, "bw_GBps": 46.0},
        "host":  {"alpha_us": 10.0, "bw_GBps": 24.0}
      },
      "cpu_adam_Gparams_per_s": 1.1,  # DeepSpeedCPUAdam update rate per node
      "optimizer_bytes_per_param": 32.0,  # device bytes moved per parameter by the GPU optimizer step
      "sweeps": {...}                 # raw measurements (kept for the record; not read by the simulator)
    }
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field

from sim.errors import InputError
from sim.ioutil import atomic_write_text, dumps_json
from sim.yamlio import StrictModel, read_text, validate_model

FORMAT = "moesim.calibration"
VERSION = 1
_OPEN = ConfigDict(extra="forbid", allow_inf_nan=False)


class GemmFit(StrictModel):
    """Achieved GEMM throughput model for one dtype."""

    model_config = _OPEN
    peak_TFLOPs: float = Field(gt=0, description="asymptotic achieved TFLOP/s for large M, N, K")
    m_half: float = Field(ge=0, description="M at which throughput is half of peak (per unit of N, K factor)")
    nk_half: float = Field(ge=0, description="half-saturation size of N and K")
    fit_rel_err: float | None = Field(default=None, ge=0, description="median relative error of the fit")


class LinkFit(StrictModel):
    """alpha-beta model of a link class: time = alpha + bytes / bw."""

    model_config = _OPEN
    alpha_us: float = Field(ge=0)
    bw_GBps: float = Field(gt=0)
    fit_rel_err: float | None = Field(default=None, ge=0)


class Calibration(StrictModel):
    """A calibration file; see the module docstring for the meaning of each field."""

    model_config = _OPEN
    format: str = FORMAT
    version: int = VERSION
    hardware: dict[str, Any] = {}
    gemm: dict[str, GemmFit] = {}
    attention_efficiency: float | None = Field(default=None, gt=0, le=1)
    hbm_bw_GBps: float | None = Field(default=None, gt=0)
    kernel_launch_us: float | None = Field(default=None, ge=0)
    links: dict[str, LinkFit] = {}
    cpu_adam_Gparams_per_s: float | None = Field(default=None, gt=0)
    optimizer_bytes_per_param: float | None = Field(default=None, gt=0)
    sweeps: dict[str, Any] = {}


def load_calibration(path: str | Path) -> Calibration:
    """Read and validate a calibration JSON."""
    import json

    text = read_text(path, "calibration file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"not valid JSON: {exc.msg} at line {exc.lineno}", file=str(path)) from None
    except RecursionError:
        raise InputError("JSON is nested too deeply", file=str(path)) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InputError(
            f"not a calibration file (expected format: {FORMAT})", file=str(path), field="format"
        )
    if data.get("version") != VERSION:
        raise InputError(
            f"unsupported version {data.get('version')!r}; this moesim reads {VERSION}",
            file=str(path),
            field="version",
        )
    links = data.get("links", {})
    unknown = (set(links) if isinstance(links, dict) else set()) - {"intra", "inter", "host"}
    if unknown:
        raise InputError(
            f"unknown link class(es) {sorted(unknown)}; allowed: intra, inter, host",
            file=str(path),
            field="links",
        )
    return validate_model(Calibration, data, str(path))


def save_calibration(path: str | Path, calib: Calibration) -> None:
    atomic_write_text(path, dumps_json(calib.model_dump(mode="json")))
