// Communicators of the CUDA backend (see server/backend/communicator.h for the contract).
//
// Buffers given to AllGather live in the rank's device memory; the gather is ordered on the rank's
// stream, after the work already queued there, and before anything queued after it.
//
//   NcclCommunicator   one NCCL communicator per device, all created together in one process
//                      (ncclCommInitAll); AllGather only enqueues (ncclAllGather on the stream).
//   device-copy group  for ranks that share a device (NCCL refuses two ranks on one GPU: used to
//                      test uneven and empty shard layouts on one GPU): each rank waits for its
//                      stream, the ranks meet at a host barrier, each copies every rank's buffer
//                      with cudaMemcpyAsync (peer copies where ranks are on different devices),
//                      waits, and meets the others again before anyone reuses its send buffer.
//
// Thread safety: one thread per rank object, as the Communicator contract says; ranks of a group
// call the same collectives in the same order.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/backend/communicator.h"

namespace logitserve {

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int device, int rank, int size, cudaStream_t stream)
      : comm_(comm), device_(device), rank_(rank), size_(size), stream_(stream) {}
  ~NcclCommunicator() override;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::Status AllGather(const void* send, void* recv, size_t bytes) override;
  // An asynchronous NCCL failure (a peer died, a network error), if any.
  absl::Status AsyncError() const;

 private:
  ncclComm_t comm_;
  int device_;
  int rank_;
  int size_;
  cudaStream_t stream_;
};

// One NcclCommunicator per entry of `devices` (distinct devices), rank i on devices[i] using
// streams[i]. NVLink SHARP (NVLS) is switched off unless NCCL_NVLS_ENABLE is already set: the
// gathers here are a few MB, and multicast objects can wedge a shared host's GPUs.
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateNcclCommunicators(
    const std::vector<int>& devices, const std::vector<cudaStream_t>& streams);

// A device-copy group: rank i on devices[i] (devices may repeat) using streams[i].
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateDeviceCopyCommunicators(
    const std::vector<int>& devices, const std::vector<cudaStream_t>& streams);

}  // namespace logitserve
