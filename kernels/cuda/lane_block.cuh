// One vocabulary block held by one warp: the layout, loads and reductions the (row, block) kernels
// share (private to kernels/cuda).
//
// Why a warp per block. The first kernels used a 256-thread CTA per (row, block): 8 values a
// thread, two CTA-wide reductions with barriers per 4 KB, per-element NaN checks. Nsight Compute
// measured them instruction- and latency-bound (85 % SM, 36 % DRAM throughput). A warp owning a
// block holds 64 values a lane, reduces with shuffles only (no shared memory, no barrier), has all
// of its 16-byte loads in flight before the first use, and spends its instructions on the values:
// the maximum is one NaN-propagating packed max per two 16-bit values (so NaN and +inf detection
// cost nothing per element: a NaN anywhere makes the block maximum NaN, a +inf makes it +inf), and
// the sums are one subtract, one clamp, one multiply, one ex2 and two adds per value.
//
// Determinism. Element e of chunk j of lane l is id blk * kVocabBlock + j * 256 + l * 8 + e, for
// every input dtype, every source alignment and partial blocks alike. Each lane adds its values in
// (j, e) order into two accumulators (even e, odd e), adds those, and the warp combines lanes with
// a fixed xor butterfly. Nothing depends on the grid, the row count, the shard layout or the dtype
// (every value is converted exactly to fp32 first), so every source of the same values gives the
// same bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "kernels/cuda/device_common.cuh"

