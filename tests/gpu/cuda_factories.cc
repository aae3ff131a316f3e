#include "tests/gpu/cuda_factories.h"

#include <utility>

#include "server/backend/cuda/cuda_backend.h"
#include "tests/gpu/gpu_test_env.h"

namespace logitserve::testing {

BackendFactory CudaFactory(std::string name, int shards, std::vector<int64_t> shard_weights,
                           int /*threads*/) {
  if (name.rfind("cpu", 0) == 0) name = "cuda" + name.substr(3);
  return BackendFactory{std::move(name), [shards, shard_weights]() {
                          CudaBackendOptions options;
                          // Hidden mode through the tiles at every hidden size: the suites
                          // compare layouts bit for bit (the fused kernel has its own tests).
                          options.hidden_fused_max_hidden = 0;
                          options.shards = shards;
                          options.shard_weights = shard_weights;
                          if (VisibleCudaDevices() >= shards) {
                            for (int d = 0; d < shards; ++d) options.devices.push_back(d);
                          } else {
                            options.devices = {0};
                          }
                          return CreateCudaBackend(options);
                        }};
}

BackendFactory TestBackend(std::string name, int shards, std::vector<int64_t> shard_weights,
                           int threads) {
  return CudaFactory("cuda_" + name, shards, std::move(shard_weights), threads);
}

std::vector<BackendFactory> TestBackends() { return CudaShardConfigs(); }

std::vector<BackendFactory> CudaShardConfigs() {
  return {
      CudaFactory("cuda_1shard", 1, {}, 0),
      CudaFactory("cuda_2shards", 2, {}, 0),
      CudaFactory("cuda_3shards", 3, {}, 0),
      CudaFactory("cuda_uneven_1_3", 2, {1, 3}, 0),
      CudaFactory("cuda_empty_1_0_2", 3, {1, 0, 2}, 0),
      // Trailing empty shards: MakeShardLayout clamps them to [V, V), which is not a block
      // boundary when V % kVocabBlock != 0; the real last block must stay with its owner.
      CudaFactory("cuda_trailing_empty_1_0", 2, {1, 0}, 0),
      CudaFactory("cuda_trailing_empty_2_1_0", 3, {2, 1, 0}, 0),
  };
}

BackendFactory CudaDevicesFactory(std::string name, std::vector<int> devices) {
  return BackendFactory{std::move(name), [devices]() {
                          CudaBackendOptions options;
                          options.hidden_fused_max_hidden = 0;
                          options.devices = devices;
                          return CreateCudaBackend(options);
                        }};
}

}  // namespace logitserve::testing
