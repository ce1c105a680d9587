#!/usr/bin/env bash
# One short GPU session: calibrate with NCCL, validate the GPU accuracy scenarios, keep every result.
#
#   hw_validate/gpu_check.sh OUTDIR [--wheels DIR] [--ngpus N] [--steps N] [--quick] [--dry-run]
#
# Run from anywhere on a machine with NVIDIA GPUs and a CUDA build of torch. What it does, in order:
#   0. environment: nvidia-smi, python/torch/CUDA versions -> OUTDIR/env.txt. With --wheels DIR it
#      first installs what the job needs (deepspeed, simpy, pydantic, hjson, networkx, pyyaml, scipy,
#      tqdm, ...) from DIR only (pip --no-index), keeping the machine's torch (pinned by a constraint).
#      moesim itself is used from this checkout (PYTHONPATH), not installed.
#   1. python -m hw_validate.gpu_kernels on one GPU: the published layer rows' expert GEMMs (dense,
#      grouped, FP8, burst and sustained, randn and zeros, SM clock and power sampled) and attention,
#      each beside moesim's cost model -> OUTDIR/gpu_kernels/gpu_kernels.{json,md}
#   2. moesim calibrate --backend nccl --nproc N over the GPU scenarios' shapes -> OUTDIR/calibration.json
#   3. moesim validate for each scenarios/accuracy/gpu/*.yaml on N GPUs (N = 1: ep 1, every expert
#      local; N > 1: --set cluster.gpus_per_node=N --set parallelism.ep=N) -> OUTDIR/<scenario>/
#      (measurement.json, router_trace.json, logs/, validation.json, table.txt)
#   4. python benchmarks/bench_accuracy.py --collect OUTDIR -> OUTDIR/accuracy/<name>.{json,md}
# Every step has a timeout; a failed step is logged to OUTDIR/status.txt and the script goes on, so
# whatever finished is in OUTDIR. Budget: under 15 minutes on one H200 (the kernel probe about one,
# five at most; the GPU scenarios train in seconds; most of the rest is process start-up and
# NCCL/DeepSpeed init).
# --dry-run prints the commands (and checks the scenarios load and the kernel probe plans) without
# touching a GPU.
# Multi-node: run `deepspeed --hostfile H --num_nodes M hw_validate/train_moe.py --scenario S` on
# the cluster (moesim's launcher runs one node); the measurement it writes is what validate reads.
set -euo pipefail

usage() { sed -n '2,4p' "$0" >&2; exit 2; }

OUTDIR=""
WHEELS=""
NGPUS=""
STEPS=20
QUICK=""
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) WHEELS="${2:?--wheels needs a directory}"; shift 2 ;;
    --ngpus) NGPUS="${2:?--ngpus needs a number}"; shift 2 ;;
    --steps) STEPS="${2:?--steps needs a number}"; shift 2 ;;
    --quick) QUICK="--quick"; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) usage ;;
    -*) echo "gpu_check.sh: unknown option $1" >&2; usage ;;
    *) if [ -n "$OUTDIR" ]; then usage; fi; OUTDIR="$1"; shift ;;
  esac
done
[ -n "$OUTDIR" ] || usage
case "$NGPUS" in ''|*[!0-9]*) [ -z "$NGPUS" ] || { echo "gpu_check.sh: --ngpus must be a number" >&2; exit 2; } ;; esac
case "$STEPS" in ''|*[!0-9]*) echo "gpu_check.sh: --steps must be a number" >&2; exit 2 ;; esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
STATUS="$OUTDIR/status.txt"
: > "$STATUS"
T0=$(date +%s)

log() { echo "[gpu_check $(($(date +%s) - T0))s] $*" | tee -a "$STATUS"; }

# run LIMIT_S NAME CMD...: echo it, run it under a timeout (dry run: echo only), log ok/failed
run() {
  local limit="$1" name="$2"; shift 2
  printf '%q ' "$@" > "$OUTDIR/$name.cmd"; echo >> "$OUTDIR/$name.cmd"
  if [ "$DRY" = 1 ]; then
    log "dry-run: $(cat "$OUTDIR/$name.cmd")"
    return 0
  fi
  log "start $name (limit ${limit}s): $(cat "$OUTDIR/$name.cmd")"
  local rc=0
  timeout --signal=TERM --kill-after=20 "$limit" "$@" > "$OUTDIR/$name.log" 2>&1 || rc=$?
  if [ "$rc" = 0 ]; then log "ok $name"; else log "FAILED $name (exit $rc; see $OUTDIR/$name.log)"; tail -n 20 "$OUTDIR/$name.log" | tee -a "$STATUS" >&2; fi
  return 0
}

# ---- 0. environment and packages -------------------------------------------------------------------
if [ -n "$WHEELS" ]; then
  [ -d "$WHEELS" ] || { echo "gpu_check.sh: --wheels $WHEELS is not a directory" >&2; exit 2; }
  TORCH_V="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo "")"
  CONSTRAINTS="$OUTDIR/constraints.txt"
  if [ -n "$TORCH_V" ]; then echo "torch==$TORCH_V" > "$CONSTRAINTS"; else : > "$CONSTRAINTS"; fi
  run 240 install "$PY" -m pip install --no-index --find-links "$WHEELS" -c "$CONSTRAINTS" \
    deepspeed simpy "pydantic>=2.6,<3" hjson networkx pyyaml numpy scipy tqdm psutil py-cpuinfo msgpack ninja packaging
