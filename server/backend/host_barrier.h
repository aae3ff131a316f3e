// HostBarrier: threads of one group (the ranks of a job) meet here. Reusable: a generation
// counter tells rounds apart. Used by the in-process Communicator and by the CUDA backend's
// rank threads.
//
// Thread safety: Wait() is called by exactly `size` threads per round.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace logitserve {

class HostBarrier {
 public:
  explicit HostBarrier(int size) : size_(size) {}
  // Blocks until all `size` threads of this round have arrived.
  void Wait() {
    absl::MutexLock lock(&mu_);
    const uint64_t gen = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      cv_.SignalAll();
      return;
    }
    while (generation_ == gen) cv_.Wait(&mu_);
  }
  int size() const { return size_; }

 private:
  const int size_;
  absl::Mutex mu_;
  absl::CondVar cv_;
  int arrived_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
};

// HostExchange: a group's barrier plus one published (pointer, bytes) slot per rank: a rank
// deposits its send buffer, all meet at the barrier, every rank reads every slot, and all meet
// again before any buffer is reused. Behind the in-process Communicator and the CUDA backend's
// device-copy fallback.
//
// Thread safety: Deposit / Slot from any rank thread; Wait as HostBarrier::Wait.
class HostExchange {
 public:
  explicit HostExchange(int size) : barrier_(size), slots_(static_cast<size_t>(size)) {}
  int size() const { return barrier_.size(); }
  // Blocks until all ranks of this round have arrived.
  void Wait() { barrier_.Wait(); }
  void Deposit(int rank, const void* data, size_t bytes) {
    absl::MutexLock lock(&mu_);
    slots_[static_cast<size_t>(rank)] = {data, bytes};
  }
  std::pair<const void*, size_t> Slot(int rank) {
    absl::MutexLock lock(&mu_);
    return slots_[static_cast<size_t>(rank)];
  }

 private:
  HostBarrier barrier_;
  absl::Mutex mu_;
  std::vector<std::pair<const void*, size_t>> slots_ ABSL_GUARDED_BY(mu_);
};

}  // namespace logitserve
