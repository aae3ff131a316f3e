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
//                   real skipped collective, stalled kernel or illegal address), parsed there.
// Never enable it in production: it exists to be tested against.
//
// Thread safety: as the wrapped backend.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "server/backend/backend.h"

namespace logitserve {

// INVALID_ARGUMENT naming --test-fault for a malformed SPEC.
absl::StatusOr<std::unique_ptr<Backend>> WrapWithTestFault(std::unique_ptr<Backend> backend,
                                                           const std::string& spec);

// True for the kinds the CUDA backend injects itself (CudaBackendOptions::test_fault).
bool IsCudaTestFault(const std::string& spec);

// slow-load:MS: the delay before each head at start-up; zero for any other SPEC (or a bad MS).
std::chrono::milliseconds SlowLoadDelay(const std::string& spec);

}  // namespace logitserve
