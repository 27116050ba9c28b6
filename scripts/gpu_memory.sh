#!/usr/bin/env bash
# Lean by default on the device machine (issues 41, 50), one `run` call (stage limits sum to
# under 10 minutes): build, the capacity / memory-policy / table-batched tests on the GPU, the
# sanitizer (memcheck on the small script; racecheck and synccheck on the harness's small
# cases, scripts/gpu_race.sh, when present), then the Meta-like collections at batch 32768:
# ours_layer (TTEmbeddingCollection with DEFAULT settings: memory_budget="auto") beside the
# hand-tuned ours_batched_capacity, with peak device memory per case. TABLES (default
# 240,480,788) picks the collections; IMPLS overrides the impls. EcoRec on the same bags:
# scripts/gpu_ecorec.sh (its own call: its build takes 4 minutes). Logs and JSON go to $OUT.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_memory_out}
# shellcheck source=scripts/device_stage.sh
source "$(dirname "$0")/device_stage.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
stage 240 build env FLOWTT_CUDA=ON FLOWTT_CUDA_ARCHITECTURES=90 $PY -m pip install --no-build-isolation --no-deps -v -e .
par=(); $PY -c "import xdist" 2>/dev/null && par=(-n 8)
stage 110 tests $PY -m pytest -q -p no:cacheprovider "${par[@]}" tests/test_capacity.py tests/test_group_op.py \
  tests/test_memory.py tests/test_memory_policy.py
stage 60 sanitizer_memcheck compute-sanitizer --error-exitcode 1 --tool memcheck --kernel-name kns=flowtt \
  --target-processes all $PY scripts/sanitize_small.py
[[ -x scripts/gpu_race.sh ]] && TAIL=6 stage 150 sanitizer_race env OUT="$OUT" scripts/gpu_race.sh
TAIL=20 stage ${BENCH_LIMIT:-260} bench $PY -m benchmarks --suite collection --tables "${TABLES:-240,480,788}" \
  --batches 32768 --impls "${IMPLS:-ours_layer,ours_batched_capacity}" --out-dir "$OUT/bench" --time-budget 240
exit $status
