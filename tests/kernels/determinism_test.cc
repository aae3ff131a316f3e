// The determinism promise (SPEC §3), bit for bit: a row's outputs do not depend on the batch it
// is in or its position there, on the shard layout, on the input dtype carrying the same values,
// on which other outputs were requested, or on concurrent calls. CPU backend at a fixed thread
// count (the promise is per thread-count setting).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "tests/kernels/expect_reference.h"
#include "tests/kernels/job_builder.h"

namespace logitserve::testing {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

std::unique_ptr<Backend> MustCreate(const BackendFactory& f) {
  absl::StatusOr<std::unique_ptr<Backend>> b = f.create();
  EXPECT_TRUE(b.ok()) << f.name << ": " << b.status();
  return b.ok() ? *std::move(b) : nullptr;
}

// n random rows of `cols` values (normal, std 3, some rows partly masked) with `row` at `pos`.
std::vector<float> Embed(std::mt19937_64& rng, const std::vector<float>& row, int64_t cols,
                         int64_t n, int64_t pos) {
  std::vector<float> out = RandomNormal(rng, n * cols, 3.0);
  for (int64_t r = 0; r < n; r += 3) MaskRandomTokens(rng, out, cols, r, 0.2);
  std::copy(row.begin(), row.end(), out.begin() + pos * cols);
  return out;
}

std::vector<int32_t> EmbedIds(std::mt19937_64& rng, const std::vector<int32_t>& ids, int64_t vocab,
                              int64_t n, int64_t pos) {
  const int32_t k = static_cast<int32_t>(ids.size());
  std::vector<int32_t> out = RandomTargets(rng, n, k, vocab, -100, 0.2);
  std::copy(ids.begin(), ids.end(), out.begin() + pos * k);
  return out;
}

struct Placement {
  int64_t n;
  int64_t pos;
};

// Logits mode: the row alone, and inside batches at several positions, on every shard layout.
TEST(Determinism, LogitsRowBitsIndependentOfBatchPositionAndShards) {
  for (int64_t v : {int64_t{4097}, int64_t{32000}}) {
    SCOPED_TRACE("V = " + std::to_string(v));
    std::mt19937_64 rng(static_cast<uint64_t>(v));
    std::vector<float> m = RandomNormal(rng, v, 3.0);
    std::vector<float> r = RandomNormal(rng, v, 3.0);
    MaskRandomTokens(rng, m, v, 0, 0.05);
    const std::vector<int32_t> ids = {3, -100, static_cast<int32_t>(v - 1)};
    constexpr int32_t kTopK = 5;
    auto job = [&](const std::vector<float>& mm, const std::vector<float>& rr,
                   const std::vector<int32_t>& tt, int64_t n) {
      OwnedJob j;
      j.SetModelLogits(Share(Encode(FloatType::kFloat32, n, v, mm)), 0.9f)
          .SetReferenceLogits(Share(Encode(FloatType::kFloat32, n, v, rr)));
      j.WithEverything(tt, 3, kTopK, 0.3f);
      return j;
    };
    const OwnedJob alone = job(m, r, ids, 1);
    std::vector<std::pair<Placement, OwnedJob>> batches;
    for (Placement p : {Placement{13, 0}, Placement{13, 6}, Placement{13, 12}, Placement{70, 65}}) {
      batches.emplace_back(p, job(Embed(rng, m, v, p.n, p.pos), Embed(rng, r, v, p.n, p.pos),
                                  EmbedIds(rng, ids, v, p.n, p.pos), p.n));
    }
    std::unique_ptr<Backend> first = MustCreate(TestBackends()[0]);
    ASSERT_NE(first, nullptr);
    LOGITSERVE_ASSERT_SCORE(baseline, *first, alone.job);
    ExpectMatchesReference(alone.job, baseline);  // the bits being compared are also right
    for (const BackendFactory& f : TestBackends()) {
      SCOPED_TRACE(f.name);
      std::unique_ptr<Backend> b = MustCreate(f);
      ASSERT_NE(b, nullptr);
      LOGITSERVE_ASSERT_SCORE(got_alone, *b, alone.job);
      ExpectBitwiseEqual(got_alone, baseline);
      for (const auto& [p, j] : batches) {
        SCOPED_TRACE("batch of " + std::to_string(p.n) + " at " + std::to_string(p.pos));
        LOGITSERVE_ASSERT_SCORE(got, *b, j.job);
        ExpectRowBitwiseEqual(baseline, 0, got, p.pos, 3, kTopK);
      }
    }
  }
}

// A JSD job without top-k: the same bits on every shard layout (the case a one-rank JSD path of
// its own would take, as branch jsd-fused's one-kernel pass did; this test compared it with the
// two-pass one there). Rows with masked tokens and rows of the other's support.
TEST(Determinism, JsdBitsIndependentOfShards) {
  const int64_t n = 70, v = 32000;
  std::mt19937_64 rng(31);
  std::vector<float> m = RandomNormal(rng, n * v, 3.0);
  std::vector<float> r = RandomNormal(rng, n * v, 3.0);
  MaskRandomTokens(rng, m, v, 3, 0.1);
  MaskRandomTokens(rng, r, v, 40, 0.3);
  OwnedJob j;
  j.SetModelLogits(Share(Encode(FloatType::kBFloat16, n, v, m)))
      .SetReferenceLogits(Share(Encode(FloatType::kBFloat16, n, v, r)))
      .WithEntropy()
      .WithForwardKl()
      .WithJsd(0.3f);
  std::unique_ptr<Backend> first = MustCreate(TestBackends()[0]);
  ASSERT_NE(first, nullptr);
  LOGITSERVE_ASSERT_SCORE(baseline, *first, j.job);
  ExpectMatchesReference(j.job, baseline);
  for (const BackendFactory& f : TestBackends()) {
    SCOPED_TRACE(f.name);
    std::unique_ptr<Backend> b = MustCreate(f);
    ASSERT_NE(b, nullptr);
    LOGITSERVE_ASSERT_SCORE(got, *b, j.job);
    ExpectBitwiseEqual(got, baseline);
  }
}

// The same values delivered as fp32, bf16 or fp16 give the same bits: values k/16, |k| <= 255,
// are exact in all three (8 significant bits, within fp16's range), and so is -inf.
TEST(Determinism, SameBitsForFp32Bf16Fp16Inputs) {
  const int64_t n = 5, v = 4097;
  std::mt19937_64 rng(21);
  std::uniform_int_distribution<int> k(-255, 255);
  std::bernoulli_distribution masked(0.03);
  std::vector<float> m(n * v), r(n * v);
  for (float& x : m) x = masked(rng) ? -kInf : k(rng) / 16.0f;
  for (float& x : r) x = masked(rng) ? -kInf : k(rng) / 16.0f;
  for (float x : m) {
    ASSERT_EQ(RoundTo(FloatType::kBFloat16, x), x);
    ASSERT_EQ(RoundTo(FloatType::kFloat16, x), x);
  }
  const std::vector<int32_t> ids = RandomTargets(rng, n, 2, v, -100, 0.2);
  std::unique_ptr<Backend> b = MustCreate(TestBackend("3shards", 3));
  ASSERT_NE(b, nullptr);
  for (float temperature : {1.0f, 0.7f}) {
    SCOPED_TRACE(temperature);
    std::vector<ScoreResult> results;
    const std::vector<std::pair<FloatType, FloatType>> types = {
        {FloatType::kFloat32, FloatType::kFloat32},
        {FloatType::kBFloat16, FloatType::kBFloat16},
        {FloatType::kFloat16, FloatType::kFloat16},
        {FloatType::kBFloat16, FloatType::kFloat16},
        {FloatType::kFloat16, FloatType::kFloat32}};
    for (auto [tm, tr] : types) {
      SCOPED_TRACE(DTypeName(tm) + " / " + DTypeName(tr));
      OwnedJob j;
      j.SetModelLogits(Share(Encode(tm, n, v, m)), temperature)
          .SetReferenceLogits(Share(Encode(tr, n, v, r)), temperature);
      j.WithEverything(ids, 2, 4, 0.3f);
      LOGITSERVE_ASSERT_SCORE(got, *b, j.job);
      results.push_back(got);
    }
    for (size_t i = 1; i < results.size(); ++i) {
      SCOPED_TRACE("type pair " + std::to_string(i) + " vs fp32");
      ExpectBitwiseEqual(results[i], results[0]);
    }
  }
}

// A request merged with others that ask for different outputs must still get the same bits, so
// no output may depend on which other outputs the job computes.
TEST(Determinism, OutputsDoNotDependOnOtherRequestedOutputs) {
  const int64_t n = 7, v = 4097;
  std::mt19937_64 rng(22);
  std::vector<float> m = RandomNormal(rng, n * v, 3.0);
  std::vector<float> r = RandomNormal(rng, n * v, 3.0);
  MaskRandomTokens(rng, m, v, 2, 0.1);
  const SharedMatrix mm = Share(Encode(FloatType::kBFloat16, n, v, m));
  const SharedMatrix rr = Share(Encode(FloatType::kBFloat16, n, v, r));
  const std::vector<int32_t> ids = RandomTargets(rng, n, 2, v, -100, 0.2);
  std::unique_ptr<Backend> b = MustCreate(TestBackend("2shards", 2));
  ASSERT_NE(b, nullptr);
  OwnedJob all;
  all.SetModelLogits(mm).SetReferenceLogits(rr).WithEverything(ids, 2, 3, 0.3f);
  LOGITSERVE_ASSERT_SCORE(everything, *b, all.job);
  auto single = [&](auto configure) {
    OwnedJob j;
    j.SetModelLogits(mm).SetReferenceLogits(rr);
    configure(j);
    return j;
  };
  const std::vector<std::pair<std::string, OwnedJob>> jobs = {
      {"targets", single([&](OwnedJob& j) { j.WithTargets(ids, 2); })},
      {"top_k", single([&](OwnedJob& j) { j.WithTopK(3); })},
      {"entropy", single([&](OwnedJob& j) { j.WithEntropy(); })},
      {"reference_entropy", single([&](OwnedJob& j) { j.WithReferenceEntropy(); })},
      {"forward_kl", single([&](OwnedJob& j) { j.WithForwardKl(); })},
      {"reverse_kl", single([&](OwnedJob& j) { j.WithReverseKl(); })},
      {"jsd", single([&](OwnedJob& j) { j.WithJsd(0.3f); })},
  };
  for (const auto& [name, j] : jobs) {
    SCOPED_TRACE(name);
    LOGITSERVE_ASSERT_SCORE(got, *b, j.job);
    auto same = [&](const auto& part, const auto& whole) {
      if (part.empty()) return;
      ASSERT_EQ(part.size(), whole.size());
      EXPECT_EQ(std::memcmp(part.data(), whole.data(), part.size() * sizeof(part[0])), 0);
    };
    same(got.target_logprobs, everything.target_logprobs);
    same(got.top_k_ids, everything.top_k_ids);
    same(got.top_k_logprobs, everything.top_k_logprobs);
    same(got.entropy, everything.entropy);
    same(got.reference_entropy, everything.reference_entropy);
    same(got.forward_kl, everything.forward_kl);
    same(got.reverse_kl, everything.reverse_kl);
    same(got.jsd, everything.jsd);
  }
}

// A job that asks for the model's outputs only (targets, top-k, entropy) gets the bits of a job
// that asks for everything, at V = 32000 (several blocks per shard). Folded in from the CUDA
// backend's own suite (it ran on every visible GPU; here the two-shard layout: two GPUs through
// NCCL when visible, else two shards on GPU 0).
TEST(Determinism, ModelOutputsDoNotDependOnReferenceOutputs) {
  constexpr int64_t kN = 9, kVocab = 32000;
  std::mt19937_64 rng(31);
  const LogitsPair in = MakeLogitsPair(rng, FloatType::kBFloat16, kN, kVocab, 3.0);
  const std::vector<int32_t> ids = RandomTargets(rng, kN, 2, kVocab, -100, 0.2);
  std::unique_ptr<Backend> b = MustCreate(TestBackend("2shards", 2));
  ASSERT_NE(b, nullptr);
  OwnedJob all;
  all.SetModelLogits(in.model).SetReferenceLogits(in.reference).WithEverything(ids, 2, 3, 0.3f);
  LOGITSERVE_ASSERT_SCORE(everything, *b, all.job);
  OwnedJob model_only;
  model_only.SetModelLogits(in.model).WithTargets(ids, 2).WithTopK(3).WithEntropy();
  LOGITSERVE_ASSERT_SCORE(part, *b, model_only.job);
  auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b, const char* what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    for (size_t i = 0; i < a.size(); ++i) {
      if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
        ADD_FAILURE() << what << " row " << i << ": " << a[i] << " vs " << b[i];
        return;
      }
    }
  };
  same_bits(part.target_logprobs, everything.target_logprobs, "target_logprobs");
  same_bits(part.top_k_logprobs, everything.top_k_logprobs, "top_k_logprobs");
  EXPECT_EQ(part.top_k_ids, everything.top_k_ids);
  same_bits(part.entropy, everything.entropy, "entropy");
}

