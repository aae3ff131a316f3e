// Rank: everything one rank (one vocabulary shard on one device) of CudaBackend owns for the
// backend's lifetime: streams, events, cuBLASLt handle, workspaces, pinned buffers and its
// communicator; plus the small RAII pieces it is made of (Carver, LtHandle).
//
// Thread safety: a Rank is used by its worker thread during a job, under the backend's score
// mutex, and by the backend's thread when no job runs.
#pragma once

#include <cublasLt.h>

#include <array>
#include <cstddef>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "server/backend/communicator.h"
#include "server/backend/cuda/copy_pool.h"
#include "server/backend/cuda/cuda_status.h"
#include "server/backend/cuda/device_resources.h"
#include "server/backend/cuda/nccl_communicator.h"

namespace logitserve::cuda_internal {

namespace k = kernels;
namespace kc = kernels::cuda;

// Row tiles in flight per rank at most (tile_done events, a ring): the host waits for tile
// t - depth before it queues tile t (RankWorker::WaitTile picks depth <= kTileEvents), so stop
// checks and the watchdog stay within `depth` tiles of the device.
constexpr int kTileEvents = 16;

// Host threads of the output copy-back and of the staging of pageable hidden states at most
// (RankWorker::Finish, RankWorker::BeginTile).
constexpr size_t kOutputThreads = 8;
// A thread of the staging copy per this many bytes (a 2048-row tile of H = 4096 bf16 is 16 MiB).
constexpr size_t kStagingBytesPerThread = size_t{1} << 20;

// Carves one device buffer into 256-byte aligned pieces.
class Carver {
 public:
  size_t Add(size_t bytes) {
    const size_t at = total_;
    total_ += (bytes + 255) / 256 * 256;
    return at;
  }
  size_t total() const { return total_; }

 private:
  size_t total_ = 0;
};

// cuBLASLt handle owner.
class LtHandle {
 public:
  LtHandle() = default;
  ~LtHandle() {
    if (handle_ != nullptr) cublasLtDestroy(handle_);
  }
  LtHandle(const LtHandle&) = delete;
  LtHandle& operator=(const LtHandle&) = delete;
  absl::Status Create() {
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cublasLtCreate(&handle_));
    return absl::OkStatus();
  }
  cublasLtHandle_t get() const { return handle_; }

 private:
  cublasLtHandle_t handle_ = nullptr;
};

