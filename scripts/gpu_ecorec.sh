#!/usr/bin/env bash
# EcoRec (SC24, repository SC24_ADE) as a peer on the Meta-like collections, one device `run`
# call (about 8 minutes at most): build EcoRec's extension for sm_90 (benchmarks/ecorec_peer.py
# --build-only, cached in $ECOREC_BUILD outside the repository), then time it on the suite's bags
# (240x4096, 240x32768, 480x32768, 788x32768; CASES overrides) within the time left.
# The checkout is expected at third_party/SC24_ADE (gitignored, ~4 MB: ship it with the run
# tool's carry=["third_party/SC24_ADE"]; ECOREC_PATH overrides). Needs python3 with torch + CUDA
# (no flowtt_jax build: the peer imports the workloads without jax). Logs and JSON go to $OUT.
set -uo pipefail
OUT=${OUT:-$PWD/gpu_ecorec_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export MAX_JOBS=${MAX_JOBS:-16}
export FLOWTT_COMMIT=${FLOWTT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
PY=${PY:-python3}
ECO=${ECOREC_PATH:-third_party/SC24_ADE}
BUILD=${ECOREC_BUILD:-/tmp/flowtt_ecorec_build}
TOTAL=${TOTAL:-500}  # seconds for the whole script (the device call allows 600)
status=0
stage() { local limit=$1 name=$2; shift 2; echo "== $name ($(date +%T), limit ${limit}s)"; timeout "$limit" "$@" >"$OUT/$name.log" 2>&1 || { echo "   rc $?"; status=1; }; tail -"${TAIL:-4}" "$OUT/$name.log"; }
if [ ! -f "$ECO/ecorec/tt_emb/tt_emb_cuda.cu" ]; then
  echo "no EcoRec checkout at $ECO: ship third_party/SC24_ADE with the run tool's carry"; exit 2
fi
echo "EcoRec: $(cat "$ECO/FLOWTT_SOURCE" 2>/dev/null || echo 'source unknown'), $(du -sh "$ECO" | cut -f1)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
nvcc --version | tail -1
stage 240 build $PY -m benchmarks.ecorec_peer --ecorec-path "$ECO" --build-dir "$BUILD" --build-only
log=$(ls -t "$BUILD"/ecorec_*/build.log 2>/dev/null | head -1)
[ -n "$log" ] && cp "$log" "$OUT/ecorec_build.log"
[ "$status" = 0 ] || { echo "build failed: see $OUT/build.log, $OUT/ecorec_build.log"; exit 1; }
left=$((TOTAL - SECONDS))
TAIL=40 stage "$left" bench $PY -m benchmarks.ecorec_peer --ecorec-path "$ECO" --build-dir "$BUILD" \
  --cases "${CASES:-240x4096,240x32768,480x32768,788x32768}" --out-dir "$OUT/ecorec" \
  --time-budget $((left - 25)) ${PEER_ARGS:-}
ls -l "$OUT/ecorec" 2>/dev/null
exit $status
