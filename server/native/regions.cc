#include "regions.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <ctime>
#include <map>
#include <stdexcept>

#include "common.h"

namespace voxserve {

namespace {

constexpr size_t kMaxRecordBytes = 4096;  // a record is ~250 bytes: a larger file is none of ours
// A record's identity (inode, mtime, size) vouches for what was read from it only when it was read a while after its
// mtime: one removed and written anew within a tick of the file system's clock can come back with the same inode,
// size and mtime. Until then it is read again (as shm.RACY_NS in the Python processes).
constexpr int64_t kRacyNs = 1000000000;

int64_t Ns(const struct timespec& t) { return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec; }

int64_t WallNs() {
  struct timespec now {};
  clock_gettime(CLOCK_REALTIME, &now);
  return Ns(now);
}

bool ParseUnsigned(const std::string& text, uint64_t* out) {
  if (text.empty() || text.size() > 19) return false;
  uint64_t value = 0;
  for (const char c : text) {
    if (c < '0' || c > '9') return false;
    value = value * 10 + static_cast<uint64_t>(c - '0');
  }
  *out = value;
  return true;
}

// The file's bytes (at most kMaxRecordBytes), and its identity as it was read; false when it cannot be read now.
bool ReadRecord(const std::string& path, std::string* text, struct stat* info) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) return false;
  bool ok = fstat(fd, info) == 0 && S_ISREG(info->st_mode) && info->st_size > 0 &&
            static_cast<size_t>(info->st_size) <= kMaxRecordBytes;
  if (ok) {
    text->resize(static_cast<size_t>(info->st_size));
    size_t got = 0;
    while (got < text->size()) {
      const ssize_t n = read(fd, text->data() + got, text->size() - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    ok = got == text->size();
  }
  close(fd);
  return ok;
}

}  // namespace

bool Regions::ValidName(const std::string& name) {
  if (name.empty() || name.size() > 128) return false;
  for (const char c : name) {
    const bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' ||
                    c == '.' || c == '-';
    if (!ok) return false;
  }
  return true;
}

bool Regions::Lookup(const std::string& name, CudaRegionRecord* out) {
  if (!ValidName(name)) return false;
  const std::string path = dir_ + "/r-" + name;
  struct stat info {};
  if (lstat(path.c_str(), &info) != 0 || !S_ISREG(info.st_mode)) {  // (a link is none of ours: read with O_NOFOLLOW)
    std::lock_guard<std::mutex> l(mu_);
    cache_.erase(name);
    return false;
  }
  const int64_t mtime_ns = Ns(info.st_mtim);
  {
    std::lock_guard<std::mutex> l(mu_);
    auto it = cache_.find(name);
    if (it != cache_.end() && it->second.inode == info.st_ino && it->second.mtime_ns == mtime_ns &&
        it->second.size == info.st_size && it->second.read_ns - mtime_ns >= kRacyNs) {
      if (!it->second.cuda) return false;
      *out = it->second.record;
      return true;
    }
  }
  // New, changed since it was read, or read too soon after it was written: read it (outside the lock; a record
  // being written reads as none).
  const int64_t read_ns = WallNs();
  std::string text;
  struct stat read_info {};
  if (!ReadRecord(path, &text, &read_info)) return false;
  std::map<std::string, std::string> fields;
  try {
    fields = ParseFlatJson(text);
  } catch (const std::exception&) {
    return false;  // cut short (being written): as absent, as cudashm._read_record
  }
  Cached cached{read_info.st_ino, Ns(read_info.st_mtim), read_info.st_size, read_ns, false, {}};
  const auto kind = fields.find("kind");
  if (kind != fields.end() && kind->second == "cuda") {
    uint64_t device = 0, size = 0;
    const auto d = fields.find("device_id"), b = fields.find("byte_size"), h = fields.find("handle"),
               t = fields.find("token");
    if (d == fields.end() || b == fields.end() || h == fields.end() || t == fields.end() ||
        !ParseUnsigned(d->second, &device) || !ParseUnsigned(b->second, &size) || device > INT32_MAX)
      return false;  // not a record cudashm.py reads either
    cached.cuda = true;
    cached.record.device_id = static_cast<int64_t>(device);
    cached.record.byte_size = size;
  }
  std::lock_guard<std::mutex> l(mu_);
  if (cache_.size() >= kMaxCached && cache_.find(name) == cache_.end()) cache_.clear();
  cache_[name] = cached;
  if (!cached.cuda) return false;
  *out = cached.record;
  return true;
}

}  // namespace voxserve
