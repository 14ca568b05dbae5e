// A front end of `voxserve serve --frontends` written on gRPC's C++ callback server: a probe, not product code.
//
// It does, for a plain ModelInfer request (the tensor in raw_input_contents, or FP32 typed contents), what a
// voxserve front end does (server/protocol/inference.py with server/topology/remote.py): parse, validate as
// server/protocol/codec.py does, copy the tensor into this process's staging arena (a memfd the engine maps), send
// the engine one record (server/topology/ipc.py), and answer with the engine's output rows or its status. It
// connects to a running voxserve engine as one more front end, so the same engine serves it and the Python front
// ends side by side, which is what bench/probes/native_frontend/compare.py measures.
//
// Left out (the Python front end has them): TLS and tokens, metrics, statistics, system and CUDA shared memory,
// ModelStreamInfer, the control RPCs beyond readiness (metadata, configuration, statistics, shared-memory
// registration), REST, several engines, requests larger than an arena block (sent in pieces), draining, tracing and
// the access log. The RPC limit is one counter over the process.
//
//   bench/probes/native_frontend/build.sh
//   build/native_frontend/frontend --engine /tmp/voxserve-replicas-XXXX/engine-0.sock --port 0
//   (prints "listening PORT" once the engine has answered its hello)
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "grpc_service.grpc.pb.h"

namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the records are little-endian structs");

// ---- the IPC schema of server/topology/ipc.py ------------------------------------------------------------------

// ipc.REQUEST "<BB2xIQQQd5Q": kind, datatype, 2 pad, trailer bytes, id, arena offset, byte count, deadline
// (CLOCK_MONOTONIC seconds, NaN: none), shape (N, Cin, D, H, W).
struct __attribute__((packed)) RequestRecord {
  uint8_t kind;
  uint8_t datatype;  // its index in voxserve.datatypes.INPUT_DATATYPES
  uint8_t pad[2];
  uint32_t trailer_bytes;
  uint64_t id;
  uint64_t offset;
  uint64_t nbytes;
  double deadline;
  uint64_t shape[5];
};
// ipc.REPLY "<BB2xIQQQ": kind, status code (core.errors.Status: gRPC's numbers), 2 pad, payload bytes, id, queue
// ns, samples of its execution; then the payload (the FP32 output rows, or the error's message).
struct __attribute__((packed)) ReplyRecord {
  uint8_t kind;
  uint8_t code;
  uint8_t pad[2];
  uint32_t payload_bytes;
  uint64_t id;
  uint64_t queue_ns;
  uint64_t batch_samples;
};
static_assert(sizeof(RequestRecord) == 80, "ipc.REQUEST.size");
static_assert(sizeof(ReplyRecord) == 32, "ipc.REPLY.size");

constexpr uint8_t kInfer = 1, kCancel = 2;  // ipc.INFER, ipc.CANCEL
constexpr uint8_t kReplyOk = 1;             // ipc.OK (ipc.ERROR: 2)
constexpr size_t kAlign = 256;              // ipc.ALIGN: arena blocks start on this boundary

const char* const kDatatypes[] = {"FP32", "FP16", "BF16"};  // voxserve.datatypes.INPUT_DATATYPES, in order
constexpr size_t kItemsize[] = {4, 2, 2};

double MonotonicNow() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);  // Python's time.monotonic() on Linux
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

// ---- settings ----------------------------------------------------------------------------------------------------

struct Options {
  std::string engine;                   // the engine's Unix socket
  std::string host = "127.0.0.1";
  int port = 0;
  std::string name = "native-probe";    // this front end's name in the engine's log
  size_t arena_bytes = 256u << 20;      // --frontend-arena-bytes
  std::string model_name = "voxnet";    // --model-name, --model-version
  std::string model_version = "1";
  int64_t max_request_samples = 1024;   // --max-request-samples
  int64_t max_request_voxels = 1 << 25; // --max-request-voxels
  size_t max_queue = 512;               // --max-queue-size: requests waiting for the engine
  int max_concurrent_rpcs = 256;        // --max-concurrent-rpcs (over the whole process here)
  int max_message_bytes = 128 << 20;    // --max-message-bytes
  int max_streams_per_connection = 64;  // --max-streams-per-connection
};

