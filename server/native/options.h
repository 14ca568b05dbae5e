// The command line of voxserve-frontend. The supervisor (server/topology/) gives every flag; the defaults are the
// Python front end's (server/settings.py), for running the binary by hand.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace voxserve {

// A flag that is unknown, lacks its value or has one that does not parse: exit 2 with the message.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct GrpcArg {
  std::string name;
  bool is_int;  // the value parsed as an integer: an integer channel arg, else a string one
  int int_value;
  std::string string_value;
};

struct Options {
  std::vector<std::string> engines;       // --engine (repeatable): the engines' Unix sockets
  std::string listen;                      // --listen HOST:PORT, the public gRPC address
  std::string partner;                     // --partner unix:PATH, the Python front end
  std::string name = "native";             // --name
  uint64_t arena_bytes = 256ull << 20;     // --arena-bytes
  std::string model_name = "voxnet";       // --model-name
  std::string model_version = "1";         // --model-version
  int64_t max_request_samples = 1024;      // --max-request-samples
  int64_t max_request_voxels = 1 << 25;    // --max-request-voxels
  int64_t max_queue_size = 512;            // --max-queue-size
  int64_t max_concurrent_rpcs = 256;       // --max-concurrent-rpcs
  std::vector<GrpcArg> grpc_args;          // --grpc-arg NAME=VALUE (repeatable)
  std::string token_digests;               // --token-digests PATH ("" : no token check)
  std::string tls_cert, tls_key, tls_client_ca;
  bool fast_path = true;                   // --fast-path 0|1
  std::string regions_dir;                 // --regions-dir PATH: the CUDA regions' records ("": no CUDA shm here)
  int64_t report_interval_ms = 100;        // --report-interval-ms
  double grace_period_s = 30.0;            // --grace-period-s

  // The partner's socket path (--partner without "unix:").
  std::string partner_path() const { return partner.substr(5); }
  // An integer --grpc-arg's value, or ``otherwise`` when it was not given.
  int64_t IntArg(const std::string& arg, int64_t otherwise) const;
};

// Throws UsageError.
Options ParseOptions(int argc, char** argv);

extern const char kUsage[];

}  // namespace voxserve