// Concurrent calls on one backend give the bits of a lone call.
TEST(Determinism, ConcurrentCallsGiveSameBits) {
  const int64_t n = 33, v = 4097;
  std::mt19937_64 rng(23);
  OwnedJob j;
  j.SetModelLogits(Share(Encode(FloatType::kFloat32, n, v, RandomNormal(rng, n * v, 3.0))))
      .SetReferenceLogits(Share(Encode(FloatType::kFloat32, n, v, RandomNormal(rng, n * v, 3.0))));
  j.WithEverything(RandomTargets(rng, n, 2, v, -100, 0.2), 2, 4, 0.3f);
  std::unique_ptr<Backend> b = MustCreate(TestBackend("2shards", 2));
  ASSERT_NE(b, nullptr);
  LOGITSERVE_ASSERT_SCORE(lone, *b, j.job);
  constexpr int kThreads = 3, kRepeats = 4;
  std::vector<std::vector<absl::StatusOr<ScoreResult>>> out(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRepeats; ++i) out[t].push_back(RunJob(*b, j.job));
    });
  }
  for (std::thread& t : threads) t.join();
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kRepeats; ++i) {
      SCOPED_TRACE("thread " + std::to_string(t) + " call " + std::to_string(i));
      ASSERT_TRUE(out[t][i].ok()) << out[t][i].status();
      ExpectBitwiseEqual(*out[t][i], lone);
    }
  }
}

