// The faults CudaBackend injects itself for the tests (CudaBackendOptions::test_fault, from
// --test-fault; server/backend/fault_injection.h parses the flag): a skipped collective, a
// stalled kernel or a real sticky error (illegal address) on one rank. Kept out of the production
// pipeline's files: the rank worker only asks which fault names its rank.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace logitserve::cuda_internal {

// CudaBackendOptions::test_fault, parsed.
struct TestFault {
  enum Kind { kNone, kSkipCollective, kStall, kStickyError };
  Kind kind = kNone;
  int rank = -1;
};

// INVALID_ARGUMENT unless `text` is empty or KIND:R with R a rank in [0, ranks).
absl::StatusOr<TestFault> ParseTestFault(const std::string& text, int ranks);

}  // namespace logitserve::cuda_internal
