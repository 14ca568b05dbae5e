#include "common.h"

#include <time.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <stdexcept>

namespace voxserve {

namespace {
std::string log_prefix = "voxserve-frontend: ";
}

void SetLogName(const std::string& name) { log_prefix = "voxserve-frontend " + name + ": "; }

void Log(const char* format, ...) {
  char body[2048];
  va_list args;
  va_start(args, format);
  std::vsnprintf(body, sizeof(body), format, args);
  va_end(args);
  std::string line = log_prefix + body + "\n";
  // One write(2): a line of another thread cannot land in the middle of it.
  ssize_t ignored = write(STDERR_FILENO, line.data(), line.size());
  (void)ignored;
}

double MonotonicSeconds() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

int64_t MonotonicNs() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}

namespace {

void AppendUtf8(std::string* out, unsigned code) {
  if (code < 0x80) {
    out->push_back(static_cast<char>(code));
  } else if (code < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (code >> 6)));
    out->push_back(static_cast<char>(0x80 | (code & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xE0 | (code >> 12)));
    out->push_back(static_cast<char>(0x80 | ((code >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (code & 0x3F)));
  }
}

class FlatJsonReader {
 public:
  explicit FlatJsonReader(const std::string& text) : s_(text) {}

  std::map<std::string, std::string> Object() {
    std::map<std::string, std::string> out;
    Expect('{');
    if (Peek() == '}') {
      ++i_;
      return out;
    }
    for (;;) {
      std::string key = String();
      Expect(':');
      std::string value = Peek() == '"' ? String() : Bare();
      out[key] = value;
      const char c = Next();
      if (c == '}') break;
      if (c != ',') Fail("expected ',' or '}'");
    }
    return out;
  }

 private:
  void SkipSpace() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\t' || s_[i_] == '\r')) ++i_;
  }
  char Peek() {
    SkipSpace();
    if (i_ >= s_.size()) Fail("unexpected end");
    return s_[i_];
  }
  char Next() {
    const char c = Peek();
    ++i_;
    return c;
  }
  void Expect(char c) {
    if (Next() != c) Fail(std::string("expected '") + c + "'");
  }
  [[noreturn]] void Fail(const std::string& what) {
    throw std::runtime_error("the engine's hello is not a flat JSON object (" + what + " at " + std::to_string(i_) +
                             ")");
  }
  std::string String() {
    Expect('"');
    std::string out;
    while (i_ < s_.size()) {
      const char c = s_[i_++];
      if (c == '"') return out;
      if (c != '\\') {
        out.push_back(c);
        continue;
      }
      if (i_ >= s_.size()) break;
      const char e = s_[i_++];
      switch (e) {
        case 'n': out.push_back('\n'); break;
        case 't': out.push_back('\t'); break;
        case 'r': out.push_back('\r'); break;
        case 'b': out.push_back('\b'); break;
        case 'f': out.push_back('\f'); break;
        case 'u': {
          if (i_ + 4 > s_.size()) Fail("a cut \\u escape");
          AppendUtf8(&out, static_cast<unsigned>(std::stoul(s_.substr(i_, 4), nullptr, 16)));
          i_ += 4;
          break;
        }
        default: out.push_back(e);  // \" \\ \/
      }
    }
    Fail("an unterminated string");
  }
  std::string Bare() {  // a number, true, false or null
    SkipSpace();
    const size_t begin = i_;
    while (i_ < s_.size() && s_[i_] != ',' && s_[i_] != '}' && s_[i_] != ' ') ++i_;
    if (i_ == begin) Fail("a missing value");
    return s_.substr(begin, i_ - begin);
  }

  const std::string& s_;
  size_t i_ = 0;
};

}  // namespace

std::map<std::string, std::string> ParseFlatJson(const std::string& text) { return FlatJsonReader(text).Object(); }

std::string JsonString(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(c);
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\u%04x", static_cast<unsigned>(c));
      out += escaped;
    } else {
      out.push_back(c);
    }
  }
  return out + "\"";
}

}  // namespace voxserve
