#!/usr/bin/env bash
# compute-sanitizer over every CUDA kernel of the library, JAX-free: builds the standalone
# harness (scripts/build_harness.sh, cmake target flowtt_harness) and runs its --sanitize mode
# (cuda/harness/sanitize.cuh: small checked cases that launch every launcher's kernels, the
# window and capacity kernels included) under each tool, one after another:
#   scripts/gpu_race.sh            memcheck, racecheck, synccheck, initcheck
#   RACE_TOOLS="racecheck synccheck" scripts/gpu_race.sh
#   RACE_ONLY=san_tb scripts/gpu_race.sh     just the cases whose name contains san_tb
# Why not a JAX process: compute-sanitizer --tool racecheck on scripts/sanitize_small.py dies
# of SIGSEGV (rc 139, the sanitizer itself); and the harness's timing cases are too big for
# racecheck (its 2nd case, 27,549 ids, grew the sanitizer's host memory past 128 GiB), hence
# the small --sanitize cases (a few hundred to 1,500 ids each, sized to finish well inside
# the time limit under racecheck). No kernel-name filter: cub's sorts and scans are checked
# too. initcheck with --check-api-memory-access no, as scripts/gpu_check.sh runs it on the
# JAX script: the kernels' reads are under test (every buffer the harness allocates is filled
# by a copy or a memset before any kernel reads it), not the harness's copies back. Each
# tool's run is limited to RACE_TIMEOUT seconds (120); its log goes to $OUT/race_<tool>.log
# (OUT default ./gpu_check_out), one summary line per tool to stdout. Exit status 1 if any
# tool reports an error or a hazard (racecheck warnings included), times out, crashes, or the
# harness finds a mismatch (its last line, "SANITIZE PASS"/"SANITIZE FAIL"); 2 without
# compute-sanitizer.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-$PWD/gpu_check_out}
BUILD_ROOT=${BUILD_ROOT:-/tmp/flowtt_build}
TOOLS=${RACE_TOOLS:-memcheck racecheck synccheck initcheck}
LIMIT=${RACE_TIMEOUT:-120}
mkdir -p "$OUT"
command -v compute-sanitizer > /dev/null || { echo "compute-sanitizer not found" >&2; exit 2; }
HARNESS=$(scripts/build_harness.sh "$BUILD_ROOT/harness") || { echo "harness build FAILED"; exit 1; }

status=0
for tool in $TOOLS; do
  log=$OUT/race_$tool.log
  opts=()
  [[ $tool == initcheck ]] && opts=(--check-api-memory-access no)
  start=$SECONDS
  # shellcheck disable=SC2086  # RACE_ONLY: one case-name filter, or nothing
  timeout -k 10 "$LIMIT" compute-sanitizer --error-exitcode 1 --tool "$tool" "${opts[@]}" \
    "$HARNESS" --sanitize ${RACE_ONLY:-} > "$log" 2>&1
  rc=$?
  secs=$((SECONDS - start))
  # every summary line must say 0: "ERROR SUMMARY: 0 errors", racecheck's "RACECHECK SUMMARY:
  # 0 hazards displayed (0 errors, 0 warnings)" (warnings count too)
  summaries=$(grep -E "^=+ (ERROR|RACECHECK) SUMMARY" "$log" | sed 's/^=* *//')
  summary=$(paste -sd ';' - <<< "$summaries")
  result=$(grep -E "^SANITIZE (PASS|FAIL)" "$log" | tail -1)
  ok=1
  [[ $rc == 0 && $result == "SANITIZE PASS"* && -n $summaries ]] || ok=0
  grep -qvE "^(ERROR SUMMARY: 0 errors|RACECHECK SUMMARY: 0 hazards)" <<< "$summaries" && ok=0
  [[ $tool != racecheck ]] || grep -q "^RACECHECK SUMMARY" <<< "$summaries" || ok=0
  why=""
  [[ $rc == 124 || $rc == 137 ]] && why=" (timed out after ${LIMIT} s)"
  (( rc > 128 && rc != 137 )) && why=" (killed by signal $((rc - 128)))"
  if (( ok )); then
    echo "$tool: ${summary} | ${result} | ${secs} s | OK"
  else
    status=1
    echo "$tool: ${summary:-no summary} | ${result:-no harness result} | ${secs} s | FAILED (rc $rc)$why, log $log"
    grep -E "^FAIL |^=+ (Invalid|Error|Race|Barrier|.*hazard)" "$log" | head -8
  fi
done
exit $status
