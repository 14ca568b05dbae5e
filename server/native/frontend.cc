// voxserve-frontend: the native front end of `voxserve serve --frontends N --frontend-impl native`.
//
// Per front-end slot the supervisor starts two processes: this binary on the public gRPC port, and the Python
// front end (its "partner") on a private Unix socket. This process connects to the engines itself, exactly as a
// Python front end does (server/topology/remote.py: the hello, its own staging arena, the records of
// server/topology/ipc.py), and serves the hot path, a plain valid ModelInfer, end to end in C++: parse, copy the
// tensor into the arena (or, for a tensor in a client's CUDA region, name the region), one record to the least
// busy engine, the reply's rows (or the output region's description) as the response. Everything else
// goes to the partner, which keeps every feature; the fast path's calls are reported to it so that its metrics
// and statistics count them.
//
// The parts:
//   options.*    the command line (what the supervisor passes)
//   engines.*    the engine connections, the arena, the requests in flight (remote.RemoteRunner's work)
//   fast_path.*  which requests the fast path takes, and the responses it makes
//   regions.*    the CUDA shared-memory regions' records (a request's checks; the engines map them)
//   wire.*       a large request's tensor located in its wire bytes (copied once, into the arena)
//   calls.*      the reactors of the calls: ModelInfer's fast path, forwarding to the partner, refusal
//   report.*     the fast path's accounting, sent to the partner
//   security.*   tokens and TLS
//
// Lifecycle: connect to every engine (waiting while they warm up), bind the public port, print "listening PORT"
// on stdout. SIGTERM/SIGINT: stop taking calls (Shutdown with the grace period), answer those in flight, send the
// last report, exit 0. SIGUSR1: one line of counters on stderr (what is in flight, what the arena holds).
// Exit 2: a mistake on the command line or in a file it names; exit 1: an engine or the port could not be had.
#include <absl/synchronization/mutex.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>

#include "calls.h"
#include "common.h"

using voxserve::Log;

namespace {

int signal_pipe[2] = {-1, -1};

void OnSignal(int sig) {
  const unsigned char byte = static_cast<unsigned char>(sig);
  const int saved = errno;
  ssize_t ignored = write(signal_pipe[1], &byte, 1);  // async-signal-safe; the pipe never fills in practice
  (void)ignored;
  errno = saved;
}

std::string Counters(voxserve::Frontend& fe) {
  return fe.engines->Counters() + ", fast-path calls in progress " + std::to_string(fe.fast_calls.load()) +
         ", forwarded calls in progress " + std::to_string(fe.forwarded_calls.load()) +
         ", tensors from the wire " + std::to_string(fe.wire_tensors.load()) + ", their slices " +
         std::to_string(fe.wire_slices.load()) + ", " +
         fe.reporter->Counters();
}

}  // namespace

