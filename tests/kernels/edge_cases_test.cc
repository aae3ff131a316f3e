// SPEC §3's edge cases, one named test each, run against every backend configuration in
// EdgeBackends() (parametrized so a CUDA backend can reuse them). Most rows use V = 5000 (three
// vocabulary blocks) so that the edge values cross block and shard boundaries.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/kernels/expect_reference.h"
#include "tests/kernels/job_builder.h"
#include "tests/reference/job_reference.h"

namespace logitserve::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int64_t kV = 5000;  // three vocabulary blocks: 2048 + 2048 + 904

// ln 2 computed in fp32 from exact inputs: two roundings (log, subtraction of log 1 = 0) and the
// output, each <= u |ln 2|.
constexpr double kLn2Tol = 3 * kU;

const std::vector<FloatType> kAllTypes = {FloatType::kFloat32, FloatType::kBFloat16,
                                          FloatType::kFloat16};

std::vector<BackendFactory> EdgeBackends() {
  return {TestBackend("1shard", 1), TestBackend("empty_1_0_2", 3, {1, 0, 2})};
}

bool SameBits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

class EdgeCases : public ::testing::TestWithParam<BackendFactory> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> b = GetParam().create();
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = *std::move(b);
  }
  Backend& backend() { return *backend_; }
  std::unique_ptr<Backend> backend_;
};

SharedMatrix Fp32(int64_t rows, int64_t cols, const std::vector<float>& v) {
  return Share(Encode(FloatType::kFloat32, rows, cols, v));
}

// The job fails with INVALID_ARGUMENT whose message names `field` and the first bad row
// (`row`), not a later bad row (`later_row`, if given).
void ExpectRejected(Backend& backend, const ScoreJob& job, const std::string& field,
                    const std::string& row, const std::string& later_row = "") {
  const absl::StatusOr<ScoreResult> got = RunJob(backend, job);
  if (got.ok()) {
    ADD_FAILURE() << "accepted; want INVALID_ARGUMENT naming " << field << " row " << row;
    return;
  }
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << got.status();
  const std::string message(got.status().message());
  EXPECT_THAT(message, HasSubstr(field));
  EXPECT_THAT(message, HasSubstr(row));
  if (!later_row.empty()) {
    EXPECT_THAT(message, Not(HasSubstr(later_row)));
  }
}

// Edge 1: -inf tokens are masked; a partially masked row equals the op on its unmasked subset.
TEST_P(EdgeCases, PartialMaskEqualsSubset) {
  std::mt19937_64 rng(1);
  const int64_t n = 4;
  std::vector<float> m = RandomNormal(rng, n * kV, 3.0);
  std::vector<float> r = RandomNormal(rng, n * kV, 3.0);
  // One column mask for every row (so the subset is a matrix): the block edges plus ~30%.
  std::vector<bool> masked(kV, false);
  for (int64_t j : {0, 2047, 2048, 4095, 4096, 4999}) masked[j] = true;
  std::bernoulli_distribution coin(0.3);
  for (int64_t j = 0; j < kV; ++j) masked[j] = masked[j] || coin(rng);
  std::vector<int32_t> kept;  // subset column -> full column
  for (int64_t j = 0; j < kV; ++j) {
    if (!masked[j]) kept.push_back(static_cast<int32_t>(j));
  }
  const int64_t vs = static_cast<int64_t>(kept.size());
  std::vector<float> ms, rs;
  for (int64_t row = 0; row < n; ++row) {
    for (int64_t j = 0; j < kV; ++j) {
      if (masked[j]) {
        m[row * kV + j] = -kInf;
        r[row * kV + j] = -kInf;
      } else {
        ms.push_back(m[row * kV + j]);
        rs.push_back(r[row * kV + j]);
      }
    }
  }
  // Targets per row: a kept token, a masked token (only in the full job), another kept, ignored.
  std::vector<int32_t> full_ids, sub_ids;
  std::uniform_int_distribution<int64_t> pick(0, vs - 1);
  for (int64_t row = 0; row < n; ++row) {
    const int64_t a = pick(rng), c = pick(rng);
    full_ids.insert(full_ids.end(), {kept[a], 2048, kept[c], -100});
    sub_ids.insert(sub_ids.end(), {static_cast<int32_t>(a), -100, static_cast<int32_t>(c), -100});
  }
  OwnedJob full, sub;
  full.SetModelLogits(Fp32(n, kV, m)).SetReferenceLogits(Fp32(n, kV, r));
  full.WithEverything(full_ids, 4, 5, 0.3f);
  sub.SetModelLogits(Fp32(n, vs, ms)).SetReferenceLogits(Fp32(n, vs, rs));
  sub.WithEverything(sub_ids, 4, 5, 0.3f);

  // The oracle agrees with the statement exactly.
  const reference::ReferenceResult rf = reference::ScoreReference(full.job);
  const reference::ReferenceResult rsub = reference::ScoreReference(sub.job);
  EXPECT_EQ(rf.entropy, rsub.entropy);
  EXPECT_EQ(rf.forward_kl, rsub.forward_kl);
  EXPECT_EQ(rf.jsd, rsub.jsd);

  LOGITSERVE_ASSERT_SCORE(got_full, backend(), full.job);
  LOGITSERVE_ASSERT_SCORE(got_sub, backend(), sub.job);
  ExpectMatchesReference(full.job, got_full);
  ExpectMatchesReference(sub.job, got_sub);
  for (int64_t row = 0; row < n; ++row) {
    EXPECT_EQ(got_full.target_logprobs[row * 4 + 1], -kInf) << "masked target, row " << row;
    for (int k = 0; k < 5; ++k) {
      EXPECT_EQ(got_full.top_k_ids[row * 5 + k], kept[got_sub.top_k_ids[row * 5 + k]])
          << "row " << row << " rank " << k;
    }
  }
}

