#include "fast_path.h"

#include <array>
#include <cmath>
#include <cstring>

#include "ipc.h"

namespace voxserve {

namespace {

constexpr size_t kMaxIdBytes = 256;  // codec.MAX_ID_CHARS counts characters: <= 256 bytes is <= 256 characters
constexpr char kRegionParam[] = "shared_memory_region";  // codec.REGION_PARAM, OFFSET_PARAM, SIZE_PARAM
constexpr char kOffsetParam[] = "shared_memory_offset";
constexpr char kSizeParam[] = "shared_memory_byte_size";

struct ShmRef {
  std::string region;
  uint64_t offset = 0;
  bool sized = false;
  uint64_t byte_size = 0;
};

// A tensor's parameters when they are shared memory's and nothing else, each of the type codec._shm_ref takes
// (the region a string; the offset and byte size integers >= 0), the byte size given (the protocol requires it for
// an input, and for an output in shared memory); false otherwise.
bool SizedShmRef(const google::protobuf::Map<std::string, inference::InferParameter>& parameters, ShmRef* out) {
  bool named = false;
  for (const auto& [key, value] : parameters) {
    if (key == kRegionParam) {
      if (value.parameter_choice_case() != inference::InferParameter::kStringParam) return false;
      out->region = value.string_param();
      named = true;
      continue;
    }
    uint64_t number = 0;
    if (value.parameter_choice_case() == inference::InferParameter::kInt64Param) {
      if (value.int64_param() < 0) return false;
      number = static_cast<uint64_t>(value.int64_param());
    } else if (value.parameter_choice_case() == inference::InferParameter::kUint64Param) {
      number = value.uint64_param();
    } else {
      return false;
    }
    if (key == kOffsetParam) {
      out->offset = number;
    } else if (key == kSizeParam) {
      out->sized = true;
      out->byte_size = number;
    } else {
      return false;
    }
  }
  return named && out->sized;
}

// Whether ``nbytes`` at ``offset`` lie inside a region of ``size`` bytes (exact: no overflow).
bool Inside(uint64_t offset, uint64_t nbytes, uint64_t size) { return offset <= size && nbytes <= size - offset; }

// The typed-contents fields that are set (ListFields lists only non-empty ones), and whether fp32 is the only one.
int TypedFields(const inference::InferTensorContents& c, bool* only_fp32) {
  const int others = (c.bool_contents_size() > 0) + (c.int_contents_size() > 0) + (c.int64_contents_size() > 0) +
                     (c.uint_contents_size() > 0) + (c.uint64_contents_size() > 0) +
                     (c.fp64_contents_size() > 0) + (c.bytes_contents_size() > 0);
  *only_fp32 = others == 0;
  return others + (c.fp32_contents_size() > 0);
}

// The rest of Eligible for an input in a CUDA region (codec.decode_request's shared-memory rules, its
// _output_on_device's case): the byte size the tensor's, on a whole element of a region that holds it; an output
// in shared memory at least the (n, cout) FP32 output's size, on a whole float of a CUDA region on the same
// device that holds it.
bool RegionEligible(const FastPathSpec& spec, uint8_t datatype, uint64_t count, const std::array<int64_t, 5>& dims,
                    const ShmRef& input, const ShmRef* output, Regions* regions, Decoded* out) {
  const uint64_t itemsize = kItemsize[datatype];
  if (count > UINT64_MAX / itemsize || input.byte_size != count * itemsize || input.offset % itemsize != 0)
    return false;
  CudaRegionRecord in{}, to{};
  if (!regions->Lookup(input.region, &in) || !Inside(input.offset, input.byte_size, in.byte_size)) return false;
  if (output != nullptr) {
    uint64_t needed = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(dims[0]), static_cast<uint64_t>(spec.cout) * 4, &needed) ||
        output->byte_size < needed || output->offset % 4 != 0)
      return false;
    if (!regions->Lookup(output->region, &to) || to.device_id != in.device_id ||
        !Inside(output->offset, needed, to.byte_size))
      return false;
  }
  out->data = nullptr;
  out->nbytes = input.byte_size;
  out->typed = false;
  out->datatype = datatype;
  for (int i = 0; i < 5; ++i) out->shape[i] = static_cast<uint64_t>(dims[i]);
  out->in_region = true;
  out->region = input.region;
  out->region_offset = input.offset;
  out->region_device = in.device_id;
  out->output_in_region = output != nullptr;
  if (output != nullptr) {
    out->output_region = output->region;
    out->output_offset = output->offset;
  }
  return true;
}

}  // namespace

