#include "calls.h"

#include <grpcpp/support/proto_buffer_reader.h>
#include <grpcpp/impl/codegen/proto_utils.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common.h"
#include "wire.h"

namespace voxserve {

namespace {

// The fast path answers a ready result as DEADLINE_EXCEEDED within this long of the call's deadline, and counts a
// call cancelled within the larger of this and this share of its timeout as its deadline's (inference.py
// DEADLINE_SLACK_S, DEADLINE_SLACK_SHARE: the client's deadline passes a little before the server's).
constexpr double kDeadlineSlackS = 0.005;
constexpr double kDeadlineSlackShare = 0.1;

// Metadata that goes with a forwarded call both ways: not HTTP/2's pseudo headers, not gRPC's reserved ones, and
// not the peer header, which this front end sets.
bool Forwardable(const grpc::string_ref& key) {
  if (key.empty() || key.data()[0] == ':') return false;
  if (key.starts_with("grpc-")) return false;
  return !(key.size() == sizeof(kPeerHeader) - 1 && std::memcmp(key.data(), kPeerHeader, key.size()) == 0);
}

std::string Str(const grpc::string_ref& s) { return std::string(s.data(), s.size()); }

grpc::ChannelArguments PartnerChannelArgs(int lane) {
  grpc::ChannelArguments args;
  // The public port applies the message limits; the partner applies its own again.
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  // A retried call would be buffered here; the client decides what to retry.
  args.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
  // The partner may come up after this front end, or restart: reconnect within a second, not gRPC's minutes.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // Each lane its own connection.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetInt("voxserve.partner_lane", lane);
  return args;
}

}  // namespace

Partner::Partner(const Options& options) {
  const int64_t streams = options.IntArg("grpc.max_concurrent_streams", 0);
  int64_t count = 1;
  if (streams > 0) count = std::min<int64_t>(64, (options.max_concurrent_rpcs + streams - 1) / streams);
  for (int64_t i = 0; i < std::max<int64_t>(count, 1); ++i) {
    auto lane = std::make_unique<Lane>();
    lane->channel = grpc::CreateCustomChannel(options.partner, grpc::InsecureChannelCredentials(),
                                              PartnerChannelArgs(static_cast<int>(i)));
    lane->stub = std::make_unique<grpc::GenericStub>(lane->channel);
    lanes_.push_back(std::move(lane));
  }
  report_channel_ = grpc::CreateCustomChannel(options.partner, grpc::InsecureChannelCredentials(),
                                              PartnerChannelArgs(-1));
}

Partner::Lane& Partner::Pick() {
  Lane* best = lanes_[0].get();
  for (auto& lane : lanes_)
    if (lane->calls.load(std::memory_order_relaxed) < best->calls.load(std::memory_order_relaxed)) best = lane.get();
  return *best;
}

namespace {

// The partner's side of a forwarded call: a child of the client's call (its deadline; its cancellation, which is
// also propagated by the reactors), with the client's metadata less what is not forwardable, and its peer.
std::unique_ptr<grpc::ClientContext> PartnerContext(grpc::CallbackServerContext* ctx) {
  std::unique_ptr<grpc::ClientContext> cctx = grpc::ClientContext::FromCallbackServerContext(*ctx);
  for (const auto& [key, value] : ctx->client_metadata())
    if (Forwardable(key)) cctx->AddMetadata(Str(key), Str(value));
  cctx->AddMetadata(kPeerHeader, ctx->peer());
  return cctx;
}

// The deadline of a call as CLOCK_MONOTONIC seconds (the record's clock; NaN: none) and its distance from the
// arrival: gRPC's clocks have their own epochs, so the time left is added to CLOCK_MONOTONIC's now.
void CallDeadline(const grpc::CallbackServerContext* ctx, int64_t arrived_ns, double* deadline, double* timeout_s) {
  const gpr_timespec raw = ctx->raw_deadline();
  if (gpr_time_cmp(raw, gpr_inf_future(raw.clock_type)) == 0) {
    *deadline = NAN;
    return;
  }
  const gpr_timespec left = gpr_time_sub(raw, gpr_now(raw.clock_type));
  *timeout_s = static_cast<double>(left.tv_sec) + static_cast<double>(left.tv_nsec) * 1e-9;
  *deadline = static_cast<double>(arrived_ns) * 1e-9 + *timeout_s;
}

class Call;

// A call forwarded to the partner, in both directions at once, one message in flight each way (so HTTP/2 flow
// control holds a client that sends faster than the partner reads, and the other way round):
//   up:   the client's message (server read) -> the partner (client write) -> the next server read ... -> half-close
//   down: the partner's message (client read) -> the client (server write) -> the next client read ... -> status
// The partner's initial metadata goes out before the first message down, its trailing metadata and status are
// the call's. The deadline and cancellation are propagated (ClientContext::FromCallbackServerContext), and a
// cancellation from either side cancels the other.
//
// Lifetimes. Server-side operations are started only from client-side reactions (or Start), and Finish is called
// in the client's OnDone, so none comes after Finish. Client-side operations started from server-side reactions
// are covered by two holds on the client reactor (AddHold: its OnDone waits), one per direction, each removed
// once that direction will start nothing more. gRPC may run a reaction inline in the thread that starts an
// operation, so no operation is started with mu_ held.
class Forward {
 public:
  Forward(Frontend* fe, Call* call, grpc::GenericCallbackServerContext* ctx);
  void Start();
  void OnServerReadDone(bool ok);
  void OnServerWriteDone(bool ok);
  void Cancel() { cctx_->TryCancel(); }

