// The CPU kernels' exp (kernels/cpu/cpu_kernels.cc, ExpNonPositive) against exp in fp64, through
// the public block statistics: a block {0, x} has maximum 0, so its w = e^x * x rounded once
// (fmaf onto 0) isolates the kernel's e^x, and s = 1 + e^x. kSumRelTol's derivation
// (tests/kernels/expect_reference.h) assumes each exp within 4 ulp: that is the bound checked.
// Also CpuSplitToBf16 (the CPU backend's bf16 GEMM operands) against exact fp64 sums.
#include "logitserve/kernels/cpu_kernels.h"

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "hwy/targets.h"

namespace logitserve::kernels {
namespace {

// One ulp of the fp32 value nearest to v (v > 0, normal).
double UlpOf(double v) {
  const float f = static_cast<float>(v);
  return static_cast<double>(std::nextafter(f, std::numeric_limits<float>::infinity())) - f;
}

std::vector<float> Shifts() {
  // Dense near 0 (the polynomial's whole interval), then every range-reduction step n down to
  // -124 (x >= -86; from e^x < 2^-125 on the kernel flushes, see the last test), plus random
  // points.
  std::vector<float> x;
  for (int i = 1; i <= 20000; ++i) x.push_back(-static_cast<float>(i) * 1e-4f);
  for (int i = 0; i <= 84000; i += 7) x.push_back(-static_cast<float>(i) * 1e-3f - 2.0f);
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-86.0f, 0.0f);
  for (int i = 0; i < 20000; ++i) x.push_back(u(rng));
  return x;
}

TEST(CpuExp, WithinFourUlpOverTheNormalRange) {
  int checked = 0;
  double worst = 0.0;  // in ulp of e^x
  for (float x : Shifts()) {
    if (x == 0.0f) continue;
    const float z[2] = {0.0f, x};
    const BlockStats b = CpuBlockStats(z, 2);
    ASSERT_EQ(b.m, 0.0f);
    const double e = std::exp(static_cast<double>(x));
    // w = round(e_kernel * x): its own rounding is half an ulp of w.
    const double w_ref = e * x;
    const double err_ulp =
        (std::abs(static_cast<double>(b.w) - w_ref) - 0.5 * UlpOf(std::abs(w_ref))) /
        (UlpOf(e) * std::abs(static_cast<double>(x)));
    worst = std::max(worst, err_ulp);
    ASSERT_LE(err_ulp, 4.0) << "x = " << x << ": w " << b.w << " vs " << w_ref;
    // s = round(1 + e_kernel): within half an ulp of 1 + e plus the exp's error.
    ASSERT_LE(std::abs(static_cast<double>(b.s) - (1.0 + e)), 0.5 * UlpOf(1.0 + e) + 4.0 * UlpOf(e))
        << "x = " << x;
    ++checked;
  }
  EXPECT_GT(checked, 50000);
  RecordProperty("worst_ulp", std::to_string(worst));
}

// e^0 = 1 exactly: a block whose values all equal its maximum has s = n and w = 0 exactly, and a
// one-token row is exact (log-probability 0, entropy 0).
TEST(CpuExp, ExpOfZeroIsExactlyOne) {
  for (float m : {0.0f, 3.5f, -7.25f, 1e6f}) {
    const std::vector<float> z(37, m);
    const BlockStats b = CpuBlockStats(z.data(), static_cast<int64_t>(z.size()));
    EXPECT_EQ(b.s, 37.0f) << "m = " << m;
    EXPECT_EQ(b.w, 0.0f) << "m = " << m;
  }
}

// Terms below 2^-125 of the block maximum's weight are flushed to 0, and masked values (-inf)
// contribute exactly nothing.
TEST(CpuExp, DeepTermsAndMaskedValuesAddNothing) {
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {-88.0f, -100.0f, -150.0f, -199.0f, -inf}) {
    const float z[2] = {0.0f, x};
    const BlockStats b = CpuBlockStats(z, 2);
    EXPECT_EQ(b.s, 1.0f) << "x = " << x;
    EXPECT_EQ(b.w, 0.0f) << "x = " << x;
  }
}

// ---- CpuToFloat -------------------------------------------------------------------------------

// Runs body() once on every instruction set this machine runs and the library was built for
// (Highway dispatches to the best one; CI's and users' machines may pick another), under a trace
// naming it; the machine's own choice is back afterwards, also when an assertion ends body early.
template <typename Body>
void OnEveryTarget(Body body) {
  const std::vector<int64_t> targets = hwy::SupportedAndGeneratedTargets();
  EXPECT_FALSE(targets.empty());
  struct Restore {
    ~Restore() { hwy::SetSupportedTargetsForTest(0); }
  } restore;
  for (const int64_t target : targets) {
    hwy::SetSupportedTargetsForTest(target);
    SCOPED_TRACE(hwy::TargetName(target));
    body();
  }
}

