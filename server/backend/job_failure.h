// How the ranks of one sharded job fail together: JobFailure (the checkpoint agreement every
// rank takes before each collective) and PeerFailed (the status of a rank stopped by another's
// failure). Shared by the backends' rank workers.
//
// Thread safety: JobFailure is called by every rank thread of one job concurrently.
#pragma once

#include <cstdint>
#include <limits>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/backend/host_barrier.h"

namespace logitserve {

// The first failure of a job, shared by its rank threads so that every rank takes the same
// decision before each collective. Ranks meet at numbered checkpoints (the same sequence on every
// rank: one before each all-gather); a rank that failed since its previous checkpoint records the
// checkpoint's number, and after the barrier every rank compares the recorded number with its own:
// all stop at the same checkpoint, so none is left waiting in a collective its peers skipped.
// Later failures (a rank that has already passed checkpoint s failing before s + 1) cannot change
// the decision at s: they record s + 1 or later.
class JobFailure {
 public:
  explicit JobFailure(int ranks) : barrier_(ranks) {}
  // Every rank calls this at checkpoint `step` with its failure since the previous one. True:
  // some rank failed (at this checkpoint or before); every rank gets the same answer.
  bool Failed(int64_t step, int rank, bool failed_locally) {
    if (failed_locally) {
      absl::MutexLock lock(&mu_);
      if (step < step_ || (step == step_ && rank < rank_)) {
        step_ = step;
        rank_ = rank;
      }
    }
    if (barrier_.size() > 1) barrier_.Wait();
    absl::MutexLock lock(&mu_);
    return step_ <= step;
  }
  // Records a failure after the last checkpoint (nothing depends on it but the returned status).
  void Note(int rank) {
    absl::MutexLock lock(&mu_);
    if (rank_ < 0) rank_ = rank;
  }
  // The rank whose status the job returns, or -1.
  int rank() const {
    absl::MutexLock lock(&mu_);
    return rank_;
  }

 private:
  HostBarrier barrier_;
  mutable absl::Mutex mu_;
  int64_t step_ ABSL_GUARDED_BY(mu_) = std::numeric_limits<int64_t>::max();
  int rank_ ABSL_GUARDED_BY(mu_) = -1;
};

// What a rank reports when another rank failed: ABORTED, naming the shard whose own status the
// job returns.
inline absl::Status PeerFailed(int rank) {
  return absl::AbortedError(absl::StrCat("vocabulary shard ", rank, " failed"));
}

}  // namespace logitserve