 private:
  class Client final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
   public:
    explicit Client(Forward* f) : f_(f) {}
    void OnReadInitialMetadataDone(bool ok) override { f_->OnHeaders(ok); }
    void OnReadDone(bool ok) override { f_->OnPartnerReadDone(ok); }
    void OnWriteDone(bool ok) override { f_->OnPartnerWriteDone(ok); }
    void OnDone(const grpc::Status& status) override { f_->OnPartnerDone(status); }

   private:
    Forward* f_;
  };

  // The up direction's state: what it waits for now.
  enum class Up { kServerRead, kPartnerWrite, kClosing, kClosed };

  void OnHeaders(bool ok);
  void OnPartnerReadDone(bool ok);
  void OnPartnerWriteDone(bool ok);
  void OnPartnerDone(const grpc::Status& status);
  void ForwardHeadersLocked();

  Frontend* fe_;
  Call* call_;
  grpc::GenericCallbackServerContext* ctx_;
  Partner::Lane* lane_ = nullptr;
  std::unique_ptr<grpc::ClientContext> cctx_;
  Client client_{this};
  grpc::ByteBuffer up_, down_;

  std::mutex mu_;
  Up up_state_ = Up::kServerRead;
  bool headers_seen_ = false;       // the partner's initial metadata came (or the call failed before it)
  bool headers_ok_ = false;         // ... and can be read
  bool headers_forwarded_ = false;
  bool down_waiting_ = false;       // a message down waits for the headers to be seen
};

// The generic service's reactor (see calls.h): a forward to the partner, or a refusal.
class Call final : public grpc::ServerGenericBidiReactor {
 public:
  Call(Frontend* fe, grpc::GenericCallbackServerContext* ctx);

  void OnReadDone(bool ok) override { forward_->OnServerReadDone(ok); }
  void OnWriteDone(bool ok) override { forward_->OnServerWriteDone(ok); }
  void OnCancel() override;
  void OnDone() override;

  void Ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
  void Unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

 private:
  Frontend* fe_;
  std::unique_ptr<Forward> forward_;  // null: refused (set in the constructor, before any reaction)
  std::atomic<int> refs_{1};  // OnDone's; the forward's client side adds its own
};

// ModelInfer's reactor: the fast path, or one unary call to the partner with the same bytes.
class InferCall final : public grpc::ServerUnaryReactor, public EngineRequest {
 public:
  InferCall(Frontend* fe, grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
            grpc::ByteBuffer* response);
  // What the constructor does not: may end the call (never before the handler returns: gRPC runs no reaction
  // and no OnDone before the reactor is bound).
  void Start();

  void OnCancel() override;
  void OnDone() override;

