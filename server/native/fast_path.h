// What the fast path takes, and the answers it makes itself.
//
// A ModelInfer request is taken only when it is PLAIN and VALID: every rule of server/protocol/codec.py
// decode_request and inference.py infer holds, and it uses nothing but the tensor in the message. Everything else
// (a message that does not parse too) goes to the Python front end unchanged, so that every validation error is
// that front end's own sentence and every feature (shared memory, classification, ...) lives in one place.
// Eligible() therefore only decides; it never words an error.
#pragma once

#include <cstdint>
#include <string>

#include "grpc_service.pb.h"

namespace voxserve {

struct FastPathSpec {
  std::string model_name, model_version;
  int64_t cin, cout, k;
  int64_t max_request_samples, max_request_voxels;
  size_t largest_block;  // the arena's: a larger tensor travels in pieces, which the Python front end does
};

struct Decoded {
  uint8_t datatype = 0;   // index in kDatatypes
  uint64_t shape[5] = {};
  const char* data = nullptr;  // raw_input_contents[0], or the typed FP32 values (inside the request message);
                               // null when the raw entry was outside the message (``raw_outside``)
  size_t nbytes = 0;
  bool typed = false;  // typed contents: the response is typed too
};

// Whether the fast path takes ``r``; its tensor in ``out`` when it does. ``raw_outside``: the size of the
// request's one raw_input_contents entry, taken out of the message before it was parsed (wire.h), else null.
bool Eligible(const inference::ModelInferRequest& r, const FastPathSpec& spec, Decoded* out,
              const size_t* raw_outside = nullptr);

// The rows of an (n, cout) FP32 output that are not finite, and the first of them (inference._check_finite).
int64_t NonFiniteRows(const char* payload, uint64_t n, uint64_t cout, uint64_t* first);

// INVALID_ARGUMENT's sentence for such an output, as inference._check_finite words it.
std::string NonFiniteMessage(uint64_t first, uint64_t n, int64_t rows);

// codec.encode_response: model name and version, the request's id, one output "output" FP32 [n, cout], in
// raw_output_contents or (typed) contents.fp32_contents.
void EncodeResponse(const std::string& model_name, const std::string& model_version, const std::string& id,
                    const char* payload, uint64_t n, uint64_t cout, bool typed, inference::ModelInferResponse* out);

}  // namespace voxserve
