"""One GPU's kernels at the published rows' expert and attention shapes, beside moesim's prediction.

moesim predicts the Megatron ``moe_perf`` single-layer rows (``validation/published/L-*.yaml``, 8 x H100,
EP8) too fast, and only the expert grouped GEMMs look wrong: they would have to run 1.30-1.45x slower
than the cuBLAS-microbenchmark curve of ``sim/hardware/costs.py`` to match. This probe measures, on one
CUDA GPU, what can explain that, each kernel beside moesim's own figure for it::

    python -m hw_validate.gpu_kernels --out DIR [--quick] [--seconds S] [--budget-s B]
    python -m hw_validate.gpu_kernels --dry-run [--gpu h100-sxm] [--out DIR]   # no GPU: the plan

Shapes are read from the published rows' scenarios, never typed in: the expert cases from every
``L-*.yaml`` (one case per distinct expert shape: rows per local expert = tokens x ep x top_k /
experts, ``local experts = experts / ep``; the BF16 and FP8 rows of a model share one), the attention
cases from the models of ``D6.yaml`` and ``D7.yaml`` (their micro-batch, heads and head dim, seq 4096).
Per expert GEMM of a case (``fc1``, ``fc2``) three roles, priced as :mod:`sim.frameworks.pricing` prices
them: ``fwd`` ``x[m,k] @ W[n,k]^T`` (M=m, N=n, K=k), ``dgrad`` ``dy[m,n] @ W`` (M=m, N=k, K=n), ``wgrad``
``x^T @ dy`` (M=k, N=n, K=m, the token count reducing).

Parts (each row of the output is one kernel; one failing row or part is logged and the rest goes on):

a. dense BF16 ``torch.matmul`` at one expert's shapes, ``burst`` (warm-up + timed iterations, like
   a microbenchmark) and ``sustained`` (the layer's six GEMMs back to back for a share of
   ``--seconds``), with ``torch.randn`` data and with zeros: a power-limited GPU runs zeros faster;
b. grouped BF16 GEMMs over the case's local experts: ``torch._grouped_mm`` (2D x 3D forward and dgrad,
   2D x 2D wgrad) where the installed torch has it, and a Python loop of ``torch.matmul`` (labelled),
   burst and sustained;
c. FP8 (compute capability >= 8.9, else skipped): ``torch._scaled_mm`` per-tensor and with TE
   ``Float8BlockScaling``'s 1x128 / 128x128 block scales (cuBLAS; where the torch build supports it),
   ``torch._scaled_grouped_mm`` (row-wise scales, forward and dgrad), and the BF16 -> FP8 casts of the
   GEMM inputs (plain ``.to``, per-tensor amax + scale, and an eager 1x128 block emulation);
d. attention: ``scaled_dot_product_attention`` causal, flash and cuDNN backends, forward and
   forward + backward;
e. every row's moesim prediction: :class:`sim.hardware.costs.CostModel` of the GPU description that
   matches ``torch.cuda.get_device_name`` (H100 -> ``h100-sxm``, H200 -> ``h200-sxm``, ...), no
   calibration: ``predicted_ms`` as a training step prices the kernel and, where the cost model has the
   switch, ``predicted_burst_ms`` on its microbenchmark curve (``CostModel(gpu, burst=True)``, without
   the GPU's sustained-compute fraction); ``ratio`` / ``ratio_burst`` = measured / predicted;
f. where TransformerEngine is installed: ``te.pytorch.GroupedLinear`` forward and forward + backward,
   BF16 and FP8 blockwise, the module the published rows ran (else one row says it is unavailable).

SM clock, power, temperature and throttle reasons are sampled all along (pynvml, else
``nvidia-smi -lms``, else ``unavailable``) and summarised over each row's window. Output:
``DIR/gpu_kernels.json`` (every row: part, kernel, case, role, shape, dtype, mode, data, ms, TFLOP/s,
predicted ms, ratio, samples) and ``DIR/gpu_kernels.md`` (the tables and a summary per case: the
experts' forward and backward GEMM time over moesim's, the ratio the published rows need). Both are
rewritten after every part, so a killed run leaves what it measured. Without CUDA the probe exits 2;
``--dry-run`` lists the plan and moesim's predictions (for an H100 unless ``--gpu``). Not yet run on a
GPU; expected about a minute with default flags on an H100 (20 s of it sustained), under 40 s with
``--quick``; past ``--budget-s`` (default 210 s, ``--quick`` 80 s) no new measurement starts.

This module is the command line; :mod:`hw_validate.kernel_probe` does the work (the plan and moesim's
figures without torch, the timing, the parts, the record).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hw_validate.kernel_probe.plan import (
    ROOT,
    attention_cases,
    cost_models,
    expert_cases,
    gpu_description,
    plan,
    shrink,
)
from hw_validate.kernel_probe.report import factors, summarize, table, write
from hw_validate.kernel_probe.sampler import Sampler
from sim.hardware.costs import CostModel, bytes_per_element, gpu_curve_params
from sim.inputs.topology import load_gpu

SCHEMA = "moesim.gpu_kernels/1"
DEFAULT_SECONDS, QUICK_SECONDS = 20.0, 6.0
DEFAULT_BUDGET_S, QUICK_BUDGET_S = 210.0, 80.0


def moesim_info(gpu_name: str, matched: bool, cost: CostModel) -> dict:
    curves = {}
    for dt in ("bf16", "fp8"):
        try:
            frac, mh, nh, kh, p = gpu_curve_params(cost.gpu, dt)
            curves[dt] = {"frac": frac, "m_half": mh, "n_half": nh, "k_half": kh, "m_sharpness": p,
                          "asymptote_TFLOPs": cost.gemm_curve(dt).peak_flops / 1e12}  # fmt: skip
        except Exception as exc:  # noqa: BLE001
            curves[dt] = f"{type(exc).__name__}: {exc}"
    return {"gpu": gpu_name, "matched": matched, "curves": curves, "hbm_GBps": cost.hbm_Bps / 1e9,
            "launch_us": cost.launch_s * 1e6, "attention_TFLOPs_bf16": cost.attention_flops_per_s("bf16") / 1e12,
            "cast_bytes_per_element": 2 + bytes_per_element("fp8"),
            # asymptote_TFLOPs is the step pricing's (x this fraction, where the GPU description has one)
            "sustained_compute_fraction": getattr(cost.gpu, "sustained_compute_fraction", 1.0)}  # fmt: skip


def _git_rev() -> str:
    try:
        p = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           timeout=10)  # fmt: skip
        return p.stdout.strip() or "?"
    except Exception:  # noqa: BLE001
        return "?"


def _print_plan(rows: list[dict], cases, attn, gpu: str) -> None:
    print(
        f"gpu_kernels dry run: {len(rows)} measurements planned; moesim's predictions for {gpu} (no calibration)"
    )
    for c in cases:
        print(f"  case {c.name} ({', '.join(c.rows)}): {c.experts} local expert(s) x {c.tokens} rows, "
              f"h {c.hidden}, expert FFN {c.width} ({c.ffn_type}), dtypes {', '.join(c.dtypes)}")  # fmt: skip
    for a in attn:
        print(f"  attention {a.name} ({a.row}): batch {a.batch}, {a.heads} heads ({a.kv_heads} kv), seq {a.seq}, "
              f"head dim {a.head_dim}")  # fmt: skip
    print()
    print("\n".join(table(rows, measured=False)))


# ---- entry point --------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m hw_validate.gpu_kernels", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--out", type=Path, help="folder for gpu_kernels.json and gpu_kernels.md")
    ap.add_argument(
        "--quick", action="store_true", help="fewer iterations, shorter sustained runs (under 90 s)"
    )
    ap.add_argument("--seconds", type=float, default=None,
                    help=f"sustained runs' total seconds, over every shape (default {DEFAULT_SECONDS:g}; --quick {QUICK_SECONDS:g})")  # fmt: skip
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"stop starting new measurements after this many seconds (default {DEFAULT_BUDGET_S:g}; "
                         f"--quick {QUICK_BUDGET_S:g})")  # fmt: skip
    ap.add_argument(
        "--dry-run", action="store_true", help="list the measurements and moesim's predictions; no GPU"
    )
    ap.add_argument("--gpu", default=None, help="GPU description for --dry-run (default h100-sxm)")
    ap.add_argument(
        "--cpu-smoke", type=int, default=0, metavar="F", help=argparse.SUPPRESS
    )  # tests: CPU, dims / F
    args = ap.parse_args(argv)
    if args.seconds is None:
        args.seconds = QUICK_SECONDS if args.quick else DEFAULT_SECONDS
    if args.budget_s is None:
        args.budget_s = QUICK_BUDGET_S if args.quick else DEFAULT_BUDGET_S
    if args.seconds < 0 or args.budget_s <= 0:
        ap.error("--seconds must be >= 0 and --budget-s > 0")
    t_start = time.monotonic()

    def log(msg: str) -> None:
        print(f"[gpu_kernels {time.monotonic() - t_start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    cases, attn = expert_cases(), attention_cases()
    if args.dry_run:
        gpu = args.gpu or "h100-sxm"
        cost, burst = cost_models(load_gpu(gpu))
        rows = plan(cases, attn, cost, burst)
        _print_plan(rows, cases, attn, gpu)
        if args.out:
            doc = {"schema": SCHEMA, "dry_run": True, "device": {"name": f"(dry run: {gpu})"},
                   "moesim": moesim_info(gpu, True, cost), "sampler": {"source": "none"},
                   "cases": [c.to_json() for c in cases], "attention_cases": [a.to_json() for a in attn],
                   "rows": rows, "summary": [], "errors": []}  # fmt: skip
            write(args.out, doc)
        return 0
    if args.out is None:
        ap.error("--out DIR is required (except with --dry-run)")

    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        print(f"gpu_kernels: torch is not importable ({exc}); nothing to measure (use --dry-run for the plan)",
              file=sys.stderr)  # fmt: skip
        return 2
    smoke = args.cpu_smoke > 0
    if not smoke and not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device (torch.cuda.is_available() is False); this probe measures GPU kernels. "
              "Use --dry-run to list the plan and moesim's predictions.", file=sys.stderr)  # fmt: skip
        return 2
    device = torch.device("cpu") if smoke else torch.device("cuda", torch.cuda.current_device())
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                            "host": platform.node(), "checkout": _git_rev()}  # fmt: skip
    target: str | int = 0
    if smoke:
        name = "cpu (smoke run)"
        cases, attn = shrink(cases, attn, args.cpu_smoke)
    else:
        props = torch.cuda.get_device_properties(device)
        name = torch.cuda.get_device_name(device)
        info.update(capability=list(torch.cuda.get_device_capability(device)), sms=props.multi_processor_count,
                    memory_GiB=props.total_memory / 2**30,
                    cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)  # fmt: skip
        try:
            target = f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
        except AttributeError:
            vis = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
            target = int(vis) if vis.isdigit() else device.index or 0
    info["name"] = name
    gpu, matched = args.gpu or gpu_description(name)[0], args.gpu is not None or gpu_description(name)[1]
    cost, burst = cost_models(load_gpu(gpu))
    rows = plan(cases, attn, cost, burst)
    sampler = Sampler(target).start() if not smoke else Sampler()
    doc: dict[str, Any] = {"schema": SCHEMA, "dry_run": False, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "argv": sys.argv[1:] if argv is None else argv, "quick": args.quick, "seconds": args.seconds,
                           "device": info, "moesim": moesim_info(gpu, matched, cost),
                           "sampler": {"source": sampler.source, "static": sampler.static, "error": sampler.error},
                           "cases": [c.to_json() for c in cases], "attention_cases": [a.to_json() for a in attn],
                           "rows": rows, "summary": [], "errors": []}  # fmt: skip
    log(f"{name}: moesim GPU {gpu}{'' if matched else ' (no description matched)'}; {len(rows)} rows; "
        f"sampler {sampler.source}; sustained {args.seconds:g} s; budget {args.budget_s:g} s")  # fmt: skip
    from hw_validate.kernel_probe.probe import Probe

    probe = Probe(torch, device, rows, cases, attn, args, log)
    probe.sampler = sampler
    probe.t_start = t_start

    def checkpoint(what: str) -> None:
        doc["summary"], doc["errors"], doc["wall_s"] = (
            summarize(rows, cases),
            probe.errors,
            time.monotonic() - t_start,
        )
        doc["factors"] = factors(doc["summary"])
        write(args.out, doc)
        log(f"{what} done; written to {args.out}")

    # most telling first: BF16 burst and sustained, then the published rows' own module (TE), then the raw
    # FP8 kernels (the likeliest to fail on a given torch build), then attention
    steps = [(f"a+b {c.name}", probe.run_bf16, c) for c in cases]
    steps += [(f"f {c.name}", probe.run_te, c) for c in cases]
    steps += [(f"c {c.name}", probe.run_fp8, c) for c in cases]
    steps += [(f"d {a.row}", probe.run_attention, a) for a in attn]
    try:
        for what, fn, arg in steps:
            log(f"{what}")
            try:
                fn(arg)
            except Exception as exc:  # noqa: BLE001
                probe.fail([], exc)
            checkpoint(what)
    finally:
        sampler.stop()
    for r in rows:
        if r["ms"] is None and not r["error"]:
            r["error"] = "not measured"
    checkpoint("all")
    measured = sum(1 for r in rows if r["ms"] is not None)
    log(
        f"{measured} of {len(rows)} rows measured in {time.monotonic() - t_start:.0f} s -> {args.out / 'gpu_kernels.md'}"
    )
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