// Every fp16 and bf16 bit pattern converts exactly (Float16ToFloat / BFloat16ToFloat, checked
// against the IEEE definitions elsewhere), infinities and NaN included, on every instruction set
// this machine runs and the library was built for: Highway's fp16 emulation below AVX2 maps
// +-inf to +-65536 and NaN to finite values, which would unmask a -inf logit.
TEST(CpuToFloat, EverySixteenBitPatternOnEveryTarget) {
  std::vector<uint16_t> all(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  OnEveryTarget([&] {
    for (const FloatType type : {FloatType::kFloat16, FloatType::kBFloat16}) {
      std::vector<float> got(all.size());
      CpuToFloat(type, all.data(), static_cast<int64_t>(all.size()), 1.0f, got.data());
      for (size_t i = 0; i < all.size(); ++i) {
        const float want =
            type == FloatType::kFloat16 ? Float16ToFloat(all[i]) : BFloat16ToFloat(all[i]);
        uint32_t g, w;
        std::memcpy(&g, &got[i], sizeof(g));
        std::memcpy(&w, &want, sizeof(w));
        ASSERT_EQ(g, w) << "type " << static_cast<int>(type) << ", bits 0x" << std::hex << i;
      }
    }
  });
}

// ---- CpuSplitToBf16 --------------------------------------------------------------------------

double Bf16Value(uint16_t bits) { return BFloat16ToFloat(bits); }

struct Split {
  std::vector<uint16_t> hi, mid, lo;
  uint32_t nonzero;
};

Split SplitOf(FloatType type, const void* src, int64_t n) {
  Split s{std::vector<uint16_t>(n), std::vector<uint16_t>(n), std::vector<uint16_t>(n), 0};
  s.nonzero = CpuSplitToBf16(type, src, n, s.hi.data(), s.mid.data(), s.lo.data());
  return s;
}

// Every finite fp32 value of the normal range is the exact sum of its three bf16 parts, each
// part's magnitude at most 2^-7 of the one before (so the GEMM's parts are ordered by weight).
TEST(CpuSplitToBf16, PartsSumExactlyToFp32Values) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<uint32_t> bits(0, 0xffffffffu);
  std::vector<float> x;
  for (int i = 0; i < 100000; ++i) {
    const uint32_t u = bits(rng);
    const uint32_t e = (u >> 23) & 0xffu;
    if (e < 40 || e == 0xffu) continue;  // keep the remainders above the subnormal range
    float f;
    std::memcpy(&f, &u, sizeof(f));
    x.push_back(f);
  }
  x.push_back(0.0f);
  x.push_back(-0.0f);
  x.push_back(1.0f);
  x.push_back(std::numeric_limits<float>::max());
  x.push_back(-std::numeric_limits<float>::max());
  const Split s = SplitOf(FloatType::kFloat32, x.data(), static_cast<int64_t>(x.size()));
  for (size_t i = 0; i < x.size(); ++i) {
    const double h = Bf16Value(s.hi[i]), m = Bf16Value(s.mid[i]), l = Bf16Value(s.lo[i]);
    ASSERT_EQ(h + m + l, static_cast<double>(x[i])) << "x = " << x[i];
    ASSERT_LE(std::abs(m), std::abs(h) * 0x1p-7) << "x = " << x[i];
    ASSERT_LE(std::abs(l), std::abs(m) * 0x1p-7) << "x = " << x[i];
  }
  EXPECT_EQ(s.nonzero, 7u);
}

// Values a 16-bit type holds need fewer parts: bf16 one (its own bits), fp16 at most two; equal
// values in different types split alike.
TEST(CpuSplitToBf16, SixteenBitInputsNeedFewerParts) {
  std::vector<uint16_t> bf(4096), half(4096);
  std::vector<float> as_fp32_bf(4096), as_fp32_half(4096);
  std::mt19937 rng(6);
  std::normal_distribution<float> n(0.0f, 3.0f);
  for (size_t i = 0; i < bf.size(); ++i) {
    const float v = n(rng);
    bf[i] = FloatToBFloat16(v);
    half[i] = FloatToFloat16(v);
    as_fp32_bf[i] = BFloat16ToFloat(bf[i]);
    as_fp32_half[i] = Float16ToFloat(half[i]);
  }
  const Split b = SplitOf(FloatType::kBFloat16, bf.data(), 4096);
  const Split h = SplitOf(FloatType::kFloat16, half.data(), 4096);
  const Split bf32 = SplitOf(FloatType::kFloat32, as_fp32_bf.data(), 4096);
  const Split hf32 = SplitOf(FloatType::kFloat32, as_fp32_half.data(), 4096);
  EXPECT_EQ(b.nonzero, 1u);
  EXPECT_EQ(h.nonzero, 3u);  // fp16's 11 significant bits: hi and mid
  EXPECT_EQ(b.hi, bf);
  EXPECT_EQ(bf32.hi, b.hi);
  EXPECT_EQ(bf32.nonzero, 1u);
  EXPECT_EQ(hf32.hi, h.hi);
  EXPECT_EQ(hf32.mid, h.mid);
  EXPECT_EQ(hf32.nonzero, 3u);
  for (size_t i = 0; i < half.size(); ++i) {
    ASSERT_EQ(Bf16Value(h.hi[i]) + Bf16Value(h.mid[i]), static_cast<double>(as_fp32_half[i]));
  }
}

