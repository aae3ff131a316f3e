// Device-side helpers of the CUDA benchmarks: a random fill (generating GBs of logits on the host
// is slow) and an L2 read-bandwidth probe.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "logitserve/kernels/dtype.h"

namespace logitserve::bench {

// data[i] = normal(0, stddev) of a counter-based hash of (seed, i), rounded to `type`.
cudaError_t FillNormal(kernels::FloatType type, void* data, size_t count, uint64_t seed,
                       float stddev, cudaStream_t stream);

// Reads the `bytes` at `data` `passes` times with 16-byte loads that bypass L1 (ld.global.cg;
// a compiler barrier between passes, so every pass loads again): with a buffer that fits in L2,
// the time per byte is L2's read bandwidth. `sink` (grid-size words) keeps the loads alive.
// bytes: a multiple of 16. (kernels' LaunchReadFloor is the one-pass, L1-cached HBM floor.)
cudaError_t ReadResident(const void* data, size_t bytes, int passes, uint32_t* sink,
                         cudaStream_t stream);

}  // namespace logitserve::bench
