// CudaBackend health: the collective watchdog and the fatal-error state, with real faults
// (CudaBackendOptions::test_fault), plus the memory report.
//
//   A stream that makes no progress ("stall:R", one GPU) and a collective a peer never joins
//   ("skip-collective:R", two GPUs: the peers' NCCL kernels wait on the GPU) each make Score fail
//   within the watchdog timeout plus a margin (no hang) with INTERNAL naming the watchdog;
//   Health() then returns that error, later Score / PrepareHead calls return it at once, the
//   backend is destroyed without hanging (aborted communicators are not destroyed again), and a
//   new backend on the same GPUs computes correctly.
//   The sticky-error path has its own program (cuda_sticky_fault_test): it loses the device's
//   context for the rest of the process.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "server/backend/backend.h"
#include "server/backend/cuda/cuda_backend.h"
#include "tests/gpu/gpu_test_env.h"
#include "tests/kernels/expect_reference.h"
#include "tests/kernels/job_builder.h"

namespace logitserve::testing {
namespace {

constexpr absl::Duration kTimeout = absl::Seconds(2);
// Score after a watchdog timeout returns within the timeout, the communicators' abort and the
// streams' bounded drain (at most the timeout again) plus this margin.
constexpr double kMarginSeconds = 20.0;

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// 3 tiles of 4 rows (staging sized for it) with a JSD pass: six all-gathers on two ranks.
constexpr int64_t kVocab = 5000, kTileRows = 4, kRows = 3 * kTileRows;

OwnedJob Job(std::mt19937_64& rng) {
  const LogitsPair in = MakeLogitsPair(rng, FloatType::kBFloat16, kRows, kVocab, 3.0);
  OwnedJob j;
  j.SetModelLogits(in.model)
      .SetReferenceLogits(in.reference)
      .WithEverything(RandomTargets(rng, kRows, 2, kVocab, -100, 0.2), 2, 3, 0.3f);
  return j;
}

CudaBackendOptions Options(std::vector<int> devices, std::string fault) {
  CudaBackendOptions o;
  o.devices = std::move(devices);
  o.collective_timeout = kTimeout;
  o.test_fault = std::move(fault);
  o.logits_staging_bytes = static_cast<size_t>(kTileRows * 5000 * 2 * 2);
  return o;
}

// After a fatal error: Health() reports it, and every later call fails at once with it.
void ExpectOutOfService(Backend& b, const absl::Status& failed, const OwnedJob& job) {
  EXPECT_EQ(failed.code(), absl::StatusCode::kInternal) << failed;
  EXPECT_NE(std::string(failed.message()).find("out of service"), std::string::npos) << failed;
  EXPECT_EQ(b.Health(), failed);
  const auto t0 = std::chrono::steady_clock::now();
  const absl::StatusOr<ScoreResult> again = RunJob(b, job.job);
  EXPECT_LT(SecondsSince(t0), 1.0);
  EXPECT_EQ(again.status(), failed);
  std::mt19937_64 rng(7);
  const auto w = RandomHead(rng, 100, 16, FloatType::kBFloat16, 1.0, false, HeadTransform{});
  EXPECT_EQ(b.PrepareHead(w).status(), failed);
}

TEST(CudaHealth, HealthyBackendReportsOkAndDeviceMemory) {
  std::mt19937_64 rng(3);
  const OwnedJob job = Job(rng);
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateCudaBackend(Options({}, ""));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE((*b)->Health().ok());
  LOGITSERVE_ASSERT_SCORE(got, **b, job.job);
  ExpectMatchesReference(job.job, got);
  EXPECT_TRUE((*b)->Health().ok());

  const std::vector<Backend::MemoryInfo> before = (*b)->MemoryUsage();
  ASSERT_EQ(static_cast<int>(before.size()), VisibleCudaDevices());
  for (size_t d = 0; d < before.size(); ++d) {
    EXPECT_EQ(before[d].device, "cuda:" + std::to_string(d));
    EXPECT_GT(before[d].total_bytes, 0);
    EXPECT_GT(before[d].used_bytes, 0);  // at least this backend's workspaces
    EXPECT_LE(before[d].used_bytes, before[d].total_bytes);
  }
  // 256 MiB more in use on GPU 0 shows up (cudaMalloc rounds to 2 MiB pages; nothing else runs).
  void* extra = nullptr;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&extra, size_t{256} << 20), cudaSuccess);
  const std::vector<Backend::MemoryInfo> after = (*b)->MemoryUsage();
  cudaFree(extra);
  ASSERT_EQ(after.size(), before.size());
  EXPECT_GE(after[0].used_bytes - before[0].used_bytes, int64_t{256} << 20);
  EXPECT_EQ(after[0].total_bytes, before[0].total_bytes);
}

