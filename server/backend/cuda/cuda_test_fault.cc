#include "server/backend/cuda/cuda_test_fault.h"

#include "absl/strings/str_cat.h"
#include "server/backend/fault_injection.h"

namespace logitserve::cuda_internal {

absl::StatusOr<TestFault> ParseTestFault(const std::string& text, int ranks) {
  TestFault f;
  if (text.empty()) return f;
  // The one --test-fault parser (fault_injection.h); here only its CUDA kinds, with a rank.
  absl::StatusOr<TestFaultSpec> spec = logitserve::ParseTestFault(text);
  if (!spec.ok() || !spec->cuda() || spec->value >= ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("test fault '", text,
                     "': expected skip-collective:R, stall:R or sticky-error:R with R a "
                     "rank in [0, ",
                     ranks, ")"));
  }
  switch (spec->kind) {
    case TestFaultSpec::Kind::kSkipCollective:
      f.kind = TestFault::kSkipCollective;
      break;
    case TestFaultSpec::Kind::kStall:
      f.kind = TestFault::kStall;
      break;
    default:
      f.kind = TestFault::kStickyError;
      break;
  }
  f.rank = static_cast<int>(spec->value);
  return f;
}

}  // namespace logitserve::cuda_internal
