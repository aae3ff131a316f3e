#include "server/scheduler/scheduler.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/base/cpu_relax.h"
#include "common/base/thread_name.h"
#include "server/scheduler/batch.h"

namespace logitserve {

namespace {

int64_t ViewBytes(const MatrixView& v) {
  return v.empty() ? 0 : v.rows * v.cols * kernels::SizeOf(v.type);
}

int64_t InputBytes(const DistributionInput& d) { return ViewBytes(d.hidden) + ViewBytes(d.logits); }

}  // namespace

int64_t Scheduler::EstimateItemBytes(const ScoreJob& job) {
  const int64_t per_row_outputs = job.ids_per_row + 2 * job.top_k + (job.entropy ? 1 : 0) +
                                  (job.reference_entropy ? 1 : 0) + (job.forward_kl ? 1 : 0) +
                                  (job.reverse_kl ? 1 : 0) + (job.jsd_beta.has_value() ? 1 : 0);
  // Outputs are held twice (result vectors, then the response message); ids once more as int32.
  return InputBytes(job.model) + InputBytes(job.reference) +
         static_cast<int64_t>(job.target_ids.size() * sizeof(int32_t)) +
         2 * job.rows * per_row_outputs * static_cast<int64_t>(sizeof(float));
}

int64_t Scheduler::ItemBytes(const Item& item) {
  return EstimateItemBytes(item.job) + std::max<int64_t>(0, item.extra_bytes);
}

Scheduler::Scheduler(Backend* backend, const SchedulerOptions& options, SchedulerHooks hooks)
    : backend_(backend), options_(options), hooks_(std::move(hooks)) {
  const int workers = std::max(1, options_.workers);
  workers_.reserve(static_cast<size_t>(workers));
  for (int i = 0; i < workers; ++i) {
    workers_.emplace_back([this] {
      NameThisThread("ls-sched-worker");
      WorkerLoop();
    });
  }
}

Scheduler::~Scheduler() { Stop(); }

absl::Status Scheduler::Submit(Item item) {
  auto q = std::make_unique<Queued>();
  q->bytes = ItemBytes(item);
  q->item = std::move(item);
  q->enqueued = Clock::now();
  {
    absl::MutexLock lock(&mu_);
    if (fatal_) {
      return absl::UnavailableError(absl::StrCat(
          "the backend failed and the server is restarting: ", fatal_status_.message()));
    }
    if (stopping_) return absl::UnavailableError("server is shutting down");
    if (options_.memory_budget_bytes > 0 && q->bytes > options_.memory_budget_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "request needs ", q->bytes, " bytes, more than the server's memory budget of ",
          options_.memory_budget_bytes, " (--memory-budget-bytes); split it"));
    }
    if (queue_.size() >= options_.queue_size) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "server queue is full (", options_.queue_size, " requests waiting); retry later"));
    }
    if (options_.memory_budget_bytes > 0 &&
        bytes_in_flight_ + q->bytes > options_.memory_budget_bytes) {
      return absl::ResourceExhaustedError(
          absl::StrCat("server memory budget is full (", bytes_in_flight_, " of ",
                       options_.memory_budget_bytes, " bytes in flight); retry later"));
    }
    bytes_in_flight_ += q->bytes;
    ++items_in_flight_;
    queue_.push_back(std::move(q));
    queued_.store(queue_.size(), std::memory_order_relaxed);
    // Under the lock, so depth reports arrive in queue order (the hook is a cheap gauge store).
    if (hooks_.on_queue_depth) hooks_.on_queue_depth(static_cast<int64_t>(queue_.size()));
    work_cv_.Signal();
  }
  return absl::OkStatus();
}

void Scheduler::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    work_cv_.SignalAll();
  }
  for (std::thread& t : workers_) {
    if (t.joinable()) t.join();
  }
}

int64_t Scheduler::in_flight() const {
  absl::MutexLock lock(&mu_);
  return items_in_flight_;
}

