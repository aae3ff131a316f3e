// The tile loop every rank of a sharded job runs, written once for every backend. Per row tile:
//
//   WaitTile -> stop check (ScoreJob::CheckStop) -> ComputeTile -> checkpoint -> Exchange(tile)
//     -> FoldTile -> [JSD pass: JsdTile -> checkpoint -> Exchange(JSD) -> JsdFinish] -> EndTile
//
// A rank is a ShardedRank: the backend's per-rank worker (CPU: one thread per vocabulary shard;
// CUDA: one host thread per GPU) implements the hooks; RunShardedJob calls them in this order and
// owns the failure protocol. Before every collective (the checkpoints) the ranks agree through
// JobFailure whether any of them has failed since the previous one; if so every rank returns
// there, the failing rank with its own status and the others with PeerFailed, so none is left
// waiting in a collective its peers skipped. A stop (cancelled / expired) travels like a failure.
// After a local failure a rank runs no further hook (except OnFailure) up to the next checkpoint.
//
// The hooks say what happens, not how: a fused GEMM + statistics step is one ComputeTile; a fused
// statistics + fold kernel on one rank makes Exchange and FoldTile do nothing; a backend that
// queues work asynchronously (CUDA) bounds how far the host runs ahead in WaitTile / EndTile.
//
// Thread safety: RunShardedJob runs on the rank's own thread; ranks of one job meet only through
// JobFailure and the collectives their Exchange hooks run.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "server/backend/backend.h"
#include "server/backend/job_failure.h"

namespace logitserve {

// The two collectives of a tile: the per-block statistics message (statistics, top-k lists,
// target logits) and, with a JSD pass, the per-block JSD partials.
enum class TileExchange { kStatistics, kJsdPartials };

// One rank's part of a sharded job. Every hook but OnFailure returns the rank's failure; rows
// [row0, row0 + rows) of the job make up the tile.
class ShardedRank {
 public:
  virtual ~ShardedRank() = default;

  // Before tile `tile` (0, 1, ...) is started: may wait until earlier tiles' work is done (a bound
  // on work queued ahead of the host). Default: nothing.
  virtual absl::Status WaitTile(int64_t tile);
  // The per-block statistics of the rank's vocabulary shard for the tile (and, as the backend
  // chooses, its top-k lists and target logits): the message Exchange(kStatistics) sends.
  virtual absl::Status ComputeTile(int64_t row0, int64_t rows) = 0;
  // The all-gather of this rank's message (statistics or JSD partials) with every rank's.
  virtual absl::Status Exchange(TileExchange what) = 0;
  // Folds the gathered statistics in global block order (identical bits on every rank) and, on
  // the reporting rank, writes the tile's outputs.
  virtual absl::Status FoldTile(int64_t row0, int64_t rows) = 0;
  // JSD pass only (0 < beta < 1): the rank's per-block JSD partials, normalised by the folded rows.
  virtual absl::Status JsdTile(int64_t row0, int64_t rows) = 0;
  // JSD pass only: sums the gathered partials in global block order into the JSD output.
  virtual absl::Status JsdFinish(int64_t row0, int64_t rows) = 0;
  // After the tile's work (skipped once the rank has failed). Default: nothing.
  virtual absl::Status EndTile(int64_t tile);
  // Every failure the rank records, once, as it is recorded (e.g. to report a fatal device error
  // at once to other waiters). Default: nothing.
  virtual void OnFailure(const absl::Status& status);
};

// How the job is cut into tiles, and this rank's place in it.
struct ShardedJobPlan {
  int64_t tile_rows = 0;  // rows per tile (the last tile may be shorter)
  bool jsd_pass = false;  // 0 < jsd_beta < 1: the second pass runs
  int rank = 0;           // this rank's index (JobFailure's rank)
  // Tests only: this rank fails with INTERNAL at checkpoint number test_fail_step (numbered from
  // 0 in the order above: one per tile, two with a JSD pass). -1 = never.
  int64_t test_fail_step = -1;
};

// Runs every tile of `job` on `rank`. Returns the rank's status: OK, its own failure, or
// PeerFailed when another rank's failure stopped it. A failure after the last checkpoint is
// recorded with JobFailure::Note.
absl::Status RunShardedJob(const ScoreJob& job, const ShardedJobPlan& plan, JobFailure& failure,
                           ShardedRank& rank);

}  // namespace logitserve
