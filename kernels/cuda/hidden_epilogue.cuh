// The epilogue of the fused hidden-mode kernel (hidden_stats_kernel.cu; private to kernels/cuda):
// a consumer thread's wgmma accumulators of one 64-row x 128-column subtile turned into the
// subtile's block records, target logits and (when asked) stored logits. A thread holds two rows
// (h = 0, 1: 8 apart) x 32 columns of each head; the four threads of a quad hold one row's 128
// columns, and reduce over shuffles within the quad.
#pragma once

#include <cfloat>
#include <cstdint>

#include "kernels/cuda/block_items.cuh"

namespace logitserve::kernels::cuda::hidden {

using detail::ExpShift;
using detail::kBadInput;
using detail::kFullMask;
using detail::MaxNaN;
using detail::NegInfF;

inline constexpr int kTileCols = 128;  // vocabulary columns per subtile (the wgmma's N)

// Lanes of one quad (the four threads that hold one accumulator row).
__device__ __forceinline__ unsigned QuadMask() { return 0xFu << (threadIdx.x & 28u); }

__device__ __forceinline__ float QuadSum(float x, unsigned mask) {
  x += __shfl_xor_sync(mask, x, 1);
  x += __shfl_xor_sync(mask, x, 2);
  return x;
}
__device__ __forceinline__ float QuadMax(float x) {
  x = MaxNaN(x, __shfl_xor_sync(kFullMask, x, 1));
  return MaxNaN(x, __shfl_xor_sync(kFullMask, x, 2));
}
__device__ __forceinline__ bool QuadAny(bool b, unsigned mask) {
  uint32_t x = b ? 1u : 0u;
  x |= __shfl_xor_sync(mask, x, 1);
  x |= __shfl_xor_sync(mask, x, 2);
  return x != 0;
}

// Accumulator register of row half h (0: the thread's first row, 1: the row 8 below), column pair
// j, element e: column 8 j + 2 (lane % 4) + e of the subtile.
__device__ __forceinline__ constexpr int Reg(int h, int j, int e) { return 4 * j + 2 * h + e; }

// The live (unmasked) tokens of row half h around sh, bit 2 j + e: z - sh > -inf. A token is
// masked when z == -inf or its shift overflows (z = -3e38 below a maximum of +3e38).
__device__ __forceinline__ uint32_t LiveMask(const float (&z)[64], int h, float sh) {
  uint32_t live = 0;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (z[Reg(h, j, e)] - sh > NegInfF()) live |= 1u << (2 * j + e);
    }
  }
  return live;
}

// Masking. The sums run over d = max(z - sh, floor). The first pass takes floor = -inf (d as it
// is) and assumes no token is masked; a masked token (d = -inf) then makes a sum NaN (0 * -inf),
// and the quad runs a second pass with floor = -FLT_MAX: a masked token's d becomes finite, its
// exp 0, so it adds 0 to s, 0 * d to w and 0 to the cross terms unless the other side supports
// the token, when that direction's mismatch flag makes its KL +inf whatever the term holds. Every
// finite d is >= -FLT_MAX, so live tokens keep their unclamped shifts in both passes: a deep but
// finite logit is underflow, not masking (its exp is 0 all the same; the cross terms need the
// true difference). These are PairItem's statistics: its clamp at -200 changes no bit of s and w
// of a live token (the exp of any shift below -104 is 0 in fp32). One loop body serves both
// passes: two copies of it left the pair form short of registers.
constexpr float kSecondPassFloor = -FLT_MAX;

// The sums of one distribution's row half h around sh: s = sum exp(d), w = sum exp(d) d. The
// single form and the model side of the pair form run these operations in this order.
struct Sums {
  float s = 0.0f, w = 0.0f;
  __device__ __forceinline__ void Add(float d, float x) {
    s += x;
    w = fmaf(x, d, w);
  }
};

// The record of one distribution over the thread's row half h of the subtile (the single form).
__device__ __forceinline__ BlockStats SingleRecord(const float (&z)[64], int h) {
  float m = z[Reg(h, 0, 0)];
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) m = MaxNaN(m, z[Reg(h, j, e)]);
  }
  m = QuadMax(m);
  BlockStats out = EmptyBlockStats();
  out.flags = detail::BadFlags(m);
  if (out.flags != 0 || m == NegInfF()) return out;  // uniform over the quad
  const unsigned quad = QuadMask();
  const float sh = m + 0.0f;  // -0 -> +0 (a GEMM's zero sign depends on its parts)
  float floor = NegInfF();
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
    Sums a;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float d = fmaxf(z[Reg(h, j, e)] - sh, floor);
        a.Add(d, ExpShift(d));
      }
    }
    out.s = QuadSum(a.s, quad);
    out.w = QuadSum(a.w, quad);
    if (!isnan(out.w)) break;  // uniform over the quad
    floor = kSecondPassFloor;
  }
  out.m = sh;
  return out;
}