Options ParseOptions(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) throw std::runtime_error("flag " + flag + " needs a value");
    const std::string value = argv[++i];
    if (flag == "--engine") o.engine = value;
    else if (flag == "--host") o.host = value;
    else if (flag == "--port") o.port = std::stoi(value);
    else if (flag == "--name") o.name = value;
    else if (flag == "--arena-bytes") o.arena_bytes = std::stoull(value);
    else if (flag == "--model-name") o.model_name = value;
    else if (flag == "--model-version") o.model_version = value;
    else if (flag == "--max-request-samples") o.max_request_samples = std::stoll(value);
    else if (flag == "--max-request-voxels") o.max_request_voxels = std::stoll(value);
    else if (flag == "--max-queue-size") o.max_queue = std::stoull(value);
    else if (flag == "--max-concurrent-rpcs") o.max_concurrent_rpcs = std::stoi(value);
    else throw std::runtime_error("unknown flag " + flag);
  }
  if (o.engine.empty()) throw std::runtime_error("--engine SOCKET is required");
  return o;
}

// ---- the staging arena (ipc.Arena) -------------------------------------------------------------------------------

// A memfd handed out as blocks in ring order. Positions grow without bound (offset = position % capacity); a block
// that would cross the end starts again at 0. Blocks are released in any order but reclaimed oldest first, so a
// block held long holds back the space after it, never lets it be reused. Not thread-safe: the Frontend's mutex.
class Arena {
 public:
  explicit Arena(size_t capacity) : capacity_(capacity), largest_(capacity / 2) {
    fd_ = memfd_create("voxserve-arena", MFD_CLOEXEC);
    if (fd_ < 0 || ftruncate(fd_, static_cast<off_t>(capacity)) != 0) throw std::runtime_error("memfd");
    void* map = mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (map == MAP_FAILED) throw std::runtime_error("mmap of the arena");
    base_ = static_cast<uint8_t*>(map);
  }

  // The block's ring position, or false while the ring has no room (the caller waits for a release).
  bool TryAllocate(size_t nbytes, uint64_t* position) {
    const size_t size = std::max(kAlign, (nbytes + kAlign - 1) / kAlign * kAlign);
    uint64_t start = head_;
    if (start % capacity_ + size > capacity_) start += capacity_ - start % capacity_;  // wrap
    if (start + size - tail_ > capacity_) return false;
    head_ = start + size;
    if (blocks_.empty()) tail_ = start;
    blocks_.push_back({start, false});
    *position = start;
    return true;
  }

  void Release(uint64_t position) {
    // Blocks are in position order: find this one, mark it, drop the released ones at the front.
    auto it = std::lower_bound(blocks_.begin(), blocks_.end(), position,
                               [](const Block& b, uint64_t p) { return b.start < p; });
    it->released = true;
    while (!blocks_.empty() && blocks_.front().released) blocks_.pop_front();
    tail_ = blocks_.empty() ? head_ : blocks_.front().start;
  }

  // Bytes between the oldest held block and the next free position (ipc.Arena.in_use).
  uint64_t in_use() const { return head_ - tail_; }
  uint8_t* At(uint64_t position) const { return base_ + position % capacity_; }
  uint64_t Offset(uint64_t position) const { return position % capacity_; }
  size_t capacity() const { return capacity_; }
  size_t largest() const { return largest_; }
  int fd() const { return fd_; }

 private:
  struct Block {
    uint64_t start;
    bool released;
  };
  size_t capacity_, largest_;
  int fd_ = -1;
  uint8_t* base_ = nullptr;
  std::deque<Block> blocks_;
  uint64_t head_ = 0, tail_ = 0;
};

// ---- the engine's socket -----------------------------------------------------------------------------------------

void WriteAll(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = write(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw std::runtime_error(std::string("write to the engine: ") + std::strerror(errno));
    data += n;
    size -= static_cast<size_t>(n);
  }
}

