#!/usr/bin/env bash
# One device-machine session: install, build the kernel, run the GPU tests, compute-sanitizer, the benchmark.
# Usage (on the device machine, repository root): bash bench/device_check.sh [bench args...]
# SKIP_SANITIZER=1 / SKIP_BENCH=1 leave those steps out.
# Writes logs under $OUT (or ./device-out).
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source bench/device_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 - <<'PY' 2>&1 | tee "$OUT/build.txt"
import time
from voxserve.kernels import build
t = time.time(); r = build.build(force=True); print(f"cold build {time.time() - t:.1f} s: {r.path} for {r.archs}")
t = time.time(); r = build.build(); print(f"warm build {time.time() - t:.2f} s")
print("\n".join(l for l in r.ptxas_report.splitlines() if "registers" in l or "spill" in l or "Compiling" in l))
PY
timeout 420 python3 -m pytest -q -rs tests/kernels/test_kernel_gpu.py tests/core/test_pipeline_gpu.py tests/e2e/test_service.py \
  tests/kernels/test_reference.py tests/core/test_batching.py tests/core/test_faults.py 2>&1 | tee "$OUT/pytest-gpu.txt" | tail -15
if [ "${SKIP_SANITIZER:-0}" != 1 ]; then
  timeout 240 compute-sanitizer --tool memcheck --print-limit 20 python3 bench/sanitize_cases.py > "$OUT/memcheck.txt" 2>&1
  echo "memcheck rc=$?"; tail -4 "$OUT/memcheck.txt"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout 300 python3 bench/kernel_bench.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.txt" | tail -12
fi