  void OnReply(const ReplyRecord& header, const char* payload) override;
  void OnFailed(const grpc::Status& status) override { FinishFast(status, 0); }
  void Ref() override { refs_.fetch_add(1, std::memory_order_relaxed); }
  void Unref() override {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

 private:
  bool Authorized() const;
  // The fast path's end: one report record and the status (with the response when OK). Called exactly once per
  // fast-path call; ``this`` may be gone when it returns.
  void FinishFast(const grpc::Status& status, uint64_t queue_ns);
  void ReleaseSlot();
  void StartForward();
  // The code a cancelled call is counted under: DEADLINE_EXCEEDED when it was its deadline's (see the slack).
  grpc::StatusCode CancelCode() const;

  Frontend* fe_;
  grpc::CallbackServerContext* ctx_;
  const grpc::ByteBuffer* request_bb_;  // gRPC's, alive until after OnDone
  grpc::ByteBuffer* response_bb_;       // gRPC's: what Finish(OK) sends
  int64_t arrived_ns_;
  double timeout_s_ = NAN;  // the deadline's distance from the arrival (NaN: none)

  inference::ModelInferRequest request_;  // (without its tensor when split)
  SplitMessage split_;                    // a large request's slices: its tensor's pieces point into them
  bool decoded_ = false;
  bool typed_ = false;
  std::unique_ptr<std::string> output_region_;  // the CUDA region the engine writes the output into, if any
  inference::ModelInferResponse response_;
  bool holds_slot_ = false;

  // The call forwarded to the partner: the request's bytes (or, as the client did, none) up, the answer down.
  // (A stream of one message each way, so that a client's call without a message goes on as it came.)
  class Forwarded final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
   public:
    explicit Forwarded(InferCall* call) : call_(call), cctx(PartnerContext(call->ctx_)) {}
    void OnDone(const grpc::Status& status) override;

   private:
    InferCall* call_;

   public:
    std::unique_ptr<grpc::ClientContext> cctx;
    Partner::Lane* lane = nullptr;
  };

  std::mutex mu_;
  bool cancelled_ = false;
  std::unique_ptr<Forwarded> forward_;  // the partner's call, when forwarded
  std::atomic<int> refs_{1};  // OnDone's; the forward and Engines' copies add theirs
};

// ---- Call ----------------------------------------------------------------------------------------------------

Call::Call(Frontend* fe, grpc::GenericCallbackServerContext* ctx) : fe_(fe) {
  fe_->live_calls.fetch_add(1);
  if (ctx->method().rfind(kInternalPrefix, 0) == 0) {  // this process's own RPCs to the partner: never a client's
    Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "Method not found!"));
    return;
  }
  forward_ = std::make_unique<Forward>(fe_, this, ctx);
  Ref();  // the forward's client side: its OnDone drops it
  forward_->Start();
}

void Call::OnCancel() {
  if (forward_ != nullptr) forward_->Cancel();
}

void Call::OnDone() {
  fe_->live_calls.fetch_sub(1);
  Unref();
}

// ---- InferCall -------------------------------------------------------------------------------------------------

InferCall::InferCall(Frontend* fe, grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request,
                     grpc::ByteBuffer* response)
    : fe_(fe), ctx_(ctx), request_bb_(request), response_bb_(response) {
  arrived_ns_ = MonotonicNs();
  fe_->live_calls.fetch_add(1);
  CallDeadline(ctx, arrived_ns_, &deadline, &timeout_s_);
}

void InferCall::Start() {
  // The token before the message is parsed, then the RPC limit (a refused token holds no slot).
  if (fe_->tokens != nullptr && !Authorized()) {
    FinishFast(grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                            "missing or invalid credentials: send 'authorization: Bearer <token>' metadata"),
               0);
    return;
  }
  if (!request_bb_->Valid()) {  // no message (the client half-closed at once): the partner answers that
    StartForward();
    return;
  }
  if (fe_->fast_calls.fetch_add(1) >= fe_->options.max_concurrent_rpcs) {
    fe_->fast_calls.fetch_sub(1);
    FinishFast(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                            "this front end has " + std::to_string(fe_->options.max_concurrent_rpcs) +
                                " RPCs in progress, its limit (--max-concurrent-rpcs, each front end's own); "
                                "retry later"),
               0);
    return;
  }
  holds_slot_ = true;
  // Parse from gRPC's buffer, which stays as it came: a request the fast path does not take goes on byte for byte.
  // A large one's tensor stays in it (wire.h): protobuf parses the rest, and the tensor is copied once, from the
  // buffer's slices into the arena; a small one (or one the walk refuses) protobuf parses whole.
  bool parsed, split = false;
  const bool large = request_bb_->Length() >= kWholeParseBytes;
  if (large && SplitRawContents(*request_bb_, &split_)) {
    split = true;
    parsed = request_.ParseFromString(split_.rest);
  } else {
    if (large) split_ = SplitMessage();  // what a refused walk left
    grpc::ProtoBufferReader reader(const_cast<grpc::ByteBuffer*>(request_bb_));  // (only read)
    parsed = request_.ParseFromZeroCopyStream(&reader) && reader.status().ok();
  }
  Decoded d;
  if (!parsed || !Eligible(request_, fe_->spec, &d, split ? &split_.raw_bytes : nullptr, fe_->regions.get())) {
    request_.Clear();
    ReleaseSlot();
    StartForward();
    return;
  }
  decoded_ = true;
  typed_ = d.typed;
  datatype = d.datatype;
  std::memcpy(shape, d.shape, sizeof(shape));
  data = d.data;
  nbytes = d.nbytes;
  if (d.in_region) {
    in_region = true;
    region_offset = d.region_offset;
    region_device = d.region_device;
    trailer = RegionTrailer(d);
    if (d.output_in_region) output_region_ = std::make_unique<std::string>(std::move(d.output_region));
  }
  if (split) {
    pieces = std::move(split_.pieces);
    fe_->wire_tensors.fetch_add(1, std::memory_order_relaxed);
    fe_->wire_slices.fetch_add(static_cast<int64_t>(pieces.size()), std::memory_order_relaxed);
  }
  const grpc::Status status = fe_->engines->Submit(this);
  if (!status.ok()) FinishFast(status, 0);
}

