#include "server/backend/cuda/job_trace.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>

namespace logitserve::cuda_internal {

namespace {

// Every Nth job is traced; 0 = off. Read once.
int TraceEvery() {
  static const int every = [] {
    const char* v = std::getenv("LOGITSERVE_CUDA_TRACE");
    return v == nullptr ? 0 : std::max(0, std::atoi(v));
  }();
  return every;
}

thread_local std::unique_ptr<JobTrace> current;

}  // namespace

void JobTrace::Begin(long rows) {
  const int every = TraceEvery();
  if (every == 0) return;
  static std::atomic<long> jobs{0};
  if (jobs.fetch_add(1) % every != 0) return;
  auto trace = std::make_unique<JobTrace>();
  trace->pool_.resize(kMaxEntries);
  for (cudaEvent_t& e : trace->pool_) {
    if (cudaEventCreate(&e) != cudaSuccess) e = nullptr;
  }
  trace->entries_.reserve(kMaxEntries);
  trace->rows_ = rows;
  trace->start_ = std::chrono::steady_clock::now();
  current = std::move(trace);
}

void JobTrace::Mark(const char* what, cudaStream_t stream) {
  JobTrace* t = current.get();
  if (t == nullptr || t->entries_.size() >= kMaxEntries) return;
  Entry e{what, std::chrono::steady_clock::now(), nullptr};
  if (stream != nullptr) {
    e.event = t->pool_[t->entries_.size()];
    if (e.event != nullptr && cudaEventRecord(e.event, stream) != cudaSuccess) e.event = nullptr;
  }
  t->entries_.push_back(e);
}

void JobTrace::End() {
  std::unique_ptr<JobTrace> t = std::move(current);
  if (t == nullptr) return;
  cudaDeviceSynchronize();
  cudaEvent_t first = nullptr;
  for (const Entry& e : t->entries_) {
    if (e.event != nullptr) {
      first = e.event;
      break;
    }
  }
  const double begun_ms =
      std::chrono::duration<double, std::milli>(t->start_.time_since_epoch()).count();
  std::fprintf(stderr,
               "job trace: %ld rows, begun at %.3f ms (steady clock), %zu marks (host us since "
               "Begin | GPU us since first event)\n",
               t->rows_, begun_ms, t->entries_.size());
  for (const Entry& e : t->entries_) {
    const double host = std::chrono::duration<double, std::micro>(e.host - t->start_).count();
    float gpu_ms = 0;
    if (e.event != nullptr && first != nullptr &&
        cudaEventElapsedTime(&gpu_ms, first, e.event) == cudaSuccess) {
      std::fprintf(stderr, "  %9.1f | %9.1f  %s\n", host, 1000.0 * gpu_ms, e.what);
    } else {
      std::fprintf(stderr, "  %9.1f |            %s\n", host, e.what);
    }
  }
  for (cudaEvent_t e : t->pool_) {
    if (e != nullptr) cudaEventDestroy(e);
  }
}

}  // namespace logitserve::cuda_internal