// Edge 2: an entirely masked row gives NaN entropy / KL / JSD / valid logprobs; ignored ids 0.
TEST_P(EdgeCases, AllMaskedRowGivesNaN) {
  std::mt19937_64 rng(2);
  const int64_t n = 3;
  std::vector<float> m = RandomNormal(rng, n * kV, 3.0);
  std::vector<float> r = RandomNormal(rng, n * kV, 3.0);
  for (int64_t j = 0; j < kV; ++j) {
    m[1 * kV + j] = -kInf;  // model row 1
    r[2 * kV + j] = -kInf;  // reference row 2
  }
  const std::vector<int32_t> ids = {7, -100, 4999, -100, 5, 4999, 3, -100, 0};
  for (float beta : {0.0f, 0.3f, 1.0f}) {
    SCOPED_TRACE(beta);
    OwnedJob j;
    j.SetModelLogits(Fp32(n, kV, m)).SetReferenceLogits(Fp32(n, kV, r));
    j.WithEverything(ids, 3, 3, beta);
    LOGITSERVE_ASSERT_SCORE(got, backend(), j.job);
    ExpectMatchesReference(j.job, got);
    // Row 0: nothing masked, all finite.
    EXPECT_TRUE(std::isfinite(got.entropy[0]));
    EXPECT_TRUE(std::isfinite(got.forward_kl[0]));
    EXPECT_TRUE(std::isfinite(got.jsd[0]));
    // Row 1: the model is all masked.
    EXPECT_TRUE(SameBits(got.target_logprobs[3], 0.0f)) << got.target_logprobs[3];
    EXPECT_TRUE(std::isnan(got.target_logprobs[4]));
    EXPECT_TRUE(std::isnan(got.target_logprobs[5]));
    EXPECT_TRUE(std::isnan(got.entropy[1]));
    EXPECT_TRUE(std::isfinite(got.reference_entropy[1]));
    EXPECT_TRUE(std::isnan(got.forward_kl[1]));
    EXPECT_TRUE(std::isnan(got.reverse_kl[1]));
    EXPECT_TRUE(std::isnan(got.jsd[1]));
    for (int k = 0; k < 3; ++k) EXPECT_TRUE(std::isnan(got.top_k_logprobs[3 + k])) << k;
    // Row 2: the reference is all masked.
    EXPECT_TRUE(std::isfinite(got.target_logprobs[6]));
    EXPECT_TRUE(SameBits(got.target_logprobs[7], 0.0f)) << got.target_logprobs[7];
    EXPECT_TRUE(std::isfinite(got.entropy[2]));
    EXPECT_TRUE(std::isnan(got.reference_entropy[2]));
    EXPECT_TRUE(std::isnan(got.forward_kl[2]));
    EXPECT_TRUE(std::isnan(got.reverse_kl[2]));
    EXPECT_TRUE(std::isnan(got.jsd[2]));
  }
}

