// CopyPool: host threads kept for a rank's lifetime that run one job's output copies at a time
// (RankWorker::Finish splits large outputs over them). Started per job, they cost the job their
// start-up: eight std::threads started with a top-k = 64 job of 8192 rows made its Score 0.42 ms
// slower on the H200 machine (0.77 -> 1.20 ms); kept threads wait on a condition between jobs.
//
// Thread safety: Start and Wait are called by one thread (the rank's worker) at a time, Start only
// when no run is in progress.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

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

  // Runs fn(i) for every i < n (n <= size()) on the pool's threads and returns at once.
  // REQUIRES: no run in progress (the previous Start's Wait has returned).
  void Start(size_t n, std::function<void(size_t)> fn) {
    absl::MutexLock lock(&mu_);
    fn_ = std::move(fn);
    n_ = n;
    running_ = n;
    ++generation_;
  }
  // Until every fn(i) of the last Start has returned.
  void Wait() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](size_t* running) { return *running == 0; }, &running_));
  }

 private:
  void Loop(size_t i) {
    uint64_t seen = 0;
    for (;;) {
      std::function<void(size_t)> fn;
      {
        absl::MutexLock lock(&mu_);
        // A run of n threads is for threads 0 .. n - 1 only; the others wait for a wider one.
        auto ready = [&] { return quit_ || (generation_ != seen && i < n_); };
        mu_.Await(absl::Condition(&ready));
        if (quit_) return;
        seen = generation_;
        fn = fn_;
      }
      fn(i);
      absl::MutexLock lock(&mu_);
      --running_;
    }
  }

  absl::Mutex mu_;
  std::function<void(size_t)> fn_ ABSL_GUARDED_BY(mu_);
  size_t n_ ABSL_GUARDED_BY(mu_) = 0;
  size_t running_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  bool quit_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace logitserve::cuda_internal
