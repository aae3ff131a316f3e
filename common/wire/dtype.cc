#include "common/wire/dtype.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace logitserve::wire {

int64_t DTypeSize(v1::DataType dtype) {
  switch (dtype) {
    case v1::DATA_TYPE_FLOAT32:
    case v1::DATA_TYPE_INT32:
      return 4;
    case v1::DATA_TYPE_BFLOAT16:
    case v1::DATA_TYPE_FLOAT16:
      return 2;
    case v1::DATA_TYPE_INT64:
      return 8;
    default:
      return 0;
  }
}

std::string DTypeName(v1::DataType dtype) {
  if (v1::DataType_IsValid(dtype)) {
    std::string name = v1::DataType_Name(dtype);
    constexpr absl::string_view kPrefix = "DATA_TYPE_";
    return absl::StartsWith(name, kPrefix) ? name.substr(kPrefix.size()) : name;
  }
  return absl::StrCat("unknown dtype ", static_cast<int>(dtype));
}

std::optional<kernels::FloatType> FloatTypeOf(v1::DataType dtype) {
  switch (dtype) {
    case v1::DATA_TYPE_FLOAT32:
      return kernels::FloatType::kFloat32;
    case v1::DATA_TYPE_BFLOAT16:
      return kernels::FloatType::kBFloat16;
    case v1::DATA_TYPE_FLOAT16:
      return kernels::FloatType::kFloat16;
    default:
      return std::nullopt;
  }
}

v1::DataType DTypeOf(kernels::FloatType type) {
  switch (type) {
    case kernels::FloatType::kBFloat16:
      return v1::DATA_TYPE_BFLOAT16;
    case kernels::FloatType::kFloat16:
      return v1::DATA_TYPE_FLOAT16;
    case kernels::FloatType::kFloat32:
      break;
  }
  return v1::DATA_TYPE_FLOAT32;
}

bool IsIndexDType(v1::DataType dtype) {
  return dtype == v1::DATA_TYPE_INT32 || dtype == v1::DATA_TYPE_INT64;
}

}  // namespace logitserve::wire