bool InferCall::Authorized() const {
  const auto& metadata = ctx_->client_metadata();
  const grpc::string_ref key("authorization");
  const auto it = metadata.lower_bound(key);  // the first one, as the Python interceptor takes
  if (it == metadata.end() || it->first != key) return fe_->tokens->Admits("", 0);
  return fe_->tokens->Admits(it->second.data(), it->second.size());
}

void InferCall::ReleaseSlot() {
  if (holds_slot_) {
    holds_slot_ = false;
    fe_->fast_calls.fetch_sub(1);
  }
}

grpc::StatusCode InferCall::CancelCode() const {
  if (std::isnan(deadline)) return grpc::StatusCode::CANCELLED;
  const double slack = std::max(kDeadlineSlackS, kDeadlineSlackShare * timeout_s_);
  return deadline - MonotonicSeconds() <= slack ? grpc::StatusCode::DEADLINE_EXCEEDED : grpc::StatusCode::CANCELLED;
}

void InferCall::OnCancel() {
  grpc::ClientContext* forward = nullptr;
  {
    std::lock_guard<std::mutex> l(mu_);
    cancelled_ = true;
    if (forward_ != nullptr) forward = forward_->cctx.get();
  }
  if (forward != nullptr) {
    forward->TryCancel();
  } else if (!decoded_) {
    // Not on the fast path yet or any more: it ends another way (a forward that sees the cancellation).
  } else if (fe_->engines->Cancel(this)) {
    // Waiting for room or sent to an engine: it has ended there (a CANCEL record went with it).
    FinishFast(CancelledStatus(), 0);
  }
  // Otherwise it ends another way: Submit or the sender seeing the cancellation, a reply.
}

void InferCall::OnDone() {
  fe_->live_calls.fetch_sub(1);
  Unref();
}

void InferCall::OnReply(const ReplyRecord& header, const char* payload) {
  if (header.kind != kReplyOk) {  // the engine's status, as it comes (core.errors.Status.of: UNKNOWN for no code)
    const int code = header.code >= 1 && header.code <= 16 ? header.code : 2;
    FinishFast(grpc::Status(static_cast<grpc::StatusCode>(code), std::string(payload, header.payload_bytes)),
               header.queue_ns);
    return;
  }
  const uint64_t n = shape[0], cout = static_cast<uint64_t>(fe_->spec.cout);
  if (header.payload_bytes != n * cout * 4) {
    Log("an engine answered %u bytes for an output of (%llu, %llu)", header.payload_bytes,
        static_cast<unsigned long long>(n), static_cast<unsigned long long>(cout));
    FinishFast(grpc::Status(grpc::StatusCode::INTERNAL, "inference failed inside the server; see its log"),
               header.queue_ns);
    return;
  }
  uint64_t first = 0;
  const int64_t rows = NonFiniteRows(payload, n, cout, &first);
  if (rows != 0) {
    FinishFast(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, NonFiniteMessage(first, n, rows)), header.queue_ns);
    return;
  }
  // Too late for the client, which stops waiting a little before the server's deadline: say so rather than send
  // what nobody reads.
  if (!std::isnan(deadline) && deadline - MonotonicSeconds() <= kDeadlineSlackS) {
    FinishFast(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "the request's deadline passed while it ran"),
               header.queue_ns);
    return;
  }
  EncodeResponse(fe_->options.model_name, fe_->options.model_version, request_.id(), payload, n, cout, typed_,
                 &response_, output_region_.get());
  bool own = false;
  const grpc::Status serialized =
      grpc::SerializationTraits<inference::ModelInferResponse>::Serialize(response_, response_bb_, &own);
  if (!serialized.ok()) {
    FinishFast(grpc::Status(grpc::StatusCode::INTERNAL, "inference failed inside the server; see its log"),
               header.queue_ns);
    return;
  }
  FinishFast(grpc::Status::OK, header.queue_ns);
}