fi
{
  echo "date: $(date -u +%FT%TZ)"; echo "host: $(hostname)"; echo "checkout: $ROOT ($(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?'))"
  if command -v nvidia-smi > /dev/null 2>&1; then
    nvidia-smi --query-gpu=index,name,memory.total,driver_version,clocks.max.sm --format=csv 2>&1 || true
    nvidia-smi topo -m 2>&1 || true
  else
    echo "nvidia-smi: not available"
  fi
  "$PY" - <<'EOF' 2>&1 || true
import importlib, platform
print("python", platform.python_version())
for m in ("torch", "deepspeed", "simpy", "pydantic", "hjson", "numpy", "scipy", "networkx", "yaml"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"))
    except Exception as exc:  # noqa: BLE001
        print(m, "MISSING:", type(exc).__name__, exc)
try:
    import torch
    print("cuda", torch.version.cuda, "available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
    print("nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)
except Exception as exc:  # noqa: BLE001
    print("torch cuda: error", exc)
EOF
} > "$OUTDIR/env.txt"
if [ "$DRY" = 0 ]; then cat "$OUTDIR/env.txt"; fi

if [ -z "$NGPUS" ]; then
  if [ "$DRY" = 1 ]; then NGPUS=1
  else NGPUS="$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)"; fi
fi
case "$NGPUS" in ''|*[!0-9]*) echo "gpu_check.sh: --ngpus must be a number" >&2; exit 2 ;; esac
if [ "$NGPUS" -lt 1 ]; then
  log "no CUDA device visible to torch: nothing to measure (see $OUTDIR/env.txt)"
  exit 1
fi
log "using $NGPUS GPU(s), $STEPS steps per job"

SCENARIOS=("$ROOT"/scenarios/accuracy/gpu/*.yaml)
SETS=()
if [ "$NGPUS" -gt 1 ]; then SETS=(--set "cluster.gpus_per_node=$NGPUS" --set "parallelism.ep=$NGPUS"); fi

# the scenarios (with the overrides) must load; this needs only the simulator's packages
for s in "${SCENARIOS[@]}"; do
  if ! "$PY" -m sim check "$s" "${SETS[@]}" > /dev/null 2> "$OUTDIR/check.err"; then
    log "scenario $s does not load with ${SETS[*]:-no overrides}: $(cat "$OUTDIR/check.err")"
    exit 2
  fi
done
rm -f "$OUTDIR/check.err"

# ---- 1. kernel probe: one GPU's expert and attention kernels beside moesim's cost model --------------
run 300 gpu_kernels "$PY" -m hw_validate.gpu_kernels --out "$OUTDIR/gpu_kernels" $QUICK
if [ "$DRY" = 1 ]; then  # the probe's plan needs no GPU: check that it loads, keep it
  if "$PY" -m hw_validate.gpu_kernels --dry-run --out "$OUTDIR/gpu_kernels" > "$OUTDIR/gpu_kernels-plan.txt" 2>&1; then
    log "dry-run: kernel probe plan in $OUTDIR/gpu_kernels/gpu_kernels.md"
  else
    log "kernel probe plan FAILED (see $OUTDIR/gpu_kernels-plan.txt)"
  fi
fi

# ---- 2. calibration -------------------------------------------------------------------------------
CAL="$OUTDIR/calibration.json"
CAL_ARGS=()
for s in "${SCENARIOS[@]}"; do CAL_ARGS+=(--scenario "$s"); done
run 200 calibrate "$PY" -m sim calibrate --backend nccl --nproc "$NGPUS" --topology hgx-h200 \
  "${CAL_ARGS[@]}" $QUICK --timeout 180 --no-progress --out "$CAL"
if [ "$DRY" = 0 ] && [ ! -f "$CAL" ]; then
  log "calibration failed: validating without one (each validate runs a quick calibration first)"
fi

# ---- 3. validate every GPU scenario ---------------------------------------------------------------
for s in "${SCENARIOS[@]}"; do
  name="$(basename "$s" .yaml)"
  CAL_OPT=()
  if [ "$DRY" = 1 ] || [ -f "$CAL" ]; then CAL_OPT=(--calibration "$CAL"); fi
  run 120 "validate-$name" "$PY" -m sim validate "$s" "${SETS[@]}" "${CAL_OPT[@]}" --nproc "$NGPUS" \
    --launcher torchrun --steps "$STEPS" --timeout 100 --keep "$OUTDIR/$name" --quiet \
    --json "$OUTDIR/$name/validation-cli.json"
  if [ -f "$OUTDIR/validate-$name.log" ]; then cp "$OUTDIR/validate-$name.log" "$OUTDIR/$name/table.txt" 2>/dev/null || true; fi
done

# ---- 4. the record --------------------------------------------------------------------------------
run 60 record "$PY" "$ROOT/benchmarks/bench_accuracy.py" --collect "$OUTDIR" --kind gpu \
  --name "gpu-${NGPUS}x-$(hostname -s 2>/dev/null || echo host)" --out "$OUTDIR/accuracy"
log "done in $(($(date +%s) - T0)) s; results in $OUTDIR (status.txt lists every step)"
