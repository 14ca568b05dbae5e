#include "engines.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "common.h"

namespace voxserve {

grpc::Status CancelledStatus() { return grpc::Status(grpc::StatusCode::CANCELLED, "the call was cancelled"); }

namespace {

void ReadExactly(int fd, char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = read(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw std::runtime_error(std::string("reading the engine's hello: ") + std::strerror(errno));
    if (n == 0) throw std::runtime_error("the engine closed the connection during the hello");
    data += n;
    size -= static_cast<size_t>(n);
  }
}

// remote.connect_engine: connect (waiting while the engine warms up: its socket is absent or refuses), send the
// JSON hello with the arena's descriptor (SCM_RIGHTS), read the engine's hello.
// The engine's devices, one by one (a hello's "device" lists them with commas, as remote.RemoteRunner.devices).
void SplitDevices(const std::string& devices, std::vector<std::string>* out) {
  size_t begin = 0;
  for (;;) {
    const size_t comma = devices.find(',', begin);
    out->push_back(devices.substr(begin, comma - begin));
    if (comma == std::string::npos) return;
    begin = comma + 1;
  }
}

int ConnectEngine(const std::string& path, const std::string& name, const Arena& arena, EngineHello* hello) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) throw std::runtime_error("the engine socket path is too long: " + path);
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  int fd = -1;
  bool said = false;
  for (;;) {
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) throw std::runtime_error(std::string("socket: ") + std::strerror(errno));
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) break;
    const int error = errno;
    close(fd);
    if (error != ENOENT && error != ECONNREFUSED)
      throw std::runtime_error("cannot connect to the engine at " + path + ": " + std::strerror(error));
    if (!said) Log("waiting for the engine at %s", path.c_str());
    said = true;
    usleep(200 * 1000);  // remote.connect_engine's retry_s
  }
  const std::string body = "{\"frontend\": " + JsonString(name) + ", \"arena_bytes\": " +
                           std::to_string(arena.capacity()) + "}";
  std::string message(4, '\0');
  const uint32_t length = static_cast<uint32_t>(body.size());
  std::memcpy(message.data(), &length, 4);
  message += body;
  iovec iov{message.data(), message.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(sizeof(int));
  const int arena_fd = arena.fd();
  std::memcpy(CMSG_DATA(cmsg), &arena_fd, sizeof(int));
  if (sendmsg(fd, &msg, MSG_NOSIGNAL) != static_cast<ssize_t>(message.size()))
    throw std::runtime_error("cannot send the hello to the engine at " + path);
  uint32_t reply_length = 0;
  ReadExactly(fd, reinterpret_cast<char*>(&reply_length), 4);
  if (reply_length > (1u << 20)) throw std::runtime_error("the engine's hello announces " +
                                                         std::to_string(reply_length) + " bytes");
  std::string json(reply_length, '\0');
  ReadExactly(fd, json.data(), reply_length);
  const std::map<std::string, std::string> fields = ParseFlatJson(json);
  auto field = [&](const char* key) -> const std::string& {
    auto it = fields.find(key);
    if (it == fields.end()) throw std::runtime_error(std::string("the engine's hello has no ") + key + ": " + json);
    return it->second;
  };
  hello->cin = std::stoll(field("cin"));
  hello->cout = std::stoll(field("cout"));
  hello->k = std::stoll(field("k"));
  hello->device = field("device");
  hello->kernel = field("kernel");
  SplitDevices(hello->device, &hello->devices);
  const auto cuda = fields.find("cuda_devices");
  hello->cuda_devices = cuda == fields.end() ? 0 : std::stoll(cuda->second);
  if (hello->cin < 1 || hello->cout < 1 || hello->k < 1) throw std::runtime_error("the engine's hello: " + json);
  return fd;
}

}  // namespace

Engines::Engines(const Options& options) : options_(options), arena_(options.arena_bytes) {}