namespace logitserve::kernels::cuda::detail {

inline constexpr int kLaneChunks = kVocabBlock / (32 * 8);  // chunks of 8 consecutive ids per lane
static_assert(kLaneChunks * 32 * 8 == kVocabBlock, "a warp covers one block");

// Warps per CTA of the (row, block) kernels; each warp owns one (row, block) pair.
inline constexpr int kPairWarps = 4;
inline constexpr int kPairThreads = 32 * kPairWarps;

// 2^x, x <= 0, one MUFU.EX2. ex2.approx.ftz has the accuracy of exp2f (2 ulp; CUDA C Programming
// Guide, "Mathematical Functions", where exp2f is this instruction plus subnormal handling); .ftz
// flushes results below 2^-126, i.e. terms 2^-126 times smaller than the block maximum's weight 1,
// far below the sums' own rounding.
__device__ __forceinline__ float Ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// exp(x), x <= 0 (clamped shifts). Same argument rounding as before: x * log2(e) rounds by |x| u,
// which moves a term by |x| exp(x) u <= u / e relative to the block maximum's weight.
__device__ __forceinline__ float ExpShift(float x) { return Ex2(x * kLog2e); }

// log(x) for x >= FLT_MIN (normal): one MUFU.LG2 and a multiply. lg2.approx is within 2^-22.6
// absolute for x in [0.5, 2] and 2 ulp elsewhere (CUDA C Programming Guide, __log2f); times
// ln 2 that is about 1.1e-7 + 3 u |log x|. JSD weights each log of the mixture by the mixture
// itself, so the sum moves by at most that (tests/kernels/expect_reference.h, JsdTol). logf is
// ~20 instructions on the FMA pipe, and was a third of the JSD pass's time.
__device__ __forceinline__ float LogApprox(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y * 0.693147180559945309f;
}

// max that returns NaN when either operand is NaN (fmaxf returns the other operand).
__device__ __forceinline__ float MaxNaN(float a, float b) {
  float y;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

__device__ __forceinline__ float WarpMaxNaN(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = MaxNaN(x, __shfl_xor_sync(kFullMask, x, off));
  return x;
}

// The raw bits of one lane's share of a block: kLaneChunks chunks of 8 values, as 32-bit words
// (two 16-bit values a word, low half first; or one fp32 a word).
template <FloatType T>
struct LaneBlock {
  static constexpr int kWords = T == FloatType::kFloat32 ? 8 : 4;
  uint32_t w[kLaneChunks][kWords];

  // Value e of chunk j, exactly as fp32 (j and e compile-time after unrolling).
  __device__ __forceinline__ float Value(int j, int e) const { return ChunkValue(w[j], e); }

  // Value e of one chunk's words.
  static __device__ __forceinline__ float ChunkValue(const uint32_t (&c)[kWords], int e) {
    if constexpr (T == FloatType::kFloat32) {
      return __uint_as_float(c[e]);
    } else if constexpr (T == FloatType::kBFloat16) {
      const uint32_t u = c[e >> 1];
      return __uint_as_float((e & 1) ? (u & 0xffff0000u) : (u << 16));
    } else {
      __half2 h;
      memcpy(&h, &c[e >> 1], sizeof(h));
      return (e & 1) ? __high2float(h) : __low2float(h);
    }
  }

  // Maximum (NaN-propagating) or minimum (only used when no value is NaN) of the lane's 64 raw
  // values: packed bf16x2 / half2 operations for 16-bit types, one instruction per two values.
  template <bool kMax>
  __device__ __forceinline__ float RawExtreme() const {
    if constexpr (T == FloatType::kFloat32) {
      float m = __uint_as_float(w[0][0]);
#pragma unroll
      for (int j = 0; j < kLaneChunks; ++j) {
#pragma unroll
        for (int k = 0; k < kWords; ++k) {
          const float x = __uint_as_float(w[j][k]);
          m = kMax ? MaxNaN(m, x) : fminf(m, x);
        }
      }
      return m;
    } else {
      using P = std::conditional_t<T == FloatType::kBFloat16, __nv_bfloat162, __half2>;
      P m = Pair<P>(0, 0);
#pragma unroll
      for (int j = 0; j < kLaneChunks; ++j) {
#pragma unroll
        for (int k = 0; k < kWords; ++k) {
          m = kMax ? __hmax2_nan(m, Pair<P>(j, k)) : __hmin2(m, Pair<P>(j, k));
        }
      }
      return kMax ? MaxNaN(__low2float(m), __high2float(m))
                  : fminf(__low2float(m), __high2float(m));
    }
  }
  __device__ __forceinline__ float RawMax() const { return RawExtreme<true>(); }

  // Maximum (NaN-propagating) of chunk j's 8 raw values; packed for 16-bit types.
  __device__ __forceinline__ float RawChunkMax(int j) const {
    if constexpr (T == FloatType::kFloat32) {
      float m = __uint_as_float(w[j][0]);
#pragma unroll
      for (int k = 1; k < kWords; ++k) m = MaxNaN(m, __uint_as_float(w[j][k]));
      return m;
    } else {
      using P = std::conditional_t<T == FloatType::kBFloat16, __nv_bfloat162, __half2>;
      P m = Pair<P>(j, 0);
#pragma unroll
      for (int k = 1; k < kWords; ++k) m = __hmax2_nan(m, Pair<P>(j, k));
      return MaxNaN(__low2float(m), __high2float(m));
    }
  }
  __device__ __forceinline__ float RawMin() const { return RawExtreme<false>(); }

 private:
  template <typename P>
  __device__ __forceinline__ P Pair(int j, int k) const {
    P p;
    memcpy(&p, &w[j][k], sizeof(p));
    return p;
  }
};

template <FloatType T>
__device__ __forceinline__ uint32_t NegInfBits() {
  if constexpr (T == FloatType::kFloat32) return 0xff800000u;
  if constexpr (T == FloatType::kBFloat16) return 0xff80u;
  return 0xfc00u;
}

template <FloatType T>
__device__ __forceinline__ uint32_t RawBits(const DeviceSource& s, int64_t i) {
  if constexpr (T == FloatType::kFloat32) {
    return __float_as_uint(static_cast<const float*>(s.data)[i]);
  } else {
    return static_cast<const uint16_t*>(s.data)[i];
  }
}

// Loads lane `lane`'s share of the block starting at column c0 of row `row`. Columns past s.cols
// read as -inf. Full, aligned blocks use 16-byte loads, all issued before any use.
// The 16-byte loads are ld.global.cs (streaming: evict-first in L1 and L2), as the streamed fp32
// form's bulk copies are: the logits are read once, and lines kept in L2 only push out what
// others will read. Measured on the H200 (bf16 [8192 x 75968], one call, alternating with the
// plain loads): single statistics 0.294 -> 0.283 ms (1.06 -> 1.01x one read; Nsight Compute DRAM
// throughput 90.0 -> 91.9 %), Score logprobs 0.322 -> 0.301 ms, pair statistics 0.585 -> 0.578.
template <FloatType T>
__device__ __forceinline__ void LoadLaneBlock(const DeviceSource& s, int64_t row, int64_t c0,
                                              int lane, LaneBlock<T>& b) {
  const int64_t base = row * s.ld + c0 + lane * 8;
  if (s.vectorized && c0 + kVocabBlock <= s.cols) {
#pragma unroll
    for (int j = 0; j < kLaneChunks; ++j) {
      if constexpr (T == FloatType::kFloat32) {
        const uint4* p =
            reinterpret_cast<const uint4*>(static_cast<const float*>(s.data) + base + j * 256);
        const uint4 x0 = __ldcs(p);
        const uint4 x1 = __ldcs(p + 1);
        b.w[j][0] = x0.x, b.w[j][1] = x0.y, b.w[j][2] = x0.z, b.w[j][3] = x0.w;
        b.w[j][4] = x1.x, b.w[j][5] = x1.y, b.w[j][6] = x1.z, b.w[j][7] = x1.w;
      } else {
        const uint4 x = __ldcs(
            reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(s.data) + base + j * 256));
        b.w[j][0] = x.x, b.w[j][1] = x.y, b.w[j][2] = x.z, b.w[j][3] = x.w;
      }
    }
    return;
  }
  const int64_t left = s.cols - (c0 + lane * 8);  // valid values from this lane's first id
#pragma unroll
  for (int j = 0; j < kLaneChunks; ++j) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int64_t off = j * 256 + e;
      const uint32_t bits = off < left ? RawBits<T>(s, base + off) : NegInfBits<T>();
      if constexpr (T == FloatType::kFloat32) {
        b.w[j][e] = bits;
      } else if (e & 1) {
        b.w[j][e >> 1] |= bits << 16;
      } else {
        b.w[j][e >> 1] = bits;
      }
    }
  }
}

