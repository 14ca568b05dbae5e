#!/usr/bin/env bash
# Build the native front-end probe (Debian: apt-get install libgrpc++-dev protobuf-compiler-grpc) into
# build/native_frontend/, as bench/probes/cpp_sink/build.sh builds the sink.
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
out="$root/build/native_frontend"
mkdir -p "$out"
protoc -I "$root/proto" --cpp_out="$out" --grpc_out="$out" --plugin=protoc-gen-grpc="$(command -v grpc_cpp_plugin)" \
  "$root/proto/grpc_service.proto" "$root/proto/model_config.proto"
g++ -O2 -std=c++17 -Wall -Wextra -pthread -I "$out" "$root/bench/probes/native_frontend/frontend.cc" \
  "$out/grpc_service.pb.cc" "$out/grpc_service.grpc.pb.cc" "$out/model_config.pb.cc" -o "$out/frontend" \
  $(pkg-config --cflags --libs grpc++ protobuf)
echo "$out/frontend"
