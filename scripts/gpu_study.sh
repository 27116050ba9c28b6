#!/usr/bin/env bash
# Issue 54 on the device machine, one `run` call each (stage limits sum to under 10 minutes):
# build, the hot-row cache's step time (scripts/cache_step.py at batch 32,768) and the
# compression study at GPU length (examples/compression_study.py: 2,442 steps x 4,096 =
# 10 M training examples a run, 3 seeds, full Criteo cardinalities) for the budgets in
# STUDY_FACTORS (default "10 100"; the second call "1000 10000", a third STUDY_FACTORS=1
# STUDY_METHODS=dense for the uncompressed ceiling). Logs and JSON go to $OUT.
#   OUT=$OUT scripts/gpu_study.sh
#   STUDY_FACTORS="1000 10000" OUT=$OUT scripts/gpu_study.sh
set -uo pipefail
OUT=${OUT:-$PWD/gpu_study_out}
# shellcheck source=scripts/device_stage.sh
source "$(dirname "$0")/device_stage.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
stage 150 build env FLOWTT_CUDA=ON FLOWTT_CUDA_ARCHITECTURES=90 $PY -m pip install --no-build-isolation --no-deps -v -e .
[[ ${STUDY_FACTORS:-10} == 10 ]] && stage 90 cache_step $PY -m scripts.cache_step "$OUT/cache_step_gpu.json" --batch 32768
factors=${STUDY_FACTORS:-10}
# shellcheck disable=SC2086  # factors and methods: word lists
TAIL=30 stage ${STUDY_LIMIT:-330} study $PY examples/compression_study.py --steps 2442 --batch-size 4096 \
  --eval-batches 64 --seeds 0 1 2 --factors $factors --methods ${STUDY_METHODS:-hashed uniform planner planner_cache} \
  --crossover-rows --out "$OUT/compression_study_gpu_${factors// /_}.json" --plot "$OUT/compression_study_gpu_${factors// /_}.png"
exit $status
