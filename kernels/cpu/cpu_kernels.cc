// CPU kernels with Google Highway, compiled for several ISAs and dispatched once per process.
//
// Each block is read twice while it sits in L1/L2: a max pass, then one exp per element for the
// sums. With the block max known up front no per-lane rescaling (a second exp per element) is
// needed; blocks are combined with scalar rescales in block_stats.h.
//
// In-block order is fixed: lanes accumulate element i into lane i % lanes, lanes are reduced
// pairwise by Highway's ReduceSum, and the tail is handled by a masked final vector. The result of
// a block therefore depends only on its values (and the ISA chosen at start-up).

// Highway's foreach_target.h re-includes this file once per target and must come first, before
// the headers it re-reads: the includes are kept out of clang-format's regrouping.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/cpu/cpu_kernels.cc"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include <algorithm>
#include <cmath>
#include <cstring>

#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"
#include "logitserve/kernels/cpu_kernels.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace logitserve::kernels {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// Loads up to Lanes() floats starting at p with n remaining (n >= 1); missing lanes get `fill`.
HWY_INLINE VF LoadTail(DF d, const float* HWY_RESTRICT p, int64_t n, float fill) {
  const size_t lanes = hn::Lanes(d);
  if (static_cast<size_t>(n) >= lanes) return hn::LoadU(d, p);
  HWY_ALIGN float buf[hn::MaxLanes(d)];
  for (size_t i = 0; i < lanes; ++i) buf[i] = i < static_cast<size_t>(n) ? p[i] : fill;
  return hn::Load(d, buf);
}

void ToFloatImpl(FloatType type, const void* src, int64_t n, float temperature, float* dst) {
  const DF d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  if (type == FloatType::kFloat32) {
    if (dst != src) std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
  } else if (type == FloatType::kBFloat16) {
    const hn::Rebind<hwy::bfloat16_t, DF> dbf;
    const auto* s = static_cast<const hwy::bfloat16_t*>(src);
    int64_t i = 0;
    for (; i + lanes <= n; i += lanes)
      hn::StoreU(hn::PromoteTo(d, hn::LoadU(dbf, s + i)), d, dst + i);
    const auto* bits = static_cast<const uint16_t*>(src);
    for (; i < n; ++i) dst[i] = BFloat16ToFloat(bits[i]);
  } else {
    const hn::Rebind<hwy::float16_t, DF> dh;
    const hn::Rebind<uint16_t, DF> d16;
    const hn::RebindToUnsigned<DF> du;
    const auto* s = static_cast<const hwy::float16_t*>(src);
    const auto* bits = static_cast<const uint16_t*>(src);
    const auto exponent = hn::Set(du, 0x7c00u);
    int64_t i = 0;
    for (; i + lanes <= n; i += lanes) {
      const auto raw = hn::LoadU(dh, s + i);
      VF f = hn::PromoteTo(d, raw);
      // Highway 1.0's fp16 emulation (targets without F16C: SSE4 and below) turns +-inf into
      // +-65536 and a NaN into a finite value, so a masked (-inf) logit would count as a token.
      // Such lanes get Float16ToFloat's bits: sign, all-ones exponent, the payload shifted up.
      const auto h = hn::PromoteTo(du, hn::BitCast(d16, raw));
      const auto special = hn::Eq(hn::And(h, exponent), exponent);
      if (!hn::AllFalse(du, special)) {
        const auto exact = hn::Or(
            hn::Or(hn::ShiftLeft<16>(hn::And(h, hn::Set(du, 0x8000u))), hn::Set(du, 0x7f800000u)),
            hn::ShiftLeft<13>(hn::And(h, hn::Set(du, 0x03ffu))));
        f = hn::IfThenElse(hn::RebindMask(d, special), hn::BitCast(d, exact), f);
      }
      hn::StoreU(f, d, dst + i);
    }
    for (; i < n; ++i) dst[i] = Float16ToFloat(bits[i]);
  }
  if (temperature != 1.0f) {
    const VF t = hn::Set(d, temperature);
    int64_t i = 0;
    for (; i + lanes <= n; i += lanes) hn::StoreU(hn::Div(hn::LoadU(d, dst + i), t), d, dst + i);
    for (; i < n; ++i) dst[i] = dst[i] / temperature;
  }
}

