#!/usr/bin/env bash
# Every GPU suite on the device machine (repository root), one pytest process per file (a lost device
# poisons a process, so the hostile suite runs first, alone, with -x), then optional probes.
# Usage: bash bench/device_gpu_suites.sh [extra test files...]
#   PROBE=1 also runs bench/probes/cuda_shm_probe.py; SUITES=0 skips the suites.
# Writes $OUT/gpu-suites.txt (and $OUT/cuda-shm-probe-<device>.md).
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source bench/device_env.sh > /dev/null 2>&1 || { echo "device_env failed"; exit 1; }
python3 -c "from voxserve.kernels import build; build.build()" > "$OUT/build.txt" 2>&1 || { tail "$OUT/build.txt"; exit 1; }
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
suite() {  # suite <timeout> <pytest args...>
  local limit=$1; shift
  echo "== $*" | tee -a "$OUT/gpu-suites.txt"
  timeout "$limit" python3 -m pytest -q -rs -p no:cacheprovider --timeout=120 "$@" >> "$OUT/gpu-suites.txt" 2>&1
  echo "   rc=$?" >> "$OUT/gpu-suites.txt"
  tail -n 40 "$OUT/gpu-suites.txt" | grep -E '^(FAILED|ERROR)|passed|failed|skipped|rc=' | tail -6
}
if [ "${SUITES:-1}" != 0 ]; then
  suite 240 -x tests/core/test_cuda_shm_hostile_gpu.py
  suite 200 tests/core/test_ipccheck.py tests/kernels/test_devicemem_contract.py tests/core/test_hostmem_contract.py
  suite 200 tests/core/test_cuda_shm_gpu.py tests/core/test_shm_in_place_gpu.py
  suite 200 tests/core/test_cuda_client_gpu.py
  suite 240 tests/topology/test_frontends.py -k gpu
  suite 200 tests/core/test_pipeline_gpu.py tests/kernels/test_kernel_gpu.py
  suite 240 tests/e2e/test_service.py
  for extra in "$@"; do suite 240 "$extra"; done
fi
if [ "${PROBE:-0}" = 1 ]; then
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z-')
  timeout 240 python3 bench/probes/cuda_shm_probe.py --commit "${COMMIT:-$commit}" --out "$OUT/cuda-shm-probe-$name.md" 2>&1 | tail -25
fi
