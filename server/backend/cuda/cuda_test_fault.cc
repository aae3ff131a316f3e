#include "server/backend/cuda/cuda_test_fault.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace logitserve::cuda_internal {

absl::StatusOr<TestFault> ParseTestFault(const std::string& text, int ranks) {
  TestFault f;
  if (text.empty()) return f;
  const size_t colon = text.find(':');
  const std::string kind = text.substr(0, colon);
  if (kind == "skip-collective") {
    f.kind = TestFault::kSkipCollective;
  } else if (kind == "stall") {
    f.kind = TestFault::kStall;
  } else if (kind == "sticky-error") {
    f.kind = TestFault::kStickyError;
  }
  int rank = -1;
  if (f.kind == TestFault::kNone || colon == std::string::npos ||
      !absl::SimpleAtoi(text.substr(colon + 1), &rank) || rank < 0 || rank >= ranks) {
    return absl::InvalidArgumentError(
        absl::StrCat("test fault '", text,
                     "': expected skip-collective:R, stall:R or sticky-error:R with R a "
                     "rank in [0, ",
                     ranks, ")"));
  }
  f.rank = rank;
  return f;
}

}  // namespace logitserve::cuda_internal