void ReadExactly(int fd, char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = read(fd, data, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw std::runtime_error("the engine closed the connection during the hello");
    data += n;
    size -= static_cast<size_t>(n);
  }
}

// The value after "key": in the engine's hello (flat JSON from json.dumps, from a trusted local peer).
std::string HelloField(const std::string& json, const std::string& key) {
  const std::string quoted = "\"" + key + "\": ";
  const size_t at = json.find(quoted);
  if (at == std::string::npos) throw std::runtime_error("the engine's hello has no " + key);
  size_t begin = at + quoted.size();
  if (json[begin] == '"') return json.substr(begin + 1, json.find('"', begin + 1) - begin - 1);
  return json.substr(begin, json.find_first_of(",}", begin) - begin);
}

struct EngineHello {
  int64_t cin, cout, k;
  std::string device, kernel, json;
};

// remote.connect_engine: connect (waiting while the engine warms up), send the JSON hello with the arena's
// descriptor (SCM_RIGHTS), read the engine's hello. Returns the connected socket.
int ConnectEngine(const Options& o, const Arena& arena, EngineHello* hello) {
  int fd = -1;
  for (;;) {
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", o.engine.c_str());
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) break;
    if (errno != ENOENT && errno != ECONNREFUSED) throw std::runtime_error("connect to " + o.engine);
    close(fd);
    usleep(200000);
  }
  const std::string body = "{\"frontend\": \"" + o.name + "\", \"arena_bytes\": " + std::to_string(arena.capacity()) +
                           "}";
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
  if (sendmsg(fd, &msg, 0) != static_cast<ssize_t>(message.size())) throw std::runtime_error("send the hello");
  uint32_t reply_length = 0;
  ReadExactly(fd, reinterpret_cast<char*>(&reply_length), 4);
  hello->json.resize(reply_length);
  ReadExactly(fd, hello->json.data(), reply_length);
  hello->cin = std::stoll(HelloField(hello->json, "cin"));
  hello->cout = std::stoll(HelloField(hello->json, "cout"));
  hello->k = std::stoll(HelloField(hello->json, "k"));
  hello->device = HelloField(hello->json, "device");
  hello->kernel = HelloField(hello->json, "kernel");
  return fd;
}

// ---- validation (codec.decode_request, the common case) ----------------------------------------------------------

constexpr size_t kMaxIdChars = 256;  // codec.MAX_ID_CHARS

struct Decoded {
  int datatype;        // index in kDatatypes
  uint64_t shape[5];
  const char* data;    // the tensor's bytes: raw_input_contents[0], or the typed FP32 values
  size_t nbytes;
  bool typed;          // the client sent typed contents: answer the same way
};

bool SharedMemoryParameters(const google::protobuf::Map<std::string, inference::InferParameter>& p) {
  return p.count("shared_memory_region") || p.count("shared_memory_offset") || p.count("shared_memory_byte_size");
}

size_t TypedFields(const inference::InferTensorContents& c, bool* only_fp32) {
  const size_t others = (c.bool_contents_size() > 0) + (c.int_contents_size() > 0) + (c.int64_contents_size() > 0) +
                        (c.uint_contents_size() > 0) + (c.uint64_contents_size() > 0) +
                        (c.fp64_contents_size() > 0) + (c.bytes_contents_size() > 0);
  *only_fp32 = others == 0;
  return others + (c.fp32_contents_size() > 0);
}

grpc::Status Invalid(const std::string& m) { return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, m); }

