// Device-side random fill for the CUDA benchmarks (generating GBs of logits on the host is slow).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "logitserve/kernels/dtype.h"

namespace logitserve::bench {

// data[i] = normal(0, stddev) of a counter-based hash of (seed, i), rounded to `type`.
cudaError_t FillNormal(kernels::FloatType type, void* data, size_t count, uint64_t seed,
                       float stddev, cudaStream_t stream);

}  // namespace logitserve::bench
