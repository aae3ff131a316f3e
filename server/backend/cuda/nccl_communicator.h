// Communicators of the CUDA backend (see server/backend/communicator.h for the contract).
//
// Buffers given to AllGather live in the rank's device memory; the gather is ordered on the rank's
// stream, after the work already queued there, and before anything queued after it.
//
//   NcclCommunicator   one NCCL communicator per device, all created together in one process, in
//                      NCCL's non-blocking mode (ncclConfig_t::blocking = 0): no NCCL call blocks
//                      the host; an operation that NCCL answers with ncclInProgress (connection
//                      set-up, which needs every peer) is polled to completion with the watchdog
//                      timeout (watchdog.h) before anything else is queued on the stream. AllGather
//                      only enqueues (ncclAllGather on the stream); the caller watches the stream.
//                      A communicator that hung or failed is aborted (AbortNcclCommunicators) and
//                      never used again. Should the non-blocking set-up fail, blocking
//                      communicators (ncclCommInitAll) are used instead, with a warning on
//                      stderr: the stream watchdog still catches collectives hung on the GPU.
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
#include "absl/time/time.h"
#include "server/backend/communicator.h"
#include "server/backend/cuda/watchdog.h"

namespace logitserve {

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int device, int rank, int size, cudaStream_t stream,
                   absl::Duration timeout)
      : comm_(comm),
        device_(device),
        rank_(rank),
        size_(size),
        stream_(stream),
        timeout_(timeout) {}
  ~NcclCommunicator() override;  // ncclCommDestroy, unless aborted
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  absl::Status AllGather(const void* send, void* recv, size_t bytes) override;
  // An asynchronous NCCL failure (a peer died, a network error), if any; an operation still in
  // progress is not one. Every NCCL error is a fatal device error (IsFatalDeviceError).
  absl::Status AsyncError() const;
  // Waits in AllGather are abandoned (ABORTED) when `fatal` turns failed. REQUIRES: no AllGather
  // is running.
  void set_fatal_state(const FatalState* fatal) { fatal_ = fatal; }
  int device() const { return device_; }
  // Polls the communicator until no NCCL operation is in progress (watchdog); `what` names the
  // operation in the timeout's message.
  absl::Status WaitReady(const char* what) const;

 private:
  friend void AbortNcclCommunicators(const std::vector<NcclCommunicator*>& comms,
                                     absl::Duration timeout);

  ncclComm_t comm_;  // null once aborted
  int device_;
  int rank_;
  int size_;
  cudaStream_t stream_;
  absl::Duration timeout_;
  const FatalState* fatal_ = nullptr;
};

// Aborts every communicator (ncclCommAbort: NCCL kernels still waiting for a peer end, the
// streams can drain), each on its own thread, waiting at most `timeout` for them all (ncclCommAbort
// itself has been seen to hang); a thread still inside NCCL then is left to finish on its own. The
// communicators are unusable afterwards. REQUIRES: no thread is using them.
void AbortNcclCommunicators(const std::vector<NcclCommunicator*>& comms, absl::Duration timeout);

// One NcclCommunicator per entry of `devices` (distinct devices), rank i on devices[i] using
// streams[i]; NCCL calls in progress longer than `timeout` fail (watchdog). NVLink SHARP (NVLS) is
// switched off unless NCCL_NVLS_ENABLE is already set: the gathers here are a few MB, and
// multicast objects can wedge a shared host's GPUs.
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateNcclCommunicators(
    const std::vector<int>& devices, const std::vector<cudaStream_t>& streams,
    absl::Duration timeout);

// A device-copy group: rank i on devices[i] (devices may repeat) using streams[i].
absl::StatusOr<std::vector<std::unique_ptr<Communicator>>> CreateDeviceCopyCommunicators(
    const std::vector<int>& devices, const std::vector<cudaStream_t>& streams);

}  // namespace logitserve