bool Eligible(const inference::ModelInferRequest& r, const FastPathSpec& spec, Decoded* out,
              const size_t* raw_outside, Regions* regions) {
  // The model (codec.check_model), the id (inference.infer). Request-level parameters are ignored there, as here.
  if (r.model_name() != spec.model_name) return false;
  if (!r.model_version().empty() && r.model_version() != spec.model_version) return false;
  if (r.id().size() > kMaxIdBytes) return false;
  // One input, "input", of an accepted datatype: plain (no parameters), or in shared memory (no other parameter).
  if (r.inputs_size() != 1) return false;
  const inference::ModelInferRequest::InferInputTensor& t = r.inputs(0);
  if (t.name() != "input") return false;
  ShmRef input_ref, output_ref;
  const bool input_shm = !t.parameters().empty();
  if (input_shm && (regions == nullptr || !SizedShmRef(t.parameters(), &input_ref))) return false;
  int datatype = -1;
  for (int i = 0; i < 3; ++i)
    if (t.datatype() == kDatatypes[i]) datatype = i;
  if (datatype < 0) return false;
  // At most one requested output, "output": plain, or (for an input in shared memory) in shared memory
  // (classification, anything else: the partner's).
  if (r.outputs_size() > 1) return false;
  bool output_shm = false;
  if (r.outputs_size() == 1) {
    if (r.outputs(0).name() != "output") return false;
    output_shm = !r.outputs(0).parameters().empty();
    if (output_shm && (!input_shm || !SizedShmRef(r.outputs(0).parameters(), &output_ref))) return false;
  }
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
  if (input_shm) {
    if (typed != 0 || raw_entries != 0) return false;
    return RegionEligible(spec, static_cast<uint8_t>(datatype), count, {n, c, d, h, w}, input_ref,
                          output_shm ? &output_ref : nullptr, regions, out);
  }
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

std::string RegionTrailer(const Decoded& d) {
  if (!d.output_in_region) return "c" + d.region;  // ipc.REGION_KINDS["cuda"]
  // ipc.WITH_RESULT, then ipc.RESULT "<HQ": the input name's length, the output's offset; the two names
  std::string trailer = "o";
  const uint16_t length = static_cast<uint16_t>(d.region.size());  // a region name is at most 128 bytes
  trailer.append(reinterpret_cast<const char*>(&length), 2);
  trailer.append(reinterpret_cast<const char*>(&d.output_offset), 8);
  return trailer + d.region + d.output_region;
}

void EncodeResponse(const std::string& model_name, const std::string& model_version, const std::string& id,
                    const char* payload, uint64_t n, uint64_t cout, bool typed, inference::ModelInferResponse* out,
                    const std::string* output_region) {
  out->set_model_name(model_name);
  out->set_model_version(model_version);
  out->set_id(id);
  auto* tensor = out->add_outputs();
  tensor->set_name("output");
  tensor->set_datatype("FP32");
  tensor->add_shape(static_cast<int64_t>(n));
  tensor->add_shape(static_cast<int64_t>(cout));
  const size_t bytes = n * cout * 4;
  if (output_region != nullptr) {
    auto& parameters = *tensor->mutable_parameters();
    parameters[kRegionParam].set_string_param(*output_region);
    parameters[kSizeParam].set_int64_param(static_cast<int64_t>(bytes));
  } else if (typed) {
    auto* values = tensor->mutable_contents()->mutable_fp32_contents();
    values->Resize(static_cast<int>(n * cout), 0.0f);
    std::memcpy(values->mutable_data(), payload, bytes);
  } else {
    out->add_raw_output_contents(payload, bytes);
  }
}

}  // namespace voxserve
