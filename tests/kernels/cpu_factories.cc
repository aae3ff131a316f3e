// The CPU backend configurations the backend suites sweep (see job_builder.h).
#include <utility>

#include "tests/kernels/job_builder.h"

namespace logitserve::testing {

BackendFactory CpuFactory(std::string name, int shards, std::vector<int64_t> shard_weights,
                          int threads) {
  CpuBackendOptions options;
  options.threads = threads;
  options.shards = shards;
  options.shard_weights = std::move(shard_weights);
  return BackendFactory{std::move(name), [options]() { return CreateCpuBackend(options); }};
}

std::vector<BackendFactory> CpuShardConfigs() {
  return {
      CpuFactory("cpu_1shard", 1),
      CpuFactory("cpu_2shards", 2),
      CpuFactory("cpu_3shards", 3),
      CpuFactory("cpu_uneven_1_3", 2, {1, 3}),
      CpuFactory("cpu_empty_1_0_2", 3, {1, 0, 2}),
  };
}

}  // namespace logitserve::testing
