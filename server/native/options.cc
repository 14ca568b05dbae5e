#include "options.h"

#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdlib>

namespace voxserve {

const char kUsage[] =
    "usage: voxserve-frontend --engine SOCKET [--engine SOCKET ...] --listen HOST:PORT --partner unix:PATH\n"
    "       [--name NAME] [--arena-bytes N] [--model-name S] [--model-version S] [--max-request-samples N]\n"
    "       [--max-request-voxels N] [--max-queue-size N] [--max-concurrent-rpcs N] [--grpc-arg NAME=VALUE ...]\n"
    "       [--token-digests PATH] [--tls-cert PATH --tls-key PATH [--tls-client-ca PATH]] [--fast-path 0|1]\n"
    "       [--report-interval-ms N] [--grace-period-s S] [--regions-dir PATH]";

namespace {

bool ParseInt(const std::string& text, long long* out) {
  if (text.empty()) return false;
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (errno != 0 || end != text.c_str() + text.size()) return false;
  *out = value;
  return true;
}

int64_t Integer(const std::string& flag, const std::string& value, int64_t minimum) {
  long long parsed = 0;
  if (!ParseInt(value, &parsed)) throw UsageError(flag + " takes an integer, not '" + value + "'");
  if (parsed < minimum) throw UsageError(flag + " is " + value + "; it must be >= " + std::to_string(minimum));
  return parsed;
}

}  // namespace

int64_t Options::IntArg(const std::string& arg, int64_t otherwise) const {
  for (const GrpcArg& a : grpc_args)
    if (a.name == arg && a.is_int) return a.int_value;
  return otherwise;
}

Options ParseOptions(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag.rfind("--", 0) != 0) throw UsageError("unexpected argument '" + flag + "'");
    if (i + 1 >= argc) throw UsageError(flag + " needs a value");
    const std::string value = argv[++i];
    if (flag == "--engine") {
      o.engines.push_back(value);
    } else if (flag == "--listen") {
      o.listen = value;
    } else if (flag == "--partner") {
      if (value.rfind("unix:", 0) != 0 || value.size() == 5)
        throw UsageError("--partner takes unix:PATH (the Python front end's socket), not '" + value + "'");
      o.partner = value;
    } else if (flag == "--name") {
      o.name = value;
    } else if (flag == "--arena-bytes") {
      o.arena_bytes = static_cast<uint64_t>(Integer(flag, value, 1 << 20));
    } else if (flag == "--model-name") {
      o.model_name = value;
    } else if (flag == "--model-version") {
      o.model_version = value;
    } else if (flag == "--max-request-samples") {
      o.max_request_samples = Integer(flag, value, 1);
    } else if (flag == "--max-request-voxels") {
      o.max_request_voxels = Integer(flag, value, 1);
    } else if (flag == "--max-queue-size") {
      o.max_queue_size = Integer(flag, value, 1);
    } else if (flag == "--max-concurrent-rpcs") {
      o.max_concurrent_rpcs = Integer(flag, value, 1);
    } else if (flag == "--grpc-arg") {
      const size_t eq = value.find('=');
      if (eq == std::string::npos || eq == 0) throw UsageError("--grpc-arg takes NAME=VALUE, not '" + value + "'");
      GrpcArg arg{value.substr(0, eq), false, 0, value.substr(eq + 1)};
      long long parsed = 0;
      if (ParseInt(arg.string_value, &parsed)) {
        if (parsed < INT_MIN || parsed > INT_MAX)
          throw UsageError("--grpc-arg " + arg.name + ": " + arg.string_value + " does not fit a channel arg (int)");
        arg.is_int = true;
        arg.int_value = static_cast<int>(parsed);
      }
      o.grpc_args.push_back(arg);
    } else if (flag == "--token-digests") {
      o.token_digests = value;
    } else if (flag == "--tls-cert") {
      o.tls_cert = value;
    } else if (flag == "--tls-key") {
      o.tls_key = value;
    } else if (flag == "--tls-client-ca") {
      o.tls_client_ca = value;
    } else if (flag == "--fast-path") {
      if (value != "0" && value != "1") throw UsageError("--fast-path takes 0 or 1, not '" + value + "'");
      o.fast_path = value == "1";
    } else if (flag == "--regions-dir") {
      o.regions_dir = value;
    } else if (flag == "--report-interval-ms") {
      o.report_interval_ms = Integer(flag, value, 1);
    } else if (flag == "--grace-period-s") {
      char* end = nullptr;
      const double s = std::strtod(value.c_str(), &end);
      if (value.empty() || end != value.c_str() + value.size() || !std::isfinite(s) || s < 0)
        throw UsageError("--grace-period-s takes seconds >= 0, not '" + value + "'");
      o.grace_period_s = s;
    } else {
      throw UsageError("unknown flag " + flag);
    }
  }
  if (o.engines.empty()) throw UsageError("--engine SOCKET is required (at least one)");
  if (o.listen.empty()) throw UsageError("--listen HOST:PORT is required");
  if (o.partner.empty()) throw UsageError("--partner unix:PATH is required");
  if (o.tls_cert.empty() != o.tls_key.empty()) throw UsageError("--tls-cert and --tls-key go together");
  if (!o.tls_client_ca.empty() && o.tls_cert.empty())
    throw UsageError("--tls-client-ca needs --tls-cert and --tls-key");
  return o;
}

}  // namespace voxserve