TEST(CudaHealth, BadFaultAndTimeoutOptionsAreRejected) {
  for (const char* fault : {"bogus", "stall", "stall:", "stall:x", "stall:1", "stall:-1",
                            "sticky-error:3", "skip-collective:0"}) {
    SCOPED_TRACE(fault);
    // One shard on GPU 0: rank 1 does not exist, and skip-collective needs NCCL.
    EXPECT_EQ(CreateCudaBackend(Options({0}, fault)).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  CudaBackendOptions two_on_one = Options({0}, "skip-collective:1");
  two_on_one.shards = 2;  // device-copy exchange, not NCCL
  EXPECT_EQ(CreateCudaBackend(two_on_one).status().code(), absl::StatusCode::kInvalidArgument);
  CudaBackendOptions zero = Options({0}, "");
  zero.collective_timeout = absl::ZeroDuration();
  EXPECT_EQ(CreateCudaBackend(zero).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(CreateCudaBackend(Options({0}, "stall:0")).ok());
}

// A stream that makes no progress (one GPU, no NCCL): the watchdog, then out of service.
TEST(CudaHealth, StalledStreamTripsTheWatchdog) {
  std::mt19937_64 rng(5);
  const OwnedJob job = Job(rng);
  {
    absl::StatusOr<std::unique_ptr<Backend>> b = CreateCudaBackend(Options({0}, "stall:0"));
    ASSERT_TRUE(b.ok()) << b.status();
    const auto t0 = std::chrono::steady_clock::now();
    const absl::StatusOr<ScoreResult> failed = RunJob(**b, job.job);
    const double took = SecondsSince(t0);
    ASSERT_FALSE(failed.ok());
    EXPECT_GE(took, absl::ToDoubleSeconds(kTimeout) * 0.9);  // it did wait for the watchdog
    EXPECT_LT(took, 2 * absl::ToDoubleSeconds(kTimeout) + kMarginSeconds);
    EXPECT_NE(std::string(failed.status().message()).find("watchdog"), std::string::npos)
        << failed.status();
    ExpectOutOfService(**b, failed.status(), job);
    // The device itself is fine: the memory report still answers.
    const std::vector<Backend::MemoryInfo> mem = (*b)->MemoryUsage();
    ASSERT_EQ(mem.size(), 1u);
    EXPECT_GT(mem[0].total_bytes, 0);
  }  // destroyed (waits for the stall kernel's 3 x timeout at most)
  absl::StatusOr<std::unique_ptr<Backend>> fresh = CreateCudaBackend(Options({0}, ""));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  LOGITSERVE_ASSERT_SCORE(got, **fresh, job.job);
  ExpectMatchesReference(job.job, got);
}

// A rank that skips its collectives (two GPUs): its peer's NCCL kernel waits on the GPU for ever;
// the watchdog fires, every communicator is aborted, the backend is out of service.
TEST(CudaHealth, SkippedCollectiveTripsTheWatchdogAndAbortsNccl) {
  if (VisibleCudaDevices() < 2) {
    std::printf("[  SKIPPED ] needs two GPUs (NCCL), %d visible\n", VisibleCudaDevices());
    GTEST_SKIP() << "needs two GPUs";
  }
  std::mt19937_64 rng(9);
  const OwnedJob job = Job(rng);
  for (int skip_rank : {1, 0}) {
    SCOPED_TRACE("rank " + std::to_string(skip_rank) + " skips its collectives");
    absl::StatusOr<std::unique_ptr<Backend>> b =
        CreateCudaBackend(Options({0, 1}, "skip-collective:" + std::to_string(skip_rank)));
    ASSERT_TRUE(b.ok()) << b.status();
    const auto t0 = std::chrono::steady_clock::now();
    const absl::StatusOr<ScoreResult> failed = RunJob(**b, job.job);
    const double took = SecondsSince(t0);
    ASSERT_FALSE(failed.ok());
    EXPECT_LT(took, 2 * absl::ToDoubleSeconds(kTimeout) + kMarginSeconds);
    EXPECT_NE(std::string(failed.status().message()).find("watchdog"), std::string::npos)
        << failed.status();
    ExpectOutOfService(**b, failed.status(), job);
    const auto t1 = std::chrono::steady_clock::now();
    b->reset();  // aborted communicators are not destroyed again; nothing waits for ever
    EXPECT_LT(SecondsSince(t1), kMarginSeconds);
  }
  // NCCL in this process still works for a new backend on the same GPUs.
  absl::StatusOr<std::unique_ptr<Backend>> fresh = CreateCudaBackend(Options({0, 1}, ""));
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  LOGITSERVE_ASSERT_SCORE(got, **fresh, job.job);
  ExpectMatchesReference(job.job, got);
  EXPECT_TRUE((*fresh)->Health().ok());
}

}  // namespace
}  // namespace logitserve::testing
