#include "tests/gpu/gpu_test_env.h"

#include <cuda_runtime_api.h>

#include <cstdio>

#include "gtest/gtest.h"

namespace logitserve::testing {

int VisibleCudaDevices() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

namespace {

class SkipWithoutGpu : public ::testing::Environment {
 public:
  void SetUp() override {
    const int n = VisibleCudaDevices();
    if (n == 0) {
      // A skip in a global environment makes GoogleTest print "PASSED" for tests that never ran;
      // this line makes ctest (SKIP_REGULAR_EXPRESSION in cmake/LogitserveTest.cmake) report
      // them as skipped instead.
      std::printf("[  SKIPPED ] no CUDA device visible\n");
      std::fflush(stdout);
      GTEST_SKIP() << "no CUDA device visible: every GPU test is skipped";
    }
    std::printf("[ gpu       ] %d CUDA device(s) visible\n", n);
  }
};

[[maybe_unused]] ::testing::Environment* const kSkipWithoutGpu =
    ::testing::AddGlobalTestEnvironment(new SkipWithoutGpu);

}  // namespace
}  // namespace logitserve::testing