void Engines::Connect() {
  for (const std::string& path : options_.engines) {
    auto link = std::make_unique<Link>();
    link->path = path;
    link->fd = ConnectEngine(path, options_.name, arena_, &link->hello);
    if (!links_.empty() && (link->hello.cin != hello_.cin || link->hello.cout != hello_.cout ||
                            link->hello.k != hello_.k))
      throw std::runtime_error("the engine at " + path + " serves another model shape than the engine at " +
                               links_[0]->path);
    if (links_.empty()) hello_ = link->hello;
    Log("engine %s: %s, %s (cin %lld, cout %lld, k %lld)", path.c_str(), link->hello.device.c_str(),
        link->hello.kernel.c_str(), static_cast<long long>(link->hello.cin),
        static_cast<long long>(link->hello.cout), static_cast<long long>(link->hello.k));
    links_.push_back(std::move(link));
  }
  live_ = links_.size();
}

void Engines::Start() {
  for (auto& link : links_) {
    Link* l = link.get();
    l->reader = std::thread([this, l] { ReadReplies(*l); });
    l->reader.detach();
  }
}

grpc::Status Engines::QueueFull(size_t queued) const {
  // The Python front end's refusal (remote.RemoteRunner.admit's QueueFull, as core.errors.runner_error words it).
  return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                      "model '" + options_.model_name + "' is overloaded: this front end has " +
                          std::to_string(queued) + " requests waiting for the engine, its limit (--max-queue-size " +
                          std::to_string(options_.max_queue_size) + "); retry later");
}

grpc::Status Engines::LostErrorLocked() const {
  // remote.RemoteRunner.lost_error
  std::string joined;
  for (const auto& link : links_)
    for (const std::string& d : link->hello.devices) joined += (joined.empty() ? "" : ", ") + d;
  return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the engine(s) on " + joined + " stopped (" + device_lost_ +
                                                         "); this replica must be restarted, retry on another");
}

grpc::Status Engines::Submit(EngineRequest* r) {
  std::unique_lock<std::mutex> l(mu_);
  if (r->cancel_requested_) {
    r->state_ = EngineRequest::State::kEnded;
    return CancelledStatus();
  }
  if (live_ == 0) {
    r->state_ = EngineRequest::State::kEnded;
    return LostErrorLocked();
  }
  // Bounded: requests sent and not answered plus those waiting for room (remote.RemoteRunner.admit).
  const size_t queued = outstanding_ + waiting_.size();
  if (queued >= static_cast<size_t>(options_.max_queue_size)) {
    r->state_ = EngineRequest::State::kEnded;
    return QueueFull(queued);
  }
  if (r->in_region) {  // no block to wait for
    PlaceRegionLocked(r);
    l.unlock();
    if (Transmit(r)) return CancelledStatus();  // (as below)
    return grpc::Status::OK;
  }
  if (waiting_.empty() && PlaceLocked(r)) {
    l.unlock();
    // Outside the lock. The request cannot be deleted meanwhile: its call is inside a gRPC reaction (OnReadDone)
    // that has not returned, and gRPC ends a call (OnDone) only after its reactions have returned.
    if (Transmit(r)) return CancelledStatus();
    return grpc::Status::OK;
  }
  r->state_ = EngineRequest::State::kWaiting;
  waiting_.push_back(r);
  return grpc::Status::OK;
}

bool Engines::offers_cuda() const {
  for (const auto& link : links_)
    if (link->hello.cuda_devices <= 0) return false;
  return true;
}

Engines::Link* Engines::LeastBusyLocked(int64_t cuda_device, size_t* index) {
  // The live engine (executing on "cuda:<cuda_device>", when that is >= 0) with the fewest outstanding, first on
  // ties.
  const std::string place = cuda_device >= 0 ? "cuda:" + std::to_string(cuda_device) : std::string();
  Link* best = nullptr;
  for (size_t i = 0; i < links_.size(); ++i) {
    Link* link = links_[i].get();
    if (!link->lost.empty()) continue;
    if (!place.empty() && std::find(link->hello.devices.begin(), link->hello.devices.end(), place) ==
                              link->hello.devices.end())
      continue;
    if (best == nullptr || link->pending.size() < best->pending.size()) {
      best = link;
      *index = i;
    }
  }
  return best;
}

