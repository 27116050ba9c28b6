#!/usr/bin/env bash
# Nsight Compute profile of the S1 kernels (standalone harness, one launch of each kernel),
# on the device machine: scripts/profile_kernels.sh [kernel-regex] [launch-count]
# (HARNESS_ARGS: the harness's options, default --s1; e.g. "--only D128_r64_B65536")
# Writes $OUT/ncu_s1.ncu-rep, $OUT/ncu_details.txt / .csv (all sections) and
# $OUT/ncu_source_<K>.csv (per-line CUDA/SASS counters of the first launch of each kernel K
# in FLOWTT_NCU_SOURCE, a space-separated list of name regexes), summarised by
# scripts/ncu_source_summary.py.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
REGEX=${1:-rows_fwd_gemm|rows_bwd_gemm|pool_|dg[123]_}
COUNT=${2:-12}
HARNESS=$(scripts/build_harness.sh "${BUILD_ROOT:-/tmp/flowtt_build}/lineinfo" "" -lineinfo) \
  || { echo "harness build failed"; exit 1; }
ncu --clock-control none --set full --import-source yes --kernel-name "regex:$REGEX" \
  --launch-count "$COUNT" -f -o "$OUT/ncu_s1" "$HARNESS" ${HARNESS_ARGS:---s1} > "$OUT/ncu_run.log" 2>&1
tail -3 "$OUT/ncu_run.log"
ncu -i "$OUT/ncu_s1.ncu-rep" --page details --print-details all > "$OUT/ncu_details.txt" 2>&1
ncu -i "$OUT/ncu_s1.ncu-rep" --page details --csv > "$OUT/ncu_details.csv" 2>&1
for SRC in ${FLOWTT_NCU_SOURCE:-rows_bwd_gemm}; do
  ncu -i "$OUT/ncu_s1.ncu-rep" --page source --csv --print-source cuda,sass \
    --kernel-name "regex:$SRC" --launch-count 1 > "$OUT/ncu_source_$SRC.csv" 2>&1
  echo "== $SRC: source lines by stall samples"
  python3 scripts/ncu_source_summary.py "$OUT/ncu_source_$SRC.csv" 12
done
grep -E "^  [a-z_]|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Compute \(SM\) Throughput|Memory Throughput|L2 Hit|Local" \
  "$OUT/ncu_details.txt" | head -200
