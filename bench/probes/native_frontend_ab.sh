#!/usr/bin/env bash
# Two builds of the native front end, in turn, against the same load: each round starts `voxserve serve --frontends 1
# --frontend-impl native` with one binary (and its library folder), drives batch-1 requests of a small sample at
# concurrency 32 from one client process, and prints the rate, p99 and the front end's CPU microseconds per request
# (its /proc utime + stime over the measured level).
#
#   bash bench/probes/native_frontend_ab.sh A_BINARY A_LIBDIR B_BINARY B_LIBDIR [ROUNDS]   (LIBDIR "" for none)
set -uo pipefail
PY=${PYTHON:-.venv/bin/python}
VOX="$PY -m voxserve"
LOAD="--batch 1 --shape 3,4,4,4 --concurrency 32"
one() {  # one BINARY LIBDIR LABEL
  VOXSERVE_NATIVE_FRONTEND=$1 LD_LIBRARY_PATH=$2 $VOX serve --grpc-port 18401 --http-port 18400 --metrics-port 18402 \
    --frontends 1 --frontend-impl native > "/tmp/native-ab-$3.log" 2>&1 &
  local server=$! fe="" a b out
  for _ in $(seq 1 90); do $VOX health --url 127.0.0.1:18401 > /dev/null 2>&1 && break; sleep 1; done
  fe=$(pgrep -P $server -x voxserve-fronte | head -1)
  $VOX bench --url 127.0.0.1:18401 $LOAD --duration 3 > /dev/null 2>&1  # warm-up
  a=$(awk '{print $14 + $15}' "/proc/$fe/stat")
  out=$($VOX bench --url 127.0.0.1:18401 $LOAD --duration 8 --json 2> /dev/null)
  b=$(awk '{print $14 + $15}' "/proc/$fe/stat")
  "$PY" -c "
import json, os, sys
level = json.loads(sys.argv[1])['levels'][0]
cpu_s = int(sys.argv[2]) / os.sysconf('SC_CLK_TCK')
print(f\"| {sys.argv[3]} | {level['requests_per_s']:.0f} | {level['p99_ms']:.1f} | {cpu_s / level['requests'] * 1e6:.0f} |\")
" "$out" $((b - a)) "$3"
  kill -TERM $server; timeout 30 tail --pid=$server -f /dev/null
}
echo "| build | req/s | p99 ms | front end CPU us per request |"
echo "|---|---:|---:|---:|"
for _ in $(seq 1 "${5:-3}"); do one "$1" "$2" A; one "$3" "$4" B; done