bool Engines::PlaceLocked(EngineRequest* r) {
  size_t index = 0;
  Link* best = LeastBusyLocked(-1, &index);
  if (best == nullptr) return false;
  uint64_t position = 0;
  if (!arena_.TryAllocate(r->nbytes, &position)) return false;
  r->id_ = next_id_++;
  r->link_ = index;
  r->position_ = position;
  r->state_ = EngineRequest::State::kSending;
  best->pending.emplace(r->id_, Pending{r, position, true});
  ++outstanding_;
  return true;
}

void Engines::PlaceRegionLocked(EngineRequest* r) {
  // remote.RemoteRunner.run: the least busy engine on the region's device; where none executes there, the first
  // live one (engine_for: the engine that registered the region, and maps it).
  size_t index = 0;
  Link* best = LeastBusyLocked(r->region_device, &index);
  for (size_t i = 0; best == nullptr && i < links_.size(); ++i) {  // (Submit saw one live: live_ > 0)
    if (links_[i]->lost.empty()) {
      best = links_[i].get();
      index = i;
    }
  }
  r->id_ = next_id_++;
  r->link_ = index;
  r->position_ = 0;
  r->state_ = EngineRequest::State::kSending;
  best->pending.emplace(r->id_, Pending{r, 0, false});
  ++outstanding_;
}

void Engines::PlaceWaitingLocked(std::vector<EngineRequest*>* placed) {
  while (!waiting_.empty() && PlaceLocked(waiting_.front())) {
    waiting_.front()->Ref();  // TransmitPlaced copies it from this thread: its call must not be deleted meanwhile
    placed->push_back(waiting_.front());
    waiting_.pop_front();
  }
}

void Engines::TransmitPlaced(const std::vector<EngineRequest*>& placed) {
  for (EngineRequest* r : placed) {
    if (Transmit(r)) r->OnFailed(CancelledStatus());
    r->Unref();
  }
}

bool Engines::Transmit(EngineRequest* r) {
  // The one copy into the arena (remote.RemoteRunner._one). The block is this request's until the engine's reply,
  // and the engine reads it only once the record, sent after the copy, has come.
  if (r->in_region) {
    // Nothing to copy: the engine reads the tensor where it lies.
  } else if (r->data != nullptr) {
    std::memcpy(arena_.At(r->position_), r->data, r->nbytes);
  } else {
    uint8_t* to = arena_.At(r->position_);  // the pieces one after another
    for (const auto& [piece, size] : r->pieces) {
      std::memcpy(to, piece, size);
      to += size;
    }
  }
  RequestRecord record{};
  record.kind = r->in_region ? kInferRegion : kInfer;
  record.datatype = r->datatype;
  record.trailer_bytes = static_cast<uint32_t>(r->in_region ? r->trailer.size() : 0);
  record.id = r->id_;
  record.offset = r->in_region ? r->region_offset : arena_.Offset(r->position_);
  record.nbytes = r->nbytes;
  record.deadline = r->deadline;
  std::memcpy(record.shape, r->shape, sizeof(record.shape));
  Link& link = *links_[r->link_];
  Send(link, reinterpret_cast<const char*>(&record), sizeof(record), r->in_region ? r->trailer : std::string());

  std::unique_lock<std::mutex> l(mu_);
  ++infer_records_;
  if (r->in_region) ++region_records_;
  if (r->release_after_send_) {  // its engine went away during the copy: nothing reads the block any more
    r->release_after_send_ = false;
    arena_.Release(r->position_);
    std::vector<EngineRequest*> placed;
    PlaceWaitingLocked(&placed);
    l.unlock();
    TransmitPlaced(placed);
    return false;
  }
  if (r->state_ != EngineRequest::State::kSending) return false;  // answered already
  r->state_ = EngineRequest::State::kSent;
  if (!r->cancel_requested_) return false;
  // Cancelled during the copy: the engine has the record now, so it is told to drop it. The block stays
  // reserved until its reply.
  link.pending.at(r->id_).request = nullptr;
  r->state_ = EngineRequest::State::kEnded;
  ++cancel_records_;
  l.unlock();
  RequestRecord cancel{};
  cancel.kind = kCancel;
  cancel.id = r->id_;
  cancel.deadline = NAN;
  Send(link, reinterpret_cast<const char*>(&cancel), sizeof(cancel));
  return true;
}

