// Conformance: every output of a backend against the fp64 reference, over awkward shapes, input
// dtypes and shard layouts, in logits mode and hidden mode.
//
// The suites are parametrized by a BackendFactory, so a CUDA backend reuses them by adding its
// factories to Backends() below.
//
// Sweep (kept well under a minute on 2 cores):
//   Logits mode: every backend configuration x dtype {fp32, bf16, fp16} x V, and inside each
//   instance N x K x op. V in {1, 17, 111} (one vocabulary block: multi-shard configurations
//   then exercise empty shards only) runs the full product N in {0, 1, 7, 257} x K in {1, 3}.
//   V = 4097 (three blocks, the last holding one token) is added for real cross-block and
//   cross-shard combines, with N in {0, 1, 7, 70} (70 > one 64-row tile). V = 32000 runs N in
//   {0, 1, 7} only. Larger N at large V would cost the fp64 reference minutes and exercises no
//   other path: the row tiling is already crossed at V <= 111 with N = 257.
//   Ops: target logprobs [N] (K = 1) and [N, K] with ignore_index entries, top-k, entropy,
//   reference entropy, forward KL, reverse KL, JSD at beta 0, 0.3 and 1, each as its own job,
//   then everything in one job with temperatures != 1, then the divergences against a sharp
//   (T = 0.1) reference.
//   Hidden mode: V = 4097, H = 72, N in {0, 1, 7, 70}. On one shard: every transform {none, bias,
//   logit_scale, logits_scaling, softcap + bias} with (weights, hidden) in (bf16, bf16) and
//   (fp32, fp32), and the other four dtype pairs with the bias transform (the dtype only changes
//   the exact upcast before the fp32 GEMM; the transform only what follows it). On every other
//   shard configuration: softcap + bias with (bf16, bf16) and (fp32, fp16). Then the small
//   vocabularies V in {1, 17, 111} (one partial block) with N in {0, 1, 7, 257} on every shard
//   configuration, softcap + bias with (bf16, bf16), and on one shard also (fp32, fp32) without a
//   transform: cheap, and 257 rows cross several GEMM row tiles.
//   Shard configurations: TestBackends() plus trailing empty shards {1, 0} and {2, 1, 0}.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/kernels/expect_reference.h"
#include "tests/kernels/job_builder.h"

namespace logitserve::testing {
namespace {

constexpr double kLogitStd = 3.0;  // realistic spread of LM-head logits

// Every configuration of TestBackends(), plus trailing empty shards: {1, 0} and {2, 1, 0}
// (blocks per shard), where the last shard owns no vocabulary and the one before it ends on a
// partial block whenever V % kVocabBlock != 0.
std::vector<BackendFactory> Backends() {
  std::vector<BackendFactory> backends = TestBackends();
  backends.push_back(TestBackend("empty_last_1_0", 2, {1, 0}, 2));
  backends.push_back(TestBackend("empty_last_2_1_0", 3, {2, 1, 0}, 2));
  return backends;
}

void ScoreAndCompare(Backend& backend, const OwnedJob& j) {
  absl::StatusOr<ScoreResult> got = RunJob(backend, j.job);
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectMatchesReference(j.job, *got);
}

// ---- Logits mode ---------------------------------------------------------------------------

struct LogitsCase {
  BackendFactory backend;
  FloatType dtype;
  int64_t vocab;
  std::vector<int64_t> rows;
};

void PrintTo(const LogitsCase& c, std::ostream* os) {
  *os << c.backend.name << " " << DTypeName(c.dtype) << " V=" << c.vocab;
}

std::vector<LogitsCase> LogitsCases() {
  std::vector<LogitsCase> cases;
  for (const BackendFactory& b : Backends()) {
    for (FloatType t : {FloatType::kFloat32, FloatType::kBFloat16, FloatType::kFloat16}) {
      for (int64_t v : {1, 17, 111}) cases.push_back({b, t, v, {0, 1, 7, 257}});
      cases.push_back({b, t, 4097, {0, 1, 7, 70}});
      cases.push_back({b, t, 32000, {0, 1, 7}});
    }
  }
  return cases;
}

class LogitsConformance : public ::testing::TestWithParam<LogitsCase> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> b = GetParam().backend.create();
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = *std::move(b);
  }
  std::unique_ptr<Backend> backend_;
};

