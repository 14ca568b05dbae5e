#!/usr/bin/env bash
# Build the C++ sink (Debian: apt-get install libgrpc++-dev protobuf-compiler-grpc) into build/cpp_sink/.
set -euo pipefail
root=$(cd "$(dirname "$0")/../../.." && pwd)
out="$root/build/cpp_sink"
mkdir -p "$out"
protoc -I "$root/proto" --cpp_out="$out" --grpc_out="$out" --plugin=protoc-gen-grpc="$(command -v grpc_cpp_plugin)" \
  "$root/proto/grpc_service.proto" "$root/proto/model_config.proto"
g++ -O2 -std=c++17 -I "$out" "$root/bench/probes/cpp_sink/sink.cc" "$out/grpc_service.pb.cc" \
  "$out/grpc_service.grpc.pb.cc" "$out/model_config.pb.cc" -o "$out/sink" $(pkg-config --cflags --libs grpc++ protobuf)
echo "$out/sink"
