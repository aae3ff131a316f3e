// WorkerPool: a fixed set of threads running tasks from a bounded FIFO queue.
//
// The RPC handlers run on gRPC's threads and must not compute; they hand the backend work to
// this pool and return. A full queue is back-pressure, not a reason to block a gRPC thread:
// TrySubmit fails at once and the caller answers RESOURCE_EXHAUSTED.
//
// Thread safety: TrySubmit may be called from any thread; Stop from one thread at a time. Stop runs
// every task already queued, then joins the workers; after Stop, TrySubmit returns false.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace logitserve {

class WorkerPool {
 public:
  // REQUIRES: threads >= 1, max_queued >= 1.
  WorkerPool(int threads, size_t max_queued);
  ~WorkerPool();  // Stop()
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Queues `task`; false (task dropped) when max_queued tasks are already waiting or after Stop.
  bool TrySubmit(std::function<void()> task);
  // Drains the queue and joins the workers. Idempotent.
  void Stop();

 private:
  void Run();
  bool HasWorkOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t max_queued_;
  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace logitserve