bool Engines::Cancel(EngineRequest* r) {
  std::unique_lock<std::mutex> l(mu_);
  switch (r->state_) {
    case EngineRequest::State::kNew:
    case EngineRequest::State::kSending:
      r->cancel_requested_ = true;
      return false;
    case EngineRequest::State::kEnded:
      return false;
    case EngineRequest::State::kWaiting:
      waiting_.erase(std::find(waiting_.begin(), waiting_.end(), r));
      r->state_ = EngineRequest::State::kEnded;
      return true;
    case EngineRequest::State::kSent:
      break;
  }
  Link& link = *links_[r->link_];
  link.pending.at(r->id_).request = nullptr;
  r->state_ = EngineRequest::State::kEnded;
  ++cancel_records_;
  const uint64_t id = r->id_;
  l.unlock();
  // remote.RemoteRunner._ask: the engine drops it from its queue (or answers it anyway if it is running); the
  // reply, whichever it is, releases the block.
  RequestRecord cancel{};
  cancel.kind = kCancel;
  cancel.id = id;
  cancel.deadline = NAN;
  Send(link, reinterpret_cast<const char*>(&cancel), sizeof(cancel));
  return true;
}

void Engines::Send(Link& link, const char* data, size_t size, const std::string& trailer) {
  std::unique_lock<std::mutex> l(link.write_mu);
  link.outbox.append(data, size);
  link.outbox += trailer;  // (with its record, in one append under the lock: never split by another sender's)
  if (link.writing) return;  // the thread writing now sends these too
  link.writing = true;
  while (!link.outbox.empty()) {
    std::string chunk;
    chunk.swap(link.outbox);
    l.unlock();
    const char* p = chunk.data();
    size_t left = chunk.size();
    bool failed = false;
    while (left > 0) {
      const ssize_t n = send(link.fd, p, left, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        failed = true;
        break;
      }
      p += n;
      left -= static_cast<size_t>(n);
    }
    l.lock();
    // The reader sees the connection end and fails what is pending; say it once.
    if (failed && !link.write_failed) {
      link.write_failed = true;
      Log("writing to the engine at %s failed: %s", link.path.c_str(), std::strerror(errno));
    }
  }
  link.writing = false;
}

void Engines::ReadReplies(Link& link) {
  std::vector<char> buffer(1 << 16);
  size_t filled = 0;
  std::string reason = "it closed the connection";  // remote.RemoteRunner._read's words
  for (;;) {
    if (buffer.size() - filled < (1 << 15)) buffer.resize(buffer.size() * 2);
    const ssize_t n = read(link.fd, buffer.data() + filled, buffer.size() - filled);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      reason = errno == ECONNRESET ? "ConnectionResetError: [Errno 104] Connection reset by peer"
                                   : std::string("OSError: [Errno ") + std::to_string(errno) + "] " +
                                         std::strerror(errno);
      break;
    }
    if (n == 0) break;
    filled += static_cast<size_t>(n);
    size_t pos = 0;  // every whole reply of the read at once
    while (filled - pos >= sizeof(ReplyRecord)) {
      ReplyRecord header;
      std::memcpy(&header, buffer.data() + pos, sizeof(header));
      // An incomplete reply waits for more bytes; the buffer grows as they come (above), never to the length a
      // header announces, so a corrupt stream cannot make this process allocate what was never sent.
      if (filled - pos < sizeof(header) + header.payload_bytes) break;
      Deliver(link, header, buffer.data() + pos + sizeof(header));
      pos += sizeof(header) + header.payload_bytes;
    }
    std::memmove(buffer.data(), buffer.data() + pos, filled - pos);
    filled -= pos;
  }
  Lost(link, reason);
}

