#include "common/safetensors/float_type.h"

namespace logitserve {

std::optional<kernels::FloatType> FloatTypeFromSafetensors(SafetensorsDType dtype) {
  switch (dtype) {
    case SafetensorsDType::kFloat32:
      return kernels::FloatType::kFloat32;
    case SafetensorsDType::kBFloat16:
      return kernels::FloatType::kBFloat16;
    case SafetensorsDType::kFloat16:
      return kernels::FloatType::kFloat16;
    default:
      return std::nullopt;
  }
}

SafetensorsDType SafetensorsDTypeFromFloatType(kernels::FloatType type) {
  switch (type) {
    case kernels::FloatType::kBFloat16:
      return SafetensorsDType::kBFloat16;
    case kernels::FloatType::kFloat16:
      return SafetensorsDType::kFloat16;
    case kernels::FloatType::kFloat32:
      break;
  }
  return SafetensorsDType::kFloat32;
}

}  // namespace logitserve
