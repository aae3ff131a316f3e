// Scheduler: the token-budget dynamic batcher between the RPC handlers and the backend.
//
// Handlers validate a request and Submit it; admission is decided at once (a bounded queue and a
// budget of request bytes in flight: over either → RESOURCE_EXHAUSTED, after Stop → UNAVAILABLE),
// so overload is refused early instead of growing memory. Worker threads take the oldest queued
// request plus every later queued request that may share its batch (batch.h: same heads and
// versions, same options), up to max_batch_tokens rows, optionally waiting up to max_queue_delay
// for more, merge them into one backend job and split the result back. Results are bitwise the
// same as the request computed alone (batch.h says why).
//
// Cancellation and deadlines: each item's `stop` is checked when its batch is formed (a stopped
// item is never launched) and, through the merged job's stop callback, before every row tile: a
// batch stops once every member has stopped. A member that stopped while its batch ran gets its
// own stop status, not the results.
//
// Failures: an INVALID_ARGUMENT from a merged job (NaN / +inf logits of one member) is retried
// member by member, so only the bad request fails and its message names its own row. After any
// failure the backend's Health() is consulted; a fatal device error fails every later item with
// UNAVAILABLE and is reported once through SchedulerHooks::on_fatal.
//
// Thread safety: Submit from any thread; Stop from one thread. `done` callbacks run on worker
// threads, exactly once per admitted item, never under the scheduler's lock.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/backend/backend.h"
#include "server/scheduler/batch.h"

namespace logitserve {

struct SchedulerOptions {
  int workers = 1;          // batches computed concurrently
  size_t queue_size = 256;  // items waiting before RESOURCE_EXHAUSTED
  // Most rows in one merged batch; a larger request still runs, alone. 0 = never co-batch.
  int64_t max_batch_tokens = 8192;
  // How long the oldest queued item may wait for more rows to fill its batch (0 = take what is
  // queued now; under load, requests that arrive while a batch runs are batched anyway).
  std::chrono::microseconds max_queue_delay{0};
  // After computing a batch, how long a worker looks for the next request without sleeping (a
  // closed-loop client's next call usually comes within tens of microseconds; a condition
  // variable's wake-up costs about as much on an idle machine). 0 = sleep at once.
  std::chrono::microseconds idle_spin{0};
  // Budget of request bytes (inputs + outputs, see ItemBytes) admitted and not yet done, plus
  // bytes held past done (AddHeldBytes); 0 = unlimited.
  int64_t memory_budget_bytes = 0;
};

// Observers (each may be empty), called from any thread: the service feeds them to its metrics.
// on_queue_depth runs under the scheduler's lock (so reports keep queue order): it must be cheap
// and must not call back into the scheduler.
struct SchedulerHooks {
  std::function<void(int64_t requests, int64_t rows)> on_batch;
  std::function<void(int64_t depth)> on_queue_depth;
  // Called once, from a worker, when the backend reports a fatal device error.
  std::function<void(const absl::Status&)> on_fatal;
};

class Scheduler {
 public:
  using Clock = std::chrono::steady_clock;
  struct Timing {
    Clock::time_point enqueued;
    Clock::time_point started;  // the batch began computing (or the item was refused)
    Clock::time_point finished;
    int64_t batch_requests = 0;  // members of the batch the item ran in
    int64_t batch_rows = 0;
  };
  // `job` is the item's own job (still valid: the caller's views into the request included).
  using Done = std::function<void(absl::Status status, ScoreResult result, const ScoreJob& job,
                                  const Timing& timing)>;

  struct Item {
    ScoreJob job;  // validated; its views must stay valid until `done` has been called
    // The request's own cancellation / deadline (OK = keep going); may be empty.
    std::function<absl::Status()> stop;
    Done done;
    // Bytes the item makes the server hold beyond EstimateItemBytes(job), counted against the
    // memory budget too: the rest of the request message, outputs the caller derives from the
    // result (per-sequence sums), echoed fields. >= 0.
    int64_t extra_bytes = 0;
  };

  // Bytes an item holds while admitted: its inputs and its outputs.
  static int64_t EstimateItemBytes(const ScoreJob& job);
  // What admission counts for `item`: EstimateItemBytes(item.job) + item.extra_bytes.
  static int64_t ItemBytes(const Item& item);

  // `backend` must outlive the scheduler.
  Scheduler(Backend* backend, const SchedulerOptions& options, SchedulerHooks hooks);
  ~Scheduler();  // Stop()
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Admits `item` (then `done` runs exactly once, later) or refuses it (then `done` is never
  // called): RESOURCE_EXHAUSTED when the queue or the memory budget is full, UNAVAILABLE after
  // Stop or a fatal backend error.
  absl::Status Submit(Item item);

  // Refuses new items, runs every admitted one, joins the workers. Idempotent.
  void Stop();

  // Items admitted and not yet done (queued or computing).
  int64_t in_flight() const;

  // Bytes held for admitted work after its item is done (a response waiting for a slow client)
  // that count against the memory budget until released with a negative `delta`. Never refused:
  // call it from `done` (before the item's own bytes are released) to hand them over.
  void AddHeldBytes(int64_t delta);
  // Bytes counted against the memory budget now (items in flight plus held bytes).
  int64_t bytes_in_flight() const;

 private:
  struct Queued {
    Item item;
    int64_t bytes = 0;
    Clock::time_point enqueued;
  };
  void WorkerLoop();
  // Waits for work and removes the next batch from the queue; empty when stopping and drained.
  // The next batch; first spins (without the lock) until `spin_until` while the queue is empty.
  std::vector<std::unique_ptr<Queued>> TakeBatch(Clock::time_point spin_until);
  // `staging`: the calling worker's reusable buffer for merged inputs (batch.h).
  void RunBatch(std::vector<std::unique_ptr<Queued>> batch, MergedInputs* staging);
  // Computes `members` as one job (or alone) into per-member statuses and results.
  void Compute(const std::vector<Queued*>& members, std::vector<absl::Status>* status,
               std::vector<ScoreResult>* results, MergedInputs* staging);
  void Finish(Queued& q, absl::Status status, ScoreResult result, const Timing& timing);
  bool BackendFailed();

  Backend* const backend_;
  const SchedulerOptions options_;
  const SchedulerHooks hooks_;

  mutable absl::Mutex mu_;
  absl::CondVar work_cv_;
  std::deque<std::unique_ptr<Queued>> queue_ ABSL_GUARDED_BY(mu_);
  std::atomic<size_t> queued_{0};  // queue_.size(), for the workers' idle spin (no lock)
  int64_t bytes_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t items_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool fatal_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status fatal_status_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> workers_;
};

}  // namespace logitserve