// The transform of a source whose only transform is the temperature (logits mode) is monotone, so
// the maximum of the transformed values is the transformed maximum (x / t is monotone for t > 0),
// and 16-bit blocks take the packed maximum of the raw values. Head transforms (hidden mode, fp32
// GEMM output, a bias per column) are applied to the words in place before anything else.
// The rest of TransformOne after the zero fix, out of line: inlined 128 times into a pair kernel
// (with its tanhf and divisions) it made the code too large for the instruction cache, and the
// hidden-mode statistics ran at 40 cycles per instruction (Nsight Compute, H200).
static __device__ __noinline__ float TransformTail(const LoadTransform& t, int64_t c, float x) {
  if (t.head) {
    if (t.bias != nullptr) x = x + t.bias[c];
    if (t.scale != 1.0f) x = t.divide_by_scale ? x / t.scale : x * t.scale;
    if (t.softcap > 0.0f) x = t.softcap * tanhf(x / t.softcap);
  }
  if (t.temperature != 1.0f) x = x / t.temperature;
  return x;
}

template <FloatType T>
__device__ __forceinline__ void TransformInPlace(const DeviceSource& s, int64_t c0, int lane,
                                                 LaneBlock<T>& b) {
  if constexpr (T == FloatType::kFloat32) {
    if (!s.t.head && s.t.temperature == 1.0f) return;
    // TransformOne, operation for operation: the -0 -> +0 fix of a head's GEMM output inline,
    // everything else in TransformTail.
    const bool tail =
        (s.t.head && (s.t.bias != nullptr || s.t.scale != 1.0f || s.t.softcap > 0.0f)) ||
        s.t.temperature != 1.0f;
    if (!tail && c0 + kVocabBlock <= s.cols) {  // uniform over the warp
      // The zero fix alone on a full block (hidden mode's common case): x + 0 is x for every x
      // but -0, which becomes +0, so one add per value and no column test. (The general loop
      // below pays a 64-bit column test, a compare and a select a value.)
#pragma unroll
      for (int j = 0; j < kLaneChunks; ++j) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          b.w[j][e] = __float_as_uint(__fadd_rn(__uint_as_float(b.w[j][e]), 0.0f));
        }
      }
      return;
    }
