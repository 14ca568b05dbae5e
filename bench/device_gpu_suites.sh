#!/usr/bin/env bash
# Every GPU suite on the device machine (repository root), one pytest process per file (a lost device
# poisons a process, so the hostile suite runs first, alone, with -x), then optional probes.
# Usage: bash bench/device_gpu_suites.sh [test files to run first...]
#   PROBE=1 also runs bench/probes/cuda_shm_probe.py; SUITES=0 skips the default suites.
#   LIMIT_S (default 590): the whole run's seconds; each suite's (and the probe's) timeout is cut to what is
#   left, and one with under 30 s left is listed as not run. A file named as an argument runs once, first.
#   .native/voxserve-native.tar.xz (bench/native_carry.sh), when carried, is unpacked for the native front end's
#   tests (they skip without it: the device has no gRPC C++ library to build it).
# Writes $OUT/gpu-suites.txt (and $OUT/cuda-shm-probe-<device>.md).
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source bench/device_env.sh > /dev/null 2>&1 || { echo "device_env failed"; exit 1; }
python3 -c "from voxserve.kernels import build; build.build()" > "$OUT/build.txt" 2>&1 || { tail "$OUT/build.txt"; exit 1; }
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
native_frontend_env || true  # (without it the native front end's tests skip)
ran=" "  # the files named as arguments: run first, and left out of the default suites
left_s() { echo $(( ${LIMIT_S:-590} - SECONDS - 10 )); }
suite() {  # suite <timeout> <pytest args...>
  local limit=$1 left args=() a; shift
  for a in "$@"; do [[ "$ran" == *" $a "* ]] || args+=("$a"); done
  set -- "${args[@]}"
  [[ " $* " == *" tests/"* ]] || return 0  # every file of it ran already
  left=$(left_s)
  if [ "$left" -lt 30 ]; then echo "== $*: not run (out of time)" | tee -a "$OUT/gpu-suites.txt"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $*" | tee -a "$OUT/gpu-suites.txt"
  timeout -k 5 "$limit" python3 -m pytest -q -rs -p no:cacheprovider --timeout=120 "$@" >> "$OUT/gpu-suites.txt" 2>&1
  echo "   rc=$?" >> "$OUT/gpu-suites.txt"
  tail -n 40 "$OUT/gpu-suites.txt" | grep -E '^(FAILED|ERROR)|passed|failed|skipped|rc=' | tail -6
}
for first in "$@"; do suite 240 "$first"; ran+="$first "; done
if [ "${SUITES:-1}" != 0 ]; then
  suite 240 -x tests/core/test_cuda_shm_hostile_gpu.py
  suite 200 tests/core/test_ipccheck.py tests/kernels/test_devicemem_contract.py tests/core/test_hostmem_contract.py
  suite 200 tests/core/test_cuda_shm_gpu.py tests/core/test_shm_in_place_gpu.py
  suite 200 tests/core/test_cuda_client_gpu.py
  suite 240 tests/topology/test_frontends.py -k gpu
  suite 200 tests/core/test_pipeline_gpu.py tests/kernels/test_kernel_gpu.py
  suite 240 tests/e2e/test_service.py
fi
if [ "${PROBE:-0}" = 1 ]; then
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z-')
  left=$(left_s); [ "$left" -gt 240 ] && left=240
  if [ "$left" -lt 30 ]; then echo "== cuda_shm_probe: not run (out of time)" | tee -a "$OUT/gpu-suites.txt"; exit 0; fi
  timeout "$left" python3 bench/probes/cuda_shm_probe.py --commit "${COMMIT:-$commit}" --out "$OUT/cuda-shm-probe-$name.md" 2>&1 | tail -25
fi
