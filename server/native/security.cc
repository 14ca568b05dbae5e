#include "security.h"

#include <openssl/crypto.h>
#include <openssl/sha.h>

#include <fstream>
#include <sstream>

namespace voxserve {

namespace {

std::string ReadFile(const std::string& path, const char* flag) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError(std::string(flag) + " " + path + " cannot be read");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

}  // namespace

TokenDigests::TokenDigests(const std::string& path) {
  std::istringstream lines(ReadFile(path, "--token-digests"));
  std::string line;
  int number = 0;
  while (std::getline(lines, line)) {
    ++number;
    while (!line.empty() && IsSpace(line.back())) line.pop_back();
    if (line.empty()) continue;
    std::array<uint8_t, 32> digest{};
    bool ok = line.size() == 64;
    for (size_t i = 0; ok && i < 32; ++i) {
      const int hi = HexValue(line[2 * i]), lo = HexValue(line[2 * i + 1]);
      ok = hi >= 0 && lo >= 0;
      digest[i] = static_cast<uint8_t>(hi * 16 + lo);
    }
    if (!ok)
      throw UsageError("--token-digests " + path + ": line " + std::to_string(number) +
                       " is not a lowercase hex SHA-256 digest");
    digests_.push_back(digest);
  }
  if (digests_.empty()) throw UsageError("--token-digests " + path + " holds no digest");
}

bool TokenDigests::Admits(const char* value, size_t size) const {
  // "Bearer <token>": the scheme up to the first space, in any case; the token with surrounding whitespace
  // stripped. Anything else presents the empty token, which no digest admits.
  const std::string text(value, size);
  std::string token;
  const size_t space = text.find(' ');
  if (space != std::string::npos && space == 6) {
    std::string scheme = text.substr(0, 6);
    for (char& c : scheme) c = static_cast<char>(c >= 'A' && c <= 'Z' ? c - 'A' + 'a' : c);
    if (scheme == "bearer") {
      size_t begin = space + 1, end = text.size();
      while (begin < end && IsSpace(text[begin])) ++begin;
      while (end > begin && IsSpace(text[end - 1])) --end;
      token = text.substr(begin, end - begin);
    }
  }
  uint8_t digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(token.data()), token.size(), digest);
  int matched = 0;
  for (const auto& accepted : digests_) matched |= CRYPTO_memcmp(digest, accepted.data(), 32) == 0;
  return matched != 0 && !token.empty();
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentials(const Options& options) {
  if (options.tls_cert.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({ReadFile(options.tls_key, "--tls-key"), ReadFile(options.tls_cert, "--tls-cert")});
  if (!options.tls_client_ca.empty()) {
    ssl.pem_root_certs = ReadFile(options.tls_client_ca, "--tls-client-ca");
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

}  // namespace voxserve
