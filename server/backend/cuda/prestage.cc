#include "server/backend/cuda/prestage.h"

#include <algorithm>
#include <utility>

#include "logitserve/kernels/block_stats.h"
#include "server/backend/cuda/rank_worker.h"

namespace logitserve::cuda_internal {

Prestager::Prestager(std::vector<int> devices, int slots, size_t max_bytes, size_t copy_threads)
    : devices_(std::move(devices)), max_bytes_(max_bytes), copy_threads_(copy_threads) {
  if (copy_threads_ > 1) pool_ = std::make_unique<CopyPool>(copy_threads_ - 1);
  absl::MutexLock lock(&mu_);
  for (int i = 0; i < slots; ++i) slots_.push_back(std::make_unique<Slot>());
}

Prestager::~Prestager() = default;  // every lease is gone: each synchronized its slot

Prestager::Lease::~Lease() {
  if (owner_ != nullptr) owner_->Release(slot_);
}

const PrestagedTile* Prestager::Lease::tile() const {
  if (owner_ == nullptr) return nullptr;
  absl::MutexLock lock(&owner_->mu_);
  return &owner_->slots_[static_cast<size_t>(slot_)]->tile;
}

void Prestager::Release(int index) {
  Slot* slot = nullptr;
  {
    absl::MutexLock lock(&mu_);
    slot = slots_[static_cast<size_t>(index)].get();
  }
  // A job that failed before its first tile never waited for the uploads: they end before the
  // slot's buffers (or the caller's pinned input) may be reused. Otherwise already done.
  for (size_t r = 0; r < slot->streams.size(); ++r) {
    DeviceGuard guard(devices_[r]);
    if (guard.status().ok()) (void)cudaStreamSynchronize(slot->streams[r].get());
  }
  absl::MutexLock lock(&mu_);
  slot->busy = false;
}

Prestager::Lease Prestager::Stage(const ScoreJob& job, bool pair, int64_t tile_rows) {
  const DistributionInput* inputs[2] = {&job.model, pair ? &job.reference : nullptr};
  bool any = false;
  for (const DistributionInput* in : inputs) {
    any = any || (in != nullptr && in->hidden_mode() && !in->hidden.empty() &&
                  DeviceOf(in->hidden.data) < 0);
  }
  if (!any || tile_rows <= 0) return Lease();
  int index = -1;
  Slot* slot = nullptr;
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (!slots_[i]->busy) {
        slots_[i]->busy = true;
        index = static_cast<int>(i);
        slot = slots_[i].get();
        break;
      }
    }
  }
  if (slot == nullptr) return Lease();
  Lease lease(this, index);
  if (!StageInto(*slot, job, pair, tile_rows)) return Lease();  // `lease` frees the slot
  return lease;
}

bool Prestager::StageInto(Slot& slot, const ScoreJob& job, bool pair, int64_t tile_rows) {
  const size_t ranks = devices_.size();
  if (slot.streams.empty()) {  // first use: the slot's streams and events on every device
    slot.device.resize(ranks);
    slot.streams = std::vector<CudaStream>(ranks);
    slot.ready = std::vector<CudaEvent>(ranks);
    for (size_t r = 0; r < ranks; ++r) {
      DeviceGuard guard(devices_[r]);
      if (!guard.status().ok() || !slot.streams[r].Create(devices_[r]).ok() ||
          !slot.ready[r].Create(devices_[r]).ok()) {
        slot.streams.clear();
        return false;
      }
    }
  }
  PrestagedTile& tile = slot.tile;
  tile.rows = std::min(tile_rows, job.rows);
  tile.device.assign(ranks, {nullptr, nullptr});
  tile.ready.assign(ranks, nullptr);
  const DistributionInput* inputs[2] = {&job.model, pair ? &job.reference : nullptr};
  const void* sources[2] = {nullptr, nullptr};
  size_t bytes[2] = {0, 0};
  for (size_t d = 0; d < 2; ++d) {
    const DistributionInput* in = inputs[d];
    if (in == nullptr || !in->hidden_mode() || in->hidden.empty() ||
        DeviceOf(in->hidden.data) >= 0) {
      continue;
    }
    bytes[d] = static_cast<size_t>(tile.rows * in->hidden.cols * kernels::SizeOf(in->hidden.type));
    if (bytes[d] > max_bytes_) return false;
    sources[d] = in->hidden.data;
    if (IsPageable(in->hidden.data)) {  // through the slot's pinned rows
      if (!slot.host[d].Reserve(bytes[d]).ok()) return false;
      absl::MutexLock lock(&copy_mu_);
      CopyPool::Copy(pool_.get(), slot.host[d].data(), in->hidden.data, bytes[d], copy_threads_,
                     kStagingBytesPerThread);
      sources[d] = slot.host[d].data();
    }
  }
  for (size_t r = 0; r < ranks; ++r) {
    DeviceGuard guard(devices_[r]);
    if (!guard.status().ok()) return false;
    const cudaStream_t stream = slot.streams[r].get();
    for (size_t d = 0; d < 2; ++d) {
      if (sources[d] == nullptr) continue;
      DeviceBuffer& buffer = slot.device[r][d];
      if (!buffer.Reserve(devices_[r], bytes[d]).ok() ||
          cudaMemcpyAsync(buffer.data(), sources[d], bytes[d], cudaMemcpyHostToDevice, stream) !=
              cudaSuccess) {
        return false;
      }
      tile.device[r][d] = static_cast<const uint8_t*>(buffer.data());
    }
    if (cudaEventRecord(slot.ready[r].get(), stream) != cudaSuccess) return false;
    tile.ready[r] = slot.ready[r].get();
  }
  return true;
}

}  // namespace logitserve::cuda_internal
