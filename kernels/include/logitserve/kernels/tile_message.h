// The message one rank contributes per row tile of a sharded job, one layout for every backend
// (the CPU backend's host buffers and the CUDA backend's device buffers). Every rank of a job uses
// the same layout, so a gathered buffer holds rank r's message at byte r * bytes. Sections (each
// 256-byte aligned):
//   stats   [rows][max_blocks] PairBlockStats of the rank's blocks (local block index)
//   topk    [rows][top_k] TopKEntry, best first, and count [rows] int32
//   targets [rows][ids_per_row] float: z of each target id in the rank's shard
// A rank's failure is not in the message: ranks agree on failures before each exchange
// (server/backend/job_failure.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "logitserve/kernels/block_stats.h"
#include "logitserve/kernels/cpu_kernels.h"  // TopKEntry

namespace logitserve::kernels {

struct TileMessage {
  int64_t rows = 0;
  int64_t max_blocks = 0;
  int32_t top_k = 0;
  int32_t ids_per_row = 0;
  size_t stats_offset = 0;
  size_t topk_offset = 0;
  size_t count_offset = 0;
  size_t target_offset = 0;
  size_t bytes = 0;
};

// The layout for tiles of `rows` rows, the widest shard's `max_blocks` blocks, top_k and
// ids_per_row of the job.
inline TileMessage MakeTileMessage(int64_t rows, int64_t max_blocks, int32_t top_k,
                                   int32_t ids_per_row) {
  auto align = [](size_t x) { return (x + 255) / 256 * 256; };
  TileMessage m;
  m.rows = rows;
  m.max_blocks = max_blocks;
  m.top_k = top_k;
  m.ids_per_row = ids_per_row;
  const size_t r = static_cast<size_t>(rows);
  m.stats_offset = 0;
  m.topk_offset =
      align(m.stats_offset + sizeof(PairBlockStats) * r * static_cast<size_t>(max_blocks));
  m.count_offset = align(m.topk_offset + sizeof(TopKEntry) * r * static_cast<size_t>(top_k));
  m.target_offset = align(m.count_offset + sizeof(int32_t) * r);
  m.bytes = align(m.target_offset + sizeof(float) * r * static_cast<size_t>(ids_per_row));
  return m;
}

}  // namespace logitserve::kernels
