#!/usr/bin/env bash
# The engine-bound rows through native front ends on the GPU device machine (repository root), A/B in one call, each
# configuration twice, alternated (rates on these hosts drift by a fifth between leases, less within one call):
#   1. batch 1 at c=64 over the client's 16 connections in all and over 64: with 16 the kernel's hash of connections
#      onto the front ends leaves some idle (bench/results/batch1-wire-vs-cuda-shm-h200-2026-12-04.md);
#   2. each with the server's --event-loop uvloop (the engine's CPU per execution fell ~14 % with it on the CPU box:
#      bench/results/engine-probe-gpu-path-cpu-2core.md); over 64 connections also --max-queue-delay-ms 2 (the
#      engine's CPU is a cost per execution plus one per request: batches held 2 ms hold more requests, ~18 now);
#   3. full batches in CUDA shared memory at c=32, --max-batch 512, asyncio against uvloop.
# Carry .whl, .native (bash bench/native_carry.sh) and .build with the kernel library built for the GPU
# (VOXSERVE_KERNEL_CACHE=$PWD/.build/kcache voxserve kernel build --arch 9.0a). COMMIT=SHA names the commit measured.
# Writes $OUT/engine-ab-batch1-c16.md, engine-ab-batch1-c64.md, engine-ab-cuda-shm.md (bench/cpu_split.py's reports).
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
source bench/device_env.sh > /dev/null 2>&1 || { echo "device_env failed"; exit 1; }
export VOXSERVE_KERNEL_CACHE=${VOXSERVE_KERNEL_CACHE:-$PWD/.build/kcache}
native_frontend_env || { echo ".native/ not carried (bash bench/native_carry.sh)"; exit 1; }
python3 -c "from voxserve.kernels import build; build.build()" > /dev/null 2>&1 || { echo "kernel build failed"; exit 1; }
N="--frontends 12 --frontend-impl native"
split() {  # split <name> <bench flags> <configurations...>
  local name=$1 bench=$2 configs=() c; shift 2
  for c in "$@"; do configs+=("--config=$c"); done
  timeout 250 python3 bench/cpu_split.py --no-sink ${COMMIT:+--commit "$COMMIT"} "${configs[@]}" --bench="$bench" \
    --out "$OUT/engine-ab-$name.md" 2>&1 | grep -E "^\|.*(req/s|per execution)"
  echo "== $name done at $SECONDS s"
}
U="--event-loop uvloop"
split batch1-c16 "--batch 1 --concurrency 64 --duration 5 --processes 8 --connections 16" "$N" "$N $U" "$N" "$N $U"
D="--max-queue-delay-ms 2"
split batch1-c64 "--batch 1 --concurrency 64 --duration 5 --processes 8 --connections 64" \
  "$N" "$N $U" "$N $D" "$N" "$N $U" "$N $D"
split cuda-shm "--batch 128 --cuda-shared-memory --concurrency 32 --duration 5 --processes 8 --connections 16" \
  "$N --max-batch 512" "$N --max-batch 512 $U" "$N --max-batch 512" "$N --max-batch 512 $U"
