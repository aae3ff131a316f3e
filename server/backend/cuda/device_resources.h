// RAII owners of CUDA resources for the CUDA backend.
//
//   DeviceGuard   makes a device current for a scope and restores the previous one.
//   DeviceBuffer  device memory on one device (freed on that device); Reserve() grows it.
//   CudaStream    a non-blocking stream on one device.
//   CudaEvent     an event without timing on one device (completion polling).
//   PinnedBuffer  page-locked host memory (cudaMallocHost); Reserve() grows it.
//   HostBarrier   a reusable barrier for the backend's rank threads.
//
// Thread safety: DeviceGuard is per thread (the current device is thread state). The owners are
// used by one thread at a time; HostBarrier is shared by the threads that meet at it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "server/backend/host_barrier.h"

namespace logitserve {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
  // Whether cudaSetDevice succeeded.
  absl::Status status() const { return status_; }

 private:
  int previous_ = -1;
  absl::Status status_;
};

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { Free(); }
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Makes the buffer hold at least `bytes` on `device` (contents are not kept when it grows).
  // REQUIRES: `device` is current.
  absl::Status Reserve(int device, size_t bytes);
  void Free();
  void* data() const { return data_; }
  size_t size() const { return size_; }
  template <typename T>
  T* as(size_t byte_offset = 0) const {
    return reinterpret_cast<T*>(static_cast<uint8_t*>(data_) + byte_offset);
  }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  int device_ = -1;
};

class CudaStream {
 public:
  CudaStream() = default;
  ~CudaStream();
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  // REQUIRES: `device` is current. `priority` as cudaStreamCreateWithPriority (0: the default;
  // lower numbers run first).
  absl::Status Create(int device, int priority = 0);
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
  int device_ = -1;
};

class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() { Free(); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  // Makes the buffer hold at least `bytes` (contents are not kept when it grows). REQUIRES: no
  // copy from or to it is still queued.
  absl::Status Reserve(size_t bytes);
  void Free();
  uint8_t* data() const { return data_; }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

class CudaEvent {
 public:
  CudaEvent() = default;
  ~CudaEvent();
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  // REQUIRES: `device` is current.
  absl::Status Create(int device);
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
  int device_ = -1;
};

}  // namespace logitserve
