// Fatal device errors and the collective watchdog of the CUDA backend.
//
//   FatalState  the backend's health: OK until the first fatal device error (IsFatalDeviceError:
//               a sticky CUDA error, an NCCL error, a watchdog timeout), then that error for good.
//   PollUntil   waits for a device-side condition (an event, an NCCL operation in progress)
//               without ever blocking inside the driver: polls with a short back-off until the
//               condition holds, the poll fails, the backend turns fatal on another thread, or the
//               timeout passes. A timeout is itself a fatal device error.
//
// Why polling: cudaStreamSynchronize / cudaEventSynchronize block forever when a collective never
// completes (a peer that died or never joined), and a thread blocked there can neither report the
// failure nor let the communicators be aborted.
//
// Thread safety: FatalState may be used from any thread. PollUntil runs on the calling thread.
#pragma once

#include <atomic>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace logitserve {

class FatalState {
 public:
  // Records `error` (a fatal device error) unless one is already recorded, as INTERNAL saying the
  // backend is out of service, with the original message.
  void Fail(const absl::Status& error);
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // OK, or the recorded error (IsFatalDeviceError holds for it).
  absl::Status status() const;

 private:
  std::atomic<bool> failed_{false};
  mutable absl::Mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

// Calls `poll` until it returns true (OK), or returns: poll's error; ABORTED when `fatal` (may be
// null) turns failed meanwhile (the caller stops; the job returns the fatal error); a fatal
// INTERNAL error naming `what` when `timeout` passes first (the collective watchdog).
absl::Status PollUntil(absl::FunctionRef<absl::StatusOr<bool>()> poll, absl::Duration timeout,
                       const FatalState* fatal, absl::string_view what);

}  // namespace logitserve
