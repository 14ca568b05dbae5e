#!/usr/bin/env bash
# MLServer as wheels to carry to the GPU device machine for bench/service_bench.py's MLServer peer
# (bench/device_service.sh installs .mls/*.whl with pip --no-index --no-deps and passes --mlserver-pythonpath).
# Run here, in the repository root; it replaces the wheels in DEST (.mls) with exactly this set, for
# CPython PYTHON_VERSION (3.12, the device's) on manylinux x86_64, and prints their total size.
#
#   bash bench/mlserver_carry.sh [DEST]
#   PYTHON_VERSION=3.11 bash bench/mlserver_carry.sh /tmp/mls-311   # the same set for a local check
#
# The set is what `mlserver start` imports to serve the peer over gRPC, less what the device's image already
# has (its package list: torch, numpy, grpcio, protobuf, prometheus-client, uvloop, pandas,
# click, anyio, h11, aiohttp, aiofiles, packaging, python-dateutil, wrapt, ml-dtypes, idna, certifi, urllib3).
# MLServer imports its REST and metrics servers (FastAPI, uvicorn), its Kafka server (aiokafka) and
# OpenTelemetry tracing whether or not they are enabled, so they are here; its pandas codec imports pandas
# (the image's). The last group (6.6 MB) is imported only for `mlserver infer` (tritonclient[http], gevent):
# `mlserver start` loads the CLI module that holds both commands. Declared dependencies not imported here are
# left out (python-multipart: FastAPI's form parsing), except zope.event (7 KB), which gevent.events imports.
# typing-extensions is carried because pydantic 2.14 needs >= 4.16.0 and the image's version is not recorded.
# MLServer 1.7.1's generated code needs protobuf >= 5.27.2 and grpcio >= 1.67.1; googleapis-common-protos
# 1.76's needs protobuf >= 6.33.5, as voxserve's own does.
set -euo pipefail
DEST=${1:-.mls}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
WHEELS=(
  mlserver==1.7.1
  # the REST and metrics servers, settings
  fastapi==0.115.14 starlette==0.46.2 uvicorn==0.54.0 starlette-exporter==0.24.0 importlib-resources==6.5.2
  orjson==3.13.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 pydantic-settings==2.16.3 python-dotenv==1.2.4
  # gRPC metrics, Kafka, tracing
  py-grpc-prometheus==0.8.0 aiokafka==0.14.0 async-timeout==5.0.1
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-instrumentation==0.66b2 opentelemetry-instrumentation-grpc==0.66b2
  opentelemetry-instrumentation-fastapi==0.66b2 opentelemetry-instrumentation-asgi==0.66b2 asgiref==3.13.0
  opentelemetry-util-http==0.66b2 opentelemetry-exporter-otlp-proto-grpc==1.45.2
  opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-common==0.66b2
  opentelemetry-proto==1.45.2 googleapis-common-protos==1.76.0
  # `mlserver infer` (imported by the CLI module)
  tritonclient==2.73.0 python-rapidjson==1.25 geventhttpclient==2.6.1 brotli==1.2.1 gevent==26.9.0
  greenlet==3.3.2 zope.event==6.2 zope.interface==8.7
)
PLATFORMS=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  PLATFORMS+=(--platform "${p}_x86_64")
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --implementation cp \
  --python-version "$PYTHON_VERSION" "${PLATFORMS[@]}" -d "$tmp" "${WHEELS[@]}"
n=$(find "$tmp" -name '*.whl' | wc -l)
[ "$n" = "${#WHEELS[@]}" ] || { echo "expected ${#WHEELS[@]} wheels, got $n" >&2; exit 1; }
mkdir -p "$DEST"
rm -f "$DEST"/*.whl  # one version of each: two stop the install
mv "$tmp"/*.whl "$DEST"/
ls -l "$DEST"/*.whl | awk '{printf "%9d  %s\n", $5, $NF}'
du -cb "$DEST"/*.whl | awk 'END {printf "%d wheels, %.2f MiB in %s\n", n, $1 / 1048576, d}' n="$n" d="$DEST"
if [ "$DEST" = .mls ] && git rev-parse --is-inside-work-tree > /dev/null 2>&1; then
  # what a device call carries with carry=[".mls", ".whl", ".triton"]: the working tree and those folders
  tree=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | awk 'END {print $1}')
  dirs=$(du -cb .mls $(ls -d .whl .triton 2>/dev/null) | awk 'END {print $1}')
  awk -v t="$tree" -v d="$dirs" 'BEGIN {printf "with the working tree, .whl/ and .triton/: %.2f MiB of a call'"'"'s 64 MiB\n", (t + d) / 1048576}'
fi
