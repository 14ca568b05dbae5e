#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

#include "ipc.h"

namespace voxserve {

Arena::Arena(size_t capacity) : capacity_(capacity) {
  fd_ = memfd_create("voxserve-arena", MFD_CLOEXEC);
  // Sparse, as the Python front end's: pages exist once written.
  if (fd_ < 0 || ftruncate(fd_, static_cast<off_t>(capacity)) != 0)
    throw std::runtime_error(std::string("cannot make the staging arena (memfd): ") + std::strerror(errno));
  void* map = mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (map == MAP_FAILED)
    throw std::runtime_error(std::string("cannot map the staging arena: ") + std::strerror(errno));
  base_ = static_cast<uint8_t*>(map);
}

bool Arena::TryAllocate(size_t nbytes, uint64_t* position) {
  const size_t size = std::max(kAlign, (nbytes + kAlign - 1) / kAlign * kAlign);
  uint64_t start = head_;
  if (start % capacity_ + size > capacity_) start += capacity_ - start % capacity_;  // does not fit before the end
  if (start + size - tail_ > capacity_) return false;
  head_ = start + size;
  if (blocks_.empty()) tail_ = start;
  blocks_.push_back({start, false});
  *position = start;
  return true;
}

void Arena::Release(uint64_t position) {
  auto it = std::lower_bound(blocks_.begin(), blocks_.end(), position,
                             [](const Block& b, uint64_t p) { return b.start < p; });
  if (it == blocks_.end() || it->start != position) return;  // (never: each block is released once)
  it->released = true;
  while (!blocks_.empty() && blocks_.front().released) blocks_.pop_front();
  tail_ = blocks_.empty() ? head_ : blocks_.front().start;
}

}  // namespace voxserve
