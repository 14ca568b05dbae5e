#include "report.h"

#include <grpcpp/client_context.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "common.h"

namespace voxserve {

Reporter::Reporter(std::shared_ptr<grpc::Channel> channel, int64_t interval_ms, std::function<int64_t()> in_progress)
    : stub_(std::move(channel)), interval_ms_(interval_ms), in_progress_(std::move(in_progress)) {}

void Reporter::Add(const ReportRecord& record) {
  std::lock_guard<std::mutex> l(mu_);
  if (records_.size() >= kMaxWaiting) {
    records_.pop_front();
    ++front_seq_;
    ++dropped_;
  }
  records_.push_back(record);
}

void Reporter::Start() { thread_ = std::thread([this] { Run(); }); }

void Reporter::LogDropped() {
  uint64_t dropped;
  {
    std::lock_guard<std::mutex> l(mu_);
    dropped = dropped_;
    dropped_ = 0;
  }
  if (dropped != 0)
    Log("the partner has not taken reports for a while: dropped the %llu oldest call records (at most %zu wait)",
        static_cast<unsigned long long>(dropped), kMaxWaiting);
}

void Reporter::Run() {
  for (;;) {
    {
      std::unique_lock<std::mutex> l(mu_);
      wake_.wait_for(l, std::chrono::milliseconds(interval_ms_), [this] { return stopping_; });
      if (stopping_) return;
    }
    LogDropped();
    // Something new: records, or the in-progress count moved. Several reports in a row when many records wait.
    for (;;) {
      bool pending;
      {
        std::lock_guard<std::mutex> l(mu_);
        pending = !records_.empty() || in_progress_() != last_in_progress_;
      }
      if (!pending || !SendOne(2000)) break;
    }
  }
}

bool Reporter::SendOne(int64_t deadline_ms) {
  std::string body;
  uint64_t first_seq;
  size_t count;
  const int64_t in_progress = in_progress_();
  {
    std::lock_guard<std::mutex> l(mu_);
    count = std::min(records_.size(), kMaxPerReport);
    first_seq = front_seq_;
    ReportHeader header{};
    header.in_progress = in_progress;
    header.count = static_cast<uint32_t>(count);
    body.resize(sizeof(header) + count * sizeof(ReportRecord));
    std::memcpy(body.data(), &header, sizeof(header));
    for (size_t i = 0; i < count; ++i)
      std::memcpy(body.data() + sizeof(header) + i * sizeof(ReportRecord), &records_[i], sizeof(ReportRecord));
  }
  grpc::Slice slice(body);
  grpc::ByteBuffer request(&slice, 1), response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(deadline_ms));
  std::mutex done_mu;
  std::condition_variable done_cv;
  bool done = false;
  grpc::Status status;
  stub_.UnaryCall(&context, kReportMethod, grpc::StubOptions(), &request, &response, [&](grpc::Status s) {
    std::lock_guard<std::mutex> l(done_mu);
    status = std::move(s);
    done = true;
    done_cv.notify_one();
  });
  {
    std::unique_lock<std::mutex> l(done_mu);
    done_cv.wait(l, [&] { return done; });
  }
  std::lock_guard<std::mutex> l(mu_);
  if (!status.ok()) {
    if (!failing_)
      Log("the partner did not take a report (%d: %s); %zu call records wait", static_cast<int>(status.error_code()),
          status.error_message().c_str(), records_.size());
    failing_ = true;
    return false;
  }
  if (failing_) Log("the partner takes reports again");
  failing_ = false;
  // Those sent and still here (the oldest may have been dropped meanwhile) go.
  const uint64_t end_seq = first_seq + count;
  while (!records_.empty() && front_seq_ < end_seq) {
    records_.pop_front();
    ++front_seq_;
  }
  last_in_progress_ = in_progress;
  ++reports_;
  reported_ += count;
  return true;
}

void Reporter::Finish(int64_t budget_ms) {
  {
    std::lock_guard<std::mutex> l(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  LogDropped();
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(budget_ms);
  bool once = false;
  for (;;) {
    const int64_t left_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                                until - std::chrono::steady_clock::now()).count();
    if (left_ms <= 0) break;
    if (SendOne(left_ms)) {
      once = true;
      std::lock_guard<std::mutex> l(mu_);
      if (records_.empty()) return;
      continue;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min<int64_t>(left_ms, 100)));
  }
  std::lock_guard<std::mutex> l(mu_);
  if (!records_.empty() || !once)
    Log("the last report did not reach the partner: %zu call records are lost", records_.size());
}

std::string Reporter::Counters() {
  std::lock_guard<std::mutex> l(mu_);
  return "reports " + std::to_string(reports_) + ", records reported " + std::to_string(reported_) +
         ", records waiting " + std::to_string(records_.size());
}

}  // namespace voxserve
