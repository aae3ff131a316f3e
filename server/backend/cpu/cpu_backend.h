// CpuBackend: the always-built Backend. The vocabulary is split into `shards` ranks, each a host
// thread with OpenMP workers over its blocks, combined through the in-process Communicator, with
// the same block structure (and fold order) as the CUDA backend; see cpu_backend.cc.
//
// Thread safety: as Backend (PrepareHead and Score from any thread, concurrently).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "server/backend/backend.h"

namespace logitserve {

// The precision of hidden mode's GEMM (cpu_tile_gemm.h): kAuto runs bf16 operands (exact bf16
// parts, fp32 accumulation) where oneDNN has native bf16 matmuls (AVX512-BF16), fp32 elsewhere;
// kFp32 always fp32 (tests and benchmarks compare the two on one machine).
enum class CpuGemm { kAuto, kFp32 };

struct CpuBackendOptions {
  int threads = 0;  // 0 = all hardware threads
  int shards = 1;   // vocabulary shards combined through the in-process Communicator
  // Explicit shard sizes in blocks of kVocabBlock (tests: uneven / empty shards); empty = even.
  std::vector<int64_t> shard_weights;
  CpuGemm gemm = CpuGemm::kAuto;
};

// INVALID_ARGUMENT for shards < 1 or shard_weights of the wrong length or with a negative entry.
absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(const CpuBackendOptions& options);

}  // namespace logitserve