// OK and the request's tensor in ``out``, or the status it is refused with (the codes codec.py gives; the messages
// are shorter).
grpc::Status Decode(const inference::ModelInferRequest& r, const Options& o, const EngineHello& e, Decoded* out) {
  if (r.model_name() != o.model_name)
    return grpc::Status(grpc::StatusCode::NOT_FOUND, "model is not served here; this server serves '" +
                                                         o.model_name + "'");
  if (!r.model_version().empty() && r.model_version() != o.model_version)
    return grpc::Status(grpc::StatusCode::NOT_FOUND, "model has no such version; available: '" +
                                                         o.model_version + "'");
  if (r.id().size() > kMaxIdChars) return Invalid("request id has more than 256 characters");
  if (r.inputs_size() != 1) return Invalid("the model takes exactly one input, 'input'");
  const inference::ModelInferRequest::InferInputTensor& t = r.inputs(0);
  if (t.name() != "input") return Invalid("unknown input; the model has one input, 'input'");
  if (SharedMemoryParameters(t.parameters()) ||
      (r.outputs_size() > 0 && SharedMemoryParameters(r.outputs(0).parameters())))
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "this probe does not offer shared memory");
  int datatype = -1;
  for (int i = 0; i < 3; ++i)
    if (t.datatype() == kDatatypes[i]) datatype = i;
  if (datatype < 0) return Invalid("input 'input' has an unsupported datatype; supported: FP32, FP16, BF16");
  for (const auto& output : r.outputs())
    if (output.name() != "output") return Invalid("unknown output requested; the model has one output, 'output'");
  if (r.outputs_size() > 1) return Invalid("output 'output' is requested more than once");
  if (r.outputs_size() == 1 && r.outputs(0).parameters().count("classification"))
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "the classification extension is not offered");
  // The shape (codec._check_shape), in the same order; products are checked for overflow, since the client
  // chooses every dimension up to int64's limit.
  if (t.shape_size() != 5) return Invalid("input 'input' must have rank 5: [N, Cin, D, H, W]");
  for (int i = 0; i < 5; ++i)
    if (t.shape(i) < 1) return Invalid("every dimension of input 'input' must be >= 1");
  if (t.shape(1) != e.cin) return Invalid("input 'input' has the wrong channel count (dimension 1)");
  for (int i = 2; i < 5; ++i)
    if (t.shape(i) < e.k) return Invalid("input 'input' D, H and W must each be >= the kernel size");
  if (t.shape(0) > o.max_request_samples)
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "too many samples (--max-request-samples)");
  int64_t voxels = t.shape(0);
  bool overflow = false;
  for (int i = 2; i < 5; ++i) overflow |= __builtin_mul_overflow(voxels, t.shape(i), &voxels);
  if (overflow || voxels > o.max_request_voxels)
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "too many voxels (--max-request-voxels)");
  // N x D x H x W is bounded now, so elements and bytes fit in 64 bits (Cin is the engine's, small).
  const uint64_t elements = static_cast<uint64_t>(voxels) * static_cast<uint64_t>(e.cin);
  for (int i = 0; i < 5; ++i) out->shape[i] = static_cast<uint64_t>(t.shape(i));
  out->datatype = datatype;
  bool only_fp32 = true;
  const size_t typed = t.has_contents() ? TypedFields(t.contents(), &only_fp32) : 0;
  if (r.raw_input_contents_size() > 0) {
    if (typed) return Invalid("input 'input' sets both raw_input_contents and typed contents; send one");
    if (r.raw_input_contents_size() != 1) return Invalid("raw_input_contents must have exactly 1 entry");
    const std::string& raw = r.raw_input_contents(0);
    if (raw.size() != elements * kItemsize[datatype])
      return Invalid("input 'input': raw_input_contents[0] does not hold the shape's byte count");
    out->data = raw.data();
    out->nbytes = raw.size();
    out->typed = false;
    return grpc::Status::OK;
  }
  if (!typed) return Invalid("input 'input' carries no data: set raw_input_contents or contents.fp32_contents");
  if (datatype != 0) return Invalid("FP16 and BF16 travel only in raw_input_contents");
  if (!only_fp32) return Invalid("input 'input' is FP32: its data goes in contents.fp32_contents");
  if (static_cast<uint64_t>(t.contents().fp32_contents_size()) != elements)
    return Invalid("input 'input': contents.fp32_contents does not hold the shape's value count");
  out->data = reinterpret_cast<const char*>(t.contents().fp32_contents().data());
  out->nbytes = elements * 4;
  out->typed = true;
  return grpc::Status::OK;
}

// ---- the front end ----------------------------------------------------------------------------------------------

class InferCall;

