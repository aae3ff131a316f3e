#include "server/backend/cuda/nccl_communicator.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/base/status_macros.h"
#include "server/backend/cuda/cuda_status.h"
#include "server/backend/cuda/device_resources.h"

namespace logitserve {

NcclCommunicator::~NcclCommunicator() {
  if (comm_ == nullptr) return;
  DeviceGuard guard(device_);
  ncclCommDestroy(comm_);
}

absl::Status NcclCommunicator::WaitReady(const char* what) const {
  return PollUntil(
      [this]() -> absl::StatusOr<bool> {
        ncclResult_t state = ncclSuccess;
        LOGITSERVE_RETURN_IF_CUDA_ERROR(ncclCommGetAsyncError(comm_, &state));
        if (state == ncclInProgress) return false;
        LOGITSERVE_RETURN_IF_CUDA_ERROR(state);
        return true;
      },
      timeout_, fatal_, absl::StrCat(what, " on GPU ", device_, " (NCCL rank ", rank_, ")"));
}

absl::Status NcclCommunicator::AllGather(const void* send, void* recv, size_t bytes) {
  if (comm_ == nullptr) return absl::FailedPreconditionError("NCCL communicator was aborted");
  DeviceGuard guard(device_);
  LOGITSERVE_RETURN_IF_ERROR(guard.status());
  const ncclResult_t r = ncclAllGather(send, recv, bytes, ncclUint8, comm_, stream_);
  // Non-blocking mode: nothing more may be queued on the stream before the gather is.
  if (r == ncclInProgress) return WaitReady("ncclAllGather");
  LOGITSERVE_RETURN_IF_CUDA_ERROR(r);
  return absl::OkStatus();
}

absl::Status NcclCommunicator::AsyncError() const {
  if (comm_ == nullptr) return absl::FailedPreconditionError("NCCL communicator was aborted");
  ncclResult_t async = ncclSuccess;
  LOGITSERVE_RETURN_IF_CUDA_ERROR(ncclCommGetAsyncError(comm_, &async));
  if (async == ncclInProgress) return absl::OkStatus();
  LOGITSERVE_RETURN_IF_CUDA_ERROR(async);
  return absl::OkStatus();
}

void AbortNcclCommunicators(const std::vector<NcclCommunicator*>& comms, absl::Duration timeout) {
  // Shared with the abort threads, which may outlive this call (and the communicators).
  struct Pending {
    absl::Mutex mu;
    int left ABSL_GUARDED_BY(mu) = 0;
  };
  auto pending = std::make_shared<Pending>();
  std::vector<std::thread> threads;
  for (NcclCommunicator* c : comms) {
    if (c == nullptr || c->comm_ == nullptr) continue;
    const ncclComm_t comm = std::exchange(c->comm_, nullptr);
    const int device = c->device_;
    {
      absl::MutexLock lock(&pending->mu);
      ++pending->left;
    }
    threads.emplace_back([comm, device, pending]() {
      cudaSetDevice(device);
      ncclCommAbort(comm);  // its result changes nothing: the communicator is gone either way
      absl::MutexLock lock(&pending->mu);
      --pending->left;
    });
  }
  {
    absl::MutexLock lock(&pending->mu);
    bool (*const none_left)(int*) = [](int* left) { return *left == 0; };
    pending->mu.AwaitWithTimeout(absl::Condition(none_left, &pending->left), timeout);
  }
  for (std::thread& t : threads) t.detach();
}

absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateNcclCommunicators(
    const std::vector<int>& devices, const std::vector<cudaStream_t>& streams,
    absl::Duration timeout) {
  const int n = static_cast<int>(devices.size());
  if (n < 1 || streams.size() != devices.size()) {
    return absl::InvalidArgumentError("CreateNcclCommunicators: one stream per device");
  }
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  ncclUniqueId id;
  LOGITSERVE_RETURN_IF_CUDA_ERROR(ncclGetUniqueId(&id));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  std::vector<ncclComm_t> comms(static_cast<size_t>(n), nullptr);
  // Every rank's init in one group (one thread drives every device); in non-blocking mode the
  // group returns ncclInProgress and each communicator is polled until it is ready.
  absl::Status status = CudaStatus(ncclGroupStart(), "ncclGroupStart", __FILE__, __LINE__);
  if (status.ok()) {
    for (int r = 0; r < n; ++r) {
      DeviceGuard guard(devices[static_cast<size_t>(r)]);
      if (status = guard.status(); !status.ok()) break;
      const ncclResult_t init =
          ncclCommInitRankConfig(&comms[static_cast<size_t>(r)], n, id, r, &config);
      if (init != ncclSuccess && init != ncclInProgress) {
        status = CudaStatus(init, "ncclCommInitRankConfig", __FILE__, __LINE__);
        break;
      }
    }
    const ncclResult_t end = ncclGroupEnd();
    if (status.ok() && end != ncclSuccess && end != ncclInProgress) {
      status = CudaStatus(end, "ncclGroupEnd", __FILE__, __LINE__);
    }
  }
  std::vector<std::unique_ptr<NcclCommunicator>> made;
  for (int r = 0; r < n; ++r) {
    if (comms[static_cast<size_t>(r)] == nullptr) continue;
    made.push_back(std::make_unique<NcclCommunicator>(comms[static_cast<size_t>(r)],
                                                      devices[static_cast<size_t>(r)], r, n,
                                                      streams[static_cast<size_t>(r)], timeout));
  }
  if (status.ok() && static_cast<int>(made.size()) != n) {
    status = absl::InternalError("ncclCommInitRankConfig returned no communicator");
  }
  for (auto& c : made) {
    if (!status.ok()) break;
    status = c->WaitReady("ncclCommInitRankConfig");
  }
  if (!status.ok()) {
    std::vector<NcclCommunicator*> all;
    for (auto& c : made) all.push_back(c.get());
    AbortNcclCommunicators(all, timeout);
    made.clear();
    // Fallback: blocking communicators (ncclCommInitAll). Collectives that hang on the GPU are
    // still caught by the callers' stream watchdog; only a host-side NCCL call could block.
    std::fprintf(stderr,
                 "logitserve: non-blocking NCCL communicators failed (%s); using blocking ones\n",
                 std::string(status.message()).c_str());
    std::fill(comms.begin(), comms.end(), nullptr);
    LOGITSERVE_RETURN_IF_CUDA_ERROR(ncclCommInitAll(comms.data(), n, devices.data()));
    for (int r = 0; r < n; ++r) {
      made.push_back(std::make_unique<NcclCommunicator>(comms[static_cast<size_t>(r)],
                                                        devices[static_cast<size_t>(r)], r, n,
                                                        streams[static_cast<size_t>(r)], timeout));
    }
  }
  std::vector<std::unique_ptr<Communicator>> out;
  for (auto& c : made) out.push_back(std::move(c));
  return out;
}

namespace {

class DeviceCopyCommunicator final : public Communicator {
 public:
  DeviceCopyCommunicator(std::shared_ptr<HostExchange> group, int device, int rank, int size,
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
    group_->Wait();  // every rank's send buffer is complete and published
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
    group_->Wait();  // nobody reuses its send buffer before every rank has copied it
    return status.ok() ? done : status;
  }

 private:
  std::shared_ptr<HostExchange> group_;
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
  auto group = std::make_shared<HostExchange>(n);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < n; ++r) {
    out.push_back(std::make_unique<DeviceCopyCommunicator>(group, devices[static_cast<size_t>(r)],
                                                           r, n, streams[static_cast<size_t>(r)]));
  }
  return out;
}

}  // namespace logitserve
