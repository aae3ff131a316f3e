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

#include "absl/status/status.h"
#include "server/backend/communicator.h"
#include "server/backend/cuda/cuda_status.h"
#include "server/backend/cuda/device_resources.h"
#include "server/backend/cuda/nccl_communicator.h"

namespace logitserve::cuda_internal {

namespace k = kernels;
namespace kc = kernels::cuda;

// Row tiles in flight per rank (tile_done events): the host waits for tile t - 2 before it queues
// tile t, so the GPU always has the next tile queued while stop checks and the watchdog stay
// within two tiles of the device.
constexpr int kTileEvents = 2;

// Pieces (and host threads) of the output copy-back at most (RankWorker::Finish).
constexpr size_t kOutputPieces = 8;

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
  // folds, copies. `gemm_stream` runs hidden mode's row-tile inputs and GEMMs, so the statistics
  // of chunk c overlap the GEMMs of chunk c + 1 (double-buffered logits slots, events below).
  CudaStream stream;
  CudaStream gemm_stream;
  std::array<CudaEvent, 2> slot_filled;  // gemm_stream: chunk g's logits are in slot g % 2
  std::array<CudaEvent, 2> slot_free;    // stream: chunk g's readers are done with slot g % 2
  CudaEvent slots_released;              // stream: JSD pass done with the tile's kept chunks
  CudaEvent gemm_idle;                   // joins gemm_stream into stream
  CudaEvent uploaded;                    // gemm_stream: the job's set-up copies are done
  std::array<CudaEvent, kOutputPieces> output_pieces;  // stream: output piece i is on the host
  LtHandle lt;
  DeviceBuffer cublas_workspace;
  DeviceBuffer workspace;              // per-job scratch, grown on demand
  PinnedBuffer host_staging;           // hidden rows from pageable memory, two tiles per input
  PinnedBuffer host_io;                // target ids up, outputs down: asynchronous copies
  std::unique_ptr<Communicator> comm;  // null when the backend has one rank
  NcclCommunicator* nccl = nullptr;    // comm, when it is NCCL
  std::array<CudaEvent, kTileEvents> tile_done;  // tile t recorded in tile_done[t % kTileEvents]
  CudaEvent idle;                                // "everything queued so far is done"
  ~Rank() {
    comm.reset();  // before the stream it uses
    DeviceGuard guard(device);
    workspace.Free();
    cublas_workspace.Free();
  }
};

}  // namespace logitserve::cuda_internal
