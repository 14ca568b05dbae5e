#!/usr/bin/env bash
# Where the host's time goes on a GPU machine: the loopback transport probe (bench/probes/transport_probe.py),
# then voxserve in process and with --frontends on asyncio's loop and on uvloop (batch 1 at c=64; one full
# reference batch at c=1), then py-spy profiles of an engine and a front end under batch-1 load without batching.
# Usage (repository root, device machine): FRONTENDS=12 bash bench/device_host_probe.sh [PHASE...]
#   phases: transport, loops, profiles (default: all three)
# Writes $OUT/host-probe.txt, $OUT/transport.md and $OUT/*.raw (py-spy's collapsed stacks), as it goes.
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/host-probe.txt") 2>&1
source bench/device_env.sh > /dev/null || exit 1
FRONTENDS=${FRONTENDS:-12}
PHASES=${*:-"transport loops profiles"}
has() { [[ " $PHASES " == *" $1 "* ]]; }
LOAD="--processes 8 --connections 16"
PYSPY=$(command -v py-spy || echo /tmp/site/bin/py-spy)  # device_env.sh installs carried wheels under /tmp/site
start() {  # $@: serve flags; sets PID once every process serves
  voxserve serve --host 127.0.0.1 --grpc-port 18301 --metrics-port 18302 "$@" > "$OUT/serve.log" 2>&1 &
  PID=$!
  for _ in $(seq 1 240); do
    kill -0 $PID 2> /dev/null || { echo "server exited:"; tail -5 "$OUT/serve.log"; return 1; }
    curl -s localhost:18302/metrics 2> /dev/null | grep -q '^voxserve_model_ready{model="voxnet"} 1.0' && return 0
    sleep 1
  done
  return 1
}
stop() { kill -TERM $PID; timeout 60 tail --pid=$PID -f /dev/null || echo "server did not stop within 60 s"; }
bench() { echo "### bench $*"; timeout 60 voxserve bench --url 127.0.0.1:18301 --timeout-s 10 "$@" 2> /dev/null | tail -n +2; }
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc; git log --oneline -1 2>/dev/null
voxserve kernel build > "$OUT/kernel-build.log" 2>&1 || { echo "kernel build failed"; tail -20 "$OUT/kernel-build.log"; }
has transport && timeout 200 python3 bench/probes/transport_probe.py --messages 30 --duration 6 --processes 8 \
  --out "$OUT/transport.md" > "$OUT/transport.log" 2>&1
has transport && cat "$OUT/transport.md"
has loops && for loop in asyncio uvloop; do
  for fe in 0 "$FRONTENDS"; do
    echo "## serve --event-loop $loop --frontends $fe"
    start --event-loop "$loop" --frontends "$fe" || continue
    grep -o "([a-z]* event loop)" "$OUT/serve.log" | sort | uniq -c
    bench --batch 1 --concurrency 64 --duration 6 $LOAD
    bench --batch 128 --concurrency 1 --duration 5
    [ "$fe" = 0 ] || bench --batch 128 --concurrency 16 --duration 5 --processes 4 --connections 16
    stop
  done
done
profile() {  # $1: label; $2..: serve flags. An engine's and a front end's py-spy samples under batch-1 load.
  local label=$1; shift
  echo "## profiles ($label): serve $*, batch 1 c=64"
  start "$@" || return
  timeout 40 voxserve bench --url 127.0.0.1:18301 --batch 1 --concurrency 64 --duration 12 $LOAD \
    > "$OUT/profile-$label-bench.txt" 2>&1 &
  local load=$!
  sleep 3
  local p role engine="" frontend=""
  for p in $(pgrep -P $PID); do
    role=$(tr '\0' '\n' < /proc/$p/environ | grep '^VOXSERVE_ROLE=' | cut -d= -f2)
    [ "$role" = engine ] && engine=$p
    [ "$role" = frontend ] && frontend=$p
  done
  "$PYSPY" record -p "$engine" -d 6 -r 250 -f raw -o "$OUT/engine-$label.raw" --nonblocking > "$OUT/py-spy.log" 2>&1 &
  "$PYSPY" record -p "$frontend" -d 6 -r 250 -f raw -o "$OUT/frontend-$label.raw" --nonblocking >> "$OUT/py-spy.log" 2>&1
  wait $load
  tail -n 3 "$OUT/profile-$label-bench.txt"
  stop
}
if has profiles; then
  profile unbatched --frontends "$FRONTENDS" --no-batching
  profile batched --frontends "$FRONTENDS"
fi
date -u
