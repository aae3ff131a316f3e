#include "server/scheduler/scheduler.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "server/backend/fault_injection.h"
#include "server/backend/forwarding_backend.h"
#include "tests/kernels/cpu_factories.h"
#include "tests/kernels/expect_reference.h"
#include "tests/kernels/job_builder.h"

namespace logitserve {
namespace {

using testing::Encode;
using testing::FloatType;
using testing::OwnedJob;
using testing::Share;

// Wraps a backend: records every job it is given and, while `gate` is set, blocks the first job
// until the gate opens (so later submissions queue up behind it).
class RecordingBackend final : public ForwardingBackend {
 public:
  using ForwardingBackend::ForwardingBackend;
  absl::Status Score(const ScoreJob& job, ScoreResult* result) override {
    {
      absl::MutexLock lock(&mu_);
      rows_.push_back(job.rows);
    }
    if (gate_ != nullptr && first_.exchange(false)) gate_->WaitForNotification();
    return inner().Score(job, result);
  }
  void GateFirstJob(absl::Notification* gate) { gate_ = gate; }
  std::vector<int64_t> rows() const {
    absl::MutexLock lock(&mu_);
    return rows_;
  }

 private:
  absl::Notification* gate_ = nullptr;
  std::atomic<bool> first_{true};
  mutable absl::Mutex mu_;
  std::vector<int64_t> rows_ ABSL_GUARDED_BY(mu_);
};

// Waits until the (gated) first job has reached the backend, so later submissions queue.
void WaitUntilComputing(const RecordingBackend& backend) {
  while (backend.rows().empty()) absl::SleepFor(absl::Milliseconds(1));
}

std::unique_ptr<RecordingBackend> MakeBackend() {
  auto cpu = testing::CpuFactory("cpu_2shards", 2).create();
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  return std::make_unique<RecordingBackend>(*std::move(cpu));
}

// What a done callback saw.
struct Outcome {
  absl::Notification done;
  absl::Status status;
  ScoreResult result;
  Scheduler::Timing timing;
};

Scheduler::Item ItemFor(const OwnedJob& job, Outcome* out) {
  Scheduler::Item item;
  item.job = job.job;
  item.done = [out](absl::Status s, ScoreResult r, const ScoreJob&, const Scheduler::Timing& t) {
    out->status = std::move(s);
    out->result = std::move(r);
    out->timing = t;
    out->done.Notify();
  };
  return item;
}

struct Batches {
  absl::Mutex mu;
  std::vector<std::pair<int64_t, int64_t>> seen ABSL_GUARDED_BY(mu);  // (requests, rows)
};

SchedulerHooks RecordBatches(Batches* b) {
  SchedulerHooks hooks;
  hooks.on_batch = [b](int64_t requests, int64_t rows) {
    absl::MutexLock lock(&b->mu);
    b->seen.emplace_back(requests, rows);
  };
  return hooks;
}

// Hidden-mode jobs against one head, with a reference head, every output: the main path.
struct HiddenJobs {
  std::shared_ptr<const PreparedHead> policy;
  std::shared_ptr<const PreparedHead> reference;
  OwnedJob Make(std::mt19937_64& rng, int64_t rows, int32_t top_k) const {
    const int64_t h = policy->weights().hidden_size;
    const int64_t v = policy->weights().vocab_size;
    OwnedJob j;
    j.SetModelHidden(policy, Share(Encode(FloatType::kBFloat16, rows, h,
                                          testing::RandomNormal(rng, rows * h, 1.0))));
    j.SetReferenceHidden(reference, Share(Encode(FloatType::kBFloat16, rows, h,
                                                 testing::RandomNormal(rng, rows * h, 1.0))));
    j.WithEverything(testing::RandomTargets(rng, rows, 2, v, -100, 0.1), 2, top_k, 0.3f);
    return j;
  }
};

HiddenJobs MakeHeads(Backend& backend, std::mt19937_64& rng) {
  HiddenJobs heads;
  auto p =
      backend.PrepareHead(testing::RandomHead(rng, 3000, 32, FloatType::kBFloat16, 0.3, true, {}));
  auto r =
      backend.PrepareHead(testing::RandomHead(rng, 3000, 32, FloatType::kBFloat16, 0.3, false, {}));
  EXPECT_TRUE(p.ok() && r.ok());
  heads.policy = *p;
  heads.reference = *r;
  return heads;
}

TEST(SchedulerTest, CoBatchedResultsAreBitwiseTheResultsAlone) {
  std::unique_ptr<RecordingBackend> backend = MakeBackend();
  std::mt19937_64 rng(7);
  const HiddenJobs heads = MakeHeads(*backend, rng);
  // The first job holds the worker while the rest queue up; they then share batches: rows 1..69
  // (across the 64-row tile edge), two incompatible top-k values, and an empty request.
  std::vector<OwnedJob> jobs;
  jobs.push_back(heads.Make(rng, 5, 4));
  for (int64_t rows : {1, 69, 7, 0, 64, 3, 33, 2}) jobs.push_back(heads.Make(rng, rows, 4));
  for (int64_t rows : {6, 9}) jobs.push_back(heads.Make(rng, rows, 5));

  absl::Notification gate;
  backend->GateFirstJob(&gate);
  Batches batches;
  SchedulerOptions options;
  options.max_batch_tokens = 150;
  {
    Scheduler scheduler(backend.get(), options, RecordBatches(&batches));
    std::vector<std::unique_ptr<Outcome>> outcomes;
    for (const OwnedJob& j : jobs) {
      outcomes.push_back(std::make_unique<Outcome>());
      ASSERT_TRUE(scheduler.Submit(ItemFor(j, outcomes.back().get())).ok());
      if (outcomes.size() == 1) WaitUntilComputing(*backend);
    }
    gate.Notify();
    for (size_t i = 0; i < jobs.size(); ++i) {
      outcomes[i]->done.WaitForNotification();
      ASSERT_TRUE(outcomes[i]->status.ok()) << i << ": " << outcomes[i]->status;
      // The same job alone, straight on the backend.
      LOGITSERVE_ASSERT_SCORE(alone, *backend, jobs[i].job);
      SCOPED_TRACE(::testing::Message() << "job " << i << " (" << jobs[i].job.rows << " rows)");
      testing::ExpectBitwiseEqual(outcomes[i]->result, alone);
      EXPECT_GE(outcomes[i]->timing.batch_requests, 1);
    }
  }
  // Batches formed: job 0 alone (gated); then, in FIFO order under a 150-row budget, the
  // compatible top-k 4 jobs {1, 69, 7, 64, 3} (144 rows; 33 more would overflow), then
  // {33, 2}, then the top-k 5 jobs {6, 9}. The empty request runs alone.
  absl::MutexLock lock(&batches.mu);
  std::vector<std::pair<int64_t, int64_t>> want = {{1, 5}, {5, 144}, {1, 0}, {2, 35}, {2, 15}};
  std::sort(want.begin(), want.end());
  std::vector<std::pair<int64_t, int64_t>> got = batches.seen;
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, want);
}

TEST(SchedulerTest, StoppedItemsAreNeverLaunched) {
  std::unique_ptr<RecordingBackend> backend = MakeBackend();
  std::mt19937_64 rng(8);
  const HiddenJobs heads = MakeHeads(*backend, rng);
  const OwnedJob live = heads.Make(rng, 3, 2);
  const OwnedJob cancelled = heads.Make(rng, 11, 2);
  Outcome a, b;
  {
    Scheduler scheduler(backend.get(), SchedulerOptions{}, {});
    Scheduler::Item item = ItemFor(cancelled, &b);
    item.stop = [] { return absl::CancelledError("client went away"); };
    ASSERT_TRUE(scheduler.Submit(std::move(item)).ok());
    ASSERT_TRUE(scheduler.Submit(ItemFor(live, &a)).ok());
    a.done.WaitForNotification();
    b.done.WaitForNotification();
  }
  EXPECT_TRUE(a.status.ok()) << a.status;
  EXPECT_TRUE(absl::IsCancelled(b.status)) << b.status;
  EXPECT_TRUE(b.result.entropy.empty());
  // Only the live job's 3 rows ever reached the backend.
  EXPECT_EQ(backend->rows(), (std::vector<int64_t>{3}));
}

// Workers that spin after a batch (SchedulerOptions::idle_spin, the CUDA server's default) take
// items that arrive while they spin and items that arrive after they went to sleep, with the
// bits of the backend alone, and a scheduler stopped while they spin stops.
TEST(SchedulerTest, SpinningWorkersTakeLateAndEarlyItemsAndStop) {
  std::unique_ptr<RecordingBackend> backend = MakeBackend();
  std::mt19937_64 rng(12);
  const HiddenJobs heads = MakeHeads(*backend, rng);
  SchedulerOptions options;
  options.workers = 2;
  options.idle_spin = std::chrono::milliseconds(50);
  const auto start = std::chrono::steady_clock::now();
  {
    Scheduler scheduler(backend.get(), options, {});
    for (int i = 0; i < 6; ++i) {
      const OwnedJob job = heads.Make(rng, 1 + i, 2);
      Outcome out;
      ASSERT_TRUE(scheduler.Submit(ItemFor(job, &out)).ok());
      out.done.WaitForNotification();
      ASSERT_TRUE(out.status.ok()) << out.status;
      LOGITSERVE_ASSERT_SCORE(alone, *backend, job.job);
      testing::ExpectBitwiseEqual(out.result, alone);
      // Every other item comes after the workers' spin ran out.
      if (i % 2 == 1) std::this_thread::sleep_for(std::chrono::milliseconds(80));
    }
  }  // Stop with both workers spinning
  // Each job once through the scheduler, then once alone.
  EXPECT_EQ(backend->rows(), (std::vector<int64_t>{1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6}));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST(SchedulerTest, AMemberThatStopsDuringItsBatchGetsItsOwnStatus) {
  std::unique_ptr<RecordingBackend> backend = MakeBackend();
  std::mt19937_64 rng(9);
  const HiddenJobs heads = MakeHeads(*backend, rng);
  const OwnedJob blocker = heads.Make(rng, 1, 2);
  const OwnedJob keep = heads.Make(rng, 70, 2);
  const OwnedJob stop_late = heads.Make(rng, 70, 2);
  absl::Notification gate;
  backend->GateFirstJob(&gate);
  Outcome o0, o1, o2;
  std::atomic<int> checks{0};
  {
    Scheduler scheduler(backend.get(), SchedulerOptions{}, {});
    ASSERT_TRUE(scheduler.Submit(ItemFor(blocker, &o0)).ok());
    WaitUntilComputing(*backend);
    ASSERT_TRUE(scheduler.Submit(ItemFor(keep, &o1)).ok());
    Scheduler::Item item = ItemFor(stop_late, &o2);
    // OK when the batch is formed, stopped from the first row-tile check on.
    item.stop = [&checks] {
      return checks.fetch_add(1) == 0 ? absl::OkStatus()
                                      : absl::DeadlineExceededError("deadline passed");
    };
    ASSERT_TRUE(scheduler.Submit(std::move(item)).ok());
    gate.Notify();
    o1.done.WaitForNotification();
    o2.done.WaitForNotification();
  }
  ASSERT_TRUE(o1.status.ok()) << o1.status;  // its partner still wanted the result
  EXPECT_EQ(o1.timing.batch_requests, 2);
  LOGITSERVE_ASSERT_SCORE(alone, *backend, keep.job);
  testing::ExpectBitwiseEqual(o1.result, alone);
  EXPECT_TRUE(absl::IsDeadlineExceeded(o2.status)) << o2.status;
}

TEST(SchedulerTest, ABatchStopsAtTheNextRowTileOnceEveryMemberStopped) {
  std::unique_ptr<RecordingBackend> backend = MakeBackend();
  std::mt19937_64 rng(10);
  const HiddenJobs heads = MakeHeads(*backend, rng);
  const OwnedJob job = heads.Make(rng, 64 * 6, 2);  // 6 row tiles
  Outcome out;
  std::atomic<int> checks{0};
  {
    Scheduler scheduler(backend.get(), SchedulerOptions{}, {});
    Scheduler::Item item = ItemFor(job, &out);
    // Launch check OK, first two row tiles OK, cancelled from the third tile's check on.
    item.stop = [&checks] {
      return checks.fetch_add(1) < 3 ? absl::OkStatus() : absl::CancelledError("cancelled");
    };
    ASSERT_TRUE(scheduler.Submit(std::move(item)).ok());
    out.done.WaitForNotification();
  }
  EXPECT_TRUE(absl::IsCancelled(out.status)) << out.status;  // not ABORTED from the other shard
  // Every rank checks before every tile: 1 launch check, then 2 ranks x 2 passing tiles and the
  // failing third tile (each rank checks once more; the calls are counted, not the outcomes).
  EXPECT_LE(checks.load(), 1 + 2 * 3);
  EXPECT_GE(checks.load(), 4);
}

TEST(SchedulerTest, AdmissionRefusesOverTheQueueAndTheMemoryBudget) {
  std::unique_ptr<RecordingBackend> backend = MakeBackend();
  std::mt19937_64 rng(11);
  const HiddenJobs heads = MakeHeads(*backend, rng);
  const OwnedJob small = heads.Make(rng, 2, 2);
  const OwnedJob big = heads.Make(rng, 200, 2);
  absl::Notification gate;
  backend->GateFirstJob(&gate);
  SchedulerOptions options;
  options.queue_size = 1;
  options.max_batch_tokens = 0;
  options.memory_budget_bytes = Scheduler::EstimateItemBytes(small.job) * 3;
  ASSERT_GT(Scheduler::EstimateItemBytes(big.job), options.memory_budget_bytes);
  Outcome o1, o2, o3, o4, o5;
  Scheduler scheduler(backend.get(), options, {});
  ASSERT_TRUE(scheduler.Submit(ItemFor(small, &o1)).ok());  // computing (gated)
  WaitUntilComputing(*backend);
  ASSERT_TRUE(scheduler.Submit(ItemFor(small, &o2)).ok());  // queued
  const absl::Status full = scheduler.Submit(ItemFor(small, &o3));
  EXPECT_TRUE(absl::IsResourceExhausted(full)) << full;
  EXPECT_NE(full.message().find("queue is full"), std::string::npos) << full;
  const absl::Status too_big = scheduler.Submit(ItemFor(big, &o4));
  EXPECT_TRUE(absl::IsResourceExhausted(too_big)) << too_big;
  EXPECT_NE(too_big.message().find("memory budget"), std::string::npos) << too_big;
  EXPECT_EQ(scheduler.in_flight(), 2);
  gate.Notify();
  o1.done.WaitForNotification();
  o2.done.WaitForNotification();
  EXPECT_TRUE(o1.status.ok() && o2.status.ok());
  scheduler.Stop();
  const absl::Status stopped = scheduler.Submit(ItemFor(small, &o5));
  EXPECT_TRUE(absl::IsUnavailable(stopped)) << stopped;
  EXPECT_EQ(scheduler.in_flight(), 0);
  EXPECT_FALSE(o3.done.HasBeenNotified() || o4.done.HasBeenNotified() ||
               o5.done.HasBeenNotified());  // refused items never call done
}

TEST(SchedulerTest, BadValuesInOneMemberFailOnlyThatMemberNamingItsOwnRow) {
  std::unique_ptr<RecordingBackend> backend = MakeBackend();
  std::mt19937_64 rng(12);
  const int64_t v = 500;
  const auto logits_job = [&](int64_t rows, int64_t nan_row) {
    std::vector<float> z = testing::RandomNormal(rng, rows * v, 2.0);
    if (nan_row >= 0) z[static_cast<size_t>(nan_row * v + 17)] = std::nanf("");
    OwnedJob j;
    j.SetModelLogits(Share(Encode(FloatType::kFloat32, rows, v, z)));
    j.WithEntropy().WithTopK(2);
    return j;
  };
  const OwnedJob blocker = logits_job(1, -1);
  const OwnedJob good1 = logits_job(9, -1);
  const OwnedJob bad = logits_job(6, 4);
  const OwnedJob good2 = logits_job(3, -1);
  absl::Notification gate;
  backend->GateFirstJob(&gate);
  Outcome o0, o1, o2, o3;
  {
    Scheduler scheduler(backend.get(), SchedulerOptions{}, {});
    ASSERT_TRUE(scheduler.Submit(ItemFor(blocker, &o0)).ok());
    WaitUntilComputing(*backend);
    ASSERT_TRUE(scheduler.Submit(ItemFor(good1, &o1)).ok());
    ASSERT_TRUE(scheduler.Submit(ItemFor(bad, &o2)).ok());
    ASSERT_TRUE(scheduler.Submit(ItemFor(good2, &o3)).ok());
    gate.Notify();
    for (Outcome* o : {&o1, &o2, &o3}) o->done.WaitForNotification();
  }
  EXPECT_EQ(o1.timing.batch_requests, 3);  // they did share a batch first
  ASSERT_TRUE(o1.status.ok()) << o1.status;
  ASSERT_TRUE(o3.status.ok()) << o3.status;
  LOGITSERVE_ASSERT_SCORE(alone1, *backend, good1.job);
  LOGITSERVE_ASSERT_SCORE(alone3, *backend, good2.job);
  testing::ExpectBitwiseEqual(o1.result, alone1);
  testing::ExpectBitwiseEqual(o3.result, alone3);
  EXPECT_TRUE(absl::IsInvalidArgument(o2.status)) << o2.status;
  // Row 4 of its own request (row 13 of the merged batch).
  EXPECT_NE(o2.status.message().find("row 4"), std::string::npos) << o2.status;
}

TEST(SchedulerTest, AFatalBackendErrorFailsWorkAndIsReportedOnce) {
  auto cpu = testing::CpuFactory("cpu", 1).create();
  ASSERT_TRUE(cpu.ok());
  auto faulty = WrapWithTestFault(*std::move(cpu), "fatal-after:1");
  ASSERT_TRUE(faulty.ok()) << faulty.status();
  std::mt19937_64 rng(13);
  const HiddenJobs heads = MakeHeads(**faulty, rng);
  const OwnedJob job = heads.Make(rng, 4, 2);
  std::atomic<int> fatal_calls{0};
  SchedulerHooks hooks;
  hooks.on_fatal = [&fatal_calls](const absl::Status& s) {
    EXPECT_TRUE(absl::IsInternal(s)) << s;
    fatal_calls.fetch_add(1);
  };
  Scheduler scheduler(faulty->get(), SchedulerOptions{}, hooks);
  Outcome first, second, third;
  ASSERT_TRUE(scheduler.Submit(ItemFor(job, &first)).ok());
  first.done.WaitForNotification();
  EXPECT_TRUE(first.status.ok()) << first.status;
  ASSERT_TRUE(scheduler.Submit(ItemFor(job, &second)).ok());
  second.done.WaitForNotification();
  EXPECT_TRUE(absl::IsUnavailable(second.status)) << second.status;
  const absl::Status refused = scheduler.Submit(ItemFor(job, &third));
  EXPECT_TRUE(absl::IsUnavailable(refused)) << refused;
  EXPECT_EQ(fatal_calls.load(), 1);
}

}  // namespace
}  // namespace logitserve