// Everything one rank (one vocabulary shard on one device) owns for the backend's lifetime.
// Used by the rank's worker thread during a job, under the backend's score mutex.
struct Rank {
  int index = 0;
  int device = 0;
  // `stream` (high priority) runs everything but hidden mode's GEMMs: statistics, collectives,
  // folds, copies. `gemm_stream` runs hidden mode's row-tile inputs and GEMMs, so that with more
  // than one logits slot (JobPlan::hidden_slots; chunk g of a job uses slot g % hidden_slots,
  // events below) the statistics of chunk c may overlap the GEMMs of chunk c + 1.
  CudaStream stream;
  CudaStream gemm_stream;
  static constexpr int kMaxHiddenSlots = 4;
  std::array<CudaEvent, kMaxHiddenSlots> slot_filled;  // gemm_stream: chunk g's logits are in place
  std::array<CudaEvent, kMaxHiddenSlots> slot_free;    // stream: chunk g's readers are done
  CudaEvent slots_released;  // stream: JSD pass done with the tile's kept chunks
  CudaEvent gemm_idle;       // joins gemm_stream into stream
  CudaEvent uploaded;        // gemm_stream: the job's set-up copies are done
  // CudaBackendOptions::hidden_gemm_streams = 2: the reference distribution's row-tile inputs
  // and GEMMs on their own stream (beside the policy's), with their own events and workspace.
  CudaStream gemm_stream_b;
  std::array<CudaEvent, kMaxHiddenSlots> slot_filled_b;
  CudaEvent gemm_idle_b;
  // Logits mode's row-tile pipeline (RankWorker::ComputeTile): the statistics of tile t run on
  // stats_streams[t % 2] (low priority) into message slot t % kMessageSlots while
  // `stream` runs the tail of tile t - 1 (gather, top-k selection, all-gather, fold, JSD pass);
  // copy_stream brings each tile's outputs back to pinned memory while later tiles compute.
  // Tile t + 2's statistics wait until tile t's tail is done with their slot. More slots (three
  // and four, so that they run on) measured no gain: top-k 64, whose tail is the longest, took
  // 0.547 / 0.551 ms bf16 and 0.526 / 0.530 fp16 with four / two on the H200, 0.609-0.626 /
  // 0.608-0.619 on the H100 (docs/PERFORMANCE.md, 2026-12-05 and 12-06).
  static constexpr int kMessageSlots = 2;
  std::array<CudaStream, 2> stats_streams;
  CudaStream copy_stream;
  std::array<CudaEvent, 2> stats_done;  // stats_streams[i]: its tile's records are written
  std::array<CudaEvent, kMessageSlots> message_free;  // stream: the tail is done with slot s
  CudaEvent outputs_ready;                            // stream: the tile's outputs are written
  std::array<CudaEvent, 3> side_idle;  // joins stats_streams[0], [1] and copy_stream into stream
  // Hidden mode's cuBLASLt tiles: tile t's hidden rows go up on upload_stream into raw buffer
  // t % 2 (RankWorker::BeginTile), so that tile t + 1's upload runs beside tile t's GEMMs instead
  // of before them on the GEMM stream (16 MiB a 2048-row tile at H = 4096: ~0.33 ms, 8 % of
  // the tile). Events by [distribution * 2 + t % 2] (model 0, reference 1).
  CudaStream upload_stream;
  std::array<CudaEvent, 4> raw_ready;  // upload_stream: the raw buffer holds the tile's rows
  std::array<CudaEvent, 4> raw_free;   // GEMM stream: the tile's split has read them
  CudaEvent upload_idle;               // joins upload_stream into stream
  LtHandle lt;
  DeviceBuffer cublas_workspace;
  DeviceBuffer cublas_workspace_b;     // gemm_stream_b's (hidden_gemm_streams = 2 only)
  DeviceBuffer workspace;              // per-job scratch, grown on demand
  PinnedBuffer host_staging;           // hidden rows from pageable memory, two tiles per input
  PinnedBuffer host_io;                // target ids up, outputs down: asynchronous copies
  std::unique_ptr<Communicator> comm;  // null when the backend has one rank
  NcclCommunicator* nccl = nullptr;    // comm, when it is NCCL
  // Tile t's work is done (and, on the reporting rank, its outputs are in host_io):
  // tile_done[t % kTileEvents], recorded on copy_stream (reporting rank) or stream.
  std::array<CudaEvent, kTileEvents> tile_done;
  std::unique_ptr<CopyPool> copy_pool;  // host copy threads (output copy-back, input staging)
  CudaEvent idle;                       // "everything queued so far is done"
  ~Rank() {
    comm.reset();  // before the stream it uses
    DeviceGuard guard(device);
    workspace.Free();
    cublas_workspace.Free();
    cublas_workspace_b.Free();
  }
};

// Makes rank.stream wait for everything queued so far on gemm_stream, stats_streams and
// upload_stream (and on copy_stream when `with_copies`): one event then covers all of the rank's
// work.
inline absl::Status JoinSideStreams(Rank& rank, bool with_copies) {
  const std::pair<cudaStream_t, cudaEvent_t> sides[] = {
      {rank.gemm_stream.get(), rank.gemm_idle.get()},
      {rank.gemm_stream_b.get(), rank.gemm_idle_b.get()},
      {rank.stats_streams[0].get(), rank.side_idle[0].get()},
      {rank.stats_streams[1].get(), rank.side_idle[1].get()},
      {rank.copy_stream.get(), rank.side_idle[2].get()},
      {rank.upload_stream.get(), rank.upload_idle.get()}};
  for (const auto& [side, event] : sides) {
    if (side == rank.copy_stream.get() && !with_copies) continue;
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaEventRecord(event, side));
    LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(rank.stream.get(), event, 0));
  }
  return absl::OkStatus();
}

}  // namespace logitserve::cuda_internal
