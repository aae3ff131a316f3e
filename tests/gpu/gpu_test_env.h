// GPU tests run only where a CUDA device is visible. Linking gpu_test_env.cc adds a global test
// environment that skips every test of the program (GTEST_SKIP) when cudaGetDeviceCount reports
// no device (or fails: no driver), so CI machines without a GPU stay green.
#pragma once

namespace logitserve::testing {

// Number of visible CUDA devices; 0 when the runtime reports an error (no driver, no device).
int VisibleCudaDevices();

}  // namespace logitserve::testing
