#!/usr/bin/env bash
# The layer at scale on the device machine, one `run` call each (the stage limits of one call
# sum to under 10 minutes):
#   scripts/gpu_layer.sh        build, the collection and input pipeline tests on the GPU, the collection benchmark
#                               with ours_layer beside ours_batched (Meta-like 240 and 788 tables
#                               x 4096), construction and compile times of the packed and dict
#                               calls (python -m scripts.layer_timing, 240 and 788 tables at 4096);
#                               SKIP_TESTS=1 skips the tests
#   scripts/gpu_layer.sh dlrm   build, then the DLRM Meta-like preset at batch 4096
# Logs and JSON go to $OUT (default ./gpu_layer_out).
set -uo pipefail
OUT=${OUT:-$PWD/gpu_layer_out}
# shellcheck source=scripts/device_stage.sh
source "$(dirname "$0")/device_stage.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
STAGE=${1:-layer}
stage 240 build env FLOWTT_CUDA=ON FLOWTT_CUDA_ARCHITECTURES=90 $PY -m pip install --no-build-isolation --no-deps -v -e .
par=(); $PY -c "import xdist" 2>/dev/null && par=(-n 8)
if [[ $STAGE == dlrm ]]; then
  TAIL=6 stage 300 dlrm $PY examples/dlrm.py --preset meta --tables 240 --batch-size 4096 --steps 60 \
    --eval-batches 8 --max-rows 0 --dim 32 --rank 32 --lr 3e-3 --log-every 20 --no-progress --profile-steps 5
  exit $status
fi
[[ ${SKIP_TESTS:-0} == 1 ]] || stage 150 tests $PY -m pytest -q -p no:cacheprovider "${par[@]}" tests/test_collection_jagged.py \
  "tests/test_benchmarks.py::test_layer_impls_equal_the_packed_op" tests/test_collection_stacked.py \
  tests/test_input_pipeline.py tests/test_input_errors.py tests/test_tb_bags_ffi.py tests/test_op_policies.py
TAIL=12 stage 160 bench $PY -m benchmarks --stage collection --impls ours_batched,ours_layer,ours_layer_dict \
  --tables 240,788 --batches 4096 --out-dir "$OUT/bench" --time-budget 140
TAIL=10 stage 150 timing $PY -m scripts.layer_timing --tables 240,788 --batches 4096 \
  --calls packed,dict,packed_train,dict_train --json "$OUT/layer_timing.json"
exit $status
