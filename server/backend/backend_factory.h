// The backend a server runs on, chosen at start (SPEC §1): `auto` is CUDA when this build has it
// and a usable GPU is visible (compute capability checked against the architectures the binary
// holds code for), else the CPU backend with a warning; `cuda` fails when it cannot be had
// (never a kernel launch failure at request time); `cpu` is always available.
//
// Thread safety: call from any thread; creating a CUDA backend takes the devices it names.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/backend/backend.h"

namespace logitserve {

struct BackendSelection {
  std::string kind = "auto";  // auto | cpu | cuda
  std::vector<int> devices;   // CUDA ordinals; empty = every visible GPU
  int threads = 0;            // CPU: compute threads (0 = all cores)
  int shards = 1;             // CPU: vocabulary shards
  absl::Duration collective_timeout = absl::Seconds(60);  // CUDA: watchdog on waits/collectives
  // --test-fault, when it names a fault the CUDA backend injects itself (IsCudaTestFault).
  std::string cuda_test_fault;
};

// FAILED_PRECONDITION with IsBackendUnavailable() when `cuda` was asked for and this build has no
// CUDA or no usable GPU; otherwise the creating backend's own error.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(const BackendSelection& selection);

// True for CreateBackend's "the asked-for backend cannot exist here" error.
bool IsBackendUnavailable(const absl::Status& status);

}  // namespace logitserve