// The engine link (remote.RemoteRunner with one engine) and the arena: the requests waiting for arena room, the
// requests sent and not yet answered. One mutex guards all of it; the socket writes, and the copies of requests
// that find room at once, are done outside it.
class Frontend {
 public:
  explicit Frontend(const Options& o) : options_(o), arena_(o.arena_bytes) { fd_ = ConnectEngine(o, arena_, &hello_); }

  void Start() { reader_ = std::thread([this] { ReadReplies(); }); }

  const Options& options() const { return options_; }
  const EngineHello& hello() const { return hello_; }
  bool engine_lost() {
    std::lock_guard<std::mutex> l(mu_);
    return lost_;
  }

  // Take a decoded request: to the engine now, or once the arena has room. A status when refused at once.
  grpc::Status Submit(InferCall* call);
  // The call was cancelled (by its client, or its deadline): tell the engine; true if the caller must Finish it
  // (false: a reply has finished it, or is finishing it, already).
  bool Cancel(InferCall* call);

  std::atomic<int> rpcs{0};  // ModelInfer calls in progress (the --max-concurrent-rpcs bound)

  // What this front end did, printed when it stops (compare.py reads it): records sent, replies read, and what is
  // still held (nothing, once every request has its reply).
  std::string Summary() {
    std::lock_guard<std::mutex> l(mu_);
    return "infer records " + std::to_string(infer_records_) + ", cancel records " + std::to_string(cancel_records_) +
           ", replies " + std::to_string(replies_) + ", pending " + std::to_string(pending_.size()) + ", waiting " +
           std::to_string(waiting_.size()) + ", arena bytes held " + std::to_string(arena_.in_use());
  }

 private:
  struct Pending {
    InferCall* call;  // nullptr once cancelled: the entry then only holds the arena block until the reply
    uint64_t position;
  };

  // Under mu_: a block for ``call`` and its record appended to ``records``; false when the arena is full.
  bool PlaceLocked(InferCall* call, std::string* records);
  void CopyIn(InferCall* call);
  void Send(const std::string& records);
  void ReadReplies();
  void Deliver(const ReplyRecord& header, const char* payload);

  const Options options_;
  Arena arena_;
  EngineHello hello_;
  int fd_ = -1;
  std::thread reader_;

  std::mutex mu_;
  uint64_t next_id_ = 1;
  std::unordered_map<uint64_t, Pending> pending_;
  std::deque<InferCall*> waiting_;  // for arena room, in arrival order
  bool lost_ = false;
  uint64_t infer_records_ = 0, cancel_records_ = 0, replies_ = 0;

  // Records written by whichever thread finds no write in progress: concurrent senders' records go out together
  // in that thread's next write (ipc.Outbox's batching, without a thread of its own).
  std::mutex write_mu_;
  std::string outbox_;
  bool writing_ = false;
};