// Edge 3: KL(A || B) = +inf when A supports a token B masks, even when p_A underflows.
TEST_P(EdgeCases, SupportMismatchUnderflowGivesInf) {
  for (FloatType t : kAllTypes) {
    SCOPED_TRACE(DTypeName(t));
    const SharedMatrix a = Share(Encode(t, 1, 2, {0.0f, -200.0f}));  // e^-200 underflows fp32
    const SharedMatrix b = Share(Encode(t, 1, 2, {0.0f, -kInf}));
    {
      OwnedJob j;  // model A, reference B: reverse = KL(A || B)
      j.SetModelLogits(a).SetReferenceLogits(b).WithReverseKl().WithForwardKl().WithJsd(0.3f);
      LOGITSERVE_ASSERT_SCORE(got, backend(), j.job);
      EXPECT_EQ(got.reverse_kl[0], kInf);
      // KL(B || A) = log(1 + e^-200) ~ 1e-87: 0 in fp32.
      EXPECT_TRUE(std::isfinite(got.forward_kl[0]));
      EXPECT_LE(std::abs(got.forward_kl[0]), 1e-30);
      EXPECT_TRUE(std::isfinite(got.jsd[0]));  // JSD stays finite under support mismatch
      ExpectMatchesReference(j.job, got);
    }
    {
      OwnedJob j;  // model B, reference A: forward = KL(A || B)
      j.SetModelLogits(b).SetReferenceLogits(a).WithForwardKl().WithJsd(0.0f);
      LOGITSERVE_ASSERT_SCORE(got, backend(), j.job);
      EXPECT_EQ(got.forward_kl[0], kInf);
      EXPECT_EQ(got.jsd[0], kInf);
    }
  }
  // The same across blocks and shards: the underflowing token sits in the last block.
  std::mt19937_64 rng(3);
  std::vector<float> a = RandomNormal(rng, kV, 3.0);
  std::vector<float> b = a;
  a[4500] = -200.0f;
  b[4500] = -kInf;
  OwnedJob j;
  j.SetModelLogits(Fp32(1, kV, a)).SetReferenceLogits(Fp32(1, kV, b));
  j.WithReverseKl().WithForwardKl().WithJsd(0.3f);
  LOGITSERVE_ASSERT_SCORE(got, backend(), j.job);
  EXPECT_EQ(got.reverse_kl[0], kInf);
  EXPECT_TRUE(std::isfinite(got.forward_kl[0]));
  ExpectMatchesReference(j.job, got);
}

// Edge 3, reverse case: A = [0, -inf], B = [0, 0] gives KL(A || B) = ln 2.
TEST_P(EdgeCases, ReverseMismatchGivesLn2) {
  for (FloatType t : kAllTypes) {
    SCOPED_TRACE(DTypeName(t));
    OwnedJob j;
    j.SetModelLogits(Share(Encode(t, 1, 2, {0.0f, -kInf})))
        .SetReferenceLogits(Share(Encode(t, 1, 2, {0.0f, 0.0f})));
    j.WithReverseKl().WithForwardKl();
    LOGITSERVE_ASSERT_SCORE(got, backend(), j.job);
    EXPECT_NEAR(got.reverse_kl[0], std::log(2.0), kLn2Tol);  // KL(model || reference)
    EXPECT_EQ(got.forward_kl[0], kInf);                      // KL(reference || model)
  }
}

// Edges 1 and 3, the other way round: underflow is not masking. B = [0, -300] masks nothing;
// p_B(1) = e^-300 underflows fp32, yet lp_B(1) = -300 is finite and KL(A || B) uses it:
// A = [0, 0] gives KL(A || B) = (1/2)(-ln 2) + (1/2)(300 - ln 2) = 150 - ln 2.
TEST_P(EdgeCases, DeepFiniteLogitIsNotMasked) {
  for (FloatType t : kAllTypes) {
    SCOPED_TRACE(DTypeName(t));
    OwnedJob j;
    j.SetModelLogits(Share(Encode(t, 1, 2, {0.0f, 0.0f})))
        .SetReferenceLogits(Share(Encode(t, 1, 2, {0.0f, -300.0f})));
    j.WithReverseKl().WithForwardKl().WithJsd(1.0f);
    LOGITSERVE_ASSERT_SCORE(got, backend(), j.job);
    EXPECT_NEAR(got.reverse_kl[0], 150.0 - std::log(2.0), 150.0 * 4 * kU);  // a few ulp of 150
    EXPECT_NEAR(got.forward_kl[0], std::log(2.0), kLn2Tol);
    ExpectMatchesReference(j.job, got);
  }
}