void InferCall::FinishFast(const grpc::Status& status, uint64_t queue_ns) {
  ReportRecord record{};
  const grpc::StatusCode code =
      status.error_code() == grpc::StatusCode::CANCELLED ? CancelCode() : status.error_code();
  record.code = static_cast<uint8_t>(code);
  record.served = 1;  // the fast path takes only the served model
  record.elapsed_ns = MonotonicNs() - arrived_ns_;
  record.queue_ns = static_cast<int64_t>(queue_ns);
  record.samples = decoded_ ? static_cast<int64_t>(shape[0]) : 0;
  record.input_bytes = decoded_ ? static_cast<int64_t>(nbytes) : 0;
  record.path = in_region ? kPathCudaShm : kPathWire;
  fe_->reporter->Add(record);
  ReleaseSlot();
  Finish(status);
}

void InferCall::StartForward() {
  std::unique_ptr<Forwarded> forward = std::make_unique<Forwarded>(this);
  Forwarded* f = forward.get();
  bool cancelled;
  {
    std::lock_guard<std::mutex> l(mu_);
    forward_ = std::move(forward);
    cancelled = cancelled_;
  }
  fe_->forwarded_calls.fetch_add(1);
  f->lane = &fe_->partner->Pick();
  f->lane->calls.fetch_add(1);
  Ref();  // the forward's OnDone drops it
  // Every operation started before the call: none is started from a reaction, so no hold is needed.
  f->lane->stub->PrepareBidiStreamingCall(f->cctx.get(), kModelInfer, grpc::StubOptions(), f);
  if (request_bb_->Valid())
    f->StartWriteLast(request_bb_, grpc::WriteOptions());
  else
    f->StartWritesDone();  // as the client did
  f->StartRead(response_bb_);
  f->StartCall();
  if (cancelled) f->cctx->TryCancel();  // cancelled before the forward existed
}

void InferCall::Forwarded::OnDone(const grpc::Status& status) {
  InferCall* call = call_;
  for (const auto& [key, value] : cctx->GetServerInitialMetadata())
    if (Forwardable(key)) call->ctx_->AddInitialMetadata(Str(key), Str(value));
  for (const auto& [key, value] : cctx->GetServerTrailingMetadata())
    if (Forwardable(key)) call->ctx_->AddTrailingMetadata(Str(key), Str(value));
  lane->calls.fetch_sub(1);
  call->fe_->forwarded_calls.fetch_sub(1);
  if (status.ok() && !call->response_bb_->Valid())  // (a partner's unary method always answers OK with a message)
    call->Finish(grpc::Status(grpc::StatusCode::INTERNAL, "the partner answered OK without a message"));
  else
    call->Finish(status);
  call->Unref();  // may delete the call, and this with it: the last thing done here
}

// ---- Forward ---------------------------------------------------------------------------------------------------

Forward::Forward(Frontend* fe, Call* call, grpc::GenericCallbackServerContext* ctx)
    : fe_(fe), call_(call), ctx_(ctx), cctx_(PartnerContext(ctx)) {}

void Forward::Start() {
  fe_->forwarded_calls.fetch_add(1);
  lane_ = &fe_->partner->Pick();
  lane_->calls.fetch_add(1);
  lane_->stub->PrepareBidiStreamingCall(cctx_.get(), ctx_->method(), grpc::StubOptions(), &client_);
  client_.AddMultipleHolds(2);  // up and down (see the class comment)
  // The server read before the call starts: once it has, the partner may end it (and the server call) any time.
  call_->StartRead(&up_);
  client_.StartRead(&down_);
  client_.StartCall();
}

