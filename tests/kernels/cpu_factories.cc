// The CPU backend configurations: CpuFactory, and the link-time TestBackend / TestBackends of
// job_builder.h for the programs that run the backend suites against CpuBackend.
#include "tests/kernels/cpu_factories.h"

#include <utility>

#include "server/backend/cpu/cpu_backend.h"

namespace logitserve::testing {

BackendFactory CpuFactory(std::string name, int shards, std::vector<int64_t> shard_weights,
                          int threads) {
  CpuBackendOptions options;
  options.threads = threads;
  options.shards = shards;
  options.shard_weights = std::move(shard_weights);
  return BackendFactory{std::move(name), [options]() { return CreateCpuBackend(options); }};
}

BackendFactory TestBackend(std::string name, int shards, std::vector<int64_t> shard_weights,
                           int threads) {
  return CpuFactory("cpu_" + name, shards, std::move(shard_weights), threads);
}

std::vector<BackendFactory> TestBackends() {
  return {
      TestBackend("1shard", 1),
      TestBackend("2shards", 2),
      TestBackend("3shards", 3),
      TestBackend("uneven_1_3", 2, {1, 3}),
      TestBackend("empty_1_0_2", 3, {1, 0, 2}),
  };
}

}  // namespace logitserve::testing