void Scheduler::AddHeldBytes(int64_t delta) {
  absl::MutexLock lock(&mu_);
  bytes_in_flight_ += delta;
}

int64_t Scheduler::bytes_in_flight() const {
  absl::MutexLock lock(&mu_);
  return bytes_in_flight_;
}

std::vector<std::unique_ptr<Scheduler::Queued>> Scheduler::TakeBatch(Clock::time_point spin_until) {
  while (queued_.load(std::memory_order_relaxed) == 0 && Clock::now() < spin_until) {
    for (int i = 0; i < 32; ++i) CpuRelax();
  }
  std::vector<std::unique_ptr<Queued>> batch;
  {
    absl::MutexLock lock(&mu_);
    while (true) {
      while (queue_.empty() && !stopping_) work_cv_.Wait(&mu_);
      if (queue_.empty()) return batch;  // stopping and drained
      // The oldest item leads; later compatible items join while the rows fit the budget.
      const ScoreJob& lead = queue_.front()->item.job;
      std::vector<size_t> picked = {0};
      int64_t rows = lead.rows;
      const bool batchable = options_.max_batch_tokens > 0 && lead.rows > 0;
      bool full = !batchable || rows >= options_.max_batch_tokens;
      for (size_t i = 1; batchable && !full && i < queue_.size(); ++i) {
        const ScoreJob& job = queue_[i]->item.job;
        if (job.rows == 0 || !CanShareBatch(lead, job)) continue;
        if (rows + job.rows > options_.max_batch_tokens) {
          full = true;  // a later, smaller item could fit, but FIFO order wins
          break;
        }
        picked.push_back(i);
        rows += job.rows;
        full = rows >= options_.max_batch_tokens;
      }
      const Clock::time_point deadline = queue_.front()->enqueued + options_.max_queue_delay;
      const Clock::time_point now = Clock::now();
      if (full || stopping_ || now >= deadline) {
        for (auto it = picked.rbegin(); it != picked.rend(); ++it) {
          batch.push_back(std::move(queue_[*it]));
          queue_.erase(queue_.begin() + static_cast<std::ptrdiff_t>(*it));
        }
        std::reverse(batch.begin(), batch.end());
        queued_.store(queue_.size(), std::memory_order_relaxed);
        if (hooks_.on_queue_depth) hooks_.on_queue_depth(static_cast<int64_t>(queue_.size()));
        break;
      }
      // Wait for more rows (a Submit signals) or for the lead's delay to run out.
      work_cv_.WaitWithTimeout(&mu_, absl::FromChrono(deadline - now));
    }
  }
  return batch;
}

void Scheduler::WorkerLoop() {
  MergedInputs staging;  // reused by every batch this worker merges
  Clock::time_point spin_until{};
  while (true) {
    std::vector<std::unique_ptr<Queued>> batch = TakeBatch(spin_until);
    if (batch.empty()) return;
    RunBatch(std::move(batch), &staging);
    staging.Trim();
    spin_until = Clock::now() + options_.idle_spin;
  }
}

bool Scheduler::BackendFailed() {
  absl::Status health = backend_->Health();
  if (health.ok()) return false;
  bool first = false;
  {
    absl::MutexLock lock(&mu_);
    if (!fatal_) {
      fatal_ = true;
      fatal_status_ = health;
      first = true;
    }
  }
  if (first && hooks_.on_fatal) hooks_.on_fatal(health);
  return true;
}

void Scheduler::Finish(Queued& q, absl::Status status, ScoreResult result, const Timing& timing) {
  q.item.done(std::move(status), std::move(result), q.item.job, timing);
  absl::MutexLock lock(&mu_);
  bytes_in_flight_ -= q.bytes;
  --items_in_flight_;
}

