#include "client/tensor.h"

#include <bit>
#include <cstring>
#include <limits>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/status_macros.h"
#include "common/wire/dtype.h"
#include "logitserve/kernels/dtype.h"

namespace logitserve::client {
namespace {

// The wire format is little-endian; copying host memory is only correct on such a host.
static_assert(std::endian::native == std::endian::little,
              "logitserve assumes a little-endian host");

template <typename T>
v1::Tensor Pack(v1::DataType dtype, std::span<const T> values, const std::vector<int64_t>& shape) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.mutable_data()->assign(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
  return t;
}

// product(shape), or -1 when a dim is negative or the product overflows int64.
int64_t NumElements(const v1::Tensor& t) {
  int64_t n = 1;
  for (int64_t d : t.shape()) {
    if (d < 0) return -1;
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) return -1;
    n *= d;
  }
  return n;
}

}  // namespace

v1::Tensor TensorOf(std::span<const float> values, const std::vector<int64_t>& shape) {
  return Pack(v1::DATA_TYPE_FLOAT32, values, shape);
}

v1::Tensor TensorOf(std::span<const int32_t> values, const std::vector<int64_t>& shape) {
  return Pack(v1::DATA_TYPE_INT32, values, shape);
}

v1::Tensor TensorOf(std::span<const int64_t> values, const std::vector<int64_t>& shape) {
  return Pack(v1::DATA_TYPE_INT64, values, shape);
}

v1::Tensor BFloat16TensorOf(std::span<const float> values, const std::vector<int64_t>& shape) {
  std::vector<uint16_t> bits(values.size());
  for (size_t i = 0; i < values.size(); ++i) bits[i] = kernels::FloatToBFloat16(values[i]);
  return BFloat16TensorFromBits(bits, shape);
}

v1::Tensor BFloat16TensorFromBits(std::span<const uint16_t> bits,
                                  const std::vector<int64_t>& shape) {
  return Pack(v1::DATA_TYPE_BFLOAT16, bits, shape);
}

v1::Tensor Float16TensorFromBits(std::span<const uint16_t> bits,
                                 const std::vector<int64_t>& shape) {
  return Pack(v1::DATA_TYPE_FLOAT16, bits, shape);
}

const char* DTypeName(v1::DataType dtype) {
  switch (dtype) {
    case v1::DATA_TYPE_FLOAT32:
      return "float32";
    case v1::DATA_TYPE_BFLOAT16:
      return "bfloat16";
    case v1::DATA_TYPE_FLOAT16:
      return "float16";
    case v1::DATA_TYPE_INT32:
      return "int32";
    case v1::DATA_TYPE_INT64:
      return "int64";
    default:
      return "unspecified";
  }
}

absl::Status CheckTensor(const v1::Tensor& tensor, absl::string_view field) {
  const int64_t size = wire::DTypeSize(tensor.dtype());
  if (size == 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": dtype is unspecified or unknown"));
  }
  const int64_t n = NumElements(tensor);
  if (n < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": invalid shape [", absl::StrJoin(tensor.shape(), ", "), "]"));
  }
  if (n > std::numeric_limits<int64_t>::max() / size) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": shape [", absl::StrJoin(tensor.shape(), ", "), "] is too large"));
  }
  if (tensor.has_shared_memory()) {  // the server checks the range against the region
    const uint64_t declared = tensor.shared_memory().byte_size();
    if (!tensor.data().empty() || (declared != 0 && declared != static_cast<uint64_t>(n * size))) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": a shared-memory tensor needs empty data and byte_size 0 or ",
                       n * size, " (shape [", absl::StrJoin(tensor.shape(), ", "), "] of ",
                       DTypeName(tensor.dtype()), ")"));
    }
    return absl::OkStatus();
  }
  if (static_cast<int64_t>(tensor.data().size()) != n * size) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", tensor.data().size(), " data bytes do not match shape [",
                     absl::StrJoin(tensor.shape(), ", "), "] of ", DTypeName(tensor.dtype())));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> FloatsOf(const v1::Tensor& tensor) {
  LOGITSERVE_RETURN_IF_ERROR(CheckTensor(tensor, "tensor"));
  if (tensor.has_shared_memory()) {
    return absl::InvalidArgumentError("tensor: its bytes are in shared memory, not in data");
  }
  const std::string& data = tensor.data();
  const int64_t n = static_cast<int64_t>(data.size()) / wire::DTypeSize(tensor.dtype());
  std::vector<float> out(n);
  const std::optional<kernels::FloatType> type = wire::FloatTypeOf(tensor.dtype());
  if (!type.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected a floating-point tensor, got ", DTypeName(tensor.dtype())));
  }
  for (int64_t i = 0; i < n; ++i) out[i] = kernels::LoadAsFloat(*type, data.data(), i);
  return out;
}

absl::StatusOr<std::vector<int64_t>> IntsOf(const v1::Tensor& tensor) {
  LOGITSERVE_RETURN_IF_ERROR(CheckTensor(tensor, "tensor"));
  if (tensor.has_shared_memory()) {
    return absl::InvalidArgumentError("tensor: its bytes are in shared memory, not in data");
  }
  const std::string& data = tensor.data();
  if (tensor.dtype() == v1::DATA_TYPE_INT64) {
    std::vector<int64_t> out(data.size() / 8);
    std::memcpy(out.data(), data.data(), data.size());
    return out;
  }
  if (tensor.dtype() == v1::DATA_TYPE_INT32) {
    std::vector<int32_t> narrow(data.size() / 4);
    std::memcpy(narrow.data(), data.data(), data.size());
    return std::vector<int64_t>(narrow.begin(), narrow.end());
  }
  return absl::InvalidArgumentError(
      absl::StrCat("expected an integer tensor, got ", DTypeName(tensor.dtype())));
}

v1::Tensor SliceRows(const v1::Tensor& tensor, int64_t begin, int64_t end) {
  v1::Tensor out;
  out.set_dtype(tensor.dtype());
  out.add_shape(end - begin);
  int64_t row_elements = 1;
  for (int i = 1; i < tensor.shape_size(); ++i) {
    out.add_shape(tensor.shape(i));
    row_elements *= tensor.shape(i);
  }
  const int64_t row_bytes = row_elements * wire::DTypeSize(tensor.dtype());
  if (tensor.has_shared_memory()) {  // the same bytes, named in place
    v1::SharedMemoryRef* ref = out.mutable_shared_memory();
    ref->set_region(tensor.shared_memory().region());
    ref->set_offset(tensor.shared_memory().offset() + static_cast<uint64_t>(begin * row_bytes));
    ref->set_byte_size(static_cast<uint64_t>((end - begin) * row_bytes));
    return out;
  }
  out.mutable_data()->assign(tensor.data(), begin * row_bytes, (end - begin) * row_bytes);
  return out;
}

}  // namespace logitserve::client
