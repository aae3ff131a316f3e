// A sticky CUDA error takes the CudaBackend out of service (its own program: the error loses the
// device's context for the rest of the process, so nothing else may run here).
//
// "sticky-error:0" makes rank 0 run a kernel that stores through a null pointer: a real
// cudaErrorIllegalAddress. Score fails within seconds (with two GPUs the other rank's NCCL wait is
// abandoned and its communicator aborted), INTERNAL naming the error; Health() returns it; later
// calls return it at once; the memory report still answers (zeros for the lost device).
#include <chrono>
#include <memory>
#include <random>
#include <string>

#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "server/backend/backend.h"
#include "server/backend/cuda/cuda_backend.h"
#include "tests/gpu/gpu_test_env.h"
#include "tests/kernels/job_builder.h"

namespace logitserve::testing {
namespace {

TEST(CudaHealth, StickyErrorTakesTheBackendOutOfService) {
  std::mt19937_64 rng(11);
  constexpr int64_t kRows = 12, kVocab = 5000;
  const LogitsPair in = MakeLogitsPair(rng, FloatType::kBFloat16, kRows, kVocab, 3.0);
  OwnedJob job;
  job.SetModelLogits(in.model)
      .SetReferenceLogits(in.reference)
      .WithEverything(RandomTargets(rng, kRows, 2, kVocab, -100, 0.2), 2, 3, 0.3f);
  CudaBackendOptions o;  // every visible GPU: with two, rank 1 waits in NCCL for rank 0
  o.collective_timeout = absl::Seconds(30);
  o.test_fault = "sticky-error:0";
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateCudaBackend(o);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_TRUE((*b)->Health().ok());
  const auto t0 = std::chrono::steady_clock::now();
  const absl::StatusOr<ScoreResult> failed = RunJob(**b, job.job);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_FALSE(failed.ok());
  // Found by the next CUDA call, not by the watchdog (30 s).
  EXPECT_LT(took, 20.0);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kInternal) << failed.status();
  EXPECT_NE(std::string(failed.status().message()).find("cudaErrorIllegalAddress"),
            std::string::npos)
      << failed.status();
  EXPECT_NE(std::string(failed.status().message()).find("out of service"), std::string::npos)
      << failed.status();
  EXPECT_EQ((*b)->Health(), failed.status());
  const auto t1 = std::chrono::steady_clock::now();
  EXPECT_EQ(RunJob(**b, job.job).status(), failed.status());
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count(), 1.0);
  EXPECT_EQ(static_cast<int>((*b)->MemoryUsage().size()), VisibleCudaDevices());
}

}  // namespace
}  // namespace logitserve::testing