// The record of the pair (a = model, b = reference) over row half h of the subtile: PairItem's
// statistics. The a side's operations are SingleRecord's, in the same order: the cross terms
// c_ab = sum exp(da) (da - db), c_ba = -sum exp(db) (da - db) ride along.
__device__ __forceinline__ PairBlockStats PairRecord(const float (&za)[64], const float (&zb)[64],
                                                     int h) {
  float ma = za[Reg(h, 0, 0)], mb = zb[Reg(h, 0, 0)];
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      ma = MaxNaN(ma, za[Reg(h, j, e)]);
      mb = MaxNaN(mb, zb[Reg(h, j, e)]);
    }
  }
  ma = QuadMax(ma);
  mb = QuadMax(mb);
  PairBlockStats out{EmptyBlockStats(), EmptyBlockStats(), 0.0f, 0.0f};
  out.a.flags = detail::BadFlags(ma);
  out.b.flags = detail::BadFlags(mb);
  if ((out.a.flags | out.b.flags) & kBadInput) return out;  // uniform over the quad
  const unsigned quad = QuadMask();
  const float ninf = NegInfF();
  // A fully masked side shifts by 0: all of its tokens are masked.
  const float sha = (ma == ninf ? 0.0f : ma) + 0.0f;
  const float shb = (mb == ninf ? 0.0f : mb) + 0.0f;
  float floor = ninf;
  Sums a, b;
  float cab = 0.0f, cba = 0.0f;
#pragma unroll 1
  for (int pass = 0; pass < 2; ++pass) {
    a = Sums{};
    b = Sums{};
    cab = 0.0f;
    cba = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float da = fmaxf(za[Reg(h, j, e)] - sha, floor);
        const float db = fmaxf(zb[Reg(h, j, e)] - shb, floor);
        const float ea = ExpShift(da);
        const float eb = ExpShift(db);
        const float diff = da - db;
        a.Add(da, ea);
        b.Add(db, eb);
        cab = fmaf(ea, diff, cab);
        cba = fmaf(-eb, diff, cba);
      }
    }
    a.s = QuadSum(a.s, quad);
    a.w = QuadSum(a.w, quad);
    b.s = QuadSum(b.s, quad);
    b.w = QuadSum(b.w, quad);
    cab = QuadSum(cab, quad);
    cba = QuadSum(cba, quad);
    if (!isnan(a.w) && !isnan(b.w) && !isnan(cab) && !isnan(cba)) break;  // uniform over quad
    floor = kSecondPassFloor;
    const uint32_t live_a = LiveMask(za, h, sha), live_b = LiveMask(zb, h, shb);
    if (QuadAny((live_a & ~live_b) != 0, quad)) out.a.flags |= kFlagASupportsBMasked;
    if (QuadAny((live_b & ~live_a) != 0, quad)) out.a.flags |= kFlagBSupportsAMasked;
  }
  if (ma != ninf) {
    out.a.m = sha;
    out.a.s = a.s;
    out.a.w = a.w;
    out.c_ab = cab;
  }
  if (mb != ninf) {
    out.b.m = shb;
    out.b.s = b.s;
    out.b.w = b.w;
    out.c_ba = cba;
  }
  return out;
}

// The head transform of every accumulator of a column below `cols` (TransformOne, inline: a call
// would make the compiler save registers around it and serialise the wgmma pipeline). Columns
// past `cols` are left alone (MaskTail masks them): their bias would lie past the bias array
// (compute-sanitizer memcheck found those reads, up to 127 floats past its end).
__device__ __forceinline__ void TransformAll(const LoadTransform& t, int64_t c_base, int quad_col,
                                             int64_t cols, float (&z)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    const int64_t c = c_base + 8 * (i / 4) + quad_col + (i & 1);
    if (c < cols) z[i] = detail::TransformOne(t, c, z[i]);
  }
}

// Columns at or past `cols` are masked.
__device__ __forceinline__ void MaskTail(int64_t c_base, int quad_col, int64_t cols,
                                         float (&z)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    if (c_base + 8 * (i / 4) + quad_col + (i & 1) >= cols) z[i] = NegInfF();
  }
}

// Target logits that fall into this thread's columns of the subtile (ids are rare hits: one range
// test per id, the register select only on a hit).
// Row `row`'s ids are ids[row * per_row + q], global; column c of the launch is id col0 + c.
struct Targets {
  const int32_t* ids;
  int32_t per_row;
  float* out;
  int64_t col0;
  int64_t cols;
};
__device__ __forceinline__ void GatherTargets(const Targets& p, const float (&z)[64], int64_t row,
                                              int h, int64_t c_base, int quad_col) {
  for (int32_t q = 0; q < p.per_row; ++q) {
    const int64_t c = static_cast<int64_t>(p.ids[row * p.per_row + q]) - p.col0 - c_base;
    if (c < 0 || c >= kTileCols || c >= p.cols - c_base) continue;
    const int rel = static_cast<int>(c);
    if ((rel & 7) - (rel & 1) != quad_col) continue;
    const int jt = rel >> 3, et = rel & 1;
    float v = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (j == jt && e == et) v = z[Reg(h, j, e)];
      }
    }
    p.out[row * p.per_row + q] = v + 0.0f;  // -0 -> +0, as TransformOne
  }
}

// The raw accumulators (the GEMM's output) of valid rows and columns, for a later pass.
__device__ __forceinline__ void StoreLogits(float* out, int64_t ld, const float (&z)[64],
                                            int64_t row, int h, int64_t c_base, int quad_col,
                                            int64_t cols) {
  float* r = out + row * ld;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int64_t c = c_base + 8 * j + quad_col;
    if (c + 1 < cols) {
      *reinterpret_cast<float2*>(r + c) = make_float2(z[Reg(h, j, 0)], z[Reg(h, j, 1)]);
    } else if (c < cols) {
      r[c] = z[Reg(h, j, 0)];
    }
  }
}

}  // namespace logitserve::kernels::cuda::hidden
