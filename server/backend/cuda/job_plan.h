// JobPlan: the read-only description of one CudaBackend job that its rank workers share (layout,
// tile sizes, message layout, which inputs are read in place), and the tile-size constants the
// planner and the workers agree on. Built by CudaBackend::Plan on the calling thread before the
// rank threads start; never written after.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "logitserve/kernels/block_stats.h"
#include "logitserve/kernels/cuda_kernels.h"
#include "server/backend/backend.h"
#include "server/backend/cuda/prestage.h"

namespace logitserve::cuda_internal {

namespace k = kernels;
namespace kc = kernels::cuda;

// Logits mode: most rows per tile (bounds the per-rank message, O(rows * (blocks + top_k))).
constexpr int64_t kMaxLogitsTileRows = 8192;
// Logits mode with top-k, CudaBackendOptions::logits_tile_rows = 0: rows per pipelined tile
// (H200, [8192 x 75968], Score wall clock, logitserve-kernel-bench --logits-tile-rows; with the
// selection kernels of eb37afc: k = 64 tiles of 4096 / 2048 / 1024 / 512 rows 0.677 / 0.645 /
// 0.665 / 0.925 ms (fp16: 2048 0.637, 1024 0.705); k = 1024 3.657 / 3.351 / 3.148 / 3.159 (fp16:
// 2048 3.172, 1024 3.066); before them one 8192-row tile cost 0.760 and 5.90 ms). A small k's
// selection is short, so fewer, larger tiles cost less host time; a large k's is long enough
// that a finer pipeline hides more of it. Without top-k one tile measured best (logprobs 0.321
// ms against 0.334 with 1024-row tiles, JSD 1.626 against 1.747): their tails are mostly fixed
// latency.
inline int64_t TopKTileRows(int32_t k) { return k <= 128 ? 2048 : 1024; }
// Fused hidden mode, CudaBackendOptions::hidden_fused_tile_rows = 0: rows per pipelined tile
// (consecutive tiles' kernels run on the two statistics streams, so one tile's last wave can share
// the GPU with the next tile's first), and at most the rows whose two logits slots per
// distribution fit in kFusedLogitsBytes when top-k or JSD keep them. H200, N 8192, H 1024, V
// 151936 pair, cluster 2x1 (logitserve-kernel-bench --fused-configs, three alternations, session
// of 2026-12-06 00:40 UTC): 512 / 1024 / 2048-row tiles 10.10-10.11 / 9.84-9.85 / 10.04-10.08 ms.
constexpr int64_t kFusedTileRows = 1024;
constexpr int64_t kFusedLogitsBytes = int64_t{512} << 20;
// first_bad_row's "no bad row" value (cudaMemset byte 0x7f).
constexpr int32_t kNoBadRow = 0x7f7f7f7f;

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline int64_t CeilDiv(int64_t x, int64_t m) { return (x + m - 1) / m; }

// Rows per row tile of a fused hidden-mode job (JobPlan::fused): `option_rows`
// (CudaBackendOptions::hidden_fused_tile_rows) or kFusedTileRows, fewer when the job keeps its
// logits (`widest`: the slot's columns).
inline int64_t FusedTileRows(int64_t option_rows, const ScoreJob& job, bool keeps_logits,
                             int64_t widest) {
  int64_t rows = option_rows > 0 ? option_rows : kFusedTileRows;
  if (keeps_logits && option_rows == 0) {
    const int64_t dists = job.NeedsReference() ? 2 : 1;
    rows = std::min(rows, kFusedLogitsBytes / (2 * dists * widest * 4));
  }
  // Whole 128-row CTA tiles, no more than the job needs (any count gives the same bits).
  rows = std::min(rows, RoundUp(job.rows, 128));
  return std::max<int64_t>(rows / 128 * 128, 128);
}

// Read-only description of one job, shared by the rank workers.
// CudaBackendOptions::hidden_fused_cluster "auto": clusters of two row tiles (each CTA pair
// shares its weight tiles by multicast) once a launch has enough rows to fill them, else 2x2.
inline constexpr int64_t kFusedAutoClusterRows = 512;
inline kc::HiddenCluster FusedAutoCluster(int64_t rows) {
  return rows >= kFusedAutoClusterRows ? kc::HiddenCluster::k2x1 : kc::HiddenCluster::k2x2;
}

struct JobPlan {
  const ScoreJob* job = nullptr;
  std::vector<ShardRange> layout;
  kc::ShardBlocks shards;
  int64_t num_blocks = 0;
  int64_t max_blocks = 0;
  bool pair = false;
  bool jsd_pass = false;  // 0 < beta < 1: second pass
  int32_t jsd_endpoint = 0;
  bool any_hidden = false;
  // Hidden mode through the fused GEMM + statistics kernel (kc::LaunchHiddenStats; every
  // distribution of the job in hidden mode, a Hopper GPU on every rank): the job then runs as a
  // row-tile pipeline like logits mode (RankWorker::ComputeLogitsTile), each tile's fused launch
  // in place of its statistics launch. `fused_logits`: top-k or a JSD pass reads the logits again,
  // so the fused launch also writes them into two alternating slots of [tile_rows][chunk_cols].
  bool fused = false;
  bool fused_logits = false;
  std::optional<kc::HiddenCluster> fused_cluster;  // none: FusedAutoCluster(the launch's rows)
  // Hidden mode: the GEMMs run on the rank's second stream, overlapping the statistics of the
  // previous chunk (CudaBackendOptions::overlap_hidden_gemms); else both on one stream.
  bool overlap_gemms = false;
  // ... and the reference distribution's on the rank's gemm_stream_b
  // (CudaBackendOptions::hidden_gemm_streams).
  bool two_gemm_streams = false;
  // Logits slots per distribution of the cuBLASLt-tile path (CudaBackendOptions::hidden_slots).
  int hidden_slots = 1;
  int64_t tile_rows = 0;  // rows per tile (the last tile may hold fewer)
  // Vocabulary columns per statistics launch (hidden mode: the slot width, a whole number of GEMM
  // chunks, CudaBackendOptions::hidden_stats_chunks).
  int64_t chunk_cols = 0;
  kc::TileMessage msg;
  std::vector<bool> model_zero_copy;  // per rank: the model logits already live on its device
  std::vector<bool> ref_zero_copy;
  // Some logits input lives in pageable host memory: its per-tile copy waits (in the driver,
  // without a time limit) for the rank's stream, so a rank lets only one tile run ahead of the
  // host. (Pageable hidden states are staged through pinned memory instead: no such wait.)
  bool pageable_logits = false;
  bool model_pageable_hidden = false;
  bool ref_pageable_hidden = false;
  // Hidden mode: the first tile's host rows already on the ranks' devices (prestage.h), or null.
  const PrestagedTile* prestaged = nullptr;
};

// The statistics records inside one rank's tile message (kc::TileMessage's layout).
inline k::PairBlockStats* StatsOf(uint8_t* msg, const kc::TileMessage& m) {
  return reinterpret_cast<k::PairBlockStats*>(msg + m.stats_offset);
}

}  // namespace logitserve::cuda_internal
