#!/usr/bin/env bash
# The Python packages the GPU device machine lacks (its image has torch, grpcio 1.84, protobuf, prometheus-client,
# safetensors, nvidia-ml-py, numpy, pytest and uvloop, and no package index), as wheels for its Python 3.12 on
# x86-64, pinned and without their dependencies (each needed one is named here):
#   .whl/        what the server and service_bench import: the health and reflection services, the REST port
#                (aiohttp and its parts, orjson), cuda-bindings for the client's CUDA shared memory (15 MiB);
#   .whl-tools/  what only the tests and probes import: tritonclient (with ml-dtypes and rapidjson) and its CUDA
#                shared memory utilities, OpenTelemetry for --tracing, cryptography for the TLS tests' certificates,
#                pytest-timeout for device_gpu_suites.sh,
#                hypothesis, py-spy (16 MiB). A service benchmark's call leaves it behind, so that .whl, .triton,
#                .mls and .native fit one call's 64 MiB. bench/device_env.sh installs both folders when present.
#
#   bash bench/device_wheels.sh      then name .whl (and .whl-tools) in the device call's carry
set -euo pipefail
PYTHON=${PYTHON:-python3}
download() {  # download <dest> <name==version>...
  local dest=$1; shift
  mkdir -p "$dest"
  "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --implementation cp \
    --python-version 3.12 --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$dest" "$@"
}
download .whl grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0 \
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 attrs==26.1.0 frozenlist==1.8.0 multidict==7.2.1 \
  propcache==0.5.4 yarl==1.25.1 idna==3.20 orjson==3.13.0 cuda-bindings==13.0.3 cuda-pathfinder==1.3.3
download .whl-tools tritonclient==2.73.0 python-rapidjson==1.25 ml-dtypes==0.5.4 \
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2 \
  opentelemetry-exporter-otlp-proto-grpc==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
  opentelemetry-semantic-conventions==0.66b2 googleapis-common-protos==1.76.0 \
  pytest-timeout==2.4.0 hypothesis==6.170.17 sortedcontainers==2.4.0 py-spy==0.4.1 \
  cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
du -sh .whl .whl-tools
