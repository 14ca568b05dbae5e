#!/usr/bin/env bash
# A first look at service throughput on a GPU machine (not the full bench/service_bench.py of the
# throughput issue): voxserve bench against a local server, with and without batching.
# Run after bench/device_check.sh has installed the package. Writes $OUT/service-probe.txt.
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}  # wheels device_check.sh installed
run() {  # $1: extra serve flags, $2..: bench args
  local flags=$1; shift
  voxserve serve --grpc-port 18301 --metrics-port -1 $flags > "$OUT/serve.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 120); do
    kill -0 $pid 2> /dev/null || { echo "server exited:"; tail -5 "$OUT/serve.log"; return; }
    voxserve health --url localhost:18301 --timeout-s 2 > /dev/null 2>&1 && break; sleep 1
  done
  echo "## serve $flags; bench $*"
  voxserve bench --url localhost:18301 "$@" 2> /dev/null
  kill -TERM $pid; wait $pid
}
{
  run "" --batch 128 --concurrency 1,4 --duration 5 --compare-raw
  run "" --batch 128 --dtype fp16 --concurrency 1,4 --duration 5
  run "" --batch 128 --concurrency 1,4 --duration 5 --shared-memory
  run "" --batch 1 --concurrency 1,64 --duration 5
  run "--no-batching" --batch 1 --concurrency 1,64 --duration 5
} 2>&1 | tee "$OUT/service-probe.txt"