void Forward::OnServerReadDone(bool ok) {
  std::unique_lock<std::mutex> l(mu_);
  if (up_state_ == Up::kClosed) return;  // the partner has ended the call: nothing more goes up
  up_state_ = ok ? Up::kPartnerWrite : Up::kClosed;
  l.unlock();
  if (ok) {
    client_.StartWrite(&up_);
    return;
  }
  // The client half-closed, or the call ended (then the cancellation reaches the partner: OnCancel, propagation).
  if (!ctx_->IsCancelled()) client_.StartWritesDone();
  client_.RemoveHold();
}

void Forward::OnPartnerWriteDone(bool ok) {
  std::unique_lock<std::mutex> l(mu_);
  if (!ok || up_state_ == Up::kClosing) {  // the partner's side is over
    up_state_ = Up::kClosed;
    l.unlock();
    client_.RemoveHold();
    return;
  }
  up_state_ = Up::kServerRead;
  l.unlock();
  call_->StartRead(&up_);
}

void Forward::ForwardHeadersLocked() {
  if (headers_forwarded_ || !headers_ok_) return;
  headers_forwarded_ = true;
  for (const auto& [key, value] : cctx_->GetServerInitialMetadata())
    if (Forwardable(key)) ctx_->AddInitialMetadata(Str(key), Str(value));
}

void Forward::OnHeaders(bool ok) {
  std::unique_lock<std::mutex> l(mu_);
  headers_seen_ = true;
  headers_ok_ = ok;
  ForwardHeadersLocked();
  const bool write = down_waiting_;
  down_waiting_ = false;
  l.unlock();
  if (write) call_->StartWrite(&down_);
}

void Forward::OnPartnerReadDone(bool ok) {
  std::unique_lock<std::mutex> l(mu_);
  if (ok) {
    if (!headers_seen_) {  // (gRPC delivers the headers first; their reaction may still be running)
      down_waiting_ = true;
      return;
    }
    ForwardHeadersLocked();
    l.unlock();
    call_->StartWrite(&down_);
    return;
  }
  // The partner has sent all it will: its status follows. Nothing more goes up either; the up direction lets go
  // of its hold now if it waits for the client, else at its next step.
  bool release_up = false;
  if (up_state_ == Up::kServerRead) {
    up_state_ = Up::kClosed;
    release_up = true;
  } else if (up_state_ == Up::kPartnerWrite) {
    up_state_ = Up::kClosing;
  }
  l.unlock();
  if (release_up) client_.RemoveHold();
  client_.RemoveHold();  // down: no more reads
}

void Forward::OnServerWriteDone(bool ok) {
  if (ok) {
    client_.StartRead(&down_);
    return;
  }
  // The client is gone: so is the partner's call.
  cctx_->TryCancel();
  client_.RemoveHold();
}

void Forward::OnPartnerDone(const grpc::Status& status) {
  {
    std::lock_guard<std::mutex> l(mu_);
    ForwardHeadersLocked();
    for (const auto& [key, value] : cctx_->GetServerTrailingMetadata())
      if (Forwardable(key)) ctx_->AddTrailingMetadata(Str(key), Str(value));
  }
  lane_->calls.fetch_sub(1);
  fe_->forwarded_calls.fetch_sub(1);
  Call* call = call_;
  call->Finish(status);
  call->Unref();  // may delete the call, and this with it: the last thing done here
}

}  // namespace

grpc::ServerGenericBidiReactor* Service::CreateReactor(grpc::GenericCallbackServerContext* ctx) {
  return new Call(fe_, ctx);
}

InferService::InferService(Frontend* fe) {
  // A method without a handler, then given its raw callback handler (what protoc's WithRawCallbackMethod_ does
  // for a service of its own; the other methods of GRPCInferenceService stay the generic service's).
  AddMethod(new grpc::internal::RpcServiceMethod(kModelInfer, grpc::internal::RpcMethod::NORMAL_RPC, nullptr));
  MarkMethodRawCallback(
      0, new grpc::internal::CallbackUnaryHandler<grpc::ByteBuffer, grpc::ByteBuffer>(
             [fe](grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* request, grpc::ByteBuffer* response) {
               auto* call = new InferCall(fe, ctx, request, response);
               call->Start();
               return call;
             }));
}

}  // namespace voxserve