TEST_P(LogitsConformance, EveryOpMatchesReference) {
  const LogitsCase& c = GetParam();
  std::mt19937_64 rng(static_cast<uint64_t>(c.vocab) * 31 + static_cast<uint64_t>(c.dtype));
  for (int64_t n : c.rows) {
    SCOPED_TRACE("N = " + std::to_string(n));
    const LogitsPair in = MakeLogitsPair(rng, c.dtype, n, c.vocab, kLogitStd);
    auto base = [&] {
      OwnedJob j;
      j.SetModelLogits(in.model).SetReferenceLogits(in.reference);
      return j;
    };
    for (int32_t k : {1, 3}) {
      SCOPED_TRACE("K = " + std::to_string(k));
      {
        SCOPED_TRACE("target_logprobs");
        OwnedJob j;  // model only: no reference input at all
        j.SetModelLogits(in.model).WithTargets(RandomTargets(rng, n, k, c.vocab, -100, 0.15), k,
                                               -100);
        ScoreAndCompare(*backend_, j);
      }
      {
        SCOPED_TRACE("target_logprobs, ignore_index -1");
        OwnedJob j = base();
        j.WithTargets(RandomTargets(rng, n, k, c.vocab, -1, 0.3), k, -1);
        ScoreAndCompare(*backend_, j);
      }
      {
        SCOPED_TRACE("top_k");
        OwnedJob j;
        j.SetModelLogits(in.model).WithTopK(static_cast<int32_t>(std::min<int64_t>(k, c.vocab)));
        ScoreAndCompare(*backend_, j);
      }
    }
    {
      SCOPED_TRACE("entropy");
      OwnedJob j;
      j.SetModelLogits(in.model).WithEntropy();
      ScoreAndCompare(*backend_, j);
    }
    {
      SCOPED_TRACE("reference_entropy");
      OwnedJob j = base();
      j.WithReferenceEntropy();
      ScoreAndCompare(*backend_, j);
    }
    {
      SCOPED_TRACE("forward_kl");
      OwnedJob j = base();
      j.WithForwardKl();
      ScoreAndCompare(*backend_, j);
    }
    {
      SCOPED_TRACE("reverse_kl");
      OwnedJob j = base();
      j.WithReverseKl();
      ScoreAndCompare(*backend_, j);
    }
    for (float beta : {0.0f, 0.3f, 1.0f}) {
      SCOPED_TRACE("jsd beta " + std::to_string(beta));
      OwnedJob j = base();
      j.WithJsd(beta);
      ScoreAndCompare(*backend_, j);
    }
    {
      SCOPED_TRACE("everything, temperatures 0.7 / 1.3");
      OwnedJob j;
      j.SetModelLogits(in.model, 0.7f).SetReferenceLogits(in.reference, 1.3f);
      j.WithEverything(RandomTargets(rng, n, 3, c.vocab, -100, 0.15), 3,
                       static_cast<int32_t>(std::min<int64_t>(5, c.vocab)), 0.3f);
      ScoreAndCompare(*backend_, j);
    }
    {
      // A sharp reference (T = 0.1): its centred logits reach -400, far below where fp32 exp
      // underflows, while the model still puts mass there. KL(model || reference) must use the
      // true lp_ref there (underflow is not masking).
      SCOPED_TRACE("KL and JSD, reference temperature 0.1");
      OwnedJob j;
      j.SetModelLogits(in.model).SetReferenceLogits(in.reference, 0.1f);
      j.WithForwardKl().WithReverseKl().WithReferenceEntropy().WithJsd(0.3f);
      ScoreAndCompare(*backend_, j);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, LogitsConformance, ::testing::ValuesIn(LogitsCases()),
                         [](const ::testing::TestParamInfo<LogitsCase>& info) {
                           return info.param.backend.name + "_" + DTypeName(info.param.dtype) +
                                  "_V" + std::to_string(info.param.vocab);
                         });

// ---- Hidden mode ---------------------------------------------------------------------------

struct HiddenCase {
  BackendFactory backend;
  FloatType weight_dtype;
  FloatType hidden_dtype;
  std::string transform_name;
  HeadTransform transform;
  bool bias;
  double logit_std;  // target spread of the logits before softcap
  int64_t vocab;
  std::vector<int64_t> rows;
};

void PrintTo(const HiddenCase& c, std::ostream* os) {
  *os << c.backend.name << " W " << DTypeName(c.weight_dtype) << " h " << DTypeName(c.hidden_dtype)
      << " " << c.transform_name << " V=" << c.vocab;
}

constexpr int64_t kHiddenVocab = 4097;                   // three blocks, the last holding one token
const std::vector<int64_t> kHiddenRows = {0, 1, 7, 70};  // 70 rows: more than one 64-row tile
constexpr int64_t kHidden = 72;     // not a multiple of the SIMD width or GEMM tiles
constexpr int64_t kRefHidden = 40;  // the reference head has its own hidden size

std::vector<HiddenCase> HiddenCases() {
  HeadTransform none;
  HeadTransform cohere;
  cohere.logit_scale = 0.0625f;
  HeadTransform granite;
  granite.logits_scaling = 8.0f;
  HeadTransform gemma;
  gemma.softcap = 30.0f;
  struct T {
    std::string name;
    HeadTransform t;
    bool bias;
    double std;  // Gemma: logits of std ~30 before the cap, so it bites
  };
  const std::vector<T> transforms = {{"none", none, false, kLogitStd},
                                     {"bias", none, true, kLogitStd},
                                     {"logit_scale", cohere, false, kLogitStd},
                                     {"logits_scaling", granite, false, kLogitStd},
                                     {"softcap_bias", gemma, true, 30.0}};
  std::vector<HiddenCase> cases;
  const std::vector<BackendFactory> backends = Backends();
  for (FloatType w : {FloatType::kFloat32, FloatType::kBFloat16}) {
    for (FloatType h : {FloatType::kFloat32, FloatType::kBFloat16, FloatType::kFloat16}) {
      const bool same = (w == FloatType::kFloat32 && h == FloatType::kFloat32) ||
                        (w == FloatType::kBFloat16 && h == FloatType::kBFloat16);
      for (const T& t : transforms) {
        if (same || t.name == "bias") {
          cases.push_back(
              {backends[0], w, h, t.name, t.t, t.bias, t.std, kHiddenVocab, kHiddenRows});
        }
      }
    }
  }
  const T& softcap = transforms.back();
  for (size_t b = 1; b < backends.size(); ++b) {
    for (FloatType h : {FloatType::kBFloat16, FloatType::kFloat16}) {
      const FloatType w = h == FloatType::kBFloat16 ? FloatType::kBFloat16 : FloatType::kFloat32;
      cases.push_back({backends[b], w, h, softcap.name, softcap.t, softcap.bias, softcap.std,
                       kHiddenVocab, kHiddenRows});
    }
  }
  for (int64_t v : {1, 17, 111}) {
    for (const BackendFactory& b : backends) {
      cases.push_back({b,
                       FloatType::kBFloat16,
                       FloatType::kBFloat16,
                       softcap.name,
                       softcap.t,
                       softcap.bias,
                       softcap.std,
                       v,
                       {0, 1, 7, 257}});
    }
    const T& none = transforms.front();
    cases.push_back({backends[0],
                     FloatType::kFloat32,
                     FloatType::kFloat32,
                     none.name,
                     none.t,
                     none.bias,
                     none.std,
                     v,
                     {0, 1, 7, 257}});
  }
  return cases;
}

class HiddenConformance : public ::testing::TestWithParam<HiddenCase> {
 protected:
  void SetUp() override {
    absl::StatusOr<std::unique_ptr<Backend>> b = GetParam().backend.create();
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = *std::move(b);
  }
  std::shared_ptr<const PreparedHead> Prepare(std::shared_ptr<HeadWeights> w) {
    absl::StatusOr<std::shared_ptr<const PreparedHead>> p = backend_->PrepareHead(std::move(w));
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *p : nullptr;
  }
  std::unique_ptr<Backend> backend_;
};

TEST_P(HiddenConformance, EveryOutputMatchesReference) {
  const HiddenCase& c = GetParam();
  std::mt19937_64 rng(1234 + static_cast<uint64_t>(c.weight_dtype) * 7 +
                      static_cast<uint64_t>(c.hidden_dtype));
  // h ~ N(0, 1), W ~ N(0, s / sqrt(H)): the dot products have spread s; the transform's own
  // scale is undone so that the logits stay realistic.
  const double gain = static_cast<double>(c.transform.logit_scale) / c.transform.logits_scaling;
  const double w_std = c.logit_std / std::sqrt(static_cast<double>(kHidden)) / gain;
  const int64_t v = c.vocab;
  const int32_t top_k = static_cast<int32_t>(std::min<int64_t>(5, v));
  auto model = Prepare(RandomHead(rng, v, kHidden, c.weight_dtype, w_std, c.bias, c.transform));
  auto ref = Prepare(RandomHead(rng, v, kRefHidden, FloatType::kBFloat16,
                                kLogitStd / std::sqrt(static_cast<double>(kRefHidden)), false,
                                HeadTransform{}));
  ASSERT_NE(model, nullptr);
  ASSERT_NE(ref, nullptr);
  for (int64_t n : c.rows) {
    SCOPED_TRACE("N = " + std::to_string(n));
    const SharedMatrix h =
        Share(Encode(c.hidden_dtype, n, kHidden, RandomNormal(rng, n * kHidden, 1.0)));
    const SharedMatrix hr =
        Share(Encode(c.hidden_dtype, n, kRefHidden, RandomNormal(rng, n * kRefHidden, 1.0)));
    {
      SCOPED_TRACE("everything");
      OwnedJob j;
      j.SetModelHidden(model, h).SetReferenceHidden(ref, hr);
      j.WithEverything(RandomTargets(rng, n, 3, v, -100, 0.15), 3, top_k, 0.3f);
      ScoreAndCompare(*backend_, j);
    }
    {
      SCOPED_TRACE("targets + entropy + jsd(0), temperature 0.8 / 1.5");
      OwnedJob j;
      j.SetModelHidden(model, h, 0.8f).SetReferenceHidden(ref, hr, 1.5f);
      j.WithTargets(RandomTargets(rng, n, 1, v, -100, 0.15), 1).WithEntropy().WithJsd(0.0f);
      ScoreAndCompare(*backend_, j);
    }
    {
      SCOPED_TRACE("hidden model, logits reference");
      const SharedMatrix rl =
          Share(Encode(FloatType::kFloat32, n, v, RandomNormal(rng, n * v, 3.0)));
      OwnedJob j;
      j.SetModelHidden(model, h).SetReferenceLogits(rl);
      j.WithReverseKl().WithForwardKl().WithTopK(std::min(top_k, 2));
      ScoreAndCompare(*backend_, j);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, HiddenConformance, ::testing::ValuesIn(HiddenCases()),
                         [](const ::testing::TestParamInfo<HiddenCase>& info) {
                           const HiddenCase& c = info.param;
                           return c.backend.name + "_W" + DTypeName(c.weight_dtype) + "_h" +
                                  DTypeName(c.hidden_dtype) + "_" + c.transform_name + "_V" +
                                  std::to_string(c.vocab);
                         });

}  // namespace
}  // namespace logitserve::testing
