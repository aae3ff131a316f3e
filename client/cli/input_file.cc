#include "client/cli/input_file.h"

#include <cmath>
#include <cstring>
#include <map>
#include <numbers>
#include <optional>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/status_macros.h"
#include "common/safetensors/float_type.h"
#include "common/safetensors/safetensors.h"
#include "common/wire/dtype.h"
#include "logitserve/kernels/dtype.h"

namespace logitserve::client {
namespace {

// The wire dtype of a safetensors dtype the wire carries (F32, BF16, F16, I32, I64).
std::optional<v1::DataType> WireDType(SafetensorsDType dtype) {
  if (const std::optional<kernels::FloatType> t = FloatTypeFromSafetensors(dtype)) {
    return wire::DTypeOf(*t);
  }
  if (dtype == SafetensorsDType::kInt32) return v1::DATA_TYPE_INT32;
  if (dtype == SafetensorsDType::kInt64) return v1::DATA_TYPE_INT64;
  return std::nullopt;
}

// Copies tensor `name` of `file` into `out` after checking dtype class and rank.
absl::Status CopyTensor(const SafetensorsFile& file, const std::string& name, bool integer,
                        int min_rank, int max_rank, v1::Tensor& out) {
  const SafetensorsTensor* t = file.Find(name);
  const std::optional<v1::DataType> dtype = WireDType(t->dtype);
  if (!dtype.has_value() || wire::IsIndexDType(*dtype) != integer) {
    return absl::InvalidArgumentError(absl::StrCat(file.path(), ": tensor '", name, "' has dtype ",
                                                   SafetensorsDTypeName(t->dtype), "; expected ",
                                                   integer ? "I32 or I64" : "F32, BF16 or F16"));
  }
  const int rank = static_cast<int>(t->shape.size());
  if (rank < min_rank || rank > max_rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(file.path(), ": tensor '", name, "' has shape [",
                     absl::StrJoin(t->shape, ", "), "]; expected ",
                     min_rank == max_rank ? absl::StrCat("rank ", min_rank)
                                          : absl::StrCat("rank ", min_rank, " or ", max_rank),
                     name == "target_ids" ? " ([N] or [N, K])" : " ([N, columns])"));
  }
  out.set_dtype(*dtype);
  for (int64_t d : t->shape) out.add_shape(d);
  out.mutable_data()->assign(reinterpret_cast<const char*>(t->data), t->bytes);
  return absl::OkStatus();
}

// Box-Muller on 53-bit uniforms from mt19937_64 (whose output sequence the C++ standard fixes,
// unlike std::normal_distribution's algorithm).
class NormalGenerator {
 public:
  explicit NormalGenerator(uint64_t seed) : engine_(seed) {}
  double Next() {
    const double u1 = static_cast<double>((engine_() >> 11) + 1) * 0x1.0p-53;  // (0, 1]
    const double u2 = static_cast<double>(engine_() >> 11) * 0x1.0p-53;        // [0, 1)
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }
  uint64_t NextBits() { return engine_(); }

 private:
  std::mt19937_64 engine_;
};

}  // namespace

absl::StatusOr<ScoreInput> LoadScoreInput(const std::string& path) {
  LOGITSERVE_ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(path));
  const bool has_hidden = file.Find("hidden") != nullptr;
  const bool has_logits = file.Find("logits") != nullptr;
  if (has_hidden == has_logits) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": needs exactly one of the tensors 'hidden' [N, H] or 'logits' [N, V]; it has ",
        has_hidden
            ? "both"
            : absl::StrCat("neither (tensors: ", absl::StrJoin(file.tensor_names(), ", "), ")")));
  }
  if (file.Find("reference_hidden") != nullptr && file.Find("reference_logits") != nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": has both 'reference_hidden' and 'reference_logits'; keep one"));
  }
  ScoreInput input;
  v1::ScoreRequest& r = input.request;
  const std::string model = has_hidden ? "hidden" : "logits";
  if (absl::Status s = CopyTensor(file, model, false, 2, 2,
                                  has_hidden ? *r.mutable_hidden() : *r.mutable_logits());
      !s.ok()) {
    return s;
  }
  const int64_t rows = file.Find(model)->shape[0];
  for (const std::string& name : file.tensor_names()) {
    v1::Tensor* dst = nullptr;
    bool integer = false;
    int min_rank = 2;
    if (name == model) continue;
    if (name == "reference_hidden") {
      dst = r.mutable_reference_hidden();
    } else if (name == "reference_logits") {
      dst = r.mutable_reference_logits();
    } else if (name == "target_ids") {
      dst = r.mutable_target_ids();
      integer = true;
      min_rank = 1;
    } else {
      input.ignored_tensors.push_back(name);
      continue;
    }
    LOGITSERVE_RETURN_IF_ERROR(CopyTensor(file, name, integer, min_rank, 2, *dst));
    if (dst->shape(0) != rows) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ": tensor '", name, "' has ", dst->shape(0), " rows but '", model, "' has ", rows));
    }
  }
  return input;
}

