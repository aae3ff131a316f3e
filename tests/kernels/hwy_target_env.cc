// Test-only: LOGITSERVE_TEST_HWY_TARGET=<name> (a Highway target name: AVX2, SSE4, SCALAR, ...)
// runs this binary's CPU kernels on that instruction set instead of the machine's best, through
// Highway's SetSupportedTargetsForTest, before main. Highway dispatches once per process to the
// best set the CPU has, so without this a suite only ever checks one of them, while CI's and
// users' CPUs pick others (an fp16 conversion correct on AVX2 and wrong below it went unseen that
// way). A set this CPU lacks, or an unknown name, ends the process with kSkipExitCode before any
// test runs (ctest's SKIP_RETURN_CODE: reported as skipped, never as passed); unset, nothing
// changes.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "hwy/targets.h"

namespace logitserve::testing {
namespace {

constexpr int kSkipExitCode = 77;

[[maybe_unused]] const bool kTargetSet = [] {
  const char* name = std::getenv("LOGITSERVE_TEST_HWY_TARGET");
  if (name == nullptr) return false;
  for (int bit = 0; bit < 63; ++bit) {
    const int64_t target = int64_t{1} << bit;
    if (std::strcmp(name, hwy::TargetName(target)) != 0) continue;
    if ((hwy::SupportedTargets() & target) == 0) {
      std::printf("[  SKIPPED ] this CPU cannot run Highway target %s\n", name);
      std::exit(kSkipExitCode);
    }
    hwy::SetSupportedTargetsForTest(target);
    std::printf("[ hwy target ] %s\n", name);
    return true;
  }
  std::printf("[  SKIPPED ] unknown Highway target '%s'\n", name);
  std::exit(kSkipExitCode);
}();

}  // namespace
}  // namespace logitserve::testing
