// The tensor of a large ModelInferRequest taken from the received bytes themselves (server/protocol/wire.py's
// walk, in C++): the top level of the message's wire format is walked over gRPC's slices (tag, then a varint,
// fixed or length-delimited payload), raw_input_contents is located there, and protobuf parses only the rest
// (names, shapes, parameters: a few hundred bytes). The tensor's bytes are then copied once, from the slices
// straight into the arena block, where parsing the whole message would copy them into the message first.
#pragma once

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace voxserve {

// Below this many bytes protobuf parses the whole message, tensor included (wire.py's WHOLE_PARSE_BYTES). Timed
// alone on the 2-core box the walk costs less from about 4 KiB of tensor, but served end to end a request of
// 9 KiB cost the front end 5-28 us more with the walk than without in three pairs of runs out of three
// (bench/results/native-frontend-copies-cpu-2core.md), so the smaller messages keep the whole parse.
constexpr size_t kWholeParseBytes = 32 * 1024;

struct SplitMessage {
  std::vector<grpc::Slice> slices;  // the message's, referenced: the pieces below point into them
  std::string rest;                 // the message without its raw_input_contents field
  std::vector<std::pair<const char*, size_t>> pieces;  // raw_input_contents[0]'s bytes, slice by slice, in order
  size_t raw_bytes = 0;
};

// True when ``message`` is a well-formed sequence of top-level fields (wire types 0, 1, 2 and 5; a field number
// >= 1) holding raw_input_contents exactly once, as a length-delimited field: ``out`` then holds the rest and the
// tensor's pieces. False for anything else (a malformed message, groups, no raw entry or several): the message is
// to be parsed whole, as it is below kWholeParseBytes.
bool SplitRawContents(const grpc::ByteBuffer& message, SplitMessage* out);

}  // namespace voxserve
