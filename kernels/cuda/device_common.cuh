// Device-side helpers shared by the CUDA kernels (private to kernels/cuda): the launch-time view
// of a source, the transform, 8-value loads (top-k), the warp sum.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "logitserve/kernels/cuda_kernels.h"

namespace logitserve::kernels::cuda::detail {

inline constexpr unsigned kFullMask = 0xffffffffu;

// Shifted logits are clamped before exp (block_stats.h says why); the one constant of the CPU
// kernels, the fold and these kernels.
using ::logitserve::kernels::kClampShift;
inline constexpr float kLog2e = 1.44269504088896341f;

__device__ __forceinline__ float NegInfF() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float PosInfF() { return __int_as_float(0x7f800000); }

// The launch-time view of a LogitsSource.
struct DeviceSource {
  const void* data;
  int64_t ld;
  int64_t cols;
  FloatType type;
  bool vectorized;  // 16-byte loads are aligned for every (row, 8-aligned column)
  LoadTransform t;
};

inline DeviceSource MakeDeviceSource(const LogitsSource& s) {
  DeviceSource d;
  d.data = s.data;
  d.ld = s.ld;
  d.cols = s.cols;
  d.type = s.type;
  const int64_t es = SizeOf(s.type);
  d.vectorized = (reinterpret_cast<uintptr_t>(s.data) % 16 == 0) && ((s.ld * es) % 16 == 0);
  d.t = s.transform;
  return d;
}

__device__ __forceinline__ float TransformOne(const LoadTransform& t, int64_t c, float x) {
  if (t.head) {
    // A GEMM that adds exactly-zero partial products (see LaunchSplitToBf16) may turn -0 into +0;
    // making every zero +0 keeps the bits equal whichever number of parts ran.
    x = (x == 0.0f) ? 0.0f : x;
    if (t.bias != nullptr) x = x + t.bias[c];
    if (t.scale != 1.0f) x = t.divide_by_scale ? x / t.scale : x * t.scale;
    if (t.softcap > 0.0f) x = t.softcap * tanhf(x / t.softcap);
  }
  if (t.temperature != 1.0f) x = x / t.temperature;
  return x;
}

__device__ __forceinline__ float Bf16Bits(uint32_t bits16) { return __uint_as_float(bits16 << 16); }

__device__ __forceinline__ float LoadRaw(const DeviceSource& s, int64_t row, int64_t c) {
  const int64_t i = row * s.ld + c;
  switch (s.type) {
    case FloatType::kFloat32:
      return static_cast<const float*>(s.data)[i];
    case FloatType::kBFloat16:
      return Bf16Bits(static_cast<const uint16_t*>(s.data)[i]);
    case FloatType::kFloat16:
    default:
      return __half2float(static_cast<const __half*>(s.data)[i]);
  }
}

// One logit after the transform; columns past s.cols are -inf.
__device__ __forceinline__ float LoadOne(const DeviceSource& s, int64_t row, int64_t c) {
  if (c >= s.cols) return NegInfF();
  return TransformOne(s.t, c, LoadRaw(s, row, c));
}

// Elements [c, c + 8) of row `row` (c a multiple of 8) into v, transformed; past s.cols -inf.
__device__ __forceinline__ void Load8(const DeviceSource& s, int64_t row, int64_t c,
                                      float (&v)[8]) {
  const int64_t n = s.cols - c;
  if (n >= 8 && s.vectorized) {
    const int64_t i = row * s.ld + c;
    if (s.type == FloatType::kFloat32) {
      const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(s.data) + i);
      const float4 x0 = p[0];
      const float4 x1 = p[1];
      v[0] = x0.x, v[1] = x0.y, v[2] = x0.z, v[3] = x0.w;
      v[4] = x1.x, v[5] = x1.y, v[6] = x1.z, v[7] = x1.w;
    } else {
      const uint4 u = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(s.data) + i);
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        if (s.type == FloatType::kBFloat16) {
          v[2 * k] = __uint_as_float(w[k] << 16);
          v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
        } else {
          __half2 h;
          memcpy(&h, &w[k], sizeof(h));
          const float2 f = __half22float2(h);
          v[2 * k] = f.x;
          v[2 * k + 1] = f.y;
        }
      }
    }
    if (s.t.head || s.t.temperature != 1.0f) {
#pragma unroll
      for (int k = 0; k < 8; ++k) v[k] = TransformOne(s.t, c + k, v[k]);
    }
    return;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k)
    v[k] = (k < n) ? TransformOne(s.t, c + k, LoadRaw(s, row, c + k)) : NegInfF();
}

// Lanes combine with an xor butterfly: every lane ends with the same bits (IEEE addition is
// commutative), in a fixed order.
__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(kFullMask, x, off);
  return x;
}

// Calls f(std::integral_constant<FloatType, T>{}) for the run-time type t.
template <typename F>
void WithType(FloatType t, F&& f) {
  switch (t) {
    case FloatType::kFloat32:
      f(std::integral_constant<FloatType, FloatType::kFloat32>{});
      break;
    case FloatType::kBFloat16:
      f(std::integral_constant<FloatType, FloatType::kBFloat16>{});
      break;
    case FloatType::kFloat16:
      f(std::integral_constant<FloatType, FloatType::kFloat16>{});
      break;
  }
}

}  // namespace logitserve::kernels::cuda::detail
