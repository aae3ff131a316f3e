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

struct CpuBackendOptions {
  int threads = 0;  // 0 = all hardware threads
  int shards = 1;   // vocabulary shards combined through the in-process Communicator
  // Explicit shard sizes in blocks of kVocabBlock (tests: uneven / empty shards); empty = even.
  std::vector<int64_t> shard_weights;
};

// INVALID_ARGUMENT for shards < 1 or shard_weights of the wrong length or with a negative entry.
absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(const CpuBackendOptions& options);

}  // namespace logitserve
