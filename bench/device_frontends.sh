#!/usr/bin/env bash
# Batch-1 serving with and without --frontends on a GPU machine: `voxserve bench` at concurrency 64 from
# several load processes, each server configuration with batching on and off.
# Usage (repository root, device machine): bash bench/device_frontends.sh [FRONTENDS...]   (default: 4 6)
# Appends to $OUT/frontends.txt as it goes (a run cut short keeps what it measured).
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/frontends.txt") 2>&1
source bench/device_env.sh > /dev/null || exit 1
COUNTS=${*:-"4 6"}
LOAD=${LOAD:-"--processes 8 --connections 16"}
run() {  # $1: serve flags, $2..: bench args
  local flags=$1; shift
  # shellcheck disable=SC2086
  voxserve serve --host 127.0.0.1 --grpc-port 18301 --metrics-port 18302 $flags > "$OUT/serve.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 240); do
    kill -0 $pid 2> /dev/null || { echo "server exited:"; tail -5 "$OUT/serve.log"; return; }
    # voxserve_model_ready is the minimum over every process: 1 once all of them serve.
    curl -s localhost:18302/metrics 2> /dev/null | grep -q '^voxserve_model_ready{model="voxnet"} 1.0' && break
    sleep 1
  done
  echo "## serve $flags; bench $*"
  timeout 60 voxserve bench --url 127.0.0.1:18301 --timeout-s 10 "$@" 2> /dev/null | tail -n +2
  curl -s localhost:18302/metrics | grep -E '^voxserve_batch_size_(sum|count)'
  kill -TERM $pid
  timeout 60 tail --pid=$pid -f /dev/null || echo "server did not stop within 60 s"
}
date -u
nvidia-smi --query-gpu=name --format=csv,noheader
nproc
for n in 0 $COUNTS; do
  for flags in "" "--no-batching"; do
    fe=$([ "$n" = 0 ] || echo "--frontends $n")
    # shellcheck disable=SC2086
    run "$fe $flags" --batch 1 --concurrency 64 --duration 6 $LOAD
  done
done
