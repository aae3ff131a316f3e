// RankWorker's output copy-back (see rank_worker.h): each tile's output slices from the device to
// pinned host memory as the tile finishes (CopyTileOutputs, from EndTile), and from there into the
// result on the host (WaitTile for early tiles, Finish for the rest, on several threads when
// large). A second file of rank_worker.cc's class, which would otherwise pass 700 lines.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "server/backend/cuda/cuda_status.h"
#include "server/backend/cuda/job_trace.h"
#include "server/backend/cuda/rank_worker.h"

namespace logitserve::cuda_internal {

namespace {

// Host threads for `bytes` of output copies: one per 512 KB, at most half the cores and
// kOutputThreads (one core copies ~10 GB/s: the 4 MB of a top-k = 64 output for 8192 rows took
// as long on one as the top-k kernels, and 64 MB for k = 1024 ten times longer).
size_t CopyThreads(size_t bytes) {
  constexpr size_t kPerThread = size_t{512} << 10;
  return std::clamp<size_t>((bytes + kPerThread - 1) / kPerThread, 1, MaxCopyThreads());
}

}  // namespace

std::vector<HostCopy> RankWorker::TileHostCopies(int64_t tile) const {
  std::vector<HostCopy> copies;
  const size_t n = static_cast<size_t>(job_.rows);
  const size_t row0 = static_cast<size_t>(tile * plan_.tile_rows);
  const size_t rows = static_cast<size_t>(TileRows(tile));
  const uint8_t* io = rank_.host_io.data() + io_outputs_at_;
  for (size_t i = 0; i < out_bytes_.size(); ++i) {
    if (out_bytes_[i] == 0) continue;
    const size_t per_row = out_bytes_[i] / n;  // every output is [n][per-row entries]
    copies.push_back({static_cast<uint8_t*>(out_dst_[i]) + row0 * per_row,
                      io + out_at_[i] + row0 * per_row, rows * per_row});
  }
  return copies;
}

absl::Status RankWorker::CopyTileOutputs(int64_t tile) {
  const bool last = tile + 1 == num_tiles_;
  // Earlier tiles on copy_stream, behind the tile's outputs (an event): their copies overlap the
  // next tiles' work. The last tile's copies are the end of the job: straight on `stream`, one
  // cross-stream hop less.
  const cudaStream_t copy = last ? stream() : rank_.copy_stream.get();
  if (!last) {
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaEventRecord(rank_.outputs_ready.get(), stream()));
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(copy, rank_.outputs_ready.get(), 0));
  }
  // The tile's slice of each output (offsets in the device block and in its staging alike), and
  // for the last tile the bad-row markers (every fold has run), in increasing order.
  std::vector<std::pair<size_t, size_t>> ranges;  // [begin, end)
  if (last) ranges.emplace_back(0, 2 * sizeof(int32_t));
  const size_t n = static_cast<size_t>(job_.rows);
  const size_t row0 = static_cast<size_t>(tile * plan_.tile_rows);
  const size_t rows = static_cast<size_t>(TileRows(tile));
  for (size_t i = 0; i < out_bytes_.size(); ++i) {
    if (out_bytes_[i] == 0) continue;
    const size_t per_row = out_bytes_[i] / n;
    ranges.emplace_back(out_at_[i] + row0 * per_row, out_at_[i] + (row0 + rows) * per_row);
  }
  // Ranges less than kMergeGap apart go in one copy: a copy costs a few us of latency, a 64 KB
  // gap about 1.3 us of PCIe time (the last tile of a logprobs job: markers and slice in one).
  // The gap's bytes are other tiles' rows: earlier ones final (rewritten with the same values),
  // later ones not yet, and rewritten by their own tile's copy, which runs after this one (one
  // copy stream; the last tile's copies wait for it, EndTile). The host reads a tile's rows only
  // after that tile's event.
  constexpr size_t kMergeGap = size_t{64} << 10;
  uint8_t* io = rank_.host_io.data() + io_outputs_at_;
  for (size_t i = 0; i < ranges.size();) {
    size_t end = ranges[i].second, j = i + 1;
    while (j < ranges.size() && ranges[j].first - end <= kMergeGap) end = ranges[j++].second;
    const size_t at = ranges[i].first;
    LOGITSERVE_RETURN_IF_CUDA_ERROR(
        cudaMemcpyAsync(io + at, out_block_ + at, end - at, cudaMemcpyDeviceToHost, copy));
    i = j;
  }
  LOGITSERVE_RETURN_IF_CUDA_ERROR(
      cudaEventRecord(rank_.tile_done[static_cast<size_t>(tile % kTileEvents)].get(), copy));
  JobTrace::Mark("outputs copied", copy);
  return absl::OkStatus();
}
absl::Status RankWorker::Finish(bool copy, int32_t* first_bad) {
  DeviceGuard guard(rank_.device);
  LOGITSERVE_RETURN_IF_ERROR(guard.status());
  LOGITSERVE_RETURN_IF_ERROR(IssueUploads());
  // Work still queued reads the request's memory and this rank's workspace: it must be done
  // before Score returns. On the reporting rank after a successful job, the last tile's event
  // covers all of it (EndTile); every other rank waits here.
  if (!(copy && reports_)) {
    LOGITSERVE_RETURN_IF_ERROR(WaitIdle("job end"));
  } else {
    // The tiles WaitTile has not copied: each tile's slices split over the threads, every thread
    // going through the tiles in order and starting on each as soon as its event has fired, so
    // the host copies of early tiles overlap the computation and the device-to-host copies of
    // later ones.
    std::vector<std::vector<HostCopy>> tiles;
    size_t total = 0;
    for (int64_t t = copied_; t < num_tiles_; ++t) {
      tiles.push_back(TileHostCopies(t));
      for (const HostCopy& c : tiles.back()) total += c.bytes;
    }
    const size_t n = CopyThreads(total);
    std::vector<SplitCopy> splits;
    for (auto& copies : tiles) splits.emplace_back(std::move(copies), n);
    // Only the caller's share (i = 0) polls the tiles' events, and publishes how many have landed;
    // the other threads watch that counter instead of each polling the driver.
    std::atomic<int64_t> landed{0};  // tiles of `splits` whose copies are in host_io; -1: failed
    absl::Status waited;
    auto run = [&](size_t i) {
      for (size_t j = 0; j < splits.size(); ++j) {
        const int64_t t = copied_ + static_cast<int64_t>(j);
        if (i == 0) {
          waited =
              WaitFor(rank_.tile_done[static_cast<size_t>(t % kTileEvents)].get(), "output copy");
          landed.store(waited.ok() ? static_cast<int64_t>(j) + 1 : -1, std::memory_order_release);
          if (!waited.ok()) return;
          if (j + 1 == splits.size()) JobTrace::Mark("last tile's outputs landed");
        } else {
          // No timeout of its own: the caller's wait has the watchdog's and then publishes -1.
          (void)PollUntil(
              [&]() -> absl::StatusOr<bool> {
                const int64_t l = landed.load(std::memory_order_acquire);
                return l < 0 || l > static_cast<int64_t>(j);
              },
              absl::InfiniteDuration(), nullptr, "output copy");
          if (landed.load(std::memory_order_acquire) < 0) return;
        }
        splits[j].Run(i);
      }
    };
    if (n > 1 && rank_.copy_pool != nullptr) {
      rank_.copy_pool->Run(n, run);
    } else {
      for (size_t i = 0; i < n; ++i) run(i);
    }
    LOGITSERVE_RETURN_IF_ERROR(waited);
    JobTrace::Mark("host copies done");
    copied_ = num_tiles_;
    std::memcpy(first_bad, rank_.host_io.data() + io_outputs_at_, 2 * sizeof(int32_t));
  }
  if (rank_.nccl != nullptr) return rank_.nccl->AsyncError();
  return absl::OkStatus();
}

}  // namespace logitserve::cuda_internal