// One ModelInfer call: made by the handler, deleted by gRPC's OnDone (after its Finish, exactly one: the state below
// decides, under the Frontend's mutex, whether a reply, a cancellation or a lost engine finishes it).
class InferCall final : public grpc::ServerUnaryReactor {
 public:
  InferCall(Frontend* fe, grpc::CallbackServerContext* ctx, const inference::ModelInferRequest* request,
            inference::ModelInferResponse* response)
      : fe_(fe), request_(request), response_(response) {
    const gpr_timespec raw = ctx->raw_deadline();
    if (gpr_time_cmp(raw, gpr_inf_future(raw.clock_type)) == 0) {
      deadline_ = NAN;
    } else {  // gRPC's clocks have their own epochs: the time left, from CLOCK_MONOTONIC's now
      const gpr_timespec left = gpr_time_sub(raw, gpr_now(raw.clock_type));
      deadline_ = MonotonicNow() + static_cast<double>(left.tv_sec) + static_cast<double>(left.tv_nsec) * 1e-9;
    }
    if (fe->rpcs.fetch_add(1) >= fe->options().max_concurrent_rpcs) {
      Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "too many RPCs in progress (--max-concurrent-rpcs)"));
      return;
    }
    grpc::Status status = Decode(*request, fe->options(), fe->hello(), &decoded_);
    if (status.ok()) status = fe->Submit(this);
    if (!status.ok()) Finish(status);
  }

  void OnCancel() override {
    if (fe_->Cancel(this)) Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the call was cancelled"));
  }

  void OnDone() override {
    fe_->rpcs.fetch_sub(1);
    delete this;
  }

  // The engine's answer: the (N, Cout) FP32 rows, checked and put in the response as codec.encode_response does,
  // or its error as the call's status. ``payload`` lies in the reader's buffer, not necessarily 4-byte aligned.
  void Answer(const ReplyRecord& header, const char* payload) {
    if (header.kind != kReplyOk) {
      // Status.of: UNKNOWN for a number that is no status (and for OK, which no error reply should carry)
      const int code = header.code >= 1 && header.code <= 16 ? header.code : 2;
      Finish(grpc::Status(static_cast<grpc::StatusCode>(code), std::string(payload, header.payload_bytes)));
      return;
    }
    const uint64_t n = decoded_.shape[0], cout = static_cast<uint64_t>(fe_->hello().cout);
    if (header.payload_bytes != n * cout * 4) {
      Finish(grpc::Status(grpc::StatusCode::INTERNAL, "the engine's output has the wrong size"));
      return;
    }
    for (uint64_t i = 0; i < n * cout; ++i) {  // inference._check_finite
      float value;
      std::memcpy(&value, payload + 4 * i, 4);
      if (!std::isfinite(value)) {
        Finish(Invalid("input 'input' sample " + std::to_string(i / cout) + " gives a non-finite output"));
        return;
      }
    }
    if (!std::isnan(deadline_) && deadline_ - MonotonicNow() <= 0.005) {  // inference.DEADLINE_SLACK_S
      Finish(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "the request's deadline passed while it ran"));
      return;
    }
    response_->set_model_name(fe_->options().model_name);
    response_->set_model_version(fe_->options().model_version);
    response_->set_id(request_->id());
    auto* tensor = response_->add_outputs();
    tensor->set_name("output");
    tensor->set_datatype("FP32");
    tensor->add_shape(static_cast<int64_t>(n));
    tensor->add_shape(static_cast<int64_t>(cout));
    if (decoded_.typed) {
      auto* values = tensor->mutable_contents()->mutable_fp32_contents();
      values->Resize(static_cast<int>(n * cout), 0.0f);
      std::memcpy(values->mutable_data(), payload, header.payload_bytes);
    } else {
      response_->add_raw_output_contents(payload, header.payload_bytes);
    }
    Finish(grpc::Status::OK);
  }

  const Decoded& decoded() const { return decoded_; }
  double deadline() const { return deadline_; }

  // Frontend's bookkeeping (under its mutex).
  enum class State { kNew, kWaiting, kSent, kEnded };  // kEnded: answered, cancelled, or failed with the engine
  State state = State::kNew;
  uint64_t id = 0;        // the engine's name for it
  uint64_t position = 0;  // its arena block

 private:
  Frontend* fe_;
  const inference::ModelInferRequest* request_;
  inference::ModelInferResponse* response_;
  Decoded decoded_{};
  double deadline_;
};

bool Frontend::PlaceLocked(InferCall* call, std::string* records) {
  const Decoded& d = call->decoded();
  if (!arena_.TryAllocate(d.nbytes, &call->position)) return false;
  call->id = next_id_++;
  ++infer_records_;
  call->state = InferCall::State::kSent;
  pending_.emplace(call->id, Pending{call, call->position});
  RequestRecord record{};
  record.kind = kInfer;
  record.datatype = static_cast<uint8_t>(d.datatype);
  record.id = call->id;
  record.offset = arena_.Offset(call->position);
  record.nbytes = d.nbytes;
  record.deadline = call->deadline();
  std::memcpy(record.shape, d.shape, sizeof(record.shape));
  records->append(reinterpret_cast<const char*>(&record), sizeof(record));
  return true;
}

void Frontend::CopyIn(InferCall* call) {
  // The copy into the arena (remote.RemoteRunner._one). It is the second here: protobuf's parse copied the bytes
  // out of gRPC's buffer first (the Python front end views that buffer: server/protocol/wire.py). The block is this
  // call's until the engine's reply, and the engine reads it only once the record, sent after this, has come.
  std::memcpy(arena_.At(call->position), call->decoded().data, call->decoded().nbytes);
}

