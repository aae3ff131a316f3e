// CudaHead: a head as CudaBackend::PrepareHead leaves it on the devices. Immutable once prepared;
// shared by the jobs that use it (PreparedHead's contract).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "server/backend/cuda/cuda_tile_gemm.h"
#include "server/backend/cuda/device_resources.h"
#include "server/heads/prepared_head.h"

namespace logitserve::cuda_internal {

namespace k = kernels;
namespace kc = kernels::cuda;

// A head resident on the backend's devices: each rank's vocabulary slice, split into exact bf16
// parts (1 for bf16 heads, 2 for fp16, 3 for fp32: values never change), padded with zero rows to
// whole GEMM chunks and with zero columns to a hidden size that is a multiple of 8, plus the bias.
class CudaHead final : public PreparedHead {
 public:
  struct Shard {
    int64_t begin = 0;  // vocabulary ids [begin, end)
    int64_t end = 0;
    int64_t padded_rows = 0;  // end - begin rounded up to kCudaVocabChunk
    DeviceBuffer weights;     // parts x [padded_rows][k_pad] bf16
    DeviceBuffer bias;        // [padded_rows] fp32, or empty
    std::shared_ptr<const CudaTileGemm> gemm;
  };

  CudaHead(std::shared_ptr<const HeadWeights> w, const void* owner)
      : PreparedHead(std::move(w)), owner(owner) {}

  const uint16_t* Part(int rank, int part) const {
    const Shard& s = shards[static_cast<size_t>(rank)];
    return s.weights.as<uint16_t>(static_cast<size_t>(part) * static_cast<size_t>(s.padded_rows) *
                                  static_cast<size_t>(k_pad) * sizeof(uint16_t));
  }

  const void* owner;  // the backend that prepared it
  int64_t k_pad = 0;
  int parts = 1;
  std::vector<Shard> shards;  // one per rank
};

}  // namespace logitserve::cuda_internal
