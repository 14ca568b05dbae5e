#include "wire.h"

#include <algorithm>
#include <cstdint>

namespace voxserve {

namespace {

constexpr uint64_t kRawField = 7;  // ModelInferRequest.raw_input_contents

// A read position over the message's slices, as one run of bytes.
class Cursor {
 public:
  explicit Cursor(const std::vector<grpc::Slice>& slices) : slices_(slices) { Settle(); }

  size_t pos() const { return pos_; }
  bool at_end() const { return slice_ == slices_.size(); }

  bool Byte(uint8_t* b) {
    if (at_end()) return false;
    *b = slices_[slice_].begin()[offset_];
    Advance(1);
    return true;
  }

  // A base-128 varint of at most 10 bytes whose value fits 64 bits.
  bool Varint(uint64_t* value) {
    *value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!Byte(&b)) return false;
      if (shift == 63 && b > 1) return false;
      *value |= static_cast<uint64_t>(b & 0x7f) << shift;
      if (!(b & 0x80)) return true;
    }
    return false;
  }

  // Skips ``n`` bytes; ``pieces`` (if given) gets them, slice by slice. False if fewer are left.
  bool Skip(uint64_t n, std::vector<std::pair<const char*, size_t>>* pieces = nullptr) {
    while (n > 0) {
      if (at_end()) return false;
      const size_t here = std::min<uint64_t>(n, slices_[slice_].size() - offset_);
      if (pieces != nullptr) pieces->emplace_back(reinterpret_cast<const char*>(slices_[slice_].begin()) + offset_,
                                                  here);
      Advance(here);
      n -= here;
    }
    return true;
  }

 private:
  void Advance(size_t n) {
    offset_ += n;
    pos_ += n;
    Settle();
  }
  void Settle() {  // past the end of a slice (and past empty ones): the next one's start
    while (slice_ < slices_.size() && offset_ == slices_[slice_].size()) {
      ++slice_;
      offset_ = 0;
    }
  }

  const std::vector<grpc::Slice>& slices_;
  size_t slice_ = 0, offset_ = 0, pos_ = 0;
};

// The bytes [begin, end) of the slices, appended to ``out``.
void Append(const std::vector<grpc::Slice>& slices, size_t begin, size_t end, std::string* out) {
  size_t at = 0;
  for (const grpc::Slice& s : slices) {
    const size_t lo = std::max(at, begin), hi = std::min(at + s.size(), end);
    if (lo < hi) out->append(reinterpret_cast<const char*>(s.begin()) + (lo - at), hi - lo);
    at += s.size();
    if (at >= end) return;
  }
}

}  // namespace

bool SplitRawContents(const grpc::ByteBuffer& message, SplitMessage* out) {
  if (!message.Dump(&out->slices).ok()) return false;  // (a compressed message is decompressed before this)
  Cursor c(out->slices);
  size_t field_begin = 0, field_end = 0;
  bool found = false;
  while (!c.at_end()) {
    const size_t begin = c.pos();
    uint64_t tag;
    if (!c.Varint(&tag) || (tag >> 3) == 0) return false;
    const uint64_t field = tag >> 3;
    switch (tag & 7) {
      case 0: {
        uint64_t ignored;
        if (!c.Varint(&ignored)) return false;
        break;
      }
      case 1:
        if (!c.Skip(8)) return false;
        break;
      case 5:
        if (!c.Skip(4)) return false;
        break;
      case 2: {
        uint64_t length;
        if (!c.Varint(&length)) return false;
        if (field != kRawField) {
          if (!c.Skip(length)) return false;
          break;
        }
        if (found) return false;  // several entries: the whole message is parsed (and not taken)
        found = true;
        field_begin = begin;
        if (!c.Skip(length, &out->pieces)) return false;
        field_end = c.pos();
        out->raw_bytes = length;
        break;
      }
      default:  // groups (3, 4) and the wire types protobuf does not define
        return false;
    }
    if (field == kRawField && (tag & 7) != 2) return false;  // raw_input_contents of another wire type
  }
  if (!found) return false;
  const size_t total = c.pos();
  out->rest.reserve(total - (field_end - field_begin));
  Append(out->slices, 0, field_begin, &out->rest);
  Append(out->slices, field_end, total, &out->rest);
  return true;
}

}  // namespace voxserve
