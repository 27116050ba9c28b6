#!/usr/bin/env bash
# The DLRM main job at GPU speed, on the device machine (one GPU is enough):
#   scripts/dlrm_gpu.sh [more examples/dlrm.py options]
# Builds the extension with CUDA (SKIP_BUILD=1 skips it), then runs
#   python3 examples/dlrm.py --compare --max-rows 0 --steps 300 --no-progress
# (full-cardinality tables: TT vs 2.16 GB of dense tables) and prints its throughput,
# step-time breakdown, AUC and memory lines. Logs go to $OUT (default ./gpu_check_out).
set -uo pipefail
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PY:-python3}
LOG=$OUT/dlrm_gpu.log

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
if [[ ${SKIP_BUILD:-0} != 1 ]]; then
  echo "== build (FLOWTT_CUDA=ON), log in $OUT/dlrm_build.log"
  FLOWTT_CUDA=ON FLOWTT_CUDA_ARCHITECTURES=90 $PY -m pip install --no-build-isolation --no-deps -v -e . \
    >"$OUT/dlrm_build.log" 2>&1 || { echo "BUILD FAILED"; tail -40 "$OUT/dlrm_build.log"; exit 1; }
fi
ARGS=(--compare --max-rows 0 --steps 300 --no-progress --log-every 50 --profile-steps 50 "$@")
echo "== $PY examples/dlrm.py ${ARGS[*]}, log in $LOG"
$PY examples/dlrm.py "${ARGS[@]}" >"$LOG" 2>&1
rc=$?
grep -E "^DLRM|backend=|trained|held-out|step time|examples/s after compile|AUC difference|memory ratio|target" "$LOG"
[[ $rc == 0 ]] || { echo "examples/dlrm.py exited with $rc"; tail -30 "$LOG"; }
exit $rc