grpc::Status Frontend::Submit(InferCall* call) {
  if (call->decoded().nbytes > arena_.largest())  // (the Python front end sends such a request in pieces)
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "larger than an arena block; this probe does not split");
  std::string records;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (lost_) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "the engine stopped; retry on another replica");
    if (pending_.size() + waiting_.size() >= options_.max_queue)  // RemoteRunner.admit
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "this front end's queue is full (--max-queue-size)");
    if (!waiting_.empty() || !PlaceLocked(call, &records)) {
      call->state = InferCall::State::kWaiting;
      waiting_.push_back(call);
      return grpc::Status::OK;
    }
  }
  // Outside the mutex: the handler has not returned the call to gRPC yet, so no cancellation can end it meanwhile.
  CopyIn(call);
  Send(records);
  return grpc::Status::OK;
}

bool Frontend::Cancel(InferCall* call) {
  RequestRecord record{};
  {
    std::lock_guard<std::mutex> l(mu_);
    if (call->state == InferCall::State::kWaiting) {
      waiting_.erase(std::find(waiting_.begin(), waiting_.end(), call));
      call->state = InferCall::State::kEnded;
      return true;
    }
    // Answered meanwhile, or refused before it was submitted (Finish was called then).
    if (call->state != InferCall::State::kSent) return false;
    call->state = InferCall::State::kEnded;
    pending_.at(call->id).call = nullptr;  // the entry keeps the block until the engine's reply
    ++cancel_records_;
    record.kind = kCancel;
    record.id = call->id;
    record.deadline = NAN;
  }
  Send(std::string(reinterpret_cast<const char*>(&record), sizeof(record)));
  return true;
}

void Frontend::Send(const std::string& records) {
  std::unique_lock<std::mutex> l(write_mu_);
  outbox_ += records;
  if (writing_) return;  // the thread writing now sends these too
  writing_ = true;
  while (!outbox_.empty()) {
    std::string chunk;
    chunk.swap(outbox_);
    l.unlock();
    try {
      WriteAll(fd_, chunk.data(), chunk.size());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "%s\n", e.what());  // the reader sees the connection end and fails what is pending
    }
    l.lock();
  }
  writing_ = false;
}

