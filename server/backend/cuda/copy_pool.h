// CopyPool: host threads kept for a rank's lifetime that run one job's large host copies at a
// time, beside the calling thread: the output copy-back (RankWorker::Finish) and the staging of
// pageable hidden-state tiles into pinned memory (RankWorker::BeginTile). Started per job,
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
#include <cstring>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/base/thread_name.h"
#include "server/backend/cuda/watchdog.h"

namespace logitserve::cuda_internal {

// A copy of `bytes` bytes from src to dst (host memory).
struct HostCopy {
  void* dst;
  const void* src;
  size_t bytes;
};

// Host copies split over threads: one core copies ~6-10 GB/s (a 16 MB hidden-state tile took
// 2.5-2.9 ms on the H200 machine, longer than the GPU's upload of it), so large copies are cut
// into n equal shares; thread i of n copies bytes [i * share, (i + 1) * share) of the
// concatenated copies.
class SplitCopy {
 public:
  SplitCopy(std::vector<HostCopy> copies, size_t n) : copies_(std::move(copies)) {
    size_t total = 0;
    for (const HostCopy& c : copies_) total += c.bytes;
    share_ = (total + n - 1) / n;
  }
  void Run(size_t i) const {
    const size_t begin = i * share_, end = begin + share_;
    size_t at = 0;
    for (const HostCopy& c : copies_) {
      const size_t lo = std::max(begin, at), hi = std::min(end, at + c.bytes);
      if (lo < hi) {
        std::memcpy(static_cast<uint8_t*>(c.dst) + (lo - at),
                    static_cast<const uint8_t*>(c.src) + (lo - at), hi - lo);
      }
      at += c.bytes;
    }
  }

 private:
  std::vector<HostCopy> copies_;
  size_t share_ = 0;
};

class CopyPool {
 public:
  explicit CopyPool(size_t threads) {
    for (size_t i = 0; i < threads; ++i) {
      threads_.emplace_back([this, i] {
        NameThisThread("ls-copy");
        Loop(i);
      });
    }
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

  // Copies `bytes` from src to dst (host memory) on up to `max_threads` threads (the caller and
  // pool threads), one per `per_thread` bytes; returns when done. `pool` may be null (one thread).
  static void Copy(CopyPool* pool, void* dst, const void* src, size_t bytes, size_t max_threads,
                   size_t per_thread) {
    const size_t most = pool == nullptr ? 1 : std::clamp<size_t>(max_threads, 1, pool->size() + 1);
    const size_t n = std::clamp<size_t>((bytes + per_thread - 1) / per_thread, 1, most);
    if (n == 1) {
      std::memcpy(dst, src, bytes);
      return;
    }
    const SplitCopy split({HostCopy{dst, src, bytes}}, n);
    pool->Run(n, [&split](size_t i) { split.Run(i); });
  }

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