// Edge 4: a one-hot row has H = 0 and KL(p || p) = 0 exactly, and no NaN anywhere.
TEST_P(EdgeCases, OneHotRow) {
  struct Row {
    int64_t v;
    int32_t hot;
    float value;
  };
  for (const Row& c : {Row{2, 0, 0.0f}, Row{kV, 3000, 12.5f}, Row{kV, 4999, -7.0f}}) {
    SCOPED_TRACE("V = " + std::to_string(c.v) + " hot = " + std::to_string(c.hot));
    std::vector<float> z(c.v, -kInf);
    z[c.hot] = c.value;
    const SharedMatrix p = Fp32(1, c.v, z);
    const int32_t other = c.hot == 0 ? 1 : 0;
    for (float beta : {0.0f, 0.3f, 1.0f}) {
      SCOPED_TRACE(beta);
      OwnedJob j;
      j.SetModelLogits(p).SetReferenceLogits(p);
      j.WithEverything({c.hot, other}, 2, 2, beta);
      LOGITSERVE_ASSERT_SCORE(got, backend(), j.job);
      EXPECT_TRUE(SameBits(got.entropy[0], 0.0f)) << got.entropy[0];
      EXPECT_TRUE(SameBits(got.reference_entropy[0], 0.0f)) << got.reference_entropy[0];
      EXPECT_TRUE(SameBits(got.forward_kl[0], 0.0f)) << got.forward_kl[0];
      EXPECT_TRUE(SameBits(got.reverse_kl[0], 0.0f)) << got.reverse_kl[0];
      EXPECT_EQ(got.target_logprobs[0], 0.0f);
      EXPECT_EQ(got.target_logprobs[1], -kInf);
      EXPECT_EQ(got.top_k_ids[0], c.hot);
      EXPECT_EQ(got.top_k_logprobs[0], 0.0f);
      EXPECT_EQ(got.top_k_ids[1], other);  // masked tokens rank last, by id
      EXPECT_EQ(got.top_k_logprobs[1], -kInf);
      if (beta == 0.0f || beta == 1.0f) {
        EXPECT_TRUE(SameBits(got.jsd[0], 0.0f)) << got.jsd[0];
      } else {
        EXPECT_LE(std::abs(got.jsd[0]), JsdTol(RowScale{}, RowScale{}, c.v, beta, 0.0));
      }
      ExpectMatchesReference(j.job, got);
    }
  }
}

// Edge 5: a common offset of 1e8 on values that are multiples of 8 (exact in fp32 next to 1e8,
// whose ulp is 8) gives exactly the unshifted results: the fast path works on z - M, which is
// the same exact number in both rows.
TEST_P(EdgeCases, LargeOffset1e8) {
  std::mt19937_64 rng(5);
  const int64_t n = 3;
  std::uniform_int_distribution<int> k(-6, 6);
  std::bernoulli_distribution mask(0.05);
  std::vector<float> m(n * kV), r(n * kV), ms(n * kV), rs(n * kV);
  for (int64_t i = 0; i < n * kV; ++i) {
    const bool masked = mask(rng);
    m[i] = masked ? -kInf : 8.0f * k(rng);
    r[i] = masked ? -kInf : 8.0f * k(rng);
    ms[i] = m[i] + 1e8f;
    rs[i] = r[i] + 1e8f;
    if (!masked) {
      ASSERT_EQ(static_cast<double>(ms[i]), 1e8 + m[i]);  // the shifted value is exact
    }
  }
  std::vector<int32_t> ids = RandomTargets(rng, n, 2, kV, -100, 0.2);
  for (float beta : {0.0f, 0.3f, 1.0f}) {
    SCOPED_TRACE(beta);
    OwnedJob plain, shifted;
    plain.SetModelLogits(Fp32(n, kV, m)).SetReferenceLogits(Fp32(n, kV, r));
    plain.WithEverything(ids, 2, 4, beta);
    shifted.SetModelLogits(Fp32(n, kV, ms)).SetReferenceLogits(Fp32(n, kV, rs));
    shifted.WithEverything(ids, 2, 4, beta);
    LOGITSERVE_ASSERT_SCORE(got_plain, backend(), plain.job);
    LOGITSERVE_ASSERT_SCORE(got_shifted, backend(), shifted.job);
    ExpectMatchesReference(plain.job, got_plain);
    ExpectBitwiseEqual(got_plain, got_shifted);
  }
}

