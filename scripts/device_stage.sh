# Sourced by the device scripts (scripts/gpu_layer.sh, gpu_memory.sh) after they set $OUT:
# the folder made, the environment every device call sets, $PY, $status, and
#   stage LIMIT NAME CMD...   CMD under a LIMIT-second timeout, its output in $OUT/NAME.log,
#                             the last $TAIL (4) lines shown; a failure or timeout sets status=1.
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export FLOWTT_COMMIT=${FLOWTT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
PY=${PY:-python3}
status=0
stage() {
  local limit=$1 name=$2
  shift 2
  echo "== $name ($(date +%T))"
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1 || { echo "   rc $?"; status=1; }
  tail -"${TAIL:-4}" "$OUT/$name.log"
}
