// Tokens and TLS on the public port (server/protocol/security.py is the Python front end's side of both).
#pragma once

#include <grpcpp/security/server_credentials.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "options.h"

namespace voxserve {

// The accepted bearer tokens, as SHA-256 digests (--token-digests: the supervisor parses --auth-token-file and
// writes one lowercase hex digest per line, so no token is ever on this process's command line or disk).
class TokenDigests {
 public:
  // Throws UsageError for a file that cannot be read, holds no digest, or a line that is not one.
  explicit TokenDigests(const std::string& path);

  // Whether an ``authorization`` value (``Bearer <token>``, the scheme in any case, the token stripped) carries an
  // accepted token, as security.BearerTokens.admits: the presented token's digest is compared with every accepted
  // one with CRYPTO_memcmp, so the time taken depends on neither the token's length nor how much of it matched.
  bool Admits(const char* value, size_t size) const;

 private:
  std::vector<std::array<uint8_t, 32>> digests_;
};

// The public port's credentials: TLS with --tls-cert/--tls-key, requiring and verifying client certificates
// signed by --tls-client-ca when it is given (security.server_credentials); insecure without them. Throws
// UsageError for a file that cannot be read.
std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const Options& options);

}  // namespace voxserve
