#!/usr/bin/env bash
# The GPU readiness check on a lent GPU machine, in one line (docs/gpu.md):
#   bash benchmarks/gpu_check.sh "$OUT" [gpu_check options, e.g. --only env,kernels]
# Installs the carried wheels (.whl/, from benchmarks/gpu_wheels.sh) into /tmp/site as the
# device README says, puts them and this repo on PYTHONPATH (the project is not pip-installed
# there), and runs `python -m benchmarks.gpu_check`, its output also in OUTDIR/gpu_check.log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:?usage: benchmarks/gpu_check.sh OUTDIR [gpu_check options]}
shift
mkdir -p "$OUTDIR"
PY=${PYTHON:-python3}
SITE=${PDSERVE_WHEEL_SITE:-/tmp/site}  # the carried wheels go here (device README: /tmp/site)
LOG="$OUTDIR/gpu_check.log"
{
  echo "== the machine's own packages (before the carried wheels):"
  "$PY" -m pip list 2>/dev/null | grep -iE '^(torch|triton|transformers|grpcio|protobuf|pydantic|typing.extensions|cryptography) ' || true
} 2>&1 | tee "$LOG"
if compgen -G ".whl/*.whl" >/dev/null; then
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl >>"$LOG" 2>&1; then
    echo "wheel install failed (see $LOG)"
    tail -20 "$LOG"
    exit 3
  fi
  export PYTHONPATH="$SITE:${PYTHONPATH:-}"
else
  echo "no .whl/ here: using the machine's packages only (carry .whl, see docs/gpu.md)" | tee -a "$LOG"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1
"$PY" -m benchmarks.gpu_check --out "$OUTDIR" --work /tmp/pdserve-gpu-check "$@" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
