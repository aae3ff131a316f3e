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

// Masking. The sums run over d = z - sh, and assume no token is masked: every shift is finite
// (the maximum is finite and no value is NaN, or the record returned early), so d is never NaN.
// A masked token (d = -inf: z = -inf, or a shift that overflows, z = -3e38 below a maximum of
// +3e38) then makes w or a cross term NaN (0 * -inf), and the quad recomputes its row half with
// the masking rules (MaskedSums): d = max(z - sh, -FLT_MAX), so a masked token's d becomes
// finite, its exp 0, and it adds 0 to s, 0 * d to w and 0 to the cross terms unless the other
// side supports the token, when that direction's mismatch flag makes its KL +inf whatever the
// term holds. Every finite d is >= -FLT_MAX, so live tokens keep their unclamped shifts in both
// passes (both give the same bits when nothing is masked): a deep but finite logit is underflow,
// not masking (its exp is 0 all the same; the cross terms need the true difference). These are
// PairItem's statistics: its clamp at -200 changes no bit of s and w of a live token (the exp of
// any shift below -104 is 0 in fp32).
//
// Why the masked pass is a separate, out-of-line function of copied values: inlined beside the
// fast pass (first as a second trip of one loop), the compiler hoisted its loop-invariant live-
// token masks out of the rare branch into every subtile, 64 compares, selects and adds a row
// half, and kept the 64 shifted values live for them (Nsight Compute, H200, H 1024: 2,700
// issued instructions a warp per subtile in the epilogue, ~350 of them those masks).
constexpr float kMaskedFloor = -FLT_MAX;

// The sums of one distribution's row half around sh: s = sum exp(d), w = sum exp(d) d. The
// single form and the model side of the pair form run these operations in this order.
struct Sums {
  float s = 0.0f, w = 0.0f;
  __device__ __forceinline__ void Add(float d, float x) {
    s += x;
    w = fmaf(x, d, w);
  }
  __device__ __forceinline__ void QuadReduce(unsigned quad) {
    s = QuadSum(s, quad);
    w = QuadSum(w, quad);
  }
};

// The sums of a pair (a = model, b = reference) around their shifts: each side's Sums, in
// SingleRecord's order for the a side, and the cross terms c_ab = sum exp(da) (da - db),
// c_ba = -sum exp(db) (da - db).
struct PairSums {
  Sums a, b;
  float cab = 0.0f, cba = 0.0f;
  uint32_t flags = 0;  // support-mismatch flags (set by the masked pass only)
  __device__ __forceinline__ void Add(float da, float db) {
    const float ea = ExpShift(da);
    const float eb = ExpShift(db);
    const float diff = da - db;
    a.Add(da, ea);
    b.Add(db, eb);
    cab = fmaf(ea, diff, cab);
    cba = fmaf(-eb, diff, cba);
  }
  __device__ __forceinline__ void QuadReduce(unsigned quad) {
    a.QuadReduce(quad);
    b.QuadReduce(quad);
    cab = QuadSum(cab, quad);
    cba = QuadSum(cba, quad);
  }
};

// The 32 values of row half h, in (j, e) order: what the masked pass gets (a local copy: its
// address never reaches the accumulators, which stay in registers).
__device__ __forceinline__ void CopyRowHalf(const float (&z)[64], int h, float (&v)[32]) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) v[2 * j + e] = z[Reg(h, j, e)];
  }
}

// Maximum (NaN-propagating) of row half h over the quad: four independent chains of the
// thread's 32 values (the maximum is exact, so the order cannot change it), then the quad.
__device__ __forceinline__ float RowHalfMax(const float (&z)[64], int h) {
  float m[4] = {z[Reg(h, 0, 0)], z[Reg(h, 0, 1)], z[Reg(h, 1, 0)], z[Reg(h, 1, 1)]};
#pragma unroll
  for (int j = 2; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) m[2 * (j & 1) + e] = MaxNaN(m[2 * (j & 1) + e], z[Reg(h, j, e)]);
  }
  return QuadMax(MaxNaN(MaxNaN(m[0], m[1]), MaxNaN(m[2], m[3])));
}