void ApplyTransformImpl(const LogitTransform& t, float* z, int64_t n) {
  const DF d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  const VF scale = hn::Set(d, t.scale);
  const VF cap = hn::Set(d, t.softcap);
  const VF temp = hn::Set(d, t.temperature);
  const bool scaled = t.scale != 1.0f;
  const bool capped = t.softcap > 0.0f;
  const bool tempered = t.temperature != 1.0f;
  // Scalar twin of the vector body, for the tail. Both evaluate the same operations in the same
  // order (tanh differs: Highway's in the body, libm's in the tail; a column always lands in the
  // same place because blocks start at fixed offsets, so results stay deterministic).
  auto scalar = [&](int64_t j) {
    float x = z[j];
    if (t.bias) x = x + t.bias[j];
    if (scaled) x = t.divide_by_scale ? x / t.scale : x * t.scale;
    if (capped) x = t.softcap * std::tanh(x / t.softcap);
    if (tempered) x = x / t.temperature;
    z[j] = x;
  };
  int64_t j = 0;
  for (; j + lanes <= n; j += lanes) {
    VF x = hn::LoadU(d, z + j);
    if (t.bias) x = hn::Add(x, hn::LoadU(d, t.bias + j));
    if (scaled) x = t.divide_by_scale ? hn::Div(x, scale) : hn::Mul(x, scale);
    if (capped) x = hn::Mul(cap, hn::Tanh(d, hn::Div(x, cap)));
    if (tempered) x = hn::Div(x, temp);
    hn::StoreU(x, d, z + j);
  }
  for (; j < n; ++j) scalar(j);
}

// e^x for x <= 0, including x = -inf (gives 0). x = n ln2 + f with n = round(x log2 e) from the
// 1.5 * 2^23 rounding constant (one FMA; n's bits then sit in the mantissa of t, so n << 23 is a
// shift of t's bits: no round or convert instruction), |f| <= ln2/2 by Cody-Waite; e^f by a
// degree-5 polynomial with constant term 1, fitted for minimal relative error on [-0.3467, 0.3467]
// (fp64 Lawson iteration, coefficients rounded to fp32). Its fp32 Horner evaluation, checked
// against exp in fp64 at 2e6 points of that interval, is within 1.9 ulp (relative 2.6 u), inside
// the 4 ulp per exp that kSumRelTol (tests/kernels/expect_reference.h) allows; the GPU's
// ex2.approx has 2 ulp. Results below 2^-125 are flushed to 0: such a term is under 1e-37 of the
// block maximum's weight 1, far below fp32 resolution of the sum. 13 instructions; the degree-7
// Taylor form with a round and a convert took 17, and the exp is the CPU kernels' bottleneck.
HWY_INLINE VF ExpNonPositive(DF d, VF x) {
  const hn::RebindToSigned<DF> di;
  const VF magic = hn::Set(d, 12582912.0f);  // 1.5 * 2^23
  const VF t = hn::MulAdd(x, hn::Set(d, 1.44269504088896341f), magic);
  const VF n = hn::Sub(t, magic);                                 // exact: |n| < 2^22
  VF f = hn::NegMulAdd(n, hn::Set(d, 0.693145751953125f), x);     // ln2 high part, exact product
  f = hn::NegMulAdd(n, hn::Set(d, 1.428606765330187045e-6f), f);  // ln2 low part
  VF p = hn::Set(d, 0.00829028338f);
  p = hn::MulAdd(p, f, hn::Set(d, 0.0418980978f));
  p = hn::MulAdd(p, f, hn::Set(d, 0.166676372f));
  p = hn::MulAdd(p, f, hn::Set(d, 0.499991477f));
  p = hn::MulAdd(p, f, hn::Set(d, 0.999999702f));
  p = hn::MulAdd(p, f, hn::Set(d, 1.0f));  // e^0 = 1 exactly: a lone token's weight is exact
  // t's low 23 bits hold n + 2^22 in two's complement: shifted by 23 they are n << 23 (mod 2^32).
  const auto scale = hn::ShiftLeft<23>(hn::BitCast(di, t));
  const VF r = hn::BitCast(d, hn::Add(hn::BitCast(di, p), scale));
  return hn::IfThenElseZero(hn::Ge(n, hn::Set(d, -125.0f)), r);  // false for -inf and NaN too
}

