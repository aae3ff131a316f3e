#include "server/backend/cuda/device_resources.h"

#include <utility>

#include "server/backend/cuda/cuda_status.h"

namespace logitserve {

DeviceGuard::DeviceGuard(int device) {
  if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
  if (previous_ != device)
    status_ = CudaStatus(cudaSetDevice(device), "cudaSetDevice", __FILE__, __LINE__);
}

DeviceGuard::~DeviceGuard() {
  int now = -1;
  if (previous_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous_) {
    cudaSetDevice(previous_);
  }
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      device_(std::exchange(other.device_, -1)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    Free();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    device_ = std::exchange(other.device_, -1);
  }
  return *this;
}

absl::Status DeviceBuffer::Reserve(int device, size_t bytes) {
  if (data_ != nullptr && device_ == device && size_ >= bytes) return absl::OkStatus();
  Free();
  if (bytes == 0) return absl::OkStatus();
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaMalloc(&data_, bytes));
  size_ = bytes;
  device_ = device;
  return absl::OkStatus();
}

void DeviceBuffer::Free() {
  if (data_ == nullptr) return;
  DeviceGuard guard(device_);
  cudaFree(data_);  // a failure here leaves nothing to do: the memory is the context's anyway
  data_ = nullptr;
  size_ = 0;
  device_ = -1;
}

CudaStream::~CudaStream() {
  if (stream_ == nullptr) return;
  DeviceGuard guard(device_);
  cudaStreamDestroy(stream_);
}

absl::Status CudaStream::Create(int device, int priority) {
  LOGITSERVE_RETURN_IF_CUDA_ERROR(
      cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, priority));
  device_ = device;
  return absl::OkStatus();
}

absl::Status PinnedBuffer::Reserve(size_t bytes) {
  if (data_ != nullptr && size_ >= bytes) return absl::OkStatus();
  Free();
  if (bytes == 0) return absl::OkStatus();
  void* p = nullptr;
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaMallocHost(&p, bytes));
  data_ = static_cast<uint8_t*>(p);
  size_ = bytes;
  return absl::OkStatus();
}

void PinnedBuffer::Free() {
  if (data_ == nullptr) return;
  cudaFreeHost(data_);
  data_ = nullptr;
  size_ = 0;
}

CudaEvent::~CudaEvent() {
  if (event_ == nullptr) return;
  DeviceGuard guard(device_);
  cudaEventDestroy(event_);
}

absl::Status CudaEvent::Create(int device) {
  LOGITSERVE_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  device_ = device;
  return absl::OkStatus();
}

}  // namespace logitserve