// The masked pass of one distribution (see above), quad-reduced.
static __device__ __noinline__ Sums MaskedSums(const float* v, float sh, unsigned quad) {
  Sums a;
  for (int i = 0; i < 32; ++i) {
    const float d = fmaxf(v[i] - sh, kMaskedFloor);
    a.Add(d, ExpShift(d));
  }
  a.QuadReduce(quad);
  return a;
}

// The masked pass of a pair, quad-reduced: both sides' sums (the a side's operations are
// MaskedSums'), the cross terms, and the support-mismatch flags.
static __device__ __noinline__ PairSums MaskedPairSums(const float* va, const float* vb, float sha,
                                                       float shb, unsigned quad) {
  PairSums p;
  bool a_only = false, b_only = false;
  for (int i = 0; i < 32; ++i) {
    p.Add(fmaxf(va[i] - sha, kMaskedFloor), fmaxf(vb[i] - shb, kMaskedFloor));
    const bool live_a = va[i] - sha > NegInfF();
    const bool live_b = vb[i] - shb > NegInfF();
    a_only |= live_a && !live_b;
    b_only |= live_b && !live_a;
  }
  p.QuadReduce(quad);
  if (QuadAny(a_only, quad)) p.flags |= kFlagASupportsBMasked;
  if (QuadAny(b_only, quad)) p.flags |= kFlagBSupportsAMasked;
  return p;
}

// The record of one distribution over the thread's row half h of the subtile (the single form).
__device__ __forceinline__ BlockStats SingleRecord(const float (&z)[64], int h) {
  const float m = RowHalfMax(z, h);
  BlockStats out = EmptyBlockStats();
  out.flags = detail::BadFlags(m);
  if (out.flags != 0 || m == NegInfF()) return out;  // uniform over the quad
  const unsigned quad = QuadMask();
  const float sh = m + 0.0f;  // -0 -> +0 (a GEMM's zero sign depends on its parts)
  Sums a;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float d = z[Reg(h, j, e)] - sh;
      a.Add(d, ExpShift(d));
    }
  }
  a.QuadReduce(quad);
  if (isnan(a.w)) {  // a masked token (uniform over the quad)
    float v[32];
    CopyRowHalf(z, h, v);
    a = MaskedSums(v, sh, quad);
  }
  out.m = sh;
  out.s = a.s;
  out.w = a.w;
  return out;
}

// The record of the pair (a = model, b = reference) over row half h of the subtile: PairItem's
// statistics. The a side's operations are SingleRecord's, in the same order: the cross terms
// c_ab = sum exp(da) (da - db), c_ba = -sum exp(db) (da - db) ride along.
__device__ __forceinline__ PairBlockStats PairRecord(const float (&za)[64], const float (&zb)[64],
                                                     int h) {
  const float ma = RowHalfMax(za, h);
  const float mb = RowHalfMax(zb, h);
  PairBlockStats out{EmptyBlockStats(), EmptyBlockStats(), 0.0f, 0.0f};
  out.a.flags = detail::BadFlags(ma);
  out.b.flags = detail::BadFlags(mb);
  if ((out.a.flags | out.b.flags) & kBadInput) return out;  // uniform over the quad
  const unsigned quad = QuadMask();
  const float ninf = NegInfF();
  // A fully masked side shifts by 0: all of its tokens are masked.
  const float sha = (ma == ninf ? 0.0f : ma) + 0.0f;
  const float shb = (mb == ninf ? 0.0f : mb) + 0.0f;
  PairSums p;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      p.Add(za[Reg(h, j, e)] - sha, zb[Reg(h, j, e)] - shb);
    }
  }
  p.QuadReduce(quad);
  if (isnan(p.a.w) || isnan(p.b.w) || isnan(p.cab) || isnan(p.cba)) {  // uniform over the quad
    float va[32], vb[32];
    CopyRowHalf(za, h, va);
    CopyRowHalf(zb, h, vb);
    p = MaskedPairSums(va, vb, sha, shb, quad);
    out.a.flags |= p.flags;
  }
  if (ma != ninf) {
    out.a.m = sha;
    out.a.s = p.a.s;
    out.a.w = p.a.w;
    out.c_ab = p.cab;
  }
  if (mb != ninf) {
    out.b.m = shb;
    out.b.s = p.b.s;
    out.b.w = p.b.w;
    out.c_ba = p.cba;
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
