#!/usr/bin/env bash
# Several GPUs (run on a multi-GPU device machine after bench/device_check.sh installed the package):
# the runner's throughput on 1 vs all GPUs with NVML utilisation, then the service on one GPU, on all GPUs in
# one process (--replicas 1) and with one process per GPU (the default), shared memory so that the socket is
# not the limit.
# SKIP_RUNNER=1 leaves the runner probes out.
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if [ "${SKIP_RUNNER:-0}" != 1 ]; then
  python3 bench/multi_gpu_probe.py --out "$OUT/multi-gpu.md" 2>&1 | tail -12
  python3 bench/multi_gpu_probe.py --pinned --out "$OUT/multi-gpu-pinned.md" 2>&1 | tail -12
fi
# Through the service: one process on GPU 0, one process on all GPUs, one process per GPU (--replicas).
# The client opens 16 connections (a connection is served by one replica), inputs in shared memory.
serve_and_bench() {  # label, serve flags...
  local label=$1; shift
  python3 -m voxserve serve --grpc-port 18302 --metrics-port 18303 "$@" > "$OUT/serve-$label.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 180); do
    kill -0 $pid 2> /dev/null || { echo "server exited"; tail -5 "$OUT/serve-$label.log"; return; }
    curl -s localhost:18303/metrics | grep -q '^voxserve_model_ready{.*} 1.0' && break; sleep 1
  done
  echo "## $label: voxserve serve $*"
  nvidia-smi --query-gpu=index,utilization.gpu --format=csv,noheader,nounits -lms 500 > "$OUT/util-$label.csv" &
  local smi=$!
  python3 -m voxserve bench --url localhost:18302 --batch 128 --concurrency 8,16,32 --duration 5 --shared-memory \
    --connections 16 2> /dev/null
  kill $smi
  python3 - "$OUT/util-$label.csv" <<'PY'
import collections, sys
u = collections.defaultdict(list)
for line in open(sys.argv[1]):
    i, v = (int(p) for p in line.split(","))
    u[i].append(v)
print("mean GPU utilisation (nvidia-smi) during the levels: " + ", ".join(f"gpu{i} {sum(v) / len(v):.0f} %" for i, v in sorted(u.items())))
PY
  kill -TERM $pid; wait $pid
}
{
  serve_and_bench one-gpu --devices 0
  serve_and_bench one-process-all-gpus --devices all --replicas 1
  serve_and_bench replica-per-gpu --devices all
} 2>&1 | tee "$OUT/multi-gpu-service.txt"
