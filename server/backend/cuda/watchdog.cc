#include "server/backend/cuda/watchdog.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "server/backend/cuda/cuda_status.h"

namespace logitserve {

void FatalState::Fail(const absl::Status& error) {
  absl::MutexLock lock(&mu_);
  if (!status_.ok() || error.ok()) return;
  status_ = MarkFatalDeviceError(absl::InternalError(absl::StrCat(
      "the CUDA backend is out of service after a fatal device error: ", error.message())));
  failed_.store(true, std::memory_order_release);
}

absl::Status FatalState::status() const {
  if (!failed()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  return status_;
}

absl::Status PollUntil(absl::FunctionRef<absl::StatusOr<bool>()> poll, absl::Duration timeout,
                       const FatalState* fatal, absl::string_view what) {
  // Spin (yielding) for the first 2 ms, as cudaStreamSynchronize would: the end of a job is
  // on the caller's critical path, and a sleeping thread wakes up 50-100 us late. Then sleep
  // 50 us between polls: a rank keeps a tile queued behind the one it waits for, so a late
  // wake-up costs no GPU time.
  constexpr absl::Duration kSpin = absl::Milliseconds(2);
  constexpr absl::Duration kNap = absl::Microseconds(50);
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + timeout;
  for (;;) {
    LOGITSERVE_ASSIGN_OR_RETURN(bool done, poll());
    if (done) return absl::OkStatus();
    if (fatal != nullptr && fatal->failed()) {
      return absl::AbortedError(
          absl::StrCat(what, ": abandoned after a fatal device error elsewhere in the backend"));
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return MarkFatalDeviceError(absl::InternalError(
          absl::StrCat(what, ": no progress for ", absl::FormatDuration(timeout),
                       " (collective watchdog timeout)")));
    }
    if (now - start < kSpin) {
      std::this_thread::yield();
    } else {
      absl::SleepFor(kNap);
    }
  }
}

}  // namespace logitserve
