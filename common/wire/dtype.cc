#include "common/wire/dtype.h"

#include "absl/strings/str_cat.h"

namespace logitserve::wire {

int64_t DTypeSize(v1::DType dtype) {
  switch (dtype) {
    case v1::FLOAT32:
    case v1::INT32:
      return 4;
    case v1::BFLOAT16:
    case v1::FLOAT16:
      return 2;
    case v1::INT64:
      return 8;
    default:
      return 0;
  }
}

std::string DTypeName(v1::DType dtype) {
  if (v1::DType_IsValid(dtype)) return v1::DType_Name(dtype);
  return absl::StrCat("unknown dtype ", static_cast<int>(dtype));
}

std::optional<kernels::FloatType> FloatTypeOf(v1::DType dtype) {
  switch (dtype) {
    case v1::FLOAT32:
      return kernels::FloatType::kFloat32;
    case v1::BFLOAT16:
      return kernels::FloatType::kBFloat16;
    case v1::FLOAT16:
      return kernels::FloatType::kFloat16;
    default:
      return std::nullopt;
  }
}

v1::DType DTypeOf(kernels::FloatType type) {
  switch (type) {
    case kernels::FloatType::kBFloat16:
      return v1::BFLOAT16;
    case kernels::FloatType::kFloat16:
      return v1::FLOAT16;
    case kernels::FloatType::kFloat32:
      break;
  }
  return v1::FLOAT32;
}

bool IsIndexDType(v1::DType dtype) { return dtype == v1::INT32 || dtype == v1::INT64; }

}  // namespace logitserve::wire
