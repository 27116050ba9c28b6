#!/usr/bin/env bash
# Times build variants of the kernels on the S1 harness case (device machine):
#   scripts/tune_harness.sh "-DKNOB=0" "-DKNOB=1 -DOTHER=2" ...
# Each argument is one set of -D defines for the kernels (cmake's FLOWTT_KERNEL_DEFINES, see
# scripts/build_harness.sh); the variants build in parallel (build dirs $BUILD_ROOT/tune_<i>),
# then run one after another with --s1-timing, or with $HARNESS_ARGS (e.g. "--only D128")
# (correctness check against the float64 host reference included). Prints the TIMING / STAGES / PASS
# lines of each and BITS (hashes of outputs and gradients); logs in $OUT/tune_<i>.log.
# Backward stage times: "-DFLOWTT_STAGE_MASK=1" "-DFLOWTT_STAGE_MASK=3" ... (docs/kernels.md).
set -uo pipefail
OUT=${OUT:-$PWD/gpu_check_out}
BUILD_ROOT=${BUILD_ROOT:-/tmp/flowtt_build}
mkdir -p "$OUT"
i=0
for flags in "$@"; do
  scripts/build_harness.sh "$BUILD_ROOT/tune_$i" "$flags" > "$OUT/tune_build_$i.log" 2>&1 &
  i=$((i + 1))
done
wait
i=0
for flags in "$@"; do
  echo "== variant $i: $flags"
  if [[ -x $BUILD_ROOT/tune_$i/flowtt_harness ]]; then
    # shellcheck disable=SC2086  # HARNESS_ARGS is a list of options
    "$BUILD_ROOT/tune_$i/flowtt_harness" ${HARNESS_ARGS:---s1-timing} > "$OUT/tune_$i.log" 2>&1
    grep -E "PASS|FAIL|TIMING|STAGES|BITS" "$OUT/tune_$i.log"
  else
    echo "build failed"; tail -5 "$OUT/tune_build_$i.log"
  fi
  i=$((i + 1))
done
