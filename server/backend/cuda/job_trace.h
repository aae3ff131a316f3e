// JobTrace: an opt-in timeline of CudaBackend jobs, for finding where a Score's time goes on the
// GPU machine, where Nsight Systems does not run (Nsight Compute times kernels one at a time, with
// caches flushed, and says nothing about the gaps between them or about the host).
//
// With LOGITSERVE_CUDA_TRACE=N (N >= 1) in the environment, every Nth job run on a thread that
// called JobTrace::Begin is traced: each Mark records the host time and, when given a stream, a
// timing event on it; End prints one line per mark to stderr — host microseconds since Begin and,
// for stream marks, GPU microseconds since the job's first stream mark — so that launch gaps,
// copy latency and host waits can be read off. Unset (the default), Begin returns at once and
// Mark is one thread-local load and a branch.
//
// Thread safety: a trace belongs to the thread that began it (thread-local); marks made on other
// threads (other ranks, copy threads) are not recorded.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <vector>

namespace logitserve::cuda_internal {

class JobTrace {
 public:
  // Starts a trace on this thread if tracing is on and this job is one of every Nth; the events
  // are created here (not while the job runs). `rows` (the job's token rows) heads the printout,
  // with the begin time on the steady clock, so that traces of concurrent jobs line up.
  static void Begin(long rows = -1);
  // Prints the trace begun on this thread, if any, and ends it.
  static void End();
  // A host-side mark; with `stream`, also a timing event recorded on it. `what` must outlive the
  // trace (a string literal).
  static void Mark(const char* what, cudaStream_t stream = nullptr);

 private:
  struct Entry {
    const char* what;
    std::chrono::steady_clock::time_point host;
    cudaEvent_t event;  // nullptr: host mark
  };
  static constexpr int kMaxEntries = 512;
  std::chrono::steady_clock::time_point start_;
  long rows_ = -1;
  std::vector<cudaEvent_t> pool_;
  std::vector<Entry> entries_;
};

}  // namespace logitserve::cuda_internal
