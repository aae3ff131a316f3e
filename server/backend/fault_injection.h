// Test-only fault injection (`logitserve --test-fault SPEC`), so end-to-end tests can drive the
// server's failure paths for real. A decorator around any Backend:
//   fatal-after:N   the first N Score calls run normally; every later one fails with INTERNAL and
//                   Health() reports the fatal error from then on (a stand-in for a sticky device
//                   error: the server must go NOT_SERVING, fail in-flight work and exit non-zero).
//   slow-tile:MS    before every row tile, sleeps MS milliseconds per 64 rows of the tile (so
//                   the time per row is the same on every backend), so cancellation, deadline
//                   and drain tests can catch a computation in flight.
// Two more kinds are classified here, so every --test-fault SPEC is read in one place:
//   slow-load:MS    the server sleeps MS before loading each head (signals during start-up);
//   skip-collective:RANK, stall:RANK, sticky-error:RANK  injected by the CUDA backend itself (a
//                   real skipped collective, stalled kernel or illegal address); ParseTestFault
//                   reads them too, the CUDA backend checks the rank.
// Never enable it in production: it exists to be tested against.
//
// Thread safety: as the wrapped backend.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/backend/backend.h"

namespace logitserve {

// --test-fault SPEC, parsed: KIND:VALUE. The one reader of the flag; the functions below and
// the CUDA backend's own faults (server/backend/cuda/cuda_test_fault.h) all go through it.
struct TestFaultSpec {
  enum class Kind {
    kNone,            // SPEC ""
    kFatalAfter,      // fatal-after:N
    kSlowTile,        // slow-tile:MS
    kSlowLoad,        // slow-load:MS
    kSkipCollective,  // skip-collective:RANK (CUDA)
    kStall,           // stall:RANK (CUDA)
    kStickyError,     // sticky-error:RANK (CUDA)
  };
  Kind kind = Kind::kNone;
  int64_t value = 0;  // N, MS or RANK; >= 0
  // Injected by the CUDA backend itself (CudaBackendOptions::test_fault).
  bool cuda() const {
    return kind == Kind::kSkipCollective || kind == Kind::kStall || kind == Kind::kStickyError;
  }
};

// The kind SPEC names (the text before ':'), whatever its value; kNone for "" or an unknown kind.
TestFaultSpec::Kind TestFaultKind(const std::string& spec);
// "" gives kind kNone. INVALID_ARGUMENT for an unknown kind, or a VALUE that is not an integer
// >= 0.
absl::StatusOr<TestFaultSpec> ParseTestFault(const std::string& spec);

// fatal-after:N or slow-tile:MS around `backend`; INVALID_ARGUMENT naming --test-fault for any
// other SPEC.
absl::StatusOr<std::unique_ptr<Backend>> WrapWithTestFault(std::unique_ptr<Backend> backend,
                                                           const std::string& spec);

// True for the kinds the CUDA backend injects itself (CudaBackendOptions::test_fault), whatever
// the value (the CUDA backend reports a bad one).
bool IsCudaTestFault(const std::string& spec);

// slow-load:MS: the delay before each head at start-up; zero for any other SPEC (or a bad MS).
std::chrono::milliseconds SlowLoadDelay(const std::string& spec);

}  // namespace logitserve