// Non-finite values keep their meaning in the first part (as the CUDA split): +-inf, a NaN.
TEST(CpuSplitToBf16, NonFiniteValuesStayInTheFirstPart) {
  const float x[3] = {std::numeric_limits<float>::infinity(),
                      -std::numeric_limits<float>::infinity(),
                      std::numeric_limits<float>::quiet_NaN()};
  const Split s = SplitOf(FloatType::kFloat32, x, 3);
  EXPECT_EQ(s.hi[0], 0x7f80u);
  EXPECT_EQ(s.hi[1], 0xff80u);
  EXPECT_EQ(s.hi[2], 0x7fc0u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(s.mid[i], 0u);
    EXPECT_EQ(s.lo[i], 0u);
  }
  EXPECT_EQ(s.nonzero, 1u);
}

// The parts the contract gives one fp32 value (cpu_kernels.h), in fp64 arithmetic: hi its top 16
// bits, mid the top 16 bits of the (exact) rest, lo the top 16 bits of what is left; a NaN gives
// hi 0x7fc0 and +-inf its own bits, both with zero mid and lo.
std::array<uint16_t, 3> ContractParts(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  if ((u & 0x7f800000u) == 0x7f800000u) {
    return {static_cast<uint16_t>((u & 0x007fffffu) != 0 ? 0x7fc0u : u >> 16), 0, 0};
  }
  auto top16 = [](double v) {
    const float f = static_cast<float>(v);  // exact: at most 16 significant bits remain
    uint32_t b;
    std::memcpy(&b, &f, sizeof(b));
    return static_cast<uint16_t>(b >> 16);
  };
  const uint16_t hi = static_cast<uint16_t>(u >> 16);
  const double r1 = static_cast<double>(x) - Bf16Value(hi);
  const uint16_t mid = top16(r1);
  const double r2 = r1 - Bf16Value(mid);
  return {hi, mid, top16(r2)};
}

// Every element of a long input (the vector body and a scalar tail) split as the contract says,
// non-finite values, signed zeros and subnormals included, from each source type; the mask says
// which parts hold a non-zero value.
TEST(CpuSplitToBf16, EveryElementAsTheContractSaysInLongInputs) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  std::uniform_int_distribution<int> pick(0, 19);
  const int n = 10007;  // not a multiple of any vector width
  std::vector<float> x(n);
  for (float& v : x) {
    switch (pick(rng)) {
      case 0:
        v = std::numeric_limits<float>::infinity();
        break;
      case 1:
        v = -std::numeric_limits<float>::infinity();
        break;
      case 2:
        v = std::numeric_limits<float>::quiet_NaN();
        break;
      case 3:
        v = -std::numeric_limits<float>::quiet_NaN();
        break;
      case 4:
        v = -0.0f;
        break;
      case 5:
        v = std::numeric_limits<float>::denorm_min() * 3.0f;
        break;
      default:
        v = normal(rng);
        break;
    }
  }
  std::vector<uint16_t> bf(n), half(n);
  std::vector<float> bf_values(n), half_values(n);
  for (int i = 0; i < n; ++i) {
    bf[i] = FloatToBFloat16(x[i]);
    half[i] = FloatToFloat16(x[i]);
    bf_values[i] = BFloat16ToFloat(bf[i]);
    half_values[i] = Float16ToFloat(half[i]);
  }
  const struct {
    FloatType type;
    const void* src;
    const std::vector<float>* values;
  } cases[] = {{FloatType::kFloat32, x.data(), &x},
               {FloatType::kBFloat16, bf.data(), &bf_values},
               {FloatType::kFloat16, half.data(), &half_values}};
  OnEveryTarget([&] {
    for (const auto& c : cases) {
      const Split s = SplitOf(c.type, c.src, n);
      uint32_t nonzero = 0;
      for (int i = 0; i < n; ++i) {
        const std::array<uint16_t, 3> want = ContractParts((*c.values)[i]);
        ASSERT_EQ(s.hi[i], want[0]) << "type " << static_cast<int>(c.type) << ", element " << i;
        ASSERT_EQ(s.mid[i], want[1]) << "type " << static_cast<int>(c.type) << ", element " << i;
        ASSERT_EQ(s.lo[i], want[2]) << "type " << static_cast<int>(c.type) << ", element " << i;
        for (int p = 0; p < 3; ++p) {
          if (want[p] & 0x7fffu) nonzero |= 1u << p;
        }
      }
      EXPECT_EQ(s.nonzero, nonzero) << "type " << static_cast<int>(c.type);
    }
  });
}

// An all-zero input (either sign) has no non-zero part: the backend's GEMM skips all of them.
TEST(CpuSplitToBf16, ZerosHaveNoNonZeroPart) {
  const float x[4] = {0.0f, -0.0f, 0.0f, -0.0f};
  const Split s = SplitOf(FloatType::kFloat32, x, 4);
  EXPECT_EQ(s.nonzero, 0u);
  EXPECT_EQ(s.hi[1], 0x8000u);
}

}  // namespace
}  // namespace logitserve::kernels