// Max over n >= 0 values, and the NaN / +inf flags.
HWY_INLINE float MaxAndFlags(const float* HWY_RESTRICT z, int64_t n, uint32_t* flags) {
  const DF d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  VF vmax = hn::Set(d, -HUGE_VALF);
  auto nan_mask = hn::FirstN(d, 0);
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const VF x = hn::LoadU(d, z + i);
    nan_mask = hn::Or(nan_mask, hn::IsNaN(x));
    vmax = hn::Max(vmax, x);
  }
  if (i < n) {
    const VF x = LoadTail(d, z + i, n - i, -HUGE_VALF);
    nan_mask = hn::Or(nan_mask, hn::IsNaN(x));
    vmax = hn::Max(vmax, x);
  }
  if (!hn::AllFalse(d, nan_mask)) *flags |= kFlagNaN;
  const float m = hn::GetLane(hn::MaxOfLanes(d, vmax));
  if (m == HUGE_VALF) *flags |= kFlagPosInf;  // a +inf logit is always the block max
  return m;
}

BlockStats BlockStatsImpl(const float* HWY_RESTRICT z, int64_t n) {
  BlockStats out = EmptyBlockStats();
  const float m = MaxAndFlags(z, n, &out.flags);
  if (out.flags != 0 || m == -HUGE_VALF) return out;
  const DF d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  const VF vm = hn::Set(d, m);
  const VF clamp = hn::Set(d, kClampShift);
  VF s = hn::Zero(d);
  VF w = hn::Zero(d);
  for (int64_t i = 0; i < n; i += lanes) {
    const VF x = LoadTail(d, z + i, n - i, -HUGE_VALF);
    const VF dz = hn::Max(hn::Sub(x, vm), clamp);  // z - m <= 0; masked / overflowed -> -200
    const VF e = ExpNonPositive(d, dz);
    s = hn::Add(s, e);
    w = hn::MulAdd(e, dz, w);
  }
  out.m = m;
  out.s = hn::GetLane(hn::SumOfLanes(d, s));
  out.w = hn::GetLane(hn::SumOfLanes(d, w));
  return out;
}

PairBlockStats PairBlockStatsImpl(const float* HWY_RESTRICT a, const float* HWY_RESTRICT b,
                                  int64_t n) {
  PairBlockStats out{EmptyBlockStats(), EmptyBlockStats(), 0.0f, 0.0f};
  const float ma = MaxAndFlags(a, n, &out.a.flags);
  const float mb = MaxAndFlags(b, n, &out.b.flags);
  if ((out.a.flags | out.b.flags) != 0) return out;
  const DF d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  // A fully masked side has m = -inf; shifting by 0 instead keeps its lanes at -inf (masked).
  const VF vma = hn::Set(d, ma == -HUGE_VALF ? 0.0f : ma);
  const VF vmb = hn::Set(d, mb == -HUGE_VALF ? 0.0f : mb);
  const VF neg_inf = hn::Set(d, -HUGE_VALF);
  const VF clamp = hn::Set(d, kClampShift);
  VF sa = hn::Zero(d), wa = hn::Zero(d), sb = hn::Zero(d), wb = hn::Zero(d);
  VF cab = hn::Zero(d), cba = hn::Zero(d);
  auto a_only = hn::FirstN(d, 0);
  auto b_only = hn::FirstN(d, 0);
  for (int64_t i = 0; i < n; i += lanes) {
    const VF da = hn::Sub(LoadTail(d, a + i, n - i, -HUGE_VALF), vma);
    const VF db = hn::Sub(LoadTail(d, b + i, n - i, -HUGE_VALF), vmb);
    const auto live_a = hn::Gt(da, neg_inf);
    const auto live_b = hn::Gt(db, neg_inf);
    a_only = hn::Or(a_only, hn::AndNot(live_b, live_a));
    b_only = hn::Or(b_only, hn::AndNot(live_a, live_b));
    const VF dac = hn::Max(da, clamp);
    const VF dbc = hn::Max(db, clamp);
    const VF ea = ExpNonPositive(d, dac);
    const VF eb = ExpNonPositive(d, dbc);
    sa = hn::Add(sa, ea);
    wa = hn::MulAdd(ea, dac, wa);
    sb = hn::Add(sb, eb);
    wb = hn::MulAdd(eb, dbc, wb);
    // Cross terms over tokens both sides support, with the unclamped shifts: a deep but finite
    // logit (b - m_b = -300) is underflow, not masking, and its KL term grows with it. A token
    // only one side supports raised a mismatch flag, which overrides that direction with +inf.
    const VF diff = hn::IfThenElseZero(hn::And(live_a, live_b), hn::Sub(da, db));
    cab = hn::MulAdd(ea, diff, cab);
    cba = hn::NegMulAdd(eb, diff, cba);
  }
  if (!hn::AllFalse(d, a_only)) out.a.flags |= kFlagASupportsBMasked;
  if (!hn::AllFalse(d, b_only)) out.a.flags |= kFlagBSupportsAMasked;
  if (ma != -HUGE_VALF) {
    out.a.m = ma;
    out.a.s = hn::GetLane(hn::SumOfLanes(d, sa));
    out.a.w = hn::GetLane(hn::SumOfLanes(d, wa));
    out.c_ab = hn::GetLane(hn::SumOfLanes(d, cab));
  }
  if (mb != -HUGE_VALF) {
    out.b.m = mb;
    out.b.s = hn::GetLane(hn::SumOfLanes(d, sb));
    out.b.w = hn::GetLane(hn::SumOfLanes(d, wb));
    out.c_ba = hn::GetLane(hn::SumOfLanes(d, cba));
  }
  return out;
}

