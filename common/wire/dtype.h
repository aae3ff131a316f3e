// The element types of a wire Tensor (logitserve.v1.DataType): their sizes, their names in error
// messages, and how the three float types map to the kernels' FloatType. The service's
// validation, the client library and the tests all read tensors through these, so the wire
// contract's "byte length = product(shape) x size" has one definition.
//
// A DataType read from a message may hold any integer (proto3 enums are open): every function
// accepts such values and treats them as unsupported.
//
// Thread safety: pure functions; call them from any thread.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "logitserve/kernels/dtype.h"
#include "logitserve/v1/logitserve.pb.h"

namespace logitserve::wire {

// Bytes per element: 4 for FLOAT32 / INT32, 2 for BFLOAT16 / FLOAT16, 8 for INT64; 0 for
// DATA_TYPE_UNSPECIFIED or a value outside the enum.
int64_t DTypeSize(v1::DataType dtype);

// The enum value's name without its DATA_TYPE_ prefix ("FLOAT32", "UNSPECIFIED", ...), or
// "unknown dtype N" for a value outside the enum.
std::string DTypeName(v1::DataType dtype);

// FLOAT32, BFLOAT16, FLOAT16 as the kernels' float type; nullopt for every other value.
std::optional<kernels::FloatType> FloatTypeOf(v1::DataType dtype);

// The wire dtype carrying `type` (the inverse of FloatTypeOf).
v1::DataType DTypeOf(kernels::FloatType type);

// INT32 or INT64: the dtypes of target ids.
bool IsIndexDType(v1::DataType dtype);

}  // namespace logitserve::wire
