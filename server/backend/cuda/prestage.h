// Prestager: a hidden-mode job's first row tile, copied from host memory to every rank's device
// before the job takes the ranks (CudaBackend::Score holds them, one job at a time, until its
// kernels are done). With two scheduler workers the next job waits for the ranks while the
// current one computes; without a prestage its first tile's host staging and upload started only
// then, with the GPU idle: the job trace of a pipelined client's 511-row jobs on the H200 showed
// ~0.27 ms of staging and ~0.1 ms of upload before each job's first GEMM, against ~1.1 ms of
// GEMMs and statistics, and the GPU busy ~80 % of the time. Prestaged, those copies run beside
// the previous job's kernels (their own stream per slot and rank); the job's first tile then
// only waits for the slot's `ready` event. Later tiles are staged by the ranks as before
// (RankWorker::BeginTile), behind earlier tiles' GEMMs.
//
// A slot holds one job's tile: pinned host rows (for pageable inputs) and, per rank, device rows
// of each distribution in hidden mode (0 the model, 1 the reference). Slots are few (as many as
// jobs that wait for the ranks at once: the scheduler's workers) and sized on first use, at most
// `max_bytes` per distribution; a job without a free slot, or with a larger first tile, is
// staged by its ranks as before. The bytes uploaded are the job's own: nothing changes a bit.
//
// Thread safety: Stage from any thread; a Lease is used by the job that got it and released by
// its destructor (after the job's kernels are done: Score waits for that).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "server/backend/backend.h"
#include "server/backend/cuda/copy_pool.h"
#include "server/backend/cuda/device_resources.h"

namespace logitserve::cuda_internal {

// What a prestaged job's rank workers read (JobPlan::prestaged).
struct PrestagedTile {
  int64_t rows = 0;  // the first tile's rows
  // [rank][distribution]: those rows on the rank's device (same dtype and layout as the input),
  // or null where that distribution is not prestaged.
  std::vector<std::array<const uint8_t*, 2>> device;
  std::vector<cudaEvent_t> ready;  // [rank]: recorded after the rank's uploads
};

class Prestager {
 public:
  // `devices`: each rank's device ordinal; `slots`: jobs that may hold a prestaged tile at once;
  // `copy_threads`: host threads of the pinned staging copy (the caller's included).
  Prestager(std::vector<int> devices, int slots, size_t max_bytes, size_t copy_threads);
  ~Prestager();
  Prestager(const Prestager&) = delete;
  Prestager& operator=(const Prestager&) = delete;

  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept : owner_(other.owner_), slot_(other.slot_) {
      other.owner_ = nullptr;
    }
    Lease& operator=(Lease&&) = delete;
    Lease(const Lease&) = delete;
    ~Lease();
    // Null when nothing was prestaged.
    const PrestagedTile* tile() const;

   private:
    friend class Prestager;
    Lease(Prestager* owner, int slot) : owner_(owner), slot_(slot) {}
    Prestager* owner_ = nullptr;
    int slot_ = -1;
  };

  // Copies rows [0, tile_rows) of every host-memory hidden-state input of `job` (`pair`: the
  // reference's too) to every rank's device, asynchronously on the slot's streams. An empty
  // lease (nothing prestaged) when no slot is free, no input is in host memory, the tile exceeds
  // max_bytes, or a CUDA call fails (the job's own copies then meet and report any device error).
  Lease Stage(const ScoreJob& job, bool pair, int64_t tile_rows);

 private:
  struct Slot {
    bool busy = false;
    PinnedBuffer host[2];
    std::vector<std::array<DeviceBuffer, 2>> device;  // [rank][distribution]
    std::vector<CudaStream> streams;                  // [rank]
    std::vector<CudaEvent> ready;                     // [rank]
    PrestagedTile tile;
  };
  bool StageInto(Slot& slot, const ScoreJob& job, bool pair, int64_t tile_rows);
  void Release(int slot);

  const std::vector<int> devices_;
  const size_t max_bytes_;
  const size_t copy_threads_;
  std::unique_ptr<CopyPool> pool_;  // used under copy_mu_ (CopyPool::Run: one caller at a time)
  absl::Mutex copy_mu_;
  absl::Mutex mu_;
  std::vector<std::unique_ptr<Slot>> slots_ ABSL_GUARDED_BY(mu_);
};

}  // namespace logitserve::cuda_internal