void Scheduler::RunBatch(std::vector<std::unique_ptr<Queued>> batch, MergedInputs* staging) {
  Timing timing;
  timing.started = Clock::now();
  const auto finish_now = [&](Queued& q, absl::Status status) {
    Timing t = timing;
    t.enqueued = q.enqueued;
    t.finished = Clock::now();
    Finish(q, std::move(status), ScoreResult{}, t);
  };
  if (BackendFailed()) {
    absl::Status fatal;
    {
      absl::MutexLock lock(&mu_);
      fatal = fatal_status_;
    }
    for (auto& q : batch) {
      finish_now(*q, absl::UnavailableError(absl::StrCat(
                         "the backend failed and the server is restarting: ", fatal.message())));
    }
    return;
  }
  // Stopped (cancelled / expired) items are never launched.
  std::vector<Queued*> members;
  for (auto& q : batch) {
    absl::Status s = q->item.stop ? q->item.stop() : absl::OkStatus();
    if (!s.ok()) {
      finish_now(*q, std::move(s));
    } else {
      members.push_back(q.get());
    }
  }
  if (members.empty()) return;
  std::vector<absl::Status> status(members.size());
  std::vector<ScoreResult> results(members.size());
  Compute(members, &status, &results, staging);
  const bool failed =
      std::any_of(status.begin(), status.end(), [](const absl::Status& s) { return !s.ok(); });
  if (failed && BackendFailed()) {
    for (absl::Status& s : status) {
      if (!s.ok() && !absl::IsInvalidArgument(s)) {
        s = absl::UnavailableError(absl::StrCat("device failure: ", s.message()));
      }
    }
  }
  timing.finished = Clock::now();
  timing.batch_requests = static_cast<int64_t>(members.size());
  timing.batch_rows = 0;
  for (const Queued* q : members) timing.batch_rows += q->item.job.rows;
  if (hooks_.on_batch) hooks_.on_batch(timing.batch_requests, timing.batch_rows);
  for (size_t i = 0; i < members.size(); ++i) {
    Queued& q = *members[i];
    // A member that stopped while its batch ran gets its own status, not the results.
    absl::Status s = std::move(status[i]);
    if (s.ok() && q.item.stop) s = q.item.stop();
    ScoreResult result = s.ok() ? std::move(results[i]) : ScoreResult{};
    Timing t = timing;
    t.enqueued = q.enqueued;
    Finish(q, std::move(s), std::move(result), t);
  }
}

void Scheduler::Compute(const std::vector<Queued*>& members, std::vector<absl::Status>* status,
                        std::vector<ScoreResult>* results, MergedInputs* staging) {
  const auto run_alone = [&](size_t i) {
    ScoreJob& job = members[i]->item.job;
    if (members[i]->item.stop) {
      job.stop = [stop = members[i]->item.stop](int64_t) { return stop(); };
    }
    (*status)[i] = backend_->Score(job, &(*results)[i]);
  };
  if (members.size() == 1) {
    run_alone(0);
    return;
  }
  std::vector<const ScoreJob*> parts;
  parts.reserve(members.size());
  for (const Queued* q : members) parts.push_back(&q->item.job);
  ScoreJob merged = MergeJobs(parts, staging);
  // The batch goes on while any member still wants its result.
  merged.stop = [&members](int64_t) -> absl::Status {
    absl::Status first;
    for (const Queued* q : members) {
      absl::Status s = q->item.stop ? q->item.stop() : absl::OkStatus();
      if (s.ok()) return s;
      if (first.ok()) first = s;
    }
    return first;
  };
  ScoreResult merged_result;
  absl::Status s = backend_->Score(merged, &merged_result);
  if (absl::IsInvalidArgument(s)) {
    // One member's bad values: compute each alone, so only it fails, naming its own row.
    for (size_t i = 0; i < members.size(); ++i) run_alone(i);
    return;
  }
  int64_t row0 = 0;
  for (size_t i = 0; i < members.size(); ++i) {
    const int64_t rows = members[i]->item.job.rows;
    (*status)[i] = s;
    if (s.ok()) (*results)[i] = SliceResult(merged, merged_result, row0, rows);
    row0 += rows;
  }
}

}  // namespace logitserve
