// Communicator: the collective that combines vocabulary shards.
//
// One Communicator object per rank (shard / device), like one NCCL communicator per device.
// Only all-gather is offered, on purpose: shards exchange their small per-block statistics and
// every rank folds them in global block order, so no reduction order can change bits.
//
// Thread safety: each rank's object is used by one thread at a time; all ranks of a group must
// call the same collectives in the same order (they block until every rank has arrived).
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace logitserve {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Gathers `bytes` bytes from every rank into recv[rank * bytes, (rank + 1) * bytes), on every
  // rank. `send` and `recv` must not overlap.
  virtual absl::Status AllGather(const void* send, void* recv, size_t bytes) = 0;
};

// An in-process group of `size` ranks that meet at a barrier; used by the CPU backend and tests.
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateInProcessCommunicators(int size);

}  // namespace logitserve
