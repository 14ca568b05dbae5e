// The engines of `--frontends`, as this front end sees them (server/topology/remote.py's RemoteRunner): one Unix
// socket per engine, the staging arena they all map, the requests sent and not yet answered, and those waiting for
// arena room.
//
// A request's life here: Submit puts it on the engine with the fewest requests outstanding from this front end
// (RemoteRunner._least_busy) as soon as the arena has a block for it, else it waits, in arrival order, for a
// reply to free one. A tensor in a client's CUDA region takes no block: it goes at once, as an INFER_REGION record
// naming the region, to the least busy engine on the region's device (or, where none runs there, the first one,
// which registered it: RemoteRunner.run). Its tensor is copied into the block and then the INFER record is sent, so the engine reads
// the block only once it holds the whole tensor. The block is released only at the engine's reply to that record
// (or when the engine's connection is gone): a request that ends early (the client cancels, its deadline passes)
// sends a CANCEL record and gives up its request object, but its block stays reserved until the engine answers,
// so the engine never reads memory that another request was given.
//
// Threads: one reader per engine (a fixed number) reads replies and answers their requests; Submit and Cancel run
// on gRPC's callback threads. One mutex guards the arena, the queues and every link's table; the copies into the
// arena and the socket writes happen outside it.
#pragma once

#include <grpcpp/support/status.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ipc.h"
#include "options.h"

namespace voxserve {

// What an engine's hello says of the model (engine.py Engine.load).
struct EngineHello {
  int64_t cin = 0, cout = 0, k = 0;
  std::string device, kernel;
  std::vector<std::string> devices;  // ``device``'s, one by one ("cuda:0", ...)
  int64_t cuda_devices = 0;          // the CUDA devices it can open clients' memory on (0: no CUDA shared memory)
};

// A request as Engines sees it (the fast path's call implements it). The tensor fields are set before Submit
// and stay unchanged; ``data`` stays readable until the object is deleted, which its owner does only after it has
// ended for Engines (below) and every Ref has been dropped.
class EngineRequest {
 public:
  virtual ~EngineRequest() = default;

  uint8_t datatype = 0;  // index in kDatatypes
  uint64_t shape[5] = {};
  const char* data = nullptr;  // the tensor, whole; or null, and it is ``pieces``, in order
  std::vector<std::pair<const char*, size_t>> pieces;
  size_t nbytes = 0;
  double deadline = 0;  // CLOCK_MONOTONIC seconds, NaN: none
  // In a client's CUDA region instead (data null, no pieces): its offset there, its device, and the record's
  // trailer (ipc.region_trailer: the region's name, and the output's region when the engine writes it).
  bool in_region = false;
  uint64_t region_offset = 0;
  int64_t region_device = 0;
  std::string trailer;

  // A request ends for Engines exactly once: refused by Submit (its status), ended by a Cancel that returned
  // true, or through one of these two, called without Engines' lock held.
  // The engine's reply; ``payload`` (header.payload_bytes) is valid during the call only.
  virtual void OnReply(const ReplyRecord& header, const char* payload) = 0;
  // Its engine's connection is gone, or it was cancelled while its tensor was being copied (status CANCELLED).
  virtual void OnFailed(const grpc::Status& status) = 0;
  // Engines holds a reference while it copies a request that waited for room, from a thread of its own.
  virtual void Ref() = 0;
  virtual void Unref() = 0;

 private:
  friend class Engines;
  enum class State { kNew, kWaiting, kSending, kSent, kEnded };
  State state_ = State::kNew;
  bool cancel_requested_ = false;    // cancelled while kNew or kSending: acted on by Submit / after the send
  bool release_after_send_ = false;  // its engine was lost while its tensor was being copied into its block
  size_t link_ = 0;
  uint64_t id_ = 0, position_ = 0;
};

// The status a request cancelled before it reached an engine ends with.
grpc::Status CancelledStatus();

class Engines {
 public:
  explicit Engines(const Options& options);  // makes the arena; throws std::runtime_error
  ~Engines() = delete;                       // lives until the process exits (its reader threads use it)

  // Connect to every --engine (waiting while a socket is absent or refuses: engines listen once warmed up), hand
  // each the arena's descriptor, read each hello. Throws std::runtime_error.
  void Connect();
  // Start the reader threads.
  void Start();

  const EngineHello& hello() const { return hello_; }
  // Whether every engine offers CUDA shared memory (remote.RemoteRunner.cuda_devices > 0).
  bool offers_cuda() const;
  size_t largest_block() const { return arena_.largest(); }

  // Take a request: sent now or waiting for room (OK), or refused (queue full, engines lost, cancelled meanwhile):
  // the status its call ends with.
  grpc::Status Submit(EngineRequest* request);
  // The request's call was cancelled (client, deadline, shutdown). True: it has ended here and the caller finishes
  // the call; false: it is ending another way (answered, failed, or Submit / the sender will see the cancellation).
  bool Cancel(EngineRequest* request);

  // "infer records ..., of which by region ..., pending ..., arena bytes held ..." for the log (SIGUSR1 and the
  // last line).
  std::string Counters();

 private:
  struct Pending {
    EngineRequest* request;  // nullptr once cancelled: the entry only keeps the block until the reply
    uint64_t position;
    bool block;  // false: a region's request, which holds no arena block
  };
  struct Link {
    std::string path;
    EngineHello hello;
    int fd = -1;
    std::unordered_map<uint64_t, Pending> pending;  // under mu_
    std::string lost;                               // under mu_; empty while connected
    std::thread reader;
    // Records written by whichever thread finds no write in progress: concurrent senders' records go out in
    // that thread's next write (ipc.Outbox's batching without a thread of its own).
    std::mutex write_mu;
    std::string outbox;
    bool writing = false;
    bool write_failed = false;
  };

  bool PlaceLocked(EngineRequest* r);
  void PlaceRegionLocked(EngineRequest* r);
  Link* LeastBusyLocked(int64_t cuda_device, size_t* index);
  void PlaceWaitingLocked(std::vector<EngineRequest*>* placed);
  bool Transmit(EngineRequest* r);
  void TransmitPlaced(const std::vector<EngineRequest*>& placed);
  void Send(Link& link, const char* data, size_t size, const std::string& trailer = std::string());
  void ReadReplies(Link& link);
  void Deliver(Link& link, const ReplyRecord& header, const char* payload);
  void Lost(Link& link, const std::string& reason);
  grpc::Status LostErrorLocked() const;
  grpc::Status QueueFull(size_t queued) const;

  const Options& options_;
  Arena arena_;
  EngineHello hello_;
  std::vector<std::unique_ptr<Link>> links_;

  std::mutex mu_;
  uint64_t next_id_ = 1;
  size_t outstanding_ = 0;  // pending entries over every link
  size_t live_ = 0;         // links still connected
  std::deque<EngineRequest*> waiting_;  // for arena room, in arrival order
  std::string device_lost_;             // set when the last engine is gone
  uint64_t infer_records_ = 0, region_records_ = 0, cancel_records_ = 0, replies_ = 0;
};

}  // namespace voxserve