// JsdToken of block_stats.h, lane by lane: two exps and one log per token.
float JsdBlockImpl(const float* HWY_RESTRICT s, const float* HWY_RESTRICT t, int64_t n, RowNorm ns,
                   RowNorm nt, float beta) {
  const DF d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  const VF ms = hn::Set(d, ns.m), ls = hn::Set(d, ns.log_s);
  const VF mt = hn::Set(d, nt.m), lt = hn::Set(d, nt.log_s);
  const VF vbeta = hn::Set(d, beta), vomb = hn::Set(d, 1.0f - beta);
  const VF clamp = hn::Set(d, kClampShift);
  const VF tiny = hn::Set(d, 1.17549435e-38f);
  VF acc_t = hn::Zero(d);
  VF acc_s = hn::Zero(d);
  for (int64_t i = 0; i < n; i += lanes) {
    const VF zs = LoadTail(d, s + i, n - i, -HUGE_VALF);
    const VF zt = LoadTail(d, t + i, n - i, -HUGE_VALF);
    const VF lps = hn::Max(hn::Sub(hn::Sub(zs, ms), ls), clamp);  // (z - M) - L, as in LogProb
    const VF lpt = hn::Max(hn::Sub(hn::Sub(zt, mt), lt), clamp);
    const VF ps = ExpNonPositive(d, hn::Min(lps, hn::Zero(d)));
    const VF pt = ExpNonPositive(d, hn::Min(lpt, hn::Zero(d)));
    const VF m = hn::Max(hn::MulAdd(vbeta, pt, hn::Mul(vomb, ps)), tiny);
    const VF log_m = hn::Log(d, m);
    acc_t = hn::MulAdd(pt, hn::Sub(lpt, log_m), acc_t);
    acc_s = hn::MulAdd(ps, hn::Sub(lps, log_m), acc_s);
  }
  const float sum_t = hn::GetLane(hn::SumOfLanes(d, acc_t));
  const float sum_s = hn::GetLane(hn::SumOfLanes(d, acc_s));
  return beta * sum_t + (1.0f - beta) * sum_s;
}

