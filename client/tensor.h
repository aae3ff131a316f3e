// Builders and readers for logitserve.v1.Tensor, so callers never hand-pack bytes.
//
// A Tensor is row-major, little-endian raw bytes with an explicit dtype and shape. The builders
// copy `values` as given and record `shape` without checking it against values.size(): the server
// (and Client::Score's request splitting) reject an inconsistent tensor with INVALID_ARGUMENT
// naming the field, and CheckTensor below lets a caller check first.
//
// Thread safety: free functions without shared state.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "logitserve/v1/logitserve.pb.h"

namespace logitserve::client {

// FLOAT32 tensor holding `values` exactly.
v1::Tensor TensorOf(std::span<const float> values, const std::vector<int64_t>& shape);
// INT32 / INT64 tensors (target ids).
v1::Tensor TensorOf(std::span<const int32_t> values, const std::vector<int64_t>& shape);
v1::Tensor TensorOf(std::span<const int64_t> values, const std::vector<int64_t>& shape);
// BFLOAT16 tensor of `values` rounded to nearest-even (the rounding PyTorch's .bfloat16() does).
v1::Tensor BFloat16TensorOf(std::span<const float> values, const std::vector<int64_t>& shape);
// BFLOAT16 / FLOAT16 tensors from raw 16-bit patterns (values already in that format).
v1::Tensor BFloat16TensorFromBits(std::span<const uint16_t> bits,
                                  const std::vector<int64_t>& shape);
v1::Tensor Float16TensorFromBits(std::span<const uint16_t> bits, const std::vector<int64_t>& shape);

// "float32", "bfloat16", "float16", "int32", "int64" (or "unspecified").
const char* DTypeName(v1::DataType dtype);

// OK when every dim is >= 0, the dtype is known and len(data) == product(shape) * size(dtype);
// for a tensor naming shared memory: data empty and byte_size 0 or that product (the server
// checks the range against its region). `field` names the tensor in the error message.
absl::Status CheckTensor(const v1::Tensor& tensor, absl::string_view field);

// The elements of a floating-point tensor converted exactly to fp32 (bf16 and fp16 upcast
// exactly). Fails on integer dtypes or an inconsistent tensor.
absl::StatusOr<std::vector<float>> FloatsOf(const v1::Tensor& tensor);

// The elements of an INT32 / INT64 tensor as int64. Fails on float dtypes or an inconsistent
// tensor.
absl::StatusOr<std::vector<int64_t>> IntsOf(const v1::Tensor& tensor);

// Rows [begin, end) of a tensor along its first dimension (a copy; for a shared-memory tensor,
// the same region with the offset and byte_size of those rows). REQUIRES: CheckTensor(t) is OK,
// t has rank >= 1 and 0 <= begin <= end <= t.shape(0).
v1::Tensor SliceRows(const v1::Tensor& tensor, int64_t begin, int64_t end);

}  // namespace logitserve::client