void Frontend::ReadReplies() {
  std::vector<char> buffer(1 << 16);
  size_t filled = 0;
  for (;;) {
    if (buffer.size() - filled < (1 << 15)) buffer.resize(buffer.size() * 2);
    const ssize_t n = read(fd_, buffer.data() + filled, buffer.size() - filled);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    filled += static_cast<size_t>(n);
    size_t pos = 0;  // every whole reply of the read at once
    while (filled - pos >= sizeof(ReplyRecord)) {
      ReplyRecord header;
      std::memcpy(&header, buffer.data() + pos, sizeof(header));
      if (filled - pos < sizeof(header) + header.payload_bytes) break;
      Deliver(header, buffer.data() + pos + sizeof(header));
      pos += sizeof(header) + header.payload_bytes;
    }
    std::memmove(buffer.data(), buffer.data() + pos, filled - pos);
    filled -= pos;
  }
  // The engine is gone: every request in progress fails UNAVAILABLE, later ones are refused (Submit).
  std::vector<InferCall*> orphans;
  {
    std::lock_guard<std::mutex> l(mu_);
    lost_ = true;
    for (auto& [id, p] : pending_)
      if (p.call != nullptr) orphans.push_back(p.call);
    pending_.clear();
    orphans.insert(orphans.end(), waiting_.begin(), waiting_.end());
    waiting_.clear();
    for (InferCall* c : orphans) c->state = InferCall::State::kEnded;
  }
  for (InferCall* c : orphans) c->Finish(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the engine stopped; retry"));
  std::fprintf(stderr, "the engine closed the connection\n");
}

void Frontend::Deliver(const ReplyRecord& header, const char* payload) {
  InferCall* call = nullptr;
  std::string records;
  {
    std::lock_guard<std::mutex> l(mu_);
    ++replies_;
    auto it = pending_.find(header.id);
    if (it == pending_.end()) return;
    call = it->second.call;
    arena_.Release(it->second.position);
    pending_.erase(it);
    if (call != nullptr) call->state = InferCall::State::kEnded;
    // Requests that waited for room, in order. Their copies are made under the mutex (a rare path: the arena was
    // full), since a cancellation could otherwise end a call, and free its request, in the middle of its copy. A
    // cancellation may still send its CANCEL before the record: the engine then runs it, and its block is
    // released at its reply as any other.
    while (!waiting_.empty() && PlaceLocked(waiting_.front(), &records)) {
      CopyIn(waiting_.front());
      waiting_.pop_front();
    }
  }
  if (!records.empty()) Send(records);
  if (call != nullptr) call->Answer(header, payload);
}

// ---- the service ------------------------------------------------------------------------------------------------

class Service final : public inference::GRPCInferenceService::CallbackService {
 public:
  explicit Service(Frontend* fe) : fe_(fe) {}

  grpc::ServerUnaryReactor* ModelInfer(grpc::CallbackServerContext* ctx, const inference::ModelInferRequest* request,
                                       inference::ModelInferResponse* response) override {
    return new InferCall(fe_, ctx, request, response);
  }

  // Enough of the rest for clients' readiness checks and the bench's server name; every other RPC is gRPC's
  // UNIMPLEMENTED (the bench then reports no queue/compute split).
  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* ctx, const inference::ServerLiveRequest*,
                                       inference::ServerLiveResponse* response) override {
    response->set_live(true);
    return Done(ctx);
  }
  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* ctx, const inference::ServerReadyRequest*,
                                        inference::ServerReadyResponse* response) override {
    response->set_ready(!fe_->engine_lost());
    return Done(ctx);
  }
  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* ctx, const inference::ModelReadyRequest* request,
                                       inference::ModelReadyResponse* response) override {
    response->set_ready(!fe_->engine_lost() && request->name() == fe_->options().model_name &&
                        (request->version().empty() || request->version() == fe_->options().model_version));
    return Done(ctx);
  }
  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* ctx, const inference::ServerMetadataRequest*,
                                           inference::ServerMetadataResponse* response) override {
    response->set_name("voxserve-native-probe");
    response->set_version("0");
    return Done(ctx);
  }

 private:
  static grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx) {
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  Frontend* fe_;
};

}  // namespace

int main(int argc, char** argv) {
  Options options;
  try {
    options = ParseOptions(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\nusage: %s --engine SOCKET [--port N] [--host H] [--arena-bytes B] ...\n", e.what(),
                 argv[0]);
    return 2;
  }
  // SIGTERM/SIGINT are taken by a thread of their own (sigwait), so block them before gRPC starts its threads.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  signal(SIGPIPE, SIG_IGN);  // a vanished engine is seen by the reader as the end of its connection

  std::unique_ptr<Frontend> fe;
  try {
    fe = std::make_unique<Frontend>(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "engine hello failed: %s\n", e.what());
    return 1;
  }
  fe->Start();
  Service service(fe.get());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options.host + ":" + std::to_string(options.port), grpc::InsecureServerCredentials(),
                           &port);
  // The Python front end's options (server/protocol/server.py) that gRPC 1.51 has.
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, options.max_streams_per_connection);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, 60000);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 20000);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server) return 1;
  std::printf("listening %d engine %s (cin %lld, cout %lld, k %lld, %s)\n", port, fe->hello().device.c_str(),
              static_cast<long long>(fe->hello().cin), static_cast<long long>(fe->hello().cout),
              static_cast<long long>(fe->hello().k), fe->hello().kernel.c_str());
  std::fflush(stdout);
  int sig = 0;
  sigwait(&stop_signals, &sig);
  // Calls in progress get up to 5 s (the engine answers them); then the process ends, closing the engine's socket.
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  std::fprintf(stderr, "stopped: %s\n", fe->Summary().c_str());
  std::fflush(stderr);
  std::_Exit(0);
}
