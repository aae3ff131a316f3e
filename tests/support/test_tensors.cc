#include "tests/support/test_tensors.h"

#include <cstring>
#include <random>
#include <string>

#include "logitserve/kernels/dtype.h"

namespace logitserve::testing {

namespace {

template <typename T>
void Append(std::string* bytes, T value) {
  char raw[sizeof(T)];
  std::memcpy(raw, &value, sizeof(T));
  bytes->append(raw, sizeof(T));
}

}  // namespace

v1::Tensor FloatTensor(v1::DataType dtype, std::span<const float> values,
                       const std::vector<int64_t>& shape) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  std::string* bytes = t.mutable_data();
  for (float v : values) {
    switch (dtype) {
      case v1::DATA_TYPE_BFLOAT16:
        Append(bytes, kernels::FloatToBFloat16(v));
        break;
      case v1::DATA_TYPE_FLOAT16:
        Append(bytes, kernels::FloatToFloat16(v));
        break;
      default:
        Append(bytes, v);
        break;
    }
  }
  return t;
}

std::vector<float> RoundedTo(v1::DataType dtype, std::span<const float> values) {
  std::vector<float> out;
  out.reserve(values.size());
  for (float v : values) {
    switch (dtype) {
      case v1::DATA_TYPE_BFLOAT16:
        out.push_back(kernels::BFloat16ToFloat(kernels::FloatToBFloat16(v)));
        break;
      case v1::DATA_TYPE_FLOAT16:
        out.push_back(kernels::Float16ToFloat(kernels::FloatToFloat16(v)));
        break;
      default:
        out.push_back(v);
        break;
    }
  }
  return out;
}

v1::Tensor IdTensor(v1::DataType dtype, std::span<const int64_t> ids,
                    const std::vector<int64_t>& shape) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  std::string* bytes = t.mutable_data();
  for (int64_t id : ids) {
    if (dtype == v1::DATA_TYPE_INT64) {
      Append(bytes, id);
    } else {
      Append(bytes, static_cast<int32_t>(id));
    }
  }
  return t;
}

std::vector<float> Normal(int64_t n, uint32_t seed, float stddev) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(rng);
  return v;
}

std::vector<int64_t> RandomIds(int64_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int64_t> dist(0, vocab - 1);
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t& x : v) x = dist(rng);
  return v;
}

}  // namespace logitserve::testing
