// What the fast path takes, and the answers it makes itself.
//
// A ModelInfer request is taken only when it is PLAIN and VALID: every rule of server/protocol/codec.py
// decode_request and inference.py infer holds, and it uses nothing but the tensor in the message, or a tensor in
// a client's CUDA shared-memory region (its output in the response, or in a CUDA region on the same device, which
// the engine writes there itself). Everything else (a message that does not parse too; system shared memory; an
// output the Python front end would store from the host) goes to the Python front end unchanged, so that every
// validation error is that front end's own sentence and every other feature (classification, ...) lives in one
// place. Eligible() therefore only decides; it never words an error.
#pragma once

#include <cstdint>
#include <string>

#include "grpc_service.pb.h"
#include "regions.h"

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
  // In a client's CUDA region (``data`` null): its name, offset and device; and, when the output goes to a CUDA
  // region too (written by the engine), that region's name and offset.
  bool in_region = false;
  std::string region;
  uint64_t region_offset = 0;
  int64_t region_device = 0;
  bool output_in_region = false;
  std::string output_region;
  uint64_t output_offset = 0;
};

// Whether the fast path takes ``r``; its tensor in ``out`` when it does. ``raw_outside``: the size of the
// request's one raw_input_contents entry, taken out of the message before it was parsed (wire.h), else null.
// ``regions``: the CUDA regions' records, when the engines offer CUDA shared memory, else null.
bool Eligible(const inference::ModelInferRequest& r, const FastPathSpec& spec, Decoded* out,
              const size_t* raw_outside = nullptr, Regions* regions = nullptr);

// An INFER_REGION record's trailer for ``d`` (ipc.region_trailer): the input's CUDA region, and the output's
// region and offset when the engine writes the output there.
std::string RegionTrailer(const Decoded& d);

// The rows of an (n, cout) FP32 output that are not finite, and the first of them (inference._check_finite).
int64_t NonFiniteRows(const char* payload, uint64_t n, uint64_t cout, uint64_t* first);

// INVALID_ARGUMENT's sentence for such an output, as inference._check_finite words it.
std::string NonFiniteMessage(uint64_t first, uint64_t n, int64_t rows);

// codec.encode_response: model name and version, the request's id, one output "output" FP32 [n, cout], in
// raw_output_contents or (typed) contents.fp32_contents; or, when ``output_region`` is given (the engine wrote the
// output there), only its description: the region and the output's byte size.
void EncodeResponse(const std::string& model_name, const std::string& model_version, const std::string& id,
                    const char* payload, uint64_t n, uint64_t cout, bool typed, inference::ModelInferResponse* out,
                    const std::string* output_region = nullptr);

}  // namespace voxserve
