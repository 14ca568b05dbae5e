// The calls on the public port, served by reactors of gRPC's callback API:
// - ModelInfer (with the fast path on) is a raw unary method of its own (InferService: the message arrives as
//   gRPC's buffer, not through a stream), whose reactor answers it on the fast path when it is plain and valid
//   (fast_path.h), the engines answering, or else forwards it to the partner as one unary call, the same bytes;
// - every other method reaches the generic service (Service), whose reactor forwards it to the partner, the
//   Python front end on its private Unix socket, unary or streaming either way, message bytes unchanged, or
//   refuses it: a client's call of a /voxserve.internal. method is UNIMPLEMENTED and never forwarded.
//
// No thread is made per call: reactions run on gRPC's callback threads, replies on the engines' reader threads.
// Memory per call is its message (and one message in flight each way when forwarded); the calls themselves are
// bounded by gRPC's stream limits, the fast path's by --max-concurrent-rpcs and --max-queue-size.
#pragma once

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engines.h"
#include "fast_path.h"
#include "options.h"
#include "regions.h"
#include "report.h"
#include "security.h"

namespace voxserve {

constexpr char kModelInfer[] = "/inference.GRPCInferenceService/ModelInfer";
constexpr char kInternalPrefix[] = "/voxserve.internal.";
constexpr char kPeerHeader[] = "x-voxserve-peer";

// The channels to the partner. Its gRPC server allows grpc.max_concurrent_streams calls per connection (the
// Python front end's --max-streams-per-connection), and a long-lived stream (a health Watch, ModelStreamInfer)
// holds its slot; so forwarded calls are spread over enough connections ("lanes", each its own channel and
// subchannel) for --max-concurrent-rpcs of them, each call on the lane with the fewest in progress. The Report
// RPC has a channel of its own, so that it never waits behind clients' streams.
class Partner {
 public:
  struct Lane {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<grpc::GenericStub> stub;
    std::atomic<int64_t> calls{0};
  };

  explicit Partner(const Options& options);
  Lane& Pick();
  std::shared_ptr<grpc::Channel> report_channel() const { return report_channel_; }
  size_t lanes() const { return lanes_.size(); }

 private:
  std::vector<std::unique_ptr<Lane>> lanes_;
  std::shared_ptr<grpc::Channel> report_channel_;
};

// What every call shares: made once in main, alive until the process exits.
struct Frontend {
  Options options;
  FastPathSpec spec;
  Engines* engines = nullptr;
  Partner* partner = nullptr;
  Reporter* reporter = nullptr;
  std::unique_ptr<Regions> regions;      // the CUDA regions' records; null: the fast path takes no CUDA shm
  std::unique_ptr<TokenDigests> tokens;  // null: no token check
  std::atomic<int64_t> fast_calls{0};    // fast-path calls in progress (the --max-concurrent-rpcs bound)
  std::atomic<int64_t> forwarded_calls{0};
  std::atomic<int64_t> live_calls{0};    // reactors not yet done (the drain waits for 0)
  // Fast-path tensors copied from the received message's slices (wire.h), and how many slices they lay in.
  std::atomic<int64_t> wire_tensors{0}, wire_slices{0};
};

// The generic service: one reactor per call of any method but those of InferService.
class Service final : public grpc::CallbackGenericService {
 public:
  explicit Service(Frontend* fe) : fe_(fe) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override;

 private:
  Frontend* fe_;
};

// ModelInfer alone, as a raw unary callback method (its request and response as gRPC's buffers): registered only
// with the fast path on (without it the generic service forwards ModelInfer as any other call).
class InferService final : public grpc::Service {
 public:
  explicit InferService(Frontend* fe);
};

}  // namespace voxserve
