#!/usr/bin/env bash
# The service benchmark on a GPU machine (repository root): GPU pipeline and front-end tests, then
# bench/service_bench.py with --frontends and a multi-process batch-1 client, MLServer included when its
# wheels were carried in .mls/ (pip download mlserver and its dependencies for the device's Python).
# Writes $OUT/service-<device>.md and $OUT/service.log.
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/service.log") 2>&1
source bench/device_env.sh > /dev/null || exit 1
MLS=()
if compgen -G ".mls/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mls-site .mls/*.whl && MLS=(--mlserver-pythonpath /tmp/mls-site)
fi
timeout 300 python3 -m pytest -q tests/core/test_pipeline_gpu.py tests/topology/test_frontends.py 2>&1 | tail -3
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z-')
timeout 500 python3 bench/service_bench.py --frontends "${FRONTENDS:-6}" --processes 8 --connections 16 "${MLS[@]}" \
  --out "$OUT/service-$name.md" > /dev/null
tail -12 "$OUT/service-$name.md"
