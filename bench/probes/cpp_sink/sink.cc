// A trivial ModelInfer sink in C++ (gRPC's synchronous C++ server), beside the Python one of `voxserve bench
// --compare-raw`: what the same client gets from a server whose transport is not Python's. It parses each request
// (protobuf C++: the tensor bytes are copied once into the message) and answers a fixed small response.
//
//   bench/probes/cpp_sink/build.sh && build/cpp_sink/sink PORT [THREADS]   (prints "listening PORT")
#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "grpc_service.grpc.pb.h"

namespace {

class Sink final : public inference::GRPCInferenceService::Service {
  grpc::Status ModelInfer(grpc::ServerContext*, const inference::ModelInferRequest* request,
                          inference::ModelInferResponse* response) override {
    response->set_model_name("sink");
    response->set_id(request->id());
    return grpc::Status::OK;
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s PORT [THREADS]\n", argv[0]);
    return 2;
  }
  const std::string address = std::string("127.0.0.1:") + argv[1];
  Sink sink;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(512 << 20);
  builder.SetMaxSendMessageSize(512 << 20);
  if (argc > 2) {
    builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS, std::atoi(argv[2]));
  }
  builder.RegisterService(&sink);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) return 1;
  std::printf("listening %d\n", port);
  std::fflush(stdout);
  server->Wait();
  return 0;
}
