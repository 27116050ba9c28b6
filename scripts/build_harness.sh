#!/usr/bin/env bash
# Configures and builds the standalone CUDA harness (cmake target flowtt_harness, which
# links the kernel library flowtt_cuda_kernels) and prints the executable's path:
#   scripts/build_harness.sh BUILD_DIR ["-DKNOB=1 -DOTHER=2"] [extra nvcc flags, e.g. -lineinfo]
# The -D defines reach the kernels through the cache variable FLOWTT_KERNEL_DEFINES.
# Build output goes to BUILD_DIR/build.log.
set -euo pipefail
BUILD=${1:?usage: scripts/build_harness.sh BUILD_DIR [defines] [nvcc flags]}
DEFINES=$(for d in ${2:-}; do printf '%s;' "${d#-D}"; done)
GENERATOR=()
command -v ninja > /dev/null && GENERATOR=(-G Ninja)
mkdir -p "$BUILD"
{
  cmake -S "$(dirname "$0")/.." -B "$BUILD" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DFLOWTT_CUDA=ON -DFLOWTT_CUDA_ARCHITECTURES=90 -DFLOWTT_BUILD_HARNESS=ON \
    -DPython_EXECUTABLE="$(command -v "${PY:-python3}")" \
    "-DFLOWTT_KERNEL_DEFINES=${DEFINES%;}" "-DCMAKE_CUDA_FLAGS=${3:-}"
  cmake --build "$BUILD" --target flowtt_harness --parallel
} > "$BUILD/build.log" 2>&1 || { echo "harness build failed (see $BUILD/build.log)" >&2; tail -20 "$BUILD/build.log" >&2; exit 1; }
echo "$BUILD/flowtt_harness"
