// The CPU kernels' exp (kernels/cpu/cpu_kernels.cc, ExpNonPositive) against exp in fp64, through
// the public block statistics: a block {0, x} has maximum 0, so its w = e^x * x rounded once
// (fmaf onto 0) isolates the kernel's e^x, and s = 1 + e^x. kSumRelTol's derivation
// (tests/kernels/expect_reference.h) assumes each exp within 4 ulp: that is the bound checked.
#include "logitserve/kernels/cpu_kernels.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

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

}  // namespace
}  // namespace logitserve::kernels
