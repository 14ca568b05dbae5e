#!/usr/bin/env bash
# Several GPUs (run on a multi-GPU device machine after bench/device_check.sh installed the package):
# the runner's throughput on 1 vs all GPUs with NVML utilisation, then `voxserve serve --devices all`
# against `--devices 0` through the service (shared memory, so that the socket is not the limit).
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 bench/multi_gpu_probe.py --out "$OUT/multi-gpu.md" 2>&1 | tail -12
python3 bench/multi_gpu_probe.py --pinned --out "$OUT/multi-gpu-pinned.md" 2>&1 | tail -12
for devices in 0 all; do
  voxserve serve --grpc-port 18302 --metrics-port 18303 --devices $devices > "$OUT/serve-$devices.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 120); do
    kill -0 $pid 2> /dev/null || { echo "server exited"; tail -5 "$OUT/serve-$devices.log"; break; }
    voxserve health --url localhost:18302 --timeout-s 2 > /dev/null 2>&1 && break; sleep 1
  done
  echo "## --devices $devices"
  python3 -c "from voxserve.client import Client; c = Client('localhost:18302'); g = c.model_config().instance_group[0]; print('instance group: count', g.count, 'gpus', list(g.gpus))"
  voxserve bench --url localhost:18302 --batch 128 --concurrency 4,8,16 --duration 5 --shared-memory 2> /dev/null
  curl -s localhost:18303/metrics | grep -E '^voxserve_gpu_utilization_ratio' || true
  kill -TERM $pid; wait $pid
done 2>&1 | tee "$OUT/multi-gpu-service.txt"