// Hidden mode: a row alone vs inside batches of 200 and 1500 at positions that are not multiples
// of any tile size, across shard layouts and hidden-state dtypes carrying the same values. (The
// CUDA backend multiplies a short job in a short row tile and a long one in full row tiles:
// the same pinned GEMM, which must give the same bits.)
TEST(Determinism, HiddenRowBitsIndependentOfBatchPositionShardsAndDtype) {
  const int64_t v = 4097, h = 72, hr = 40;
  std::mt19937_64 rng(24);
  HeadTransform gemma;
  gemma.softcap = 30.0f;
  const std::shared_ptr<HeadWeights> model_w =
      RandomHead(rng, v, h, FloatType::kBFloat16, 3.0 / std::sqrt(double{h}), true, gemma);
  const std::shared_ptr<HeadWeights> ref_w = RandomHead(
      rng, v, hr, FloatType::kFloat32, 3.0 / std::sqrt(double{hr}), false, HeadTransform{});
  // Hidden states k/16, |k| <= 255: exact in fp32, bf16 and fp16.
  auto exact_row = [&](int64_t width) {
    std::vector<float> x = RandomNormal(rng, width, 1.0);
    for (float& e : x) e = std::round(std::clamp(e * 16.0f, -255.0f, 255.0f)) / 16.0f;
    return x;
  };
  const std::vector<float> row = exact_row(h);
  const std::vector<float> row_ref = exact_row(hr);
  const std::vector<int32_t> ids = {0, 4096, -100};
  constexpr int32_t kTopK = 4;

  std::vector<std::pair<Placement, std::vector<float>>> batches, batches_ref;
  std::vector<std::vector<int32_t>> batch_ids;
  for (Placement p :
       {Placement{200, 77}, Placement{200, 130}, Placement{3, 0}, Placement{1500, 1100}}) {
    std::vector<float> x = RandomNormal(rng, p.n * h, 1.0);
    std::vector<float> xr = RandomNormal(rng, p.n * hr, 1.0);
    std::copy(row.begin(), row.end(), x.begin() + p.pos * h);
    std::copy(row_ref.begin(), row_ref.end(), xr.begin() + p.pos * hr);
    batches.emplace_back(p, std::move(x));
    batches_ref.emplace_back(p, std::move(xr));
    batch_ids.push_back(EmbedIds(rng, ids, v, p.n, p.pos));
  }

  std::unique_ptr<ScoreResult> baseline;
  const std::vector<BackendFactory> configs = {TestBackends()[0], TestBackends()[1],
                                               TestBackends()[2], TestBackends()[4]};
  for (const BackendFactory& f : configs) {
    SCOPED_TRACE(f.name);
    std::unique_ptr<Backend> b = MustCreate(f);
    ASSERT_NE(b, nullptr);
    absl::StatusOr<std::shared_ptr<const PreparedHead>> model = b->PrepareHead(model_w);
    absl::StatusOr<std::shared_ptr<const PreparedHead>> ref = b->PrepareHead(ref_w);
    ASSERT_TRUE(model.ok()) << model.status();
    ASSERT_TRUE(ref.ok()) << ref.status();
    for (FloatType t : {FloatType::kFloat32, FloatType::kBFloat16, FloatType::kFloat16}) {
      SCOPED_TRACE(DTypeName(t));
      OwnedJob alone;
      alone.SetModelHidden(*model, Share(Encode(t, 1, h, row)))
          .SetReferenceHidden(*ref, Share(Encode(t, 1, hr, row_ref)));
      alone.WithEverything(ids, 3, kTopK, 0.3f);
      LOGITSERVE_ASSERT_SCORE(got_alone, *b, alone.job);
      if (baseline == nullptr) {
        ExpectMatchesReference(alone.job, got_alone);
        baseline = std::make_unique<ScoreResult>(got_alone);
      } else {
        ExpectBitwiseEqual(got_alone, *baseline);
      }
      for (size_t i = 0; i < batches.size(); ++i) {
        const Placement p = batches[i].first;
        SCOPED_TRACE("batch of " + std::to_string(p.n) + " at " + std::to_string(p.pos));
        OwnedJob j;
        j.SetModelHidden(*model, Share(Encode(t, p.n, h, batches[i].second)))
            .SetReferenceHidden(*ref, Share(Encode(t, p.n, hr, batches_ref[i].second)));
        j.WithEverything(batch_ids[i], 3, kTopK, 0.3f);
        LOGITSERVE_ASSERT_SCORE(got, *b, j.job);
        ExpectRowBitwiseEqual(*baseline, 0, got, p.pos, 3, kTopK);
      }
    }
  }
}

}  // namespace
}  // namespace logitserve::testing