void TopKBlockImpl(const float* HWY_RESTRICT z, int64_t n, int32_t id0, int k, TopKEntry* list,
                   int* count) {
  const DF d;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  auto insert = [&](float v, int32_t id) {
    const TopKEntry e{v, id};
    if (*count == k && !Better(e, list[k - 1])) return;
    int pos = *count < k ? (*count)++ : k - 1;
    while (pos > 0 && Better(e, list[pos - 1])) {
      list[pos] = list[pos - 1];
      --pos;
    }
    list[pos] = e;
  };
  int64_t i = 0;
  // Until the list is full every value is a candidate; afterwards only values >= the worst kept
  // one can enter, which a vector compare rules out for most of the block.
  for (; i < n && *count < k; ++i) insert(z[i], id0 + static_cast<int32_t>(i));
  for (; i + lanes <= n; i += lanes) {
    const VF x = hn::LoadU(d, z + i);
    if (hn::AllFalse(d, hn::Ge(x, hn::Set(d, list[k - 1].value)))) continue;
    for (int64_t j = i; j < i + lanes; ++j) insert(z[j], id0 + static_cast<int32_t>(j));
  }
  for (; i < n; ++i) insert(z[i], id0 + static_cast<int32_t>(i));
}

// The bits of `from` as a To of the same size.
template <typename To, typename From>
HWY_INLINE To As(From from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  std::memcpy(&to, &from, sizeof(to));
  return to;
}

