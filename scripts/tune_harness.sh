#!/usr/bin/env bash
# Times build variants of the kernels on the S1 harness case (device machine):
#   scripts/tune_harness.sh "-DKNOB=0" "-DKNOB=1 -DOTHER=2" ...
# Each argument is one set of nvcc -D flags; the variants build in parallel, then run one
# after another with --s1-timing (correctness check against the float64 host reference
# included). Prints the TIMING / STAGES / PASS lines of each; logs in $OUT/tune_<i>.log.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
i=0
for flags in "$@"; do
  nvcc -arch=sm_90 -O3 -std=c++17 $flags cuda/test_harness.cu cuda/tt_kernels.cu \
    -o /tmp/flowtt_tune_$i > "$OUT/tune_build_$i.log" 2>&1 &
  i=$((i + 1))
done
wait
i=0
for flags in "$@"; do
  echo "== variant $i: $flags"
  if [[ -x /tmp/flowtt_tune_$i ]]; then
    /tmp/flowtt_tune_$i --s1-timing > "$OUT/tune_$i.log" 2>&1
    grep -E "PASS|FAIL|TIMING|STAGES" "$OUT/tune_$i.log"
  else
    echo "build failed"; tail -5 "$OUT/tune_build_$i.log"
  fi
  i=$((i + 1))
done