// Edge 6: finite extremes (-3e38 and +3e38 in one row): no NaN; z - M overflowing to -inf acts
// as masked. The extremes sit in different blocks (and shards).
TEST_P(EdgeCases, FiniteExtremes) {
  std::mt19937_64 rng(6);
  const int64_t n = 3;
  std::vector<float> m = RandomNormal(rng, n * kV, 3.0);
  std::vector<float> r = RandomNormal(rng, n * kV, 3.0);
  m[0 * kV + 10] = -3e38f;
  m[0 * kV + 4000] = 3e38f;
  r[0 * kV + 10] = -3e38f;
  r[0 * kV + 4000] = 3e38f;
  m[1 * kV + 10] = 3e38f;  // row 1: model has the extremes, the reference is ordinary
  m[1 * kV + 4000] = -3e38f;
  m[2 * kV + 2047] = -3e38f;  // row 2: only a large negative value
  r[2 * kV + 2048] = -3e38f;
  const std::vector<int32_t> ids = {10, 4000, 7, 10, 4000, 7, 2047, 2048, 7};
  for (float beta : {0.0f, 0.3f, 1.0f}) {
    SCOPED_TRACE(beta);
    OwnedJob j;
    j.SetModelLogits(Fp32(n, kV, m)).SetReferenceLogits(Fp32(n, kV, r));
    j.WithEverything(ids, 3, 3, beta);
    LOGITSERVE_ASSERT_SCORE(got, backend(), j.job);
    auto no_nan = [](const char* name, const std::vector<float>& v) {
      for (size_t i = 0; i < v.size(); ++i)
        EXPECT_FALSE(std::isnan(v[i])) << name << "[" << i << "]";
    };
    no_nan("target_logprobs", got.target_logprobs);
    no_nan("top_k_logprobs", got.top_k_logprobs);
    no_nan("entropy", got.entropy);
    no_nan("reference_entropy", got.reference_entropy);
    no_nan("forward_kl", got.forward_kl);
    no_nan("reverse_kl", got.reverse_kl);
    no_nan("jsd", got.jsd);
    EXPECT_EQ(got.entropy[0], 0.0f);  // all mass on the +3e38 token
    EXPECT_EQ(got.target_logprobs[1], 0.0f);
    EXPECT_EQ(got.target_logprobs[0], -kInf);  // -3e38 - 3e38 overflows: masked
    EXPECT_EQ(got.forward_kl[0], 0.0f);        // identical rows
    ExpectMatchesReference(j.job, got);
  }
}

// Edge 7: NaN anywhere in the input logits fails with INVALID_ARGUMENT naming the field and the
// first bad row; -inf is allowed.
TEST_P(EdgeCases, NaNLogitRejected) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::mt19937_64 rng(7);
  const int64_t n = 50, v = 300;
  for (FloatType t : kAllTypes) {
    SCOPED_TRACE(DTypeName(t));
    std::vector<float> m = RandomNormal(rng, n * v, 3.0);
    std::vector<float> r = RandomNormal(rng, n * v, 3.0);
    m[12 * v + 0] = -kInf;  // allowed
    r[37 * v + 250] = nan;
    r[41 * v + 5] = nan;
    {
      OwnedJob j;
      j.SetModelLogits(Share(Encode(t, n, v, m))).SetReferenceLogits(Share(Encode(t, n, v, r)));
      j.WithReverseKl();
      ExpectRejected(backend(), j.job, "reference_logits", "37", "41");
    }
    m[23 * v + v - 1] = nan;
    {
      OwnedJob j;
      j.SetModelLogits(Share(Encode(t, n, v, m))).WithEntropy();
      ExpectRejected(backend(), j.job, "logits", "23");
    }
  }
}

TEST_P(EdgeCases, PosInfLogitRejected) {
  std::mt19937_64 rng(8);
  const int64_t n = 40;
  for (FloatType t : kAllTypes) {
    SCOPED_TRACE(DTypeName(t));
    std::vector<float> m = RandomNormal(rng, n * kV, 3.0);
    m[3 * kV + 100] = -kInf;   // allowed
    m[29 * kV + 4500] = kInf;  // last block (a later shard)
    m[33 * kV + 0] = kInf;
    OwnedJob j;
    j.SetModelLogits(Share(Encode(t, n, kV, m)), 1.0f, "logits").WithTopK(2);
    ExpectRejected(backend(), j.job, "logits", "29", "33");
  }
}

// Edge 7 in hidden mode: NaN in the hidden states, or +inf in the logits computed from them.
TEST_P(EdgeCases, BadHiddenStatesRejected) {
  std::mt19937_64 rng(9);
  const int64_t h = 16, n = 20;
  // All-positive weights, so that a huge hidden state overflows to +inf rather than NaN.
  auto weights = RandomHead(rng, 300, h, FloatType::kFloat32, 1.0, false, HeadTransform{});
  weights->weight = Encode(FloatType::kFloat32, 300, h, std::vector<float>(300 * h, 1.0f)).bytes;
  absl::StatusOr<std::shared_ptr<const PreparedHead>> head = backend().PrepareHead(weights);
  ASSERT_TRUE(head.ok()) << head.status();
  std::vector<float> hs = RandomNormal(rng, n * h, 1.0);
  std::vector<float> nan_hs = hs;
  nan_hs[11 * h + 3] = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> big_hs = hs;
  for (int64_t i = 0; i < h; ++i) big_hs[13 * h + i] = 3e38f;
  for (const auto& [name, values, row] :
       {std::tuple<std::string, std::vector<float>, std::string>{"NaN", nan_hs, "11"},
        {"overflow", big_hs, "13"}}) {
    SCOPED_TRACE(name);
    OwnedJob j;
    j.SetModelHidden(*head, Share(Encode(FloatType::kFloat32, n, h, values)), 1.0f, "hidden");
    j.WithEntropy();
    ExpectRejected(backend(), j.job, "hidden", row);
  }
}