// CpuSplitToBf16's parts of n floats, a vector at a time; the scalar tail is the reference form
// (the same operations, so the same bits). For finite x: hi = x's top 16 bits, r1 = x - hi (exact:
// x's low 16 bits), mid = r1's top 16 bits, lo = the top 16 bits of r1 - mid (exact); NaN gives hi
// 0x7fc0 and +-inf keeps its bits, both with zero mid and lo, as the CUDA split. Returns the mask
// of parts holding a non-zero value. (The scalar loop over every element took 45 % of the CPU
// backend's hidden-mode time at V = 256: perf, the wire bench's head.)
uint32_t SplitToBf16Impl(const float* HWY_RESTRICT x, int64_t n, uint16_t* HWY_RESTRICT hi,
                         uint16_t* HWY_RESTRICT mid, uint16_t* HWY_RESTRICT lo) {
  const DF d;
  const hn::RebindToUnsigned<DF> du;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<uint16_t, DF> d16;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d));
  const auto top = hn::Set(du, 0xffff0000u);
  const auto exponent = hn::Set(du, 0x7f800000u);
  const auto mantissa = hn::Set(du, 0x007fffffu);
  const auto quiet_nan = hn::Set(du, 0x7fc0u);
  const auto magnitude = hn::Set(du, 0x7fffu);
  auto any_hi = hn::Zero(du), any_mid = hn::Zero(du), any_lo = hn::Zero(du);
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) {
    const VF v = hn::LoadU(d, x + i);
    const auto u = hn::BitCast(du, v);
    const auto non_finite = hn::Eq(hn::And(u, exponent), exponent);
    const auto nan = hn::And(non_finite, hn::Ne(hn::And(u, mantissa), hn::Zero(du)));
    const VF r1 = hn::Sub(v, hn::BitCast(d, hn::And(u, top)));
    const auto mid_bits = hn::And(hn::BitCast(du, r1), top);
    const VF r2 = hn::Sub(r1, hn::BitCast(d, mid_bits));
    const auto h = hn::IfThenElse(nan, quiet_nan, hn::ShiftRight<16>(u));
    const auto md = hn::IfThenZeroElse(non_finite, hn::ShiftRight<16>(mid_bits));
    const auto l = hn::IfThenZeroElse(non_finite, hn::ShiftRight<16>(hn::BitCast(du, r2)));
    // Each lane is below 2^16: the saturating demotion keeps its bits.
    hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, h)), d16, hi + i);
    hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, md)), d16, mid + i);
    hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, l)), d16, lo + i);
    any_hi = hn::Or(any_hi, hn::And(h, magnitude));
    any_mid = hn::Or(any_mid, hn::And(md, magnitude));
    any_lo = hn::Or(any_lo, hn::And(l, magnitude));
  }
  HWY_ALIGN uint32_t lane_bits[3][hn::MaxLanes(du)];
  hn::Store(any_hi, du, lane_bits[0]);
  hn::Store(any_mid, du, lane_bits[1]);
  hn::Store(any_lo, du, lane_bits[2]);
  uint32_t seen[3] = {0, 0, 0};
  for (int p = 0; p < 3; ++p) {
    for (int64_t j = 0; j < lanes; ++j) seen[p] |= lane_bits[p][j];
  }
  for (; i < n; ++i) {
    const uint32_t u = As<uint32_t>(x[i]);
    uint32_t h = u >> 16, md = 0, l = 0;
    if ((u & 0x7f800000u) == 0x7f800000u) {
      if (u & 0x007fffffu) h = 0x7fc0u;
    } else {
      const float r1 = x[i] - As<float>(u & 0xffff0000u);
      const uint32_t mid_bits = As<uint32_t>(r1) & 0xffff0000u;
      const float r2 = r1 - As<float>(mid_bits);
      md = mid_bits >> 16;
      l = As<uint32_t>(r2) >> 16;
    }
    hi[i] = static_cast<uint16_t>(h);
    mid[i] = static_cast<uint16_t>(md);
    lo[i] = static_cast<uint16_t>(l);
    seen[0] |= h & 0x7fffu;
    seen[1] |= md & 0x7fffu;
    seen[2] |= l & 0x7fffu;
  }
  return (seen[0] != 0 ? 1u : 0u) | (seen[1] != 0 ? 2u : 0u) | (seen[2] != 0 ? 4u : 0u);
}

}  // namespace HWY_NAMESPACE
}  // namespace logitserve::kernels
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace logitserve::kernels {

HWY_EXPORT(ToFloatImpl);
HWY_EXPORT(ApplyTransformImpl);
HWY_EXPORT(BlockStatsImpl);
HWY_EXPORT(PairBlockStatsImpl);
HWY_EXPORT(JsdBlockImpl);
HWY_EXPORT(TopKBlockImpl);
HWY_EXPORT(SplitToBf16Impl);

void CpuToFloat(FloatType type, const void* src, int64_t n, float temperature, float* dst) {
  HWY_DYNAMIC_DISPATCH(ToFloatImpl)(type, src, n, temperature, dst);
}
void CpuApplyTransform(const LogitTransform& t, float* z, int64_t n) {
  const bool identity =
      t.bias == nullptr && t.scale == 1.0f && t.softcap == 0.0f && t.temperature == 1.0f;
  if (!identity) HWY_DYNAMIC_DISPATCH(ApplyTransformImpl)(t, z, n);
}
BlockStats CpuBlockStats(const float* z, int64_t n) {
  return HWY_DYNAMIC_DISPATCH(BlockStatsImpl)(z, n);
}
PairBlockStats CpuPairBlockStats(const float* a, const float* b, int64_t n) {
  return HWY_DYNAMIC_DISPATCH(PairBlockStatsImpl)(a, b, n);
}
float CpuJsdBlock(const float* s, const float* t, int64_t n, RowNorm ns, RowNorm nt, float beta) {
  return HWY_DYNAMIC_DISPATCH(JsdBlockImpl)(s, t, n, ns, nt, beta);
}
void CpuTopKBlock(const float* z, int64_t n, int32_t id0, int k, TopKEntry* list, int* count) {
  if (k > 0) HWY_DYNAMIC_DISPATCH(TopKBlockImpl)(z, n, id0, k, list, count);
}

uint32_t CpuSplitToBf16(FloatType type, const void* src, int64_t n, uint16_t* hi, uint16_t* mid,
                        uint16_t* lo) {
  constexpr int64_t kChunk = 1024;  // 4 KB of floats: stays in L1 between the two steps
  float x[kChunk];
  uint32_t nonzero = 0;
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t m = std::min(kChunk, n - i0);
    CpuToFloat(type, static_cast<const uint8_t*>(src) + i0 * SizeOf(type), m, 1.0f, x);
    nonzero |= HWY_DYNAMIC_DISPATCH(SplitToBf16Impl)(x, m, hi + i0, mid + i0, lo + i0);
  }
  return nonzero;
}

void TopKMerge(const TopKEntry* other, int other_count, int k, TopKEntry* list, int* count) {
  // Standard merge of two sorted lists, keeping the first k (k <= kMaxTopK).
  TopKEntry merged[kMaxTopK];
  k = std::min(k, kMaxTopK);
  int i = 0, j = 0, m = 0;
  while (m < k && (i < *count || j < other_count)) {
    if (j >= other_count || (i < *count && Better(list[i], other[j]))) {
      merged[m++] = list[i++];
    } else {
      merged[m++] = other[j++];
    }
  }
  std::copy(merged, merged + m, list);
  *count = m;
}

}  // namespace logitserve::kernels
#endif  // HWY_ONCE
