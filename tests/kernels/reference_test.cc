// The fp64 reference against closed forms, and the test-support encoders it relies on.
#include "kernels/reference/reference.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "tests/kernels/job_builder.h"
#include "tests/reference/job_reference.h"

namespace logitserve {
namespace {

using reference::Entropy;
using reference::Jsd;
using reference::Kl;
using reference::LogSoftmax;
using reference::TopK;

constexpr double kInf = std::numeric_limits<double>::infinity();

// The reference computes in double over at most a few thousand terms here: its own error is a
// few ulp of double times the magnitudes involved (<= 1e3), far below this.
constexpr double kClosedFormTol = 1e-12;

TEST(ReferenceTest, UniformRow) {
  for (int64_t v : {1, 2, 17, 1000}) {
    SCOPED_TRACE(v);
    const std::vector<double> z(static_cast<size_t>(v), 1.25);
    const std::vector<double> lp = LogSoftmax(z);
    for (double x : lp) EXPECT_NEAR(x, -std::log(static_cast<double>(v)), kClosedFormTol);
    EXPECT_NEAR(Entropy(lp), std::log(static_cast<double>(v)), kClosedFormTol);
    EXPECT_NEAR(Kl(lp, lp), 0.0, kClosedFormTol);
    EXPECT_NEAR(Jsd(lp, lp, 0.3), 0.0, kClosedFormTol);
  }
}

TEST(ReferenceTest, TwoTokenKlClosedForm) {
  // a: p = [1/4, 3/4]; b: p = [1/2, 1/2].
  const std::vector<double> a = LogSoftmax(std::vector<double>{0.0, std::log(3.0)});
  const std::vector<double> b = LogSoftmax(std::vector<double>{0.0, 0.0});
  EXPECT_NEAR(std::exp(a[0]), 0.25, kClosedFormTol);
  EXPECT_NEAR(Kl(a, b), 0.25 * std::log(0.5) + 0.75 * std::log(1.5), kClosedFormTol);
  EXPECT_NEAR(Kl(b, a), 0.5 * std::log(2.0) + 0.5 * std::log(2.0 / 3.0), kClosedFormTol);
  EXPECT_NEAR(Entropy(a), -(0.25 * std::log(0.25) + 0.75 * std::log(0.75)), kClosedFormTol);
}

TEST(ReferenceTest, SupportMismatch) {
  const std::vector<double> both = LogSoftmax(std::vector<double>{0.0, 0.0});
  const std::vector<double> one = LogSoftmax(std::vector<double>{0.0, -kInf});
  EXPECT_EQ(Kl(both, one), kInf);                    // KL([0,0] || [0,-inf])
  EXPECT_NEAR(Kl(one, both), std::log(2.0), 1e-15);  // KL([0,-inf] || [0,0])
  // Underflow is not masking: p_a = e^-200 (and e^-800, which is 0 even in double) still counts.
  for (double tail : {-200.0, -800.0}) {
    const std::vector<double> a = LogSoftmax(std::vector<double>{0.0, tail});
    EXPECT_EQ(Kl(a, one), kInf) << tail;
    EXPECT_TRUE(std::isfinite(Kl(one, a))) << tail;
  }
}

TEST(ReferenceTest, JsdEndpointsAreKlExactly) {
  const std::vector<double> s = LogSoftmax(std::vector<double>{0.3, -1.0, 2.0, -kInf});
  const std::vector<double> t = LogSoftmax(std::vector<double>{1.0, 0.5, -2.0, 0.0});
  EXPECT_EQ(Jsd(s, t, 0.0), Kl(t, s));  // beta = 0: forward KL(teacher || student)
  EXPECT_EQ(Jsd(s, t, 0.0), kInf);      // the teacher supports token 3, the student masks it
  EXPECT_EQ(Jsd(s, t, 1.0), Kl(s, t));  // beta = 1: reverse KL(student || teacher)
  EXPECT_TRUE(std::isfinite(Jsd(s, t, 1.0)));
  EXPECT_TRUE(std::isfinite(Jsd(s, t, 0.5)));  // finite under support mismatch
}

TEST(ReferenceTest, JsdHalfIsClassicJensenShannon) {
  // P = [1/4, 3/4], Q = [1/2, 1/2], M = [3/8, 5/8]; JS = (KL(P||M) + KL(Q||M)) / 2.
  const std::vector<double> p = LogSoftmax(std::vector<double>{0.0, std::log(3.0)});
  const std::vector<double> q = LogSoftmax(std::vector<double>{0.0, 0.0});
  const double kl_pm = 0.25 * std::log(0.25 / 0.375) + 0.75 * std::log(0.75 / 0.625);
  const double kl_qm = 0.5 * std::log(0.5 / 0.375) + 0.5 * std::log(0.5 / 0.625);
  EXPECT_NEAR(Jsd(p, q, 0.5), 0.5 * (kl_pm + kl_qm), kClosedFormTol);
  EXPECT_NEAR(Jsd(q, p, 0.5), 0.5 * (kl_pm + kl_qm), kClosedFormTol);  // symmetric at 1/2
  // Disjoint supports: JS = ln 2.
  const std::vector<double> a = LogSoftmax(std::vector<double>{0.0, -kInf});
  const std::vector<double> b = LogSoftmax(std::vector<double>{-kInf, 0.0});
  EXPECT_NEAR(Jsd(a, b, 0.5), std::log(2.0), kClosedFormTol);
}

TEST(ReferenceTest, GeneralizedJsdClosedForm) {
  // s = [1, 0] (one-hot), t = [1/2, 1/2], beta = 0.3: m = [0.85, 0.15].
  const std::vector<double> s = LogSoftmax(std::vector<double>{0.0, -kInf});
  const std::vector<double> t = LogSoftmax(std::vector<double>{0.0, 0.0});
  const double kl_tm = 0.5 * std::log(0.5 / 0.85) + 0.5 * std::log(0.5 / 0.15);
  const double kl_sm = std::log(1.0 / 0.85);
  EXPECT_NEAR(Jsd(s, t, 0.3), 0.3 * kl_tm + 0.7 * kl_sm, kClosedFormTol);
}

TEST(ReferenceTest, AllMaskedRow) {
  const std::vector<double> lp = LogSoftmax(std::vector<double>{-kInf, -kInf, -kInf});
  const std::vector<double> ok = LogSoftmax(std::vector<double>{0.0, 1.0, 2.0});
  for (double x : lp) EXPECT_TRUE(std::isnan(x));
  EXPECT_TRUE(std::isnan(Entropy(lp)));
  EXPECT_TRUE(std::isnan(Kl(lp, ok)));
  EXPECT_TRUE(std::isnan(Kl(ok, lp)));
  for (double beta : {0.0, 0.3, 1.0}) EXPECT_TRUE(std::isnan(Jsd(ok, lp, beta))) << beta;
  EXPECT_EQ(reference::TargetLogProb(lp, -100, -100), 0.0);
  EXPECT_TRUE(std::isnan(reference::TargetLogProb(lp, 1, -100)));
  const auto top = TopK(lp, 2);
  ASSERT_EQ(top.size(), 2u);
  EXPECT_EQ(top[0].id, 0);
  EXPECT_EQ(top[1].id, 1);
  EXPECT_TRUE(std::isnan(top[0].logprob));
}

TEST(ReferenceTest, OneHotRowIsExact) {
  const std::vector<double> lp = LogSoftmax(std::vector<double>{-kInf, 7.5, -kInf});
  EXPECT_EQ(lp[1], 0.0);
  EXPECT_EQ(Entropy(lp), 0.0);
  EXPECT_EQ(Kl(lp, lp), 0.0);
}

TEST(ReferenceTest, TopKOrderTiesAndMasks) {
  const std::vector<double> lp =
      LogSoftmax(std::vector<double>{1.0, 3.0, 3.0, -kInf, 2.0, 3.0, -kInf});
  const auto top = TopK(lp, 7);
  const std::vector<int32_t> want = {1, 2, 5, 4, 0, 3, 6};  // ties by id; masked last, by id
  ASSERT_EQ(top.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(top[i].id, want[i]) << i;
  EXPECT_EQ(top[5].logprob, -kInf);
  EXPECT_EQ(TopK(lp, 100).size(), 7u);  // k clamps to V
}

TEST(ReferenceTest, FiniteExtremesOverflowActsAsMasked) {
  // z - M = -6e38 overflows fp32: masked (SPEC §3 edge 6). 0 - 3e38 does not.
  const std::vector<double> lp = LogSoftmax(std::vector<double>{3e38, -3e38, 0.0});
  EXPECT_EQ(lp[0], 0.0);
  EXPECT_EQ(lp[1], -kInf);
  EXPECT_EQ(lp[2], -3e38);
  EXPECT_EQ(Entropy(lp), 0.0);
}

TEST(ReferenceTest, LargeOffsetIsExact) {
  std::vector<double> z = {8.0, -16.0, 0.0, 24.0, -kInf};
  std::vector<double> shifted = z;
  for (double& x : shifted) x += 1e8;
  EXPECT_EQ(LogSoftmax(z), LogSoftmax(shifted));
}

TEST(ReferenceTest, TransformOrder) {
  reference::Transform t;
  EXPECT_EQ(reference::TransformLogit(t, 3.0, 0.5, 1.0), 3.5);
  t.logit_scale = 0.5f;
  EXPECT_EQ(reference::TransformLogit(t, 10.0, 2.0, 1.0), 6.0);  // (dot + bias) * scale
  t.softcap = 5.0f;
  EXPECT_DOUBLE_EQ(reference::TransformLogit(t, 10.0, 2.0, 2.0), 5.0 * std::tanh(1.2) / 2.0);
  reference::Transform granite;
  granite.logits_scaling = 4.0f;
  EXPECT_EQ(reference::TransformLogit(granite, 10.0, 2.0, 1.0), 3.0);  // (dot + bias) / scaling
}

TEST(ReferenceTest, HiddenModeLogits) {
  // V = 3, H = 2, bf16 weights: z_j = (h . W_j + bias_j) * 2, then / temperature 4.
  auto head = std::make_shared<HeadWeights>();
  head->vocab_size = 3;
  head->hidden_size = 2;
  head->dtype = kernels::FloatType::kBFloat16;
  head->weight =
      testing::Encode(kernels::FloatType::kBFloat16, 3, 2, {1.0f, 2.0f, -0.5f, 0.25f, 3.0f, -1.0f})
          .bytes;
  head->bias = {0.5f, 0.0f, -1.0f};
  head->transform.logit_scale = 2.0f;
  const testing::HostMatrix h = testing::Encode(kernels::FloatType::kFloat16, 1, 2, {2.0f, -4.0f});
  DistributionInput in;
  in.head = std::make_shared<PreparedHead>(head);
  in.hidden = h.view();
  in.temperature = 4.0f;
  double magnitude = -1.0;
  const std::vector<double> z = reference::RowLogits(in, 0, 3, &magnitude);
  EXPECT_EQ(z, (std::vector<double>{(2.0 - 8.0 + 0.5) * 2 / 4, (-1.0 - 1.0) * 2 / 4,
                                    (6.0 + 4.0 - 1.0) * 2 / 4}));
  EXPECT_EQ(magnitude, 10.0);  // max_j sum_i |h_i W_ji| = |2 * 3| + |-4 * -1|
  EXPECT_EQ(reference::HiddenDotMagnitude(in, 0, 3), 10.0);
}

TEST(ReferenceTest, ScoreReferenceLayoutAndDirections) {
  // model row: p = [1/4, 3/4]; reference row: p = [1/2, 1/2].
  testing::OwnedJob j;
  j.SetModelLogits(testing::Share(testing::Encode(kernels::FloatType::kFloat32, 1, 2,
                                                  {0.0f, static_cast<float>(std::log(3.0))})));
  j.SetReferenceLogits(
      testing::Share(testing::Encode(kernels::FloatType::kFloat32, 1, 2, {0.0f, 0.0f})));
  j.WithEverything({1, -100, 0}, 3, 2, 0.0f);
  const reference::ReferenceResult r = reference::ScoreReference(j.job);
  const double p1 = static_cast<double>(static_cast<float>(std::log(3.0)));  // fp32 input
  const double l = std::log(1.0 + std::exp(p1));
  ASSERT_EQ(r.target_logprobs.size(), 3u);
  EXPECT_NEAR(r.target_logprobs[0], p1 - l, kClosedFormTol);
  EXPECT_EQ(r.target_logprobs[1], 0.0);
  EXPECT_NEAR(r.target_logprobs[2], -l, kClosedFormTol);
  EXPECT_EQ(r.top_k_ids, (std::vector<int32_t>{1, 0}));
  EXPECT_NEAR(r.reference_entropy[0], std::log(2.0), kClosedFormTol);
  // forward = KL(reference || model), reverse = KL(model || reference), jsd(0) = forward.
  EXPECT_NEAR(r.forward_kl[0], 0.5 * (-std::log(2.0) + l) + 0.5 * (-std::log(2.0) - p1 + l),
              kClosedFormTol);
  // KL(model || reference) = sum_j p_j (lp_j + ln 2), p = [e^-l, e^(p1 - l)].
  EXPECT_NEAR(r.reverse_kl[0],
              std::exp(-l) * (-l + std::log(2.0)) + std::exp(p1 - l) * (p1 - l + std::log(2.0)),
              kClosedFormTol);
  EXPECT_EQ(r.jsd[0], r.forward_kl[0]);
}

}  // namespace
}  // namespace logitserve