#pragma unroll
    for (int j = 0; j < kLaneChunks; ++j) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int64_t c = c0 + j * 256 + lane * 8 + e;
        // Columns past cols stay -inf: a bias must not be read there.
        if (c < s.cols) {
          float x = b.Value(j, e);
          if (s.t.head) x = (x == 0.0f) ? 0.0f : x;
          if (tail) x = TransformTail(s.t, c, x);
          b.w[j][e] = __float_as_uint(x);
        }
      }
    }
  }
}

// Whether a source's values still need dividing by its temperature (fp32 blocks are transformed in
// place beforehand, TransformInPlace).
template <FloatType T>
__device__ __forceinline__ bool HasTemperature(const DeviceSource& s) {
  return T != FloatType::kFloat32 && s.t.temperature != 1.0f;
}

// x after the temperature (for a raw maximum or minimum this is exact because x / t is monotone
// for t > 0). For one-off values; the per-value loops take a Temper.
template <FloatType T>
__device__ __forceinline__ float Tempered(const DeviceSource& s, float x) {
  return HasTemperature<T>(s) ? x / s.t.temperature : x;
}

// The temperature of a source as a compile-time choice, made once per warp item by WithTemper(s).
// Left to a run-time test per value, the compiler kept the test, a branch and the whole IEEE
// division (with its slow-path call) beside every value of the unrolled loops: Nsight Compute
// (H200, bf16 pairs) put a third of the stall cycles on instruction fetch, in a 28 K-instruction
// kernel (0.79 ms; 0.59 with this, the same instructions executed). kOn divides (16-bit sources:
// fp32 words are transformed in place), otherwise it is the identity; x / 1 is x, so a side without
// a temperature may share its partner's kOn without changing a bit.
template <FloatType T, bool kOn>
struct Temper {
  float t;
  __device__ __forceinline__ float operator()(float x) const {
    if constexpr (kOn && T != FloatType::kFloat32) {
      return x / t;
    } else {
      return x;
    }
  }
};

// f(Temper) for the source's temperature (uniform over the warp).
template <FloatType T, typename F>
__device__ __forceinline__ void WithTemper(const DeviceSource& s, F&& f) {
  if (HasTemperature<T>(s)) {
    f(Temper<T, true>{s.t.temperature});
  } else {
    f(Temper<T, false>{1.0f});
  }
}

// f(Temper a, Temper b) for a pair: one choice for both sides (two bodies, not four).
template <FloatType TA, FloatType TB, typename F>
__device__ __forceinline__ void WithTempers(const DeviceSource& a, const DeviceSource& b, F&& f) {
  if (HasTemperature<TA>(a) || HasTemperature<TB>(b)) {
    f(Temper<TA, true>{a.t.temperature}, Temper<TB, true>{b.t.temperature});
  } else {
    f(Temper<TA, false>{1.0f}, Temper<TB, false>{1.0f});
  }
}

// Value e of chunk j after the transform.
template <FloatType T, bool kOn>
__device__ __forceinline__ float Z(Temper<T, kOn> tp, const LaneBlock<T>& b, int j, int e) {
  return tp(b.Value(j, e));
}

// The lane's maximum of the transformed values (NaN-propagating).
template <FloatType T, bool kOn>
__device__ __forceinline__ float LaneMax(Temper<T, kOn> tp, const LaneBlock<T>& b) {
  return tp(b.RawMax());
}
template <FloatType T>
__device__ __forceinline__ float LaneMax(const DeviceSource& s, const LaneBlock<T>& b) {
  return Tempered<T>(s, b.RawMax());
}

// The lane's minimum of the transformed values (NaN-free blocks only).
template <FloatType T, bool kOn>
__device__ __forceinline__ float LaneMin(Temper<T, kOn> tp, const LaneBlock<T>& b) {
  return tp(b.RawMin());
}

__device__ __forceinline__ float WarpMin(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fminf(x, __shfl_xor_sync(kFullMask, x, off));
  return x;
}

}  // namespace logitserve::kernels::cuda::detail
