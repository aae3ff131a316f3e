#include <cuda_fp16.h>

#include "bench/cuda/bench_fill.h"

namespace logitserve::bench {
namespace {

__device__ __forceinline__ uint64_t Mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__global__ void FillKernel(kernels::FloatType type, void* data, size_t count, uint64_t seed,
                           float stddev) {
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint64_t h = Mix(seed ^ Mix(i));
    const float u1 = (static_cast<float>(h >> 40) + 1.0f) * 0x1p-24f;  // (0, 1]
    const float u2 = static_cast<float>((h >> 16) & 0xffffffu) * 0x1p-24f;
    const float x = stddev * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    switch (type) {
      case kernels::FloatType::kFloat32:
        static_cast<float*>(data)[i] = x;
        break;
      case kernels::FloatType::kBFloat16:
        static_cast<uint16_t*>(data)[i] = kernels::FloatToBFloat16(x);
        break;
      case kernels::FloatType::kFloat16:
      default:
        static_cast<__half*>(data)[i] = __float2half_rn(x);
        break;
    }
  }
}

}  // namespace

cudaError_t FillNormal(kernels::FloatType type, void* data, size_t count, uint64_t seed,
                       float stddev, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  FillKernel<<<4096, 256, 0, stream>>>(type, data, count, seed, stddev);
  return cudaGetLastError();
}

namespace {

constexpr int kResidentThreads = 512;
constexpr int kResidentGrid = 132 * 4;

__global__ void __launch_bounds__(kResidentThreads)
    ReadResidentKernel(const uint4* data, size_t n, int passes, uint32_t* sink) {
  uint32_t acc = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t self = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int p = 0; p < passes; ++p) {
    size_t i = self;
    for (; i + 3 * stride < n; i += 4 * stride) {  // four loads in flight
      uint4 v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = __ldcg(data + i + u * stride);
#pragma unroll
      for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n; i += stride) {
      const uint4 v = __ldcg(data + i);
      acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    asm volatile("" ::: "memory");  // every pass loads again
  }
  if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;  // practically never; keeps the loads
}

}  // namespace

cudaError_t ReadResident(const void* data, size_t bytes, int passes, uint32_t* sink,
                         cudaStream_t stream) {
  if (bytes % 16 != 0 || bytes == 0 || passes < 1) return cudaErrorInvalidValue;
  ReadResidentKernel<<<kResidentGrid, kResidentThreads, 0, stream>>>(
      static_cast<const uint4*>(data), bytes / 16, passes, sink);
  return cudaGetLastError();
}

}  // namespace logitserve::bench
