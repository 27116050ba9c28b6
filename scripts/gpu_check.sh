#!/usr/bin/env bash
# GPU check on the device machine (one `run` call per stage):
#   scripts/gpu_check.sh test   build + GPU tests (pytest -m gpu) + compute-sanitizer + CUDA harness
#   scripts/gpu_check.sh full   as test (SKIP_SANITIZER=1: tests only; PYTEST_LIMIT s, 450), but the whole tests/ on the GPU backend (the gpu tests
#                               included); FULL_TESTS="tests/a.py tests/b.py ..." for a part. With
#                               pytest-xdist installed the tests run in WORKERS (8) processes
#                               (~3 minutes on an H200); without it, in one process, the whole
#                               suite does not fit a 10-minute device call
#   scripts/gpu_check.sh bench  build + the benchmark suite (python -m benchmarks)
#   scripts/gpu_check.sh sanitize  build + the fuzz corpus under compute-sanitizer, one tool
#                               after another (python -m scripts.fuzz_sanitize; CASES=0 (all),
#                               TOOLS=blocking,memcheck,racecheck,initcheck,synccheck)
#   scripts/gpu_check.sh all    GPU tests, sanitizer, benchmark, then the harness (~9 minutes)
# BENCH_ARGS="--stage single-d32 ..." passes options to `python -m benchmarks` (its --help).
# Logs, JSON and plots go to $OUT only (default ./gpu_check_out; benchmarks in $OUT/bench);
# nothing is written into the repository. The harness builds with cmake in $BUILD_ROOT.
# Set FLOWTT_COMMIT=<sha> when the machine's copy of .git may lag the working tree (the
# device tool's can).
set -uo pipefail
STAGE=${1:-all}
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export FLOWTT_COMMIT=${FLOWTT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
PY=${PY:-python3}
BUILD_ROOT=${BUILD_ROOT:-/tmp/flowtt_build}  # the harness's cmake build
HARNESS=$BUILD_ROOT/harness/flowtt_harness
status=0

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/build.log"
echo "== build (FLOWTT_CUDA=ON)" | tee -a "$OUT/build.log"
FLOWTT_CUDA=ON FLOWTT_CUDA_ARCHITECTURES=90 $PY -m pip install --no-build-isolation --no-deps -v -e . \
  >>"$OUT/build.log" 2>&1 || { echo "BUILD FAILED"; tail -40 "$OUT/build.log"; exit 1; }
$PY -c "import flowtt_jax._flowtt_cuda as m, jax; print('ext ok', sorted(m.registrations()), jax.devices())" \
  2>&1 | tee -a "$OUT/build.log"

run_tests() {
  # pytest-xdist, where installed, spreads the tests over WORKERS processes sharing the GPU
  # (compiles are CPU-bound; no preallocation, so they fit)
  local par=()
  $PY -c "import xdist" 2>/dev/null && par=(-n "${WORKERS:-14}")
  if [[ $STAGE == full ]]; then
    echo "== pytest: the whole tests/ on the GPU backend (the -m gpu tests included)" | tee "$OUT/pytest.log"
    # -v streams each result as it lands ("[gwN] ... FAILED name"), so a call cut short still
    # names every failure so far; SIGINT at PYTEST_LIMIT (s) lets pytest print its short
    # summary; the failures are listed from the log either way
    # shellcheck disable=SC2086  # FULL_TESTS is a list of paths
    JAX_DEFAULT_MATMUL_PRECISION=highest timeout -s INT -k 20 "${PYTEST_LIMIT:-450}" \
      $PY -m pytest -v -p no:cacheprovider --slow "${par[@]}" -rfE --tb=short \
      ${FULL_TESTS:-tests} >>"$OUT/pytest.log" 2>&1
    local rc=$?
    grep -E "^(FAILED|ERROR) |\] (FAILED|ERROR) " "$OUT/pytest.log" | sort -u | head -60
    grep -E "^=+ .*(passed|failed|error).* =+$" "$OUT/pytest.log" | tail -1
    [[ $rc == 0 ]] || { echo "pytest rc $rc"; status=1; }
  else
    echo "== pytest -m gpu: the CUDA tests (CUDA path and CUDA plan against the references)"
    $PY -m pytest -q -p no:cacheprovider --slow "${par[@]}" -m gpu tests 2>&1 | tee "$OUT/pytest.log" | tail -5
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
  fi
  [[ ${SKIP_SANITIZER:-0} == 1 ]] && return
  HARNESS=$(scripts/build_harness.sh "$BUILD_ROOT/harness") || status=1
  echo "== compute-sanitizer: memcheck, initcheck on a small forward+backward (JAX); racecheck, synccheck on the harness's --sanitize cases" | tee "$OUT/sanitizer.log"
  # initcheck: the kernels' own reads, not XLA's copies of whole output buffers (host API
  # accesses), whose documented-unspecified tails no kernel writes. initcheck instruments
  # every kernel: it tracks the writes of instrumented kernels only, so with kns=flowtt
  # every input XLA wrote reads as uninitialised. The harness's timing cases under memcheck
  # only: under racecheck its 2nd case (zipf 1.2, 27,549 ids) grows the sanitizer's host
  # memory past the machine's 128 GiB and is OOM-killed (dmesg; the same at e677070).
  # racecheck of the JAX script (scripts/sanitize_small.py) kills the sanitizer itself
  # (SIGSEGV, rc 139), so racecheck and synccheck run on the harness's --sanitize mode
  # instead (scripts/gpu_race.sh: small checked cases that launch every kernel, the window
  # and capacity kernels included; 120 s each at most), racecheck also on the fuzz corpus's
  # pinned cases (prefix groups over kCH: the forward's checkpoint path; a child killed by
  # SIGSEGV is rerun) and on the whole corpus in the `sanitize` stage. Any error
  # (--error-exitcode), hazard or crash fails the check.
  sanitize() {
    compute-sanitizer --error-exitcode 1 "$@" >>"$OUT/sanitizer.log" 2>&1 \
      || { local rc=$?; status=1; echo "FAILED (rc $rc)"; }
  }
  for tool in memcheck initcheck; do
    local opts=(--kernel-name kns=flowtt)
    [[ $tool == initcheck ]] && opts=(--check-api-memory-access no)
    echo "-- $tool (JAX, flowtt kernels)" | tee -a "$OUT/sanitizer.log"
    sanitize --tool $tool "${opts[@]}" --target-processes all $PY scripts/sanitize_small.py
    tail -2 "$OUT/sanitizer.log"
    [[ $tool == memcheck ]] || continue
    echo "-- $tool (standalone harness --quick)" | tee -a "$OUT/sanitizer.log"
    sanitize --tool $tool "$HARNESS" --quick
    tail -1 "$OUT/sanitizer.log"
  done
  echo "-- racecheck, synccheck (standalone harness --sanitize, every kernel; logs race_<tool>.log)" \
    | tee -a "$OUT/sanitizer.log"
  OUT="$OUT" BUILD_ROOT="$BUILD_ROOT" RACE_TOOLS="racecheck synccheck" bash scripts/gpu_race.sh 2>&1 \
    | tee -a "$OUT/sanitizer.log"
  [[ ${PIPESTATUS[0]} == 0 ]] || { status=1; echo "FAILED"; }
  echo "-- racecheck (fuzz corpus, pinned hot-prefix cases 64-68)" | tee -a "$OUT/sanitizer.log"
  $PY -m scripts.fuzz_sanitize --out "$OUT/fuzz_pinned" --seeds 64-68 --tools racecheck \
    >>"$OUT/sanitizer.log" 2>&1 || { status=1; echo "FAILED"; }
  tail -2 "$OUT/sanitizer.log"
}

run_sanitize() {
  echo "== fuzz corpus under compute-sanitizer (${TOOLS:=blocking,memcheck,racecheck,initcheck,synccheck})"
  $PY -m scripts.fuzz_sanitize --out "$OUT/fuzz" --cases "${CASES:-0}" --tools "$TOOLS" 2>&1 \
    | tee "$OUT/fuzz.log" | tail -12
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
}

run_harness() {
  echo "== CUDA harness (kernels alone, CUDA events)"
  "$HARNESS" 2>&1 | tee "$OUT/harness.log" | grep -E "FAIL|PASS \(|TIMING|STAGES" || status=1
}

run_bench() {
  echo "== benchmark (python -m benchmarks)"
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
  XLA_PYTHON_CLIENT_PREALLOCATE=true $PY -m benchmarks --out-dir "$OUT/bench" ${BENCH_ARGS:-} \
    2>&1 | tee "$OUT/bench.log" | grep -vE "^\s*$" | tail -30
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
}

# Order: correctness first, then timings (a call cut short keeps what it wrote).
case $STAGE in
  test|full) run_tests; [[ ${SKIP_SANITIZER:-0} == 1 ]] || run_harness ;;
  bench) run_bench ;;
  sanitize) run_sanitize ;;
  all) run_tests; run_bench; run_harness ;;
  *) echo "unknown stage $STAGE"; exit 2 ;;
esac
exit $status