absl::Status WriteDemoInput(const MakeInputOptions& o) {
  if (o.output.empty()) return absl::InvalidArgumentError("make-input: --output is required");
  if (o.rows < 0 || o.hidden_size < 1 || o.vocab < 1 || o.targets_per_row < 0 ||
      o.reference_hidden_size < 0 || !(o.scale >= 0.0)) {
    return absl::InvalidArgumentError(
        "make-input: need rows >= 0, hidden size >= 1, vocab >= 1, targets per row >= 0, "
        "scale >= 0");
  }
  const std::optional<kernels::FloatType> float_type = wire::FloatTypeOf(o.dtype);
  if (!float_type.has_value()) {
    return absl::InvalidArgumentError("make-input: dtype must be f32, bf16 or f16");
  }
  if (o.vocab > (int64_t{1} << 31) - 1) {
    return absl::InvalidArgumentError("make-input: vocab must fit in int32 ids");
  }
  NormalGenerator gen(o.seed);
  // Tensor bytes must outlive WriteSafetensors; one buffer per tensor, never reallocated.
  std::vector<std::vector<uint8_t>> buffers;
  buffers.reserve(3);
  std::vector<SafetensorsTensorToWrite> tensors;
  const SafetensorsDType file_dtype = SafetensorsDTypeFromFloatType(*float_type);
  auto add_floats = [&](const std::string& name, int64_t cols) {
    std::vector<uint8_t>& bytes = buffers.emplace_back();
    const int64_t n = o.rows * cols;
    bytes.resize(n * kernels::SizeOf(*float_type));
    for (int64_t i = 0; i < n; ++i) {
      const float v = static_cast<float>(o.scale * gen.Next());
      switch (*float_type) {
        case kernels::FloatType::kFloat32:
          std::memcpy(bytes.data() + 4 * i, &v, 4);
          break;
        case kernels::FloatType::kBFloat16: {
          const uint16_t b = kernels::FloatToBFloat16(v);
          std::memcpy(bytes.data() + 2 * i, &b, 2);
          break;
        }
        case kernels::FloatType::kFloat16: {
          const uint16_t h = kernels::FloatToFloat16(v);
          std::memcpy(bytes.data() + 2 * i, &h, 2);
          break;
        }
      }
    }
    tensors.push_back({name, file_dtype, {o.rows, cols}, bytes});
  };
  add_floats(o.logits ? "logits" : "hidden", o.logits ? o.vocab : o.hidden_size);
  if (o.reference) {
    add_floats(o.logits ? "reference_logits" : "reference_hidden",
               o.logits ? o.vocab
                        : (o.reference_hidden_size > 0 ? o.reference_hidden_size : o.hidden_size));
  }
  if (o.targets_per_row > 0) {
    std::vector<uint8_t>& bytes = buffers.emplace_back(o.rows * o.targets_per_row * 4);
    for (int64_t i = 0; i < o.rows * o.targets_per_row; ++i) {
      const int32_t id = static_cast<int32_t>(gen.NextBits() % static_cast<uint64_t>(o.vocab));
      std::memcpy(bytes.data() + 4 * i, &id, 4);
    }
    std::vector<int64_t> shape = {o.rows};
    if (o.targets_per_row > 1) shape.push_back(o.targets_per_row);
    tensors.push_back({"target_ids", SafetensorsDType::kInt32, shape, bytes});
  }
  const std::map<std::string, std::string> metadata = {{"generator", "logitserve-cli make-input"},
                                                       {"seed", absl::StrCat(o.seed)},
                                                       {"vocab", absl::StrCat(o.vocab)},
                                                       {"scale", absl::StrCat(o.scale)}};
  return WriteSafetensors(o.output, tensors, metadata);
}

}  // namespace logitserve::client
