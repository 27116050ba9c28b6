#!/usr/bin/env bash
# Unique-row capacities on the device machine (issue 41), one `run` call (stage limits sum to
# under 10 minutes): build, the capacity / table-batched / CUDA tests on the GPU, the sanitizer
# (memcheck, racecheck) on the small script (its capacity passes included), then the Meta-like
# collections at batch 32768 with ours_batched beside ours_batched_capacity (peak device memory
# per case). TABLES (default 240,480) picks the collections. Logs and JSON go to $OUT.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_memory_out}
# shellcheck source=scripts/device_stage.sh
source "$(dirname "$0")/device_stage.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
stage 240 build env FLOWTT_CUDA=ON FLOWTT_CUDA_ARCHITECTURES=90 $PY -m pip install --no-build-isolation --no-deps -v -e .
par=(); $PY -c "import xdist" 2>/dev/null && par=(-n 8)
stage 110 tests $PY -m pytest -q -p no:cacheprovider "${par[@]}" tests/test_capacity.py tests/test_group_op.py \
  tests/test_memory.py
for tool in ${SANITIZERS:-memcheck racecheck}; do
  stage 60 "sanitizer_$tool" compute-sanitizer --error-exitcode 1 --tool $tool --kernel-name kns=flowtt \
    --target-processes all $PY scripts/sanitize_small.py
done
TAIL=14 stage ${BENCH_LIMIT:-230} bench $PY -m benchmarks --suite collection --tables "${TABLES:-240,480}" \
  --batches 32768 --impls ours_batched,ours_batched_capacity --out-dir "$OUT/bench" --time-budget 210
exit $status