void Engines::Deliver(Link& link, const ReplyRecord& header, const char* payload) {
  EngineRequest* r = nullptr;
  std::vector<EngineRequest*> placed;
  {
    std::lock_guard<std::mutex> l(mu_);
    ++replies_;
    auto it = link.pending.find(header.id);
    if (it == link.pending.end()) return;  // (no reply is for an unknown id; nothing to do if one were)
    r = it->second.request;
    if (it->second.block) arena_.Release(it->second.position);
    link.pending.erase(it);
    --outstanding_;
    if (r != nullptr) r->state_ = EngineRequest::State::kEnded;
    PlaceWaitingLocked(&placed);
  }
  if (r != nullptr) r->OnReply(header, payload);
  TransmitPlaced(placed);
}

void Engines::Lost(Link& link, const std::string& reason) {
  std::vector<EngineRequest*> failed, failed_all, placed;
  grpc::Status lost_error;
  {
    std::lock_guard<std::mutex> l(mu_);
    link.lost = reason;
    --live_;
    for (auto& [id, p] : link.pending) {
      // A block whose tensor is still being copied is released by its sender when the copy is over.
      if (!p.block) {
        // (a region's request: nothing to release)
      } else if (p.request != nullptr && p.request->state_ == EngineRequest::State::kSending) {
        p.request->release_after_send_ = true;
      } else {
        arena_.Release(p.position);
      }
      if (p.request != nullptr) {
        p.request->state_ = EngineRequest::State::kEnded;
        failed.push_back(p.request);
      }
    }
    outstanding_ -= link.pending.size();
    link.pending.clear();
    if (live_ == 0) {
      device_lost_ = "engine connection lost: " + reason;
      lost_error = LostErrorLocked();
      for (EngineRequest* r : waiting_) {
        r->state_ = EngineRequest::State::kEnded;
        failed_all.push_back(r);
      }
      waiting_.clear();
    } else {
      PlaceWaitingLocked(&placed);
    }
  }
  Log("the engine at %s (%s) is gone (%s); %zu request(s) in flight there fail", link.path.c_str(),
      link.hello.device.c_str(), reason.c_str(), failed.size());
  if (!failed_all.empty() || lost_error.error_code() != grpc::StatusCode::OK)
    Log("every engine is gone (%s): fast-path calls are answered UNAVAILABLE", reason.c_str());
  const grpc::Status error(grpc::StatusCode::UNAVAILABLE,
                           "the engine on " + link.hello.device + " stopped (" + reason + "); retry");
  for (EngineRequest* r : failed) r->OnFailed(error);
  for (EngineRequest* r : failed_all) r->OnFailed(lost_error);
  TransmitPlaced(placed);
}

std::string Engines::Counters() {
  std::lock_guard<std::mutex> l(mu_);
  return "infer records " + std::to_string(infer_records_) + ", of which by region " +
         std::to_string(region_records_) + ", cancel records " + std::to_string(cancel_records_) +
         ", replies " + std::to_string(replies_) + ", pending " + std::to_string(outstanding_) + ", waiting " +
         std::to_string(waiting_.size()) + ", arena blocks held " + std::to_string(arena_.blocks()) +
         ", arena bytes held " + std::to_string(arena_.in_use()) + ", engines connected " + std::to_string(live_);
}

}  // namespace voxserve
