// HostBarrier: threads of one group (the ranks of a job) meet here. Reusable: a generation
// counter tells rounds apart. Used by the in-process Communicator and by the CUDA backend's
// rank threads.
//
// Thread safety: Wait() is called by exactly `size` threads per round.
#pragma once

#include <cstdint>

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

}  // namespace logitserve
