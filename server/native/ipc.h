// The records between a front end and an engine (server/topology/ipc.py, the schema's one definition) and the
// staging arena the tensors travel in. Change them only together with ipc.py.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>

namespace voxserve {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the records are little-endian structs");

// ipc.REQUEST "<BB2xIQQQd5Q": kind, datatype (its index in voxserve.datatypes.INPUT_DATATYPES), 2 pad, bytes that
// follow the record (INFER_REGION: its trailer, ipc.region_trailer; else 0), request id, offset (in the arena;
// INFER_REGION: in the client's region), byte count, deadline (CLOCK_MONOTONIC seconds; NaN: none), shape
// (N, Cin, D, H, W).
struct __attribute__((packed)) RequestRecord {
  uint8_t kind;
  uint8_t datatype;
  uint8_t pad[2];
  uint32_t trailer_bytes;
  uint64_t id;
  uint64_t offset;
  uint64_t nbytes;
  double deadline;
  uint64_t shape[5];
};

// ipc.REPLY "<BB2xIQQQ": kind, status code (gRPC's numbers), 2 pad, payload bytes, request id, queue ns, samples
// of its execution; the payload follows: the FP32 (N, Cout) output rows, or the error's message.
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

constexpr uint8_t kInfer = 1, kCancel = 2, kInferRegion = 3;  // ipc.INFER, ipc.CANCEL, ipc.INFER_REGION
constexpr uint8_t kReplyOk = 1;             // ipc.OK (ipc.ERROR is 2)
constexpr size_t kAlign = 256;              // ipc.ALIGN: blocks start on this boundary

// The input datatypes in INPUT_DATATYPES order: a record's datatype is the index.
constexpr const char* kDatatypes[] = {"FP32", "FP16", "BF16"};
constexpr size_t kItemsize[] = {4, 2, 2};

// A memfd handed out as blocks in ring order, as ipc.Arena: positions grow without bound (the offset is position %
// capacity); a block that would cross the end starts again at 0. Blocks are released in any order but reclaimed
// oldest first, so a block held long holds back the space after it and is never overwritten. A block is released
// only once the engine has replied to its request (Engines), so an engine never reads memory another request
// has been given. Not thread-safe: Engines' mutex guards it.
class Arena {
 public:
  explicit Arena(size_t capacity);  // throws std::runtime_error when the memfd cannot be made
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // A block of ``nbytes`` (its ring position in ``position``), or false while the ring has no room.
  bool TryAllocate(size_t nbytes, uint64_t* position);
  void Release(uint64_t position);

  uint8_t* At(uint64_t position) const { return base_ + position % capacity_; }
  uint64_t Offset(uint64_t position) const { return position % capacity_; }
  // Bytes between the oldest held block and the next free position (ipc.Arena.in_use): 0 when nothing is held.
  uint64_t in_use() const { return head_ - tail_; }
  size_t blocks() const { return blocks_.size(); }
  size_t capacity() const { return capacity_; }
  // The most one block may take: half, so that two requests can be in flight at least (ipc.Arena.largest).
  size_t largest() const { return capacity_ / 2; }
  int fd() const { return fd_; }

 private:
  struct Block {
    uint64_t start;
    bool released;
  };
  size_t capacity_;
  int fd_ = -1;
  uint8_t* base_ = nullptr;
  std::deque<Block> blocks_;  // held blocks in position order
  uint64_t head_ = 0, tail_ = 0;
};

}  // namespace voxserve
