// The CUDA shared-memory regions, as the fast path sees them: their records in the supervisor's regions directory
// (--regions-dir; server/protocol/cudashm.py writes them: "r-<name>", a flat JSON object with "kind": "cuda", the
// handle, "device_id", "byte_size" and a token), read for a request's checks only. Nothing is mapped here: the
// engine that takes the request maps the region and checks it again, against its own view of the record (the
// region may be unregistered in between: the engine then answers in its own words, as it does for a Python front
// end's request).
//
// A record is written once, when its region is registered, and removed when it is unregistered: a file whose
// identity (inode, mtime, size) is the one last read says nothing new, so a lookup is one stat (as cudashm._sync).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

namespace voxserve {

struct CudaRegionRecord {
  int64_t device_id = 0;
  uint64_t byte_size = 0;
};

class Regions {
 public:
  static constexpr size_t kMaxCached = 4096;  // records held here (registrations are bounded far below that)

  explicit Regions(std::string dir) : dir_(std::move(dir)) {}

  // Whether ``name`` (a client's text) is a region name at all: [A-Za-z0-9_.-]{1,128}, shm._NAME.
  static bool ValidName(const std::string& name);
  // The CUDA region ``name``'s record; false when it has none (not registered, another kind's, being written,
  // unreadable, or a name that is not one).
  bool Lookup(const std::string& name, CudaRegionRecord* out);

 private:
  struct Cached {
    ino_t inode;
    int64_t mtime_ns;
    off_t size;
    int64_t read_ns;  // the wall clock just before it was read: its identity vouches for it once settled (.cc)
    bool cuda;  // false: a record of another kind (a system region's)
    CudaRegionRecord record;
  };
  const std::string dir_;
  std::mutex mu_;
  std::unordered_map<std::string, Cached> cache_;
};

}  // namespace voxserve