// Edge 8: N = 0 is fine and gives empty outputs.
TEST_P(EdgeCases, EmptyRequest) {
  for (int64_t v : {int64_t{17}, kV}) {
    SCOPED_TRACE(v);
    OwnedJob j;
    j.SetModelLogits(Fp32(0, v, {})).SetReferenceLogits(Fp32(0, v, {}));
    j.WithEverything({}, 2, 3, 0.3f);
    LOGITSERVE_ASSERT_SCORE(got, backend(), j.job);
    EXPECT_TRUE(got.target_logprobs.empty());
    EXPECT_TRUE(got.top_k_ids.empty());
    EXPECT_TRUE(got.top_k_logprobs.empty());
    EXPECT_TRUE(got.entropy.empty());
    EXPECT_TRUE(got.reference_entropy.empty());
    EXPECT_TRUE(got.forward_kl.empty());
    EXPECT_TRUE(got.reverse_kl.empty());
    EXPECT_TRUE(got.jsd.empty());
  }
  std::mt19937_64 rng(10);
  absl::StatusOr<std::shared_ptr<const PreparedHead>> head = backend().PrepareHead(
      RandomHead(rng, kV, 8, FloatType::kBFloat16, 0.5, true, HeadTransform{}));
  ASSERT_TRUE(head.ok()) << head.status();
  OwnedJob j;
  j.SetModelHidden(*head, Share(Encode(FloatType::kBFloat16, 0, 8, {})));
  j.WithTargets({}, 1).WithEntropy().WithTopK(4);
  LOGITSERVE_ASSERT_SCORE(got, backend(), j.job);
  EXPECT_TRUE(got.target_logprobs.empty());
  EXPECT_TRUE(got.entropy.empty());
  EXPECT_TRUE(got.top_k_ids.empty());
}

// Edge 8: duplicate ids in a K-row each get the value.
TEST_P(EdgeCases, DuplicateIds) {
  std::mt19937_64 rng(11);
  const SharedMatrix z = Fp32(2, kV, RandomNormal(rng, 2 * kV, 3.0));
  OwnedJob j;
  j.SetModelLogits(z).WithTargets({5, 5, 2, 5, 4999, -100, 4999, 4999}, 4);
  LOGITSERVE_ASSERT_SCORE(got, backend(), j.job);
  ExpectMatchesReference(j.job, got);
  EXPECT_TRUE(SameBits(got.target_logprobs[0], got.target_logprobs[1]));
  EXPECT_TRUE(SameBits(got.target_logprobs[0], got.target_logprobs[3]));
  EXPECT_TRUE(SameBits(got.target_logprobs[4], got.target_logprobs[6]));
  EXPECT_TRUE(SameBits(got.target_logprobs[4], got.target_logprobs[7]));
  EXPECT_TRUE(SameBits(got.target_logprobs[5], 0.0f));
}

// ignore_index may be an id inside [0, V): that id gives exactly +0.0 wherever it appears, and
// every other id is scored as usual, bit for bit as with the default ignore_index.
TEST_P(EdgeCases, IgnoreIndexInsideTheVocabulary) {
  std::mt19937_64 rng(15);
  const int64_t n = 3;
  const SharedMatrix z = Fp32(n, kV, RandomNormal(rng, n * kV, 3.0));
  constexpr int32_t kIgnored = 2048;  // the first id of the second block
  const std::vector<int32_t> ids = {kIgnored, 1, 4999,     kIgnored, kIgnored,
                                    kIgnored, 7, kIgnored, 3000};
  OwnedJob j;
  j.SetModelLogits(z).WithTargets(ids, 3, kIgnored).WithEntropy().WithTopK(3);
  LOGITSERVE_ASSERT_SCORE(got, backend(), j.job);
  ExpectMatchesReference(j.job, got);  // ignored ids: exactly +0.0
  std::vector<int32_t> plain_ids = ids;
  for (int32_t& id : plain_ids) id = id == kIgnored ? -100 : id;
  OwnedJob plain;
  plain.SetModelLogits(z).WithTargets(plain_ids, 3).WithEntropy().WithTopK(3);
  LOGITSERVE_ASSERT_SCORE(want, backend(), plain.job);
  ExpectBitwiseEqual(got, want);
}

