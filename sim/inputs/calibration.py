"""Calibration files (``moesim calibrate`` writes them, ``calibration:`` in a scenario reads them).

Schema (JSON, ``format: moesim.calibration``, ``version: 1``); every section is optional and
replaces the topology's defaults where present::

    {
      "format": "moesim.calibration", "version": 1,
      "hardware": {"device": "cpu", "backend": "gloo", "world_size": 2, "host": "...", "torch": "..."},
      "gemm": {                       # achieved TFLOP/s(M, N, K) = peak_TFLOPs * h(M; m_half) * h(N; nk_half) * h(K; nk_half)
        "bf16": {"peak_TFLOPs": 700.0, "m_half": 400.0, "nk_half": 96.0, "fit_rel_err": 0.05,
                 "fit_max_rel_err": 0.2, "points": 40},
        "fp32": {...}
      },                              # h(x; c) = x / (x + c): small-M expert GEMMs reach a fraction of peak
      "attention_efficiency": 0.6,    # attention-core throughput / achieved GEMM peak
      "hbm_bw_GBps": 2900.0,          # achieved bandwidth of memory-bound kernels (elementwise, norms, optimizer)
      "kernel_launch_us": 6.0,        # fixed cost per kernel (launch + framework dispatch)
      "dispatcher_op_us": 25.0,       # cost of one eager op of the token dispatcher (gate top-k, permute, unpermute)
      "dispatcher_bw_GBps": 5.0,      # bandwidth of the dispatcher's gathers and scatters
      "links": {                      # alpha-beta fits per link class: time = alpha + bytes / bw
        "intra": {"alpha_us": 12.0, "bw_GBps": 310.0, "fit_rel_err": 0.04, "fit_max_rel_err": 0.09, "points": 24},
        "inter": {"alpha_us": 20.0, "bw_GBps": 46.0},
        "host":  {"alpha_us": 10.0, "bw_GBps": 24.0}
      },
      "cpu_adam_Gparams_per_s": 1.1,  # DeepSpeedCPUAdam update rate per node
      "optimizer_bytes_per_param": 32.0,  # device bytes moved per parameter by the GPU optimizer step
      "optimizer_step_overhead_us": 900.0,  # fixed cost of one optimizer step (framework bookkeeping)
      "zero_grad_hook_ns_per_param": 8.0,  # ZeRO-1/2 backward beyond autograd, per parameter of the rank
      "zero_grad_hook_overhead_us": 4000.0,  # ... and per backward
      "compute_noise_cv": 0.1,        # relative std of a rank's compute-segment time (rank-to-rank spread)
      "wake_delay_p": 0.3,            # CPU ranks: chance that a rank resumes late after a blocking collective
      "wake_delay_cap_s": 0.004,      # ... by the peer's next compute segment, at most this (seconds)
      "collective_bytes_factor": {"all_gather": 2.7},  # bytes multiplier per collective kind (default 1)
      "compute_scale": 1.3,           # in-job factor on every forward/backward kernel (fitted on a real reference job)
      "pause_rate_per_s": 20.0,       # CPU ranks: rank-local stalls (preemption, GC) per second of compute ...
      "pause_mean_s": 0.0045,         # ... each of exponential length with this mean (seconds)
      "call_overhead_us": 900.0,      # CPU ranks: in-job cost of each blocking call beyond its isolated time
      "sweeps": {...}                 # raw measurements (kept for the record; not read by the simulator)
    }

``moesim calibrate`` fills ``sweeps`` with: ``stat`` (``median`` or ``p25``: the statistic of the
timed repetitions the fits read), ``comm`` (nccl-tests rows: ``kind``, ``bytes`` per rank, ``ranks``,
``time_s``, ``median_time_s``, ``p25_s``, ``min_s``, ``reps_s``, ``algbw_GBps``, ``busbw_GBps``,
``fit_time_s`` = the simulator's time with the fitted link), ``links_by_kind`` (each collective
fitted alone, a diagnostic), ``gemm`` (``dtype``, ``m``, ``n``, ``k``, ``time_s``, ``fit_time_s``),
``attention``, ``memory``, ``launch``, ``optimizer``, ``dispatcher`` (DeepSpeed's gate, sparse
encode and decode at the scenarios' shapes: forward and backward seconds per call, the op
counts and bytes the simulator assigns them, ``fit_*_s``), ``noise`` (per segment length, every rank's
time per call and the fitted ``cv``), ``wake`` (per following segment length, every call's
exit spread between the ranks), ``desync`` (the reference job's per-call profile and the figures it
gave, hw_validate/desync.py, beside the loops' own), ``spec`` (what was measured), ``job_wall_s``,
``fit_wall_s`` and ``command``. ``hardware`` names the machine: ``device``, ``device_name``,
``backend``, ``world_size``, ``threads_per_rank``, ``cpu_count``, ``host``, ``python``, ``torch``,
``cuda``, ``topology`` (the cluster the link fit ran on) and ``scenarios`` (whose shapes were measured).

Link classes replace the topology's link figures (:func:`sim.hardware.calibrated.apply_link_calibration`, called by
``sim.engine.simulate``): ``intra`` the ``intra`` links (NVLink/NVSwitch, PCIe switch, shared memory),
``inter`` the scale-out links (``nic_tx``/``nic_rx`` take ``bw_GBps``; leaf uplinks keep their
oversubscription and scale by the same factor), ``host`` the ``pcie_host`` links. ``alpha_us`` is
the latency of *one link* of the class, as the simulator adds it per hop (a transfer between two
GPUs of a node crosses two ``intra`` links: GPU -> switch -> GPU); ``moesim calibrate`` fits it and
``bw_GBps`` through the simulator's own collective model, so the fitted pair reproduces the
measured sweep (``fit_rel_err``: median, ``fit_max_rel_err``: largest relative error over the
``points`` sizes of the sweep). The link pair is fitted on the all-to-all and all-reduce rows;
each other measured kind (``all_gather``) gets a ``collective_bytes_factor``: the factor on the
bytes its ring moves that brings the simulator's times with the fitted links to the measured ones
(least squares on relative error).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import ConfigDict, Field

from sim.errors import InputError
from sim.inputs.sections import Kind
from sim.inputs.yamlio import StrictModel, parse_json, read_text, validate_model
from sim.ioutil import atomic_write_text, dumps_json

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
    fit_max_rel_err: float | None = Field(default=None, ge=0, description="largest relative error of the fit")
    points: int | None = Field(default=None, ge=0, description="measured shapes the fit used")


class LinkFit(StrictModel):
    """alpha-beta model of a link class: time = alpha + bytes / bw."""

    model_config = _OPEN
    alpha_us: float = Field(ge=0, description="latency of one link of the class (added per hop)")
    bw_GBps: float = Field(gt=0, description="bandwidth of one link, per direction (GB/s = 1e9 B/s)")
    fit_rel_err: float | None = Field(default=None, ge=0, description="median relative error of the fit")
    fit_max_rel_err: float | None = Field(default=None, ge=0, description="largest relative error of the fit")
    points: int | None = Field(default=None, ge=0, description="measured sizes the fit used")


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
    #: the token dispatcher's eager ops (DeepSpeed's TopKGate less its GEMM, _route_slots +
    #: _sparse_encode, _sparse_decode; sim.frameworks.deepspeed.dispatcher_work counts them): time =
    #: ops x dispatcher_op_us + bytes / dispatcher_bw_GBps; absent: kernel_launch_us and hbm_bw_GBps
    dispatcher_op_us: float | None = Field(default=None, ge=0)
    dispatcher_bw_GBps: float | None = Field(default=None, gt=0)
    links: dict[str, LinkFit] = {}
    cpu_adam_Gparams_per_s: float | None = Field(default=None, gt=0)
    optimizer_bytes_per_param: float | None = Field(default=None, gt=0)
    optimizer_step_overhead_us: float | None = Field(default=None, ge=0)
    #: ZeRO-1/2's engine.backward() beyond plain autograd (gradient hooks, bucket copies): per
    #: parameter of the rank, added with each layer's gradients, plus a fixed cost per backward
    zero_grad_hook_ns_per_param: float | None = Field(default=None, ge=0)
    zero_grad_hook_overhead_us: float | None = Field(default=None, ge=0)
    #: relative std of one rank's compute-segment time: every compute segment between two
    #: collectives (and the optimizer step) of every rank is scaled by its own lognormal draw of
    #: mean 1 (sim.frameworks.deepspeed.apply_segment_noise), so the ranks reach each rendezvous apart
    compute_noise_cv: float | None = Field(default=None, ge=0, le=10)
    #: CPU ranks sharing a host's cores with gloo's helper threads: after a blocking collective, one
    #: rank of the group (with probability ``wake_delay_p``) resumes only when the core it was woken
    #: on frees up -- after the peer's next compute segment, at most ``wake_delay_cap_s`` (the
    #: scheduler's load-balance interval); sim.frameworks.deepspeed.apply_wake_delay; fitted from a real
    #: reference job's calls (hw_validate.desync) when calibrate ran one, else microbench.bench_wake
    wake_delay_p: float | None = Field(default=None, ge=0, le=1)
    wake_delay_cap_s: float | None = Field(default=None, ge=0)
    #: per collective kind, the factor on the bytes the simulator's ring moves for it, fitted by
    #: ``moesim calibrate`` on kinds whose measured cost the shared link fit does not reach: gloo's
    #: ``all_gather_into_tensor`` on this CPU host takes 3.6-4.0 ms for 4 MiB where the link fit's
    #: ring (one step, half the bytes each way) gives 1.5 ms, so its factor is ~2.5-3; absent: 1
    collective_bytes_factor: dict[Kind, Annotated[float, Field(gt=0, le=1000)]] = {}
    #: the in-job cost of the forward and backward kernels relative to what the microbenchmarks
    #: price (caches, eager dispatch, the framework's hooks between ops): every compute block of
    #: the step (GEMMs, attention, memory-bound ops, the token dispatcher's ops) takes this factor
    #: times its modelled time; not the optimizer step or ZeRO's gradient hooks, which
    #: ``moesim calibrate`` times inside a real DeepSpeed engine. Fitted from a real reference
    #: job's compute time (hw_validate.desync.fit_compute_scale) when calibrate ran one; absent: 1
    compute_scale: float | None = Field(default=None, gt=0, le=100)
    #: rank-local stalls of a CPU rank (the OS running another thread on its core, Python's garbage
    #: collector): a Poisson process over each rank's compute time, ``pause_rate_per_s`` stalls per
    #: second, each of exponential length with mean ``pause_mean_s`` (sim.frameworks.deepspeed.apply_pauses);
    #: with them, ``compute_noise_cv`` is the spread of the segments without their stalls. Fitted
    #: from a real reference job's segments between calls (hw_validate.desync.fit_pauses)
    pause_rate_per_s: float | None = Field(default=None, ge=0, le=1e6)
    pause_mean_s: float | None = Field(default=None, gt=0, le=10)
    #: CPU ranks: what a blocking collective costs inside a job beyond the same call timed alone
    #: (the wake-ups of gloo's helper threads, several per process group, on cores busy with the
    #: ranks' compute): every rank resumes this long after each blocking call (all-to-all, capacity
    #: all-reduce, the flushing gradient all-reduce, the step's norm all-reduces and parameter
    #: gathers; sim.frameworks.deepspeed.apply_wake_delay). Fitted on the real reference job's time in blocking
    #: calls (hw_validate.desync.fit_call_overhead) when calibrate ran one; absent: 0
    call_overhead_us: float | None = Field(default=None, ge=0, le=1e6)
    sweeps: dict[str, Any] = {}


def load_calibration(path: str | Path) -> Calibration:
    """Read and validate a calibration JSON."""
    text = read_text(path, "calibration file")
    data = parse_json(text, path)
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
