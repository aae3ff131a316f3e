// The CPU backend as a BackendFactory, for the suites that test something else against the real
// CPU backend (the scheduler). The backend suites name their backend through TestBackend /
// TestBackends (job_builder.h), which cpu_factories.cc also defines for the CPU programs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tests/kernels/job_builder.h"

namespace logitserve::testing {

// The CPU backend with `threads` threads and the given shard layout (see CpuBackendOptions).
BackendFactory CpuFactory(std::string name, int shards, std::vector<int64_t> shard_weights = {},
                          int threads = 2);

}  // namespace logitserve::testing
