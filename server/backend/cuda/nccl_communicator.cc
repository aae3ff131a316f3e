#include "server/backend/cuda/nccl_communicator.h"

#include <cstdlib>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "server/backend/cuda/cuda_status.h"
#include "server/backend/cuda/device_resources.h"

namespace logitserve {

NcclCommunicator::~NcclCommunicator() {
  DeviceGuard guard(device_);
  ncclCommDestroy(comm_);
}

absl::Status NcclCommunicator::AllGather(const void* send, void* recv, size_t bytes) {
  DeviceGuard guard(device_);
  LOGITSERVE_RETURN_IF_CUDA_ERROR(ncclAllGather(send, recv, bytes, ncclUint8, comm_, stream_));
  return absl::OkStatus();
}

absl::Status NcclCommunicator::AsyncError() const {
  ncclResult_t async = ncclSuccess;
  LOGITSERVE_RETURN_IF_CUDA_ERROR(ncclCommGetAsyncError(comm_, &async));
  LOGITSERVE_RETURN_IF_CUDA_ERROR(async);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateNcclCommunicators(
    const std::vector<int>& devices, const std::vector<cudaStream_t>& streams) {
  const int n = static_cast<int>(devices.size());
  if (n < 1 || streams.size() != devices.size()) {
    return absl::InvalidArgumentError("CreateNcclCommunicators: one stream per device");
  }
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  std::vector<ncclComm_t> comms(static_cast<size_t>(n), nullptr);
  LOGITSERVE_RETURN_IF_CUDA_ERROR(ncclCommInitAll(comms.data(), n, devices.data()));
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < n; ++r) {
    out.push_back(std::make_unique<NcclCommunicator>(comms[static_cast<size_t>(r)],
                                                     devices[static_cast<size_t>(r)], r, n,
                                                     streams[static_cast<size_t>(r)]));
  }
  return out;
}

namespace {

class CopyGroup {
 public:
  explicit CopyGroup(int size) : barrier_(size), slots_(static_cast<size_t>(size)) {}
  HostBarrier& barrier() { return barrier_; }
  void Deposit(int rank, const void* data, size_t bytes) {
    absl::MutexLock lock(&mu_);
    slots_[static_cast<size_t>(rank)] = {data, bytes};
  }
  std::pair<const void*, size_t> Slot(int rank) {
    absl::MutexLock lock(&mu_);
    return slots_[static_cast<size_t>(rank)];
  }

 private:
  HostBarrier barrier_;
  absl::Mutex mu_;
  std::vector<std::pair<const void*, size_t>> slots_ ABSL_GUARDED_BY(mu_);
};

class DeviceCopyCommunicator final : public Communicator {
 public:
  DeviceCopyCommunicator(std::shared_ptr<CopyGroup> group, int device, int rank, int size,
                         cudaStream_t stream)
      : group_(std::move(group)), device_(device), rank_(rank), size_(size), stream_(stream) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::Status AllGather(const void* send, void* recv, size_t bytes) override {
    DeviceGuard guard(device_);
    // Every rank reaches both barriers whatever fails, so no rank is left waiting.
    absl::Status status =
        CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize", __FILE__, __LINE__);
    group_->Deposit(rank_, send, bytes);
    group_->barrier().Wait();  // every rank's send buffer is complete and published
    for (int r = 0; r < size_ && status.ok(); ++r) {
      const auto [data, n] = group_->Slot(r);
      if (n != bytes) {
        status = absl::InternalError(absl::StrCat("AllGather: rank ", r, " sent ", n,
                                                  " bytes, rank ", rank_, " expects ", bytes));
        break;
      }
      if (bytes == 0) continue;
      status =
          CudaStatus(cudaMemcpyAsync(static_cast<uint8_t*>(recv) + static_cast<size_t>(r) * bytes,
                                     data, bytes, cudaMemcpyDefault, stream_),
                     "cudaMemcpyAsync", __FILE__, __LINE__);
    }
    const absl::Status done =
        CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize", __FILE__, __LINE__);
    group_->barrier().Wait();  // nobody reuses its send buffer before every rank has copied it
    return status.ok() ? done : status;
  }

 private:
  std::shared_ptr<CopyGroup> group_;
  int device_;
  int rank_;
  int size_;
  cudaStream_t stream_;
};

}  // namespace

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateDeviceCopyCommunicators(
    const std::vector<int>& devices, const std::vector<cudaStream_t>& streams) {
  const int n = static_cast<int>(devices.size());
  if (n < 1 || streams.size() != devices.size()) {
    return absl::InvalidArgumentError("CreateDeviceCopyCommunicators: one stream per rank");
  }
  auto group = std::make_shared<CopyGroup>(n);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < n; ++r) {
    out.push_back(std::make_unique<DeviceCopyCommunicator>(group, devices[static_cast<size_t>(r)],
                                                           r, n, streams[static_cast<size_t>(r)]));
  }
  return out;
}

}  // namespace logitserve
