// CUDA backend configurations for the backend suites (tests/kernels/job_builder.h BackendFactory).
//
// The suites of tests/kernels (conformance, edge cases, determinism) name their backends through
// TestBackend / TestBackends (job_builder.h); cuda_factories.cc defines those for CudaBackend
// (TestBackend(name, ...) is CudaFactory("cuda_" + name, ...), TestBackends() CudaShardConfigs()),
// so the CUDA programs link the same suite sources unchanged.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tests/kernels/job_builder.h"

namespace logitserve::testing {

// `shards` vocabulary shards: one per GPU when that many are visible (NCCL), else all on GPU 0
// (device-copy exchange). A leading "cpu" in `name` becomes "cuda". `threads` is ignored.
BackendFactory CudaFactory(std::string name, int shards, std::vector<int64_t> shard_weights,
                           int threads);

// The CPU suites' layouts: one shard, two, three, uneven {1, 3}, {1, 0, 2} (empty middle), and
// trailing empty shards {1, 0} and {2, 1, 0}.
std::vector<BackendFactory> CudaShardConfigs();

// The backend on exactly these devices with one shard each (NCCL across them).
BackendFactory CudaDevicesFactory(std::string name, std::vector<int> devices);

}  // namespace logitserve::testing