// Top-k ties: exactly equal log-probabilities come in id order, smaller id first, whichever block
// or shard holds them; masked tokens rank after every unmasked one, in id order too. The expected
// ids follow from the rule alone (the harness checks the values and the reference's ids as well).
TEST(EdgeCasesTopK, TiesGoToTheSmallerIdOnEveryShardLayout) {
  const std::vector<BackendFactory> layouts = {TestBackend("1shard", 1), TestBackend("3shards", 3),
                                               TestBackend("empty_1_0_2", 3, {1, 0, 2})};
  // Rows over V = 5000 (three blocks): 0 constant; 1 zeros with five 2.0s spread over every
  // block; 2 only three unmasked tokens (fewer than k), two of them tied.
  std::vector<float> z(3 * kV, 0.0f);
  for (int64_t j : {4999, 2048, 7, 3000, 4096}) z[kV + j] = 2.0f;
  for (int64_t j = 0; j < kV; ++j) z[2 * kV + j] = -kInf;
  z[2 * kV + 4500] = 1.0f;
  z[2 * kV + 100] = 2.0f;
  z[2 * kV + 2100] = 1.0f;
  // The ids the rule gives for the first k positions of each row.
  auto expected = [&](int64_t row, int32_t k) {
    std::vector<int32_t> order(kV);
    for (int32_t j = 0; j < kV; ++j) order[j] = j;
    const float* r = &z[row * kV];
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return r[a] > r[b];  // -inf last; equal values keep id order
    });
    return std::vector<int32_t>(order.begin(), order.begin() + k);
  };
  ASSERT_EQ(expected(2, 5), (std::vector<int32_t>{100, 2100, 4500, 0, 1}));
  for (const BackendFactory& f : layouts) {
    SCOPED_TRACE(f.name);
    absl::StatusOr<std::unique_ptr<Backend>> b = f.create();
    ASSERT_TRUE(b.ok()) << b.status();
    for (FloatType t : kAllTypes) {  // 0, 1, 2 and -inf are exact in every type
      for (int32_t k : {8, 300}) {
        SCOPED_TRACE(DTypeName(t) + " k = " + std::to_string(k));
        OwnedJob j;
        j.SetModelLogits(Share(Encode(t, 3, kV, z))).WithTopK(k);
        LOGITSERVE_ASSERT_SCORE(got, **b, j.job);
        for (int64_t row = 0; row < 3; ++row) {
          const std::vector<int32_t> ids(got.top_k_ids.begin() + row * k,
                                         got.top_k_ids.begin() + (row + 1) * k);
          EXPECT_EQ(ids, expected(row, k)) << "row " << row;
        }
        ExpectMatchesReference(j.job, got);
      }
    }
  }
}

// Temperature: the outputs equal the reference on z / T. With T a power of two the division is
// exact in fp32, so the outputs are bitwise those of the pre-divided logits at T = 1.
TEST_P(EdgeCases, Temperature) {
  std::mt19937_64 rng(12);
  const int64_t n = 5;
  const std::vector<float> m = RandomNormal(rng, n * kV, 3.0);
  const std::vector<float> r = RandomNormal(rng, n * kV, 3.0);
  const std::vector<int32_t> ids = RandomTargets(rng, n, 2, kV, -100, 0.2);
  for (auto [tm, tr] : {std::pair{0.7f, 1.3f}, std::pair{2.5f, 0.4f}}) {
    SCOPED_TRACE(std::to_string(tm) + " / " + std::to_string(tr));
    OwnedJob j;
    j.SetModelLogits(Fp32(n, kV, m), tm).SetReferenceLogits(Fp32(n, kV, r), tr);
    j.WithEverything(ids, 2, 3, 0.3f);
    LOGITSERVE_ASSERT_SCORE(got, backend(), j.job);
    ExpectMatchesReference(j.job, got);
  }
  std::vector<float> m2 = m, r2 = r;
  for (float& x : m2) x /= 0.5f;
  for (float& x : r2) x /= 4.0f;
  OwnedJob with_t, divided;
  with_t.SetModelLogits(Fp32(n, kV, m), 0.5f).SetReferenceLogits(Fp32(n, kV, r), 4.0f);
  with_t.WithEverything(ids, 2, 3, 0.3f);
  divided.SetModelLogits(Fp32(n, kV, m2)).SetReferenceLogits(Fp32(n, kV, r2));
  divided.WithEverything(ids, 2, 3, 0.3f);
  LOGITSERVE_ASSERT_SCORE(got_t, backend(), with_t.job);
  LOGITSERVE_ASSERT_SCORE(got_d, backend(), divided.job);
  ExpectBitwiseEqual(got_t, got_d);
}

