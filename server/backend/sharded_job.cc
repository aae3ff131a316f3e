#include "server/backend/sharded_job.h"

#include <algorithm>
#include <utility>

namespace logitserve {

absl::Status ShardedRank::WaitTile(int64_t) { return absl::OkStatus(); }
absl::Status ShardedRank::EndTile(int64_t) { return absl::OkStatus(); }
void ShardedRank::OnFailure(const absl::Status&) {}

absl::Status RunShardedJob(const ScoreJob& job, const ShardedJobPlan& plan, JobFailure& failure,
                           ShardedRank& rank) {
  int64_t step = 0;
  absl::Status local = absl::OkStatus();  // the first failure since the previous checkpoint
  auto note = [&](absl::Status s) {
    if (s.ok()) return;
    rank.OnFailure(s);
    if (local.ok()) local = std::move(s);
  };
  // A checkpoint: true when the job stops here; `local` then holds this rank's status.
  auto stop = [&]() {
    if (step == plan.test_fail_step) {
      note(absl::InternalError("injected failure (test_fail_step)"));
    }
    const bool stop_here = failure.Failed(step++, plan.rank, !local.ok());
    if (stop_here && local.ok()) local = PeerFailed(failure.rank());
    return stop_here;
  };
  for (int64_t t = 0, row0 = 0; row0 < job.rows; ++t, row0 += plan.tile_rows) {
    const int64_t rows = std::min(plan.tile_rows, job.rows - row0);
    if (local.ok()) note(rank.WaitTile(t));
    // A stop (cancelled / expired) travels like a failure: every rank ends at this tile, and
    // nothing of it has been started.
    if (local.ok()) note(job.CheckStop(rows));
    if (local.ok()) note(rank.ComputeTile(row0, rows));
    if (stop()) return local;
    note(rank.Exchange(TileExchange::kStatistics));
    if (local.ok()) note(rank.FoldTile(row0, rows));
    if (plan.jsd_pass) {
      if (local.ok()) note(rank.JsdTile(row0, rows));
      if (stop()) return local;
      note(rank.Exchange(TileExchange::kJsdPartials));
      if (local.ok()) note(rank.JsdFinish(row0, rows));
    }
    if (local.ok()) note(rank.EndTile(t));
  }
  // No collective follows: a failure after the last checkpoint only needs reporting.
  if (!local.ok()) failure.Note(plan.rank);
  return local;
}

}  // namespace logitserve
