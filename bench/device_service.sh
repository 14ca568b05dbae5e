#!/usr/bin/env bash
# The service benchmark on a GPU machine (repository root): GPU pipeline and front-end tests (TESTS=0 skips
# them), then bench/service_bench.py with --frontends and a multi-process batch-1 client, full batches at
# FULL_CONCURRENCY (1,4,16). Peers, when carried:
#   MLServer: its wheels in .mls/ (12 MB): bash bench/mlserver_carry.sh (MLServer 1.7.1 and what it imports
#             beyond the device's image, for Python 3.12); they are used only if mlserver imports with them;
#   Triton:   .triton/ holding the nvidia-pytriton 0.7.0 wheel (55 MB), or, to travel beside .mls/ within one
#             call's 64 MiB, its server parts for Python 3.12 (27 MB):
#             python bench/triton_peer/server.py pack nvidia_pytriton-0.7.0-*.whl .triton/tritonserver-py3.12.zip --python 3.12
#   Native front ends: .native/voxserve-native.tar.xz from bash bench/native_carry.sh (the binary and the libraries
#             it needs beyond the device's image, ~6 MB); NATIVE_FRONTENDS=N (default: FRONTENDS) adds the rows of
#             --frontend-impl native.
#   FULL_PROCESSES=N (default 1): load processes of the full-batch levels (one Python client process moves ~1-2
#             GB/s of 25 MB messages; more measure the server rather than the client).
#   ENGINES=N (default 1): engine processes behind the front ends (--replicas N; on one GPU they share it).
#   TABLES=a,b: only these of service_bench's tables (--tables; e.g. shm,cuda_shm,batch1,cuda_shm_batch1).
#   CONNECTIONS=N (default 16): connections of the batch-1 client in all, over its 8 processes (each front end gets
#             those the kernel hashes to it: bench/results/batch1-wire-vs-cuda-shm-h200-2026-12-04.md).
#   MAX_BATCH=N: every server's most samples in one execution (--max-batch; default the full batch's 128).
#   COMMIT=SHA: the commit measured, named in the report (the device's copy of the tree has older git metadata).
# Writes $OUT/service-<device>.md and $OUT/service.log. The whole run stays within LIMIT_S (590) seconds.
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/service.log") 2>&1
source bench/device_env.sh > /dev/null || exit 1
MLS=()
if compgen -G ".mls/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/mls-site .mls/*.whl \
    && PYTHONPATH=bench/mlserver_peer:/tmp/mls-site${PYTHONPATH:+:$PYTHONPATH} python3 -c "import mlserver.cli.main, voxnet_runtime" \
    && MLS=(--mlserver-pythonpath /tmp/mls-site)
fi
TRITON=()
triton=$({ compgen -G ".triton/*.zip"; compgen -G ".triton/*.whl"; } | head -1)
[ -n "$triton" ] && TRITON=(--triton "$triton" --triton-instances "${TRITON_INSTANCES:-2}")
if [ "${TESTS:-1}" != 0 ]; then
  timeout 300 python3 -m pytest -q tests/core/test_pipeline_gpu.py tests/topology/test_frontends.py 2>&1 | tail -3
fi
NATIVE=()
if native_frontend_env; then
  if ldd "$VOXSERVE_NATIVE_FRONTEND" | grep "not found"; then echo "native front end: libraries missing (above)"
  else NATIVE=(--native-frontends "${NATIVE_FRONTENDS:-${FRONTENDS:-6}}"); fi
fi
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z ' 'a-z-')
left=$(( ${LIMIT_S:-590} - SECONDS ))
echo "service_bench: ${left} s left; MLServer: ${MLS[*]:-not run}; Triton: ${TRITON[*]:-not carried}; native: ${NATIVE[*]:-not carried}"
PYTHONUNBUFFERED=1 timeout "$left" python3 bench/service_bench.py --frontends "${FRONTENDS:-6}" --processes 8 \
  --connections "${CONNECTIONS:-16}" --full-concurrency "${FULL_CONCURRENCY:-1,4,16}" --duration "${DURATION:-5}" "${MLS[@]}" \
  "${TRITON[@]}" "${NATIVE[@]}" --engines "${ENGINES:-1}" \
  --full-processes "${FULL_PROCESSES:-1}" ${COMMIT:+--commit "$COMMIT"} ${TABLES:+--tables "$TABLES"} \
  ${MAX_BATCH:+--max-batch "$MAX_BATCH"} --out "$OUT/service-$name.md" > /dev/null
tail -20 "$OUT/service-$name.md"
