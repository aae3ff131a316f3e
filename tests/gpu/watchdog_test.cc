// The CUDA backend's watchdog pieces that need no GPU (label unit: runs on CI machines too):
// PollUntil's outcomes, FatalState keeping the first fatal error, and which CUDA / NCCL errors
// count as fatal device errors.
#include "server/backend/cuda/watchdog.h"

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "gtest/gtest.h"
#include "server/backend/cuda/cuda_status.h"

namespace logitserve {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

TEST(PollUntil, ReturnsOnceDone) {
  int polls = 0;
  const absl::Status s = PollUntil([&]() -> absl::StatusOr<bool> { return ++polls == 100; },
                                   absl::Seconds(10), nullptr, "x");
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(polls, 100);
}

TEST(PollUntil, PassesThePollsErrorOn) {
  const absl::Status s =
      PollUntil([]() -> absl::StatusOr<bool> { return absl::DataLossError("broken"); },
                absl::Seconds(10), nullptr, "x");
  EXPECT_EQ(s, absl::DataLossError("broken"));
}

TEST(PollUntil, TimesOutWithAFatalWatchdogError) {
  const auto t0 = std::chrono::steady_clock::now();
  const absl::Status s = PollUntil([]() -> absl::StatusOr<bool> { return false; },
                                   absl::Milliseconds(200), nullptr, "row tile on GPU 3");
  const double took = SecondsSince(t0);
  EXPECT_GE(took, 0.2);
  EXPECT_LT(took, 5.0);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
  EXPECT_TRUE(IsFatalDeviceError(s)) << s;
  EXPECT_NE(std::string(s.message()).find("row tile on GPU 3"), std::string::npos) << s;
  EXPECT_NE(std::string(s.message()).find("watchdog"), std::string::npos) << s;
}

TEST(PollUntil, AbandonsTheWaitWhenTheBackendTurnsFatalElsewhere) {
  FatalState fatal;
  std::thread other([&fatal] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    fatal.Fail(MarkFatalDeviceError(absl::InternalError("GPU 1 fell off the bus")));
  });
  const auto t0 = std::chrono::steady_clock::now();
  const absl::Status s =
      PollUntil([]() -> absl::StatusOr<bool> { return false; }, absl::Seconds(60), &fatal, "x");
  other.join();
  EXPECT_LT(SecondsSince(t0), 30.0);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_FALSE(IsFatalDeviceError(s)) << s;  // the job reports the fatal error itself
}

TEST(FatalState, KeepsTheFirstErrorForGood) {
  FatalState fatal;
  EXPECT_FALSE(fatal.failed());
  EXPECT_TRUE(fatal.status().ok());
  fatal.Fail(absl::OkStatus());  // not an error: ignored
  EXPECT_FALSE(fatal.failed());
  fatal.Fail(MarkFatalDeviceError(absl::InternalError("first")));
  fatal.Fail(MarkFatalDeviceError(absl::InternalError("second")));
  ASSERT_TRUE(fatal.failed());
  const absl::Status s = fatal.status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(IsFatalDeviceError(s));
  EXPECT_NE(std::string(s.message()).find("out of service"), std::string::npos) << s;
  EXPECT_NE(std::string(s.message()).find("first"), std::string::npos) << s;
  EXPECT_EQ(std::string(s.message()).find("second"), std::string::npos) << s;
  EXPECT_EQ(fatal.status(), s);
}

TEST(FatalDeviceErrors, StickyCudaErrorsAndNcclErrorsAreFatalOthersAreNot) {
  for (cudaError_t e :
       {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorAssert,
        cudaErrorIllegalInstruction, cudaErrorMisalignedAddress, cudaErrorECCUncorrectable}) {
    SCOPED_TRACE(cudaGetErrorName(e));
    EXPECT_TRUE(IsStickyCudaError(e));
    const absl::Status s = CudaStatus(e, "kernel", "f.cc", 1);
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
    EXPECT_TRUE(IsFatalDeviceError(s));
  }
  for (cudaError_t e : {cudaErrorMemoryAllocation, cudaErrorInvalidValue,
                        cudaErrorLaunchOutOfResources, cudaErrorNotReady}) {
    SCOPED_TRACE(cudaGetErrorName(e));
    EXPECT_FALSE(IsStickyCudaError(e));
    EXPECT_FALSE(IsFatalDeviceError(CudaStatus(e, "call", "f.cc", 1)));
  }
  EXPECT_EQ(CudaStatus(cudaErrorMemoryAllocation, "cudaMalloc", "f.cc", 1).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(IsFatalDeviceError(CudaStatus(ncclSystemError, "ncclAllGather", "f.cc", 1)));
  EXPECT_TRUE(CudaStatus(ncclSuccess, "ncclAllGather", "f.cc", 1).ok());
  EXPECT_FALSE(IsFatalDeviceError(absl::InternalError("plain")));
  EXPECT_FALSE(IsFatalDeviceError(absl::OkStatus()));
}

}  // namespace
}  // namespace logitserve