// JSD's endpoints are explicit branches: beta = 0 returns forward KL, beta = 1 reverse KL, bit
// for bit, in the same call (masks and support mismatch included).
class JsdEndpoints : public EdgeCases {
 protected:
  OwnedJob Job(float beta) {
    std::mt19937_64 rng(13);
    const int64_t n = 9;
    std::vector<float> m = RandomNormal(rng, n * kV, 3.0);
    std::vector<float> r = RandomNormal(rng, n * kV, 3.0);
    MaskRandomTokens(rng, m, kV, 2, 0.2);                    // forward KL = +inf
    MaskRandomTokens(rng, r, kV, 3, 0.2);                    // reverse KL = +inf
    for (int64_t j = 0; j < kV; ++j) m[5 * kV + j] = -kInf;  // NaN
    OwnedJob job;
    job.SetModelLogits(Fp32(n, kV, m)).SetReferenceLogits(Fp32(n, kV, r));
    job.WithForwardKl().WithReverseKl().WithJsd(beta);
    return job;
  }
};

TEST_P(JsdEndpoints, JsdBetaZeroEqualsForwardKlBitwise) {
  const OwnedJob j = Job(0.0f);
  LOGITSERVE_ASSERT_SCORE(got, backend(), j.job);
  ASSERT_EQ(got.jsd.size(), got.forward_kl.size());
  EXPECT_EQ(std::memcmp(got.jsd.data(), got.forward_kl.data(), got.jsd.size() * sizeof(float)), 0);
  EXPECT_EQ(got.jsd[2], kInf);
  ExpectMatchesReference(j.job, got);
}

TEST_P(JsdEndpoints, JsdBetaOneEqualsReverseKlBitwise) {
  const OwnedJob j = Job(1.0f);
  LOGITSERVE_ASSERT_SCORE(got, backend(), j.job);
  ASSERT_EQ(got.jsd.size(), got.reverse_kl.size());
  EXPECT_EQ(std::memcmp(got.jsd.data(), got.reverse_kl.data(), got.jsd.size() * sizeof(float)), 0);
  EXPECT_EQ(got.jsd[3], kInf);
  ExpectMatchesReference(j.job, got);
}

auto BackendName = [](const ::testing::TestParamInfo<BackendFactory>& info) {
  return info.param.name;
};
INSTANTIATE_TEST_SUITE_P(Backends, EdgeCases, ::testing::ValuesIn(EdgeBackends()), BackendName);
INSTANTIATE_TEST_SUITE_P(Backends, JsdEndpoints, ::testing::ValuesIn(EdgeBackends()), BackendName);

// Edge 9: uneven shards and shards with no vocabulary give the same results, bit for bit, and
// the layouts are contiguous, ordered and block-aligned. (CPU specific: it builds its own shard
// configurations.)
TEST(EdgeCasesCpu, UnevenAndEmptyShards) {
  std::vector<BackendFactory> configs = TestBackends();
  configs.push_back(TestBackend("empty_first_0_1", 2, {0, 1}));
  configs.push_back(TestBackend("empty_last_1_0", 2, {1, 0}));
  configs.push_back(TestBackend("empty_last_2_1_0", 3, {2, 1, 0}));
  configs.push_back(TestBackend("5shards", 5));  // more shards than blocks at V = 5000
  std::mt19937_64 rng(14);
  for (int64_t v : {kV, int64_t{32000}}) {
    SCOPED_TRACE("V = " + std::to_string(v));
    const int64_t n = 6;
    std::vector<float> m = RandomNormal(rng, n * v, 3.0);
    std::vector<float> r = RandomNormal(rng, n * v, 3.0);
    MaskRandomTokens(rng, m, v, 4, 0.3);
    OwnedJob j;
    j.SetModelLogits(Fp32(n, v, m)).SetReferenceLogits(Fp32(n, v, r));
    j.WithEverything(RandomTargets(rng, n, 3, v, -100, 0.2), 3, 4, 0.3f);
    std::vector<ScoreResult> results;
    for (const BackendFactory& f : configs) {
      SCOPED_TRACE(f.name);
      absl::StatusOr<std::unique_ptr<Backend>> b = f.create();
      ASSERT_TRUE(b.ok()) << b.status();
      const std::vector<ShardRange> layout = (*b)->ShardLayout(v);
      int64_t next = 0;
      for (const ShardRange& s : layout) {
        EXPECT_EQ(s.begin, next) << "shard " << s.shard;
        EXPECT_LE(s.begin, s.end) << "shard " << s.shard;
        EXPECT_TRUE(s.begin == s.end || s.begin % kernels::kVocabBlock == 0) << "shard " << s.shard;
        next = s.end;
      }
      EXPECT_EQ(next, v);
      LOGITSERVE_ASSERT_SCORE(got, **b, j.job);
      ExpectMatchesReference(j.job, got);
      results.push_back(got);
    }
    for (size_t i = 1; i < results.size(); ++i) {
      SCOPED_TRACE(configs[i].name + " vs " + configs[0].name);
      ExpectBitwiseEqual(results[i], results[0]);
    }
  }
}

}  // namespace
}  // namespace logitserve::testing
