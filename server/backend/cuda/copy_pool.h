// CopyPool: host threads kept for a rank's lifetime that run one job's output copies at a time,
// beside the calling thread (RankWorker::Finish splits large outputs over them). Started per job,
// they cost the job their start-up: eight std::threads started with a top-k = 64 job of 8192 rows
// made its Score 0.42 ms slower on the H200 machine (0.77 -> 1.20 ms); kept threads wait on a
// condition between jobs.
//
// Thread safety: Run is called by one thread (the rank's worker) at a time.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/backend/cuda/watchdog.h"

namespace logitserve::cuda_internal {

class CopyPool {
 public:
  explicit CopyPool(size_t threads) {
    for (size_t i = 0; i < threads; ++i) threads_.emplace_back([this, i] { Loop(i); });
  }
  ~CopyPool() {
    {
      absl::MutexLock lock(&mu_);
      quit_ = true;
    }
    for (std::thread& t : threads_) t.join();
  }
  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;

  size_t size() const { return threads_.size(); }

  // Runs fn(i) for every i < n: fn(1) .. fn(size()) on the pool's threads, fn(0) and any beyond
  // the pool's size on the calling thread; returns when all have. The caller polls for the
  // pool's part (PollUntil: yielding for the first 2 ms, then napping 50 us) instead of blocking
  // on the mutex: the end of a job's copies is its caller's critical path, and a blocked thread
  // wakes tens of microseconds late (a top-k = 64 job of 8192 rows on the H200 machine ended ~80 us
  // after its last device-to-host copy).
  // REQUIRES: no run in progress (one thread calls Run at a time).
  void Run(size_t n, const std::function<void(size_t)>& fn) {
    if (n == 0) return;
    const size_t pooled = std::min(n - 1, threads_.size());
    if (pooled > 0) {
      absl::MutexLock lock(&mu_);
      fn_ = fn;
      n_ = pooled;
      running_.store(pooled, std::memory_order_relaxed);
      ++generation_;
    }
    fn(0);
    for (size_t i = pooled + 1; i < n; ++i) fn(i);
    // No timeout of its own: every share ends (the copy-back's waits have the watchdog's).
    (void)PollUntil(
        [this]() -> absl::StatusOr<bool> { return running_.load(std::memory_order_acquire) == 0; },
        absl::InfiniteDuration(), nullptr, "output copy threads");
  }

 private:
  void Loop(size_t i) {
    uint64_t seen = 0;
    for (;;) {
      std::function<void(size_t)> fn;
      {
        absl::MutexLock lock(&mu_);
        // Pool thread i runs fn(i + 1) of a run of n_ + 1; threads i >= n_ wait for a wider one.
        auto ready = [&] { return quit_ || (generation_ != seen && i < n_); };
        mu_.Await(absl::Condition(&ready));
        if (quit_) return;
        seen = generation_;
        fn = fn_;
      }
      fn(i + 1);
      running_.fetch_sub(1, std::memory_order_release);
    }
  }

  absl::Mutex mu_;
  std::function<void(size_t)> fn_ ABSL_GUARDED_BY(mu_);
  size_t n_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<size_t> running_{0};  // pool threads of the current run still working
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  bool quit_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace logitserve::cuda_internal
