// The safetensors dtypes that hold the kernels' float types: BF16, F16 and F32. Heads and the
// CLI's input files read and write floats through this one mapping.
//
// Thread safety: pure functions; call them from any thread.
#pragma once

#include <optional>

#include "common/safetensors/safetensors.h"
#include "logitserve/kernels/dtype.h"

namespace logitserve {

// The float type a safetensors dtype stores: F32, BF16, F16; nullopt for every other dtype.
std::optional<kernels::FloatType> FloatTypeFromSafetensors(SafetensorsDType dtype);

// The safetensors dtype storing `type` (the inverse of FloatTypeFromSafetensors).
SafetensorsDType SafetensorsDTypeFromFloatType(kernels::FloatType type);

}  // namespace logitserve
