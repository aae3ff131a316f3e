// Builders for logitserve.v1.Tensor in tests, independent of the client library (which has its
// own tests) so that service tests do not trust the code they might be checking against, and the
// seeded random values the end-to-end suites fill them with.
//
// Thread safety: free functions without shared state.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "logitserve/v1/logitserve.pb.h"

namespace logitserve::testing {

// A FLOAT32 / BFLOAT16 / FLOAT16 tensor of `values`, rounded to nearest-even for 16-bit types.
// The shape is recorded as given, not checked against values.size().
v1::Tensor FloatTensor(v1::DataType dtype, std::span<const float> values,
                       const std::vector<int64_t>& shape);
// The same values as `values` would hold after FloatTensor's rounding, as fp32 (exact).
std::vector<float> RoundedTo(v1::DataType dtype, std::span<const float> values);
// An INT32 / INT64 tensor of `ids` (truncated to 32 bits for INT32).
v1::Tensor IdTensor(v1::DataType dtype, std::span<const int64_t> ids,
                    const std::vector<int64_t>& shape);

// `n` values drawn from N(0, stddev^2) by std::mt19937 seeded with `seed` (deterministic).
std::vector<float> Normal(int64_t n, uint32_t seed, float stddev = 1.0f);
// `n` ids drawn uniformly from [0, vocab) by std::mt19937 seeded with `seed` (deterministic).
std::vector<int64_t> RandomIds(int64_t n, int64_t vocab, uint32_t seed);

}  // namespace logitserve::testing
