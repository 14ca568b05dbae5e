#include "fast_path.h"

#include <cmath>
#include <cstring>

#include "ipc.h"

namespace voxserve {

namespace {

constexpr size_t kMaxIdBytes = 256;  // codec.MAX_ID_CHARS counts characters: <= 256 bytes is <= 256 characters

// The typed-contents fields that are set (ListFields lists only non-empty ones), and whether fp32 is the only one.
int TypedFields(const inference::InferTensorContents& c, bool* only_fp32) {
  const int others = (c.bool_contents_size() > 0) + (c.int_contents_size() > 0) + (c.int64_contents_size() > 0) +
                     (c.uint_contents_size() > 0) + (c.uint64_contents_size() > 0) +
                     (c.fp64_contents_size() > 0) + (c.bytes_contents_size() > 0);
  *only_fp32 = others == 0;
  return others + (c.fp32_contents_size() > 0);
}

}  // namespace

bool Eligible(const inference::ModelInferRequest& r, const FastPathSpec& spec, Decoded* out,
              const size_t* raw_outside) {
  // The model (codec.check_model), the id (inference.infer). Request-level parameters are ignored there, as here.
  if (r.model_name() != spec.model_name) return false;
  if (!r.model_version().empty() && r.model_version() != spec.model_version) return false;
  if (r.id().size() > kMaxIdBytes) return false;
  // One input, "input", plain (no parameters: shared memory, or anything else), of an accepted datatype.
  if (r.inputs_size() != 1) return false;
  const inference::ModelInferRequest::InferInputTensor& t = r.inputs(0);
  if (t.name() != "input" || !t.parameters().empty()) return false;
  int datatype = -1;
  for (int i = 0; i < 3; ++i)
    if (t.datatype() == kDatatypes[i]) datatype = i;
  if (datatype < 0) return false;
  // At most one requested output, "output", plain (classification, shared memory: the partner's).
  if (r.outputs_size() > 1) return false;
  if (r.outputs_size() == 1 && (r.outputs(0).name() != "output" || !r.outputs(0).parameters().empty())) return false;
  // codec._check_shape's valid case; the client chooses every dimension up to int64's limit, so the products are
  // checked for overflow.
  if (t.shape_size() != 5) return false;
  const int64_t n = t.shape(0), c = t.shape(1), d = t.shape(2), h = t.shape(3), w = t.shape(4);
  if (c != spec.cin || n < 1 || n > spec.max_request_samples) return false;
  if (d < spec.k || h < spec.k || w < spec.k) return false;
  int64_t voxels = n, elements = 0;
  if (__builtin_mul_overflow(voxels, d, &voxels) || __builtin_mul_overflow(voxels, h, &voxels) ||
      __builtin_mul_overflow(voxels, w, &voxels) || voxels > spec.max_request_voxels)
    return false;
  if (__builtin_mul_overflow(voxels, c, &elements)) return false;
  const uint64_t count = static_cast<uint64_t>(elements);
  // The data: exactly one raw entry of the exact byte count and no typed contents, or FP32 typed contents of the
  // exact count and no raw entry.
  bool only_fp32 = true;
  const int typed = TypedFields(t.contents(), &only_fp32);
  const int raw_entries = r.raw_input_contents_size() + (raw_outside != nullptr);
  if (raw_entries > 0) {
    if (typed != 0 || raw_entries != 1) return false;
    const size_t size = raw_outside != nullptr ? *raw_outside : r.raw_input_contents(0).size();
    if (count > SIZE_MAX / kItemsize[datatype] || size != count * kItemsize[datatype]) return false;
    out->data = raw_outside != nullptr ? nullptr : r.raw_input_contents(0).data();
    out->nbytes = size;
    out->typed = false;
  } else {
    if (typed != 1 || !only_fp32 || datatype != 0) return false;
    if (static_cast<uint64_t>(t.contents().fp32_contents_size()) != count) return false;
    out->data = reinterpret_cast<const char*>(t.contents().fp32_contents().data());
    out->nbytes = count * 4;
    out->typed = true;
  }
  if (out->nbytes > spec.largest_block) return false;
  out->datatype = static_cast<uint8_t>(datatype);
  const int64_t dims[5] = {n, c, d, h, w};
  for (int i = 0; i < 5; ++i) out->shape[i] = static_cast<uint64_t>(dims[i]);
  return true;
}

int64_t NonFiniteRows(const char* payload, uint64_t n, uint64_t cout, uint64_t* first) {
  int64_t rows = 0;
  for (uint64_t i = 0; i < n; ++i) {
    bool finite = true;
    for (uint64_t j = 0; j < cout; ++j) {
      float value;
      std::memcpy(&value, payload + 4 * (i * cout + j), 4);  // the reader's buffer: not necessarily aligned
      finite &= std::isfinite(value);
    }
    if (!finite && rows++ == 0) *first = i;
  }
  return rows;
}

std::string NonFiniteMessage(uint64_t first, uint64_t n, int64_t rows) {
  return "input 'input' sample " + std::to_string(first) + " (of " + std::to_string(n) + "; " +
         std::to_string(rows) +
         " such) gives a non-finite output: it holds NaN or infinite values, or values so large that the "
         "convolution overflows float32";
}

void EncodeResponse(const std::string& model_name, const std::string& model_version, const std::string& id,
                    const char* payload, uint64_t n, uint64_t cout, bool typed, inference::ModelInferResponse* out) {
  out->set_model_name(model_name);
  out->set_model_version(model_version);
  out->set_id(id);
  auto* tensor = out->add_outputs();
  tensor->set_name("output");
  tensor->set_datatype("FP32");
  tensor->add_shape(static_cast<int64_t>(n));
  tensor->add_shape(static_cast<int64_t>(cout));
  const size_t bytes = n * cout * 4;
  if (typed) {
    auto* values = tensor->mutable_contents()->mutable_fp32_contents();
    values->Resize(static_cast<int>(n * cout), 0.0f);
    std::memcpy(values->mutable_data(), payload, bytes);
  } else {
    out->add_raw_output_contents(payload, bytes);
  }
}

}  // namespace voxserve
