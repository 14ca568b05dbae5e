// The fast path's accounting, reported to the partner (the Python front end), which counts it in its metrics and
// statistics as if it had served those calls itself.
//
// Unary /voxserve.internal.FrontendReport/Report on the partner's socket, every --report-interval-ms while there is
// something new, and once more at shutdown. The body is little-endian, no protobuf: a header <qI4x> (fast-path calls
// in progress now, record count), then that many records <BBB5xqqqq> (gRPC status code, served: 1, the input's
// path: its index in server/metrics.py INPUT_PATHS, elapsed ns from arrival to end, queue ns from the engine's
// reply or 0, samples or 0, input bytes or 0). The response is empty.
// Only calls the fast path took are reported: proxied ones are counted by the partner itself.
//
// Records wait while the partner does not take them (not up yet, draining, gone), at most kMaxWaiting; beyond
// that the oldest are dropped and the drop is logged.
#pragma once

#include <grpcpp/channel.h>
#include <grpcpp/generic/generic_stub.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace voxserve {

struct __attribute__((packed)) ReportHeader {
  int64_t in_progress;
  uint32_t count;
  uint8_t pad[4];
};
constexpr uint8_t kPathWire = 0, kPathCudaShm = 2;  // metrics.INPUT_PATHS: wire, system_shm, cuda_shm

struct __attribute__((packed)) ReportRecord {
  uint8_t code;
  uint8_t served;
  uint8_t path;
  uint8_t pad[5];
  int64_t elapsed_ns;
  int64_t queue_ns;
  int64_t samples;
  int64_t input_bytes;
};
static_assert(sizeof(ReportHeader) == 16, "<qI4x>");
static_assert(sizeof(ReportRecord) == 40, "<BBB5xqqqq>");

constexpr char kReportMethod[] = "/voxserve.internal.FrontendReport/Report";

class Reporter {
 public:
  static constexpr size_t kMaxWaiting = 1000000;
  static constexpr size_t kMaxPerReport = 16384;  // 640 KiB bodies: well under any --max-message-bytes

  // ``in_progress``: the fast-path calls in progress now (read for each report's header).
  Reporter(std::shared_ptr<grpc::Channel> channel, int64_t interval_ms, std::function<int64_t()> in_progress);
  ~Reporter() = delete;  // lives until the process exits

  void Add(const ReportRecord& record);
  void Start();
  // Stop the periodic reports and send what is left, once more even if nothing is (the in-progress count goes to
  // 0), trying for at most ``budget_ms``; logs what could not be sent.
  void Finish(int64_t budget_ms);
  std::string Counters();

 private:
  void Run();
  // One report of the oldest waiting records (at most kMaxPerReport); true when the partner took it.
  bool SendOne(int64_t deadline_ms);
  void LogDropped();

  grpc::GenericStub stub_;
  const int64_t interval_ms_;
  std::function<int64_t()> in_progress_;
  std::thread thread_;

  std::mutex mu_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::deque<ReportRecord> records_;
  uint64_t front_seq_ = 0;   // the sequence number of records_.front(): records are numbered as they are added
  uint64_t dropped_ = 0;     // dropped and not yet logged
  int64_t last_in_progress_ = 0;
  uint64_t reports_ = 0, reported_ = 0;  // reports the partner took, records in them
  bool failing_ = false;                 // the last report failed (logged once per streak)
};

}  // namespace voxserve