int main(int argc, char** argv) {
  // Be sent SIGTERM when the process that started this one dies (the supervisor, killed outright, forwards
  // nothing): no front end outlives it holding the port (supervisor.die_with_supervisor, for the Python children).
  const pid_t parent = getppid();
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (getppid() != parent) raise(SIGTERM);  // it died before the request took effect
  // gRPC's locks are Abseil's; an Abseil built without NDEBUG (Debian's) tracks every lock's acquisition order in
  // one global graph under one global lock, to report potential deadlocks: a debugging aid, 3-4 % of this
  // process's samples under load (bench/results/native-frontend-locks-cpu-2core.md). Off here.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  auto fe = std::make_unique<voxserve::Frontend>();
  try {
    fe->options = voxserve::ParseOptions(argc, argv);
    voxserve::SetLogName(fe->options.name);
    if (!fe->options.token_digests.empty())
      fe->tokens = std::make_unique<voxserve::TokenDigests>(fe->options.token_digests);
  } catch (const voxserve::UsageError& e) {
    std::fprintf(stderr, "voxserve-frontend: %s\n%s\n", e.what(), voxserve::kUsage);
    return 2;
  }
  const voxserve::Options& o = fe->options;
  std::shared_ptr<grpc::ServerCredentials> credentials;
  try {
    credentials = voxserve::ServerCredentials(o);
  } catch (const voxserve::UsageError& e) {
    Log("%s", e.what());
    return 2;
  }

  signal(SIGPIPE, SIG_IGN);  // a vanished engine is seen by its reader as the end of its connection
  // Waiting for the engines, a SIGTERM or SIGINT ends the process at once (their default): nothing is served yet.
  try {
    fe->engines = new voxserve::Engines(o);
    fe->engines->Connect();
  } catch (const std::exception& e) {
    Log("%s", e.what());
    return 1;
  }
  // From here the signals are taken by the loop at the end. gRPC's library starts threads of its own before main
  // runs, whose signal masks this process does not set, so a handler (whichever thread runs it) writes the
  // signal's number into a pipe that the main thread reads.
  if (pipe2(signal_pipe, O_CLOEXEC) != 0) {
    Log("pipe: %s", std::strerror(errno));
    return 1;
  }
  struct sigaction action {};
  action.sa_handler = OnSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  for (int sig : {SIGTERM, SIGINT, SIGUSR1}) sigaction(sig, &action, nullptr);
  const voxserve::EngineHello& hello = fe->engines->hello();
  fe->spec = {o.model_name,        o.model_version,        hello.cin, hello.cout, hello.k,
              o.max_request_samples, o.max_request_voxels, fe->engines->largest_block()};
  // CUDA shared-memory inputs on the fast path too, where the engines offer it (as the partner then does).
  if (o.fast_path && !o.regions_dir.empty() && fe->engines->offers_cuda())
    fe->regions = std::make_unique<voxserve::Regions>(o.regions_dir);
  fe->partner = new voxserve::Partner(o);
  voxserve::Frontend* shared = fe.get();
  fe->reporter = new voxserve::Reporter(fe->partner->report_channel(), o.report_interval_ms,
                                        [shared] { return shared->fast_calls.load(); });
  fe->engines->Start();
  fe->reporter->Start();

  voxserve::Service service(fe.get());
  voxserve::InferService infer_service(fe.get());
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(o.listen, credentials, &port);
  for (const voxserve::GrpcArg& arg : o.grpc_args) {
    if (arg.is_int)
      builder.AddChannelArgument(arg.name, arg.int_value);
    else
      builder.AddChannelArgument(arg.name, arg.string_value);
  }
  if (o.fast_path) builder.RegisterService(&infer_service);
  builder.RegisterCallbackGenericService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    Log("cannot serve on %s (--listen)", o.listen.c_str());
    return 1;
  }
  Log("serving on %s (port %d): fast path %s%s, %zu engine(s), partner %s (%zu connection(s))", o.listen.c_str(),
      port, o.fast_path ? "on" : "off", fe->regions != nullptr ? " (CUDA shared memory too)" : "", o.engines.size(),
      o.partner.c_str(), fe->partner->lanes());
  std::printf("listening %d\n", port);
  std::fflush(stdout);

  for (;;) {
    unsigned char sig = 0;
    const ssize_t n = read(signal_pipe[0], &sig, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n != 1) {
      Log("reading the signal pipe: %s", std::strerror(errno));
      sig = SIGTERM;
    }
    if (sig == SIGUSR1) {
      Log("counters: %s", Counters(*fe).c_str());
      continue;
    }
    Log("%s: draining (grace period %.1f s)", sig == SIGTERM ? "SIGTERM" : "SIGINT", o.grace_period_s);
    break;
  }
  // No new calls from here; those in progress get the grace period, then gRPC cancels what is left (the fast
  // path's cancellations send their CANCEL records).
  const auto grace = std::chrono::microseconds(static_cast<int64_t>(o.grace_period_s * 1e6));
  server->Shutdown(std::chrono::system_clock::now() + grace);
  // The reactors end just after: their OnDone may still run on gRPC's threads.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (fe->live_calls.load() > 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  fe->reporter->Finish(2000);
  Log("stopped: %s", Counters(*fe).c_str());
  // Nothing is torn down: the engines' readers and gRPC's threads still run, and the process ends here.
  std::fflush(stdout);
  std::_Exit(0);
}
