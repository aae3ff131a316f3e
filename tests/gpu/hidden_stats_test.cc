// The fused hidden-mode kernel (LaunchHiddenStats, sm_90a) through its launcher, on small shapes:
// 300 rows (three CTA row tiles, the last partial), V = 5000 (blocks of 2048, 2048 and 904 ids:
// the last block ends inside a 128-column subtile), K = 200 and 136 (the last 64-value step half
// out of bounds), every cluster shape.
//
// Oracles: (1) the logits the kernel writes when asked (the raw products) against an fp64 dot
// product of the same bf16 values on the host; (2) its block records against LaunchBlockStats run
// over those very logits (the statistics kernel the unfused path uses, itself tested against the
// CPU kernels and fp64): both folded on the host with block_stats.h and finished into entropy,
// KL both ways and target log-probabilities, which agree to kFinishRelTol; maxima, flags and the
// target logits are exact. Bitwise: a row's records do not depend on its position, on the other
// rows, on the cluster shape, on the number of bf16 parts carrying the same values, or (the
// model side) on whether a reference is present.
//
// Skipped on GPUs other than compute capability 9.0; on a 9.0 device the kernel must run.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "logitserve/kernels/block_stats.h"
#include "logitserve/kernels/cuda_kernels.h"
#include "logitserve/kernels/dtype.h"
#include "tests/gpu/device_array.h"
#include "tests/gpu/gpu_test_env.h"
#include "tests/kernels/job_builder.h"

namespace logitserve::testing {
namespace {

namespace k = kernels;
namespace kc = kernels::cuda;

constexpr double kU = 0x1p-24;
// A logit is a dot product of K exact bf16 products accumulated in fp32 (the tensor cores add
// each 16-product group into the accumulator): at most ~K roundings of at most u times the running
// sum of |terms|. 2 K u sum|x_k w_k| bounds it with room for the hardware's internal alignment.
double LogitTol(int64_t k, double sum_abs) { return 2.0 * static_cast<double>(k) * kU * sum_abs; }
// Final outputs from the two record sets: the sums agree to the statistics kernels' block-sum
// tolerance (64 u of the sum of |terms|, cuda_kernels_test.cc), the fused kernel adds 15 scalar
// folds per block (each a few exps and multiplies); relative to 1 + |value|, 1e-5 (~170 u) covers
// both with room.
constexpr double kFinishRelTol = 1e-5;

constexpr int64_t kRows = 300;
constexpr int64_t kV = 5000;
constexpr int64_t kKa = 200;
constexpr int64_t kKb = 136;

uint16_t Bf16Bits(float f) {
  const float r = RoundTo(k::FloatType::kBFloat16, f);
  uint32_t u;
  std::memcpy(&u, &r, sizeof(u));
  return static_cast<uint16_t>(u >> 16);
}
float Bf16Value(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Host copy of one operand: x [rows][k], w [vocab][k] as bf16 bits.
struct HostOperand {
  int64_t k = 0;
  std::vector<uint16_t> x, w;
};

// Random hidden states and head; row 1 is all zeros (a uniform row), row 2 holds one extreme
// hidden value (logits near +-3e38: shifts that overflow, i.e. masked tokens, and exact ties among
// the largest, since the extreme term dominates and bf16 weights repeat), row 3 is scaled 30x, row
// 4 holds +inf (+-inf logits: the bad-input flags).
HostOperand MakeOperand(std::mt19937_64& rng, int64_t rows, int64_t vocab, int64_t kk) {
  HostOperand o;
  o.k = kk;
  const std::vector<float> x = RandomNormal(rng, rows * kk, 1.0);
  const std::vector<float> w = RandomNormal(rng, vocab * kk, 3.0 / std::sqrt(double(kk)));
  o.x.resize(x.size());
  o.w.resize(w.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const int64_t r = static_cast<int64_t>(i) / kk;
    float v = x[i];
    if (r == 1) v = 0.0f;
    if (r == 3) v *= 30.0f;
    o.x[i] = Bf16Bits(v);
  }
  if (rows > 2) o.x[static_cast<size_t>(2 * kk)] = Bf16Bits(3.0e38f);
  if (rows > 4) o.x[static_cast<size_t>(4 * kk)] = 0x7F80;  // +inf
  for (size_t i = 0; i < w.size(); ++i) o.w[i] = Bf16Bits(w[i]);
  return o;
}

// The operand on the device, as LaunchHiddenStats takes it.
struct DeviceOperand {
  DeviceOperand(const HostOperand& h, int64_t rows, int64_t vocab)
      : x(h.x), w(h.w), rows(rows), vocab(vocab), k(h.k) {}
  kc::HiddenOperand Get() const {
    kc::HiddenOperand o;
    o.x = x.get();
    o.x_rows = rows;
    o.w = w.get();
    o.w_rows = vocab;
    o.k_pad = k;
    o.transform.head = true;
    return o;
  }
  DeviceArray<uint16_t> x, w;
  int64_t rows, vocab, k;
};

const kc::HiddenCluster kClusters[] = {kc::HiddenCluster::k1x1, kc::HiddenCluster::k2x1,
                                       kc::HiddenCluster::k1x2, kc::HiddenCluster::k2x2};
std::string Name(kc::HiddenCluster c) {
  const char* names[] = {"1x1", "2x1", "1x2", "2x2"};
  return names[static_cast<int>(c)];
}

// Everything one launch produced.
struct Outputs {
  std::vector<k::PairBlockStats> stats;  // [rows][blocks]
  std::vector<float> targets;            // [rows][ids per row]
  std::vector<float> logits_a, logits_b;
};

constexpr int32_t kIdsPerRow = 2;

class HiddenStats : public ::testing::TestWithParam<kc::HiddenCluster> {
 protected:
  void SetUp() override {
    int device = 0, major = 0, minor = 0;
    ASSERT_CUDA(cudaGetDevice(&device));
    ASSERT_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    ASSERT_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    if (major != 9 || minor != 0) GTEST_SKIP() << "the fused kernel is for compute capability 9.0";
    ASSERT_TRUE(kc::HiddenStatsSupported()) << "a 9.0 device, but the kernel does not run";
    std::mt19937_64 rng(7);
    a_ = MakeOperand(rng, kRows, kV, kKa);
    b_ = MakeOperand(rng, kRows, kV, kKb);
    ids_ = RandomTargets(rng, kRows, kIdsPerRow, static_cast<int32_t>(kV), -100, 0.2);
  }

  // One launch over rows [0, rows) of the operands (b null: the single form).
  Outputs Launch(const DeviceOperand& a, const DeviceOperand* b, int64_t rows, kc::HiddenCluster c,
                 bool logits, const std::vector<int32_t>& ids,
                 const kc::LoadTransform* ta = nullptr) {
    const int64_t blocks = k::NumBlocks(kV);
    DeviceArray<k::PairBlockStats> stats(static_cast<size_t>(rows * blocks));
    DeviceArray<int32_t> dids(ids);
    DeviceArray<float> targets(ids.size());
    DeviceArray<float> la(logits ? static_cast<size_t>(rows * kV) : 0);
    DeviceArray<float> lb(logits && b != nullptr ? static_cast<size_t>(rows * kV) : 0);
    kc::HiddenOperand oa = a.Get();
    if (ta != nullptr) oa.transform = *ta;
    const kc::HiddenOperand ob = b != nullptr ? b->Get() : kc::HiddenOperand{};
    kc::HiddenStatsArgs args;
    args.rows = rows;
    args.cols = kV;
    args.stats = stats.get();
    args.stats_ld = blocks;
    args.ids = dids.get();
    args.ids_per_row = kIdsPerRow;
    args.targets = targets.get();
    args.logits_a = la.get();
    args.logits_b = lb.get();
    args.logits_ld = kV;
    args.cluster = c;
    EXPECT_EQ(kc::LaunchHiddenStats(oa, b != nullptr ? &ob : nullptr, args, nullptr), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    Outputs r;
    r.stats = stats.ToHost();
    r.targets = targets.ToHost();
    r.logits_a = la.ToHost();
    r.logits_b = lb.ToHost();
    return r;
  }

  HostOperand a_, b_;
  std::vector<int32_t> ids_;
};

// Folds row r's records and finishes them (entropy of both sides, KL both ways).
struct Finished {
  k::PairRowStats p;
  float h_a, h_b, kl_ab, kl_ba;
};
Finished Finish(const std::vector<k::PairBlockStats>& stats, int64_t r, int64_t blocks) {
  Finished f;
  f.p = k::EmptyPairRowStats();
  for (int64_t j = 0; j < blocks; ++j)
    k::FoldPairBlock(f.p, stats[static_cast<size_t>(r * blocks + j)]);
  f.h_a = k::Entropy(f.p.a);
  f.h_b = k::Entropy(f.p.b);
  f.kl_ab = k::KlAB(f.p);
  f.kl_ba = k::KlBA(f.p);
  return f;
}

bool Close(float got, float want) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::abs(static_cast<double>(got) - want) <= kFinishRelTol * (1.0 + std::abs(want));
}

// The logits against fp64 dot products; the records against the statistics kernel over those
// logits; the target logits against the gather kernel over them. Every cluster shape.
TEST_P(HiddenStats, MatchesTheStatisticsKernelOverItsOwnLogits) {
  const DeviceOperand da(a_, kRows, kV), db(b_, kRows, kV);
  const int64_t blocks = k::NumBlocks(kV);
  {
    const kc::HiddenCluster c = GetParam();
    const Outputs run = Launch(da, &db, kRows, c, /*logits=*/true, ids_);
    // (1) Logits against fp64 (rows whose products overflow aside).
    constexpr int64_t kInfRow = 4;
    int bad_logits = 0;
    for (const auto& [op, logits] :
         {std::make_pair(&a_, &run.logits_a), std::make_pair(&b_, &run.logits_b)}) {
      for (int64_t r = 0; r < kRows && bad_logits < 5; ++r) {
        if (r == 2 || r == kInfRow) continue;
        for (int64_t j = 0; j < kV; ++j) {
          double dot = 0, sum_abs = 0;
          for (int64_t q = 0; q < op->k; ++q) {
            const double t = double(Bf16Value(op->x[static_cast<size_t>(r * op->k + q)])) *
                             Bf16Value(op->w[static_cast<size_t>(j * op->k + q)]);
            dot += t;
            sum_abs += std::abs(t);
          }
          const float got = (*logits)[static_cast<size_t>(r * kV + j)];
          if (!(std::abs(got - dot) <= LogitTol(op->k, sum_abs))) {
            ADD_FAILURE() << "logit (" << r << ", " << j << ") " << got << " vs fp64 " << dot;
            if (++bad_logits >= 5) break;
          }
        }
      }
    }
    // (2) Records against LaunchBlockStats over the same logits.
    DeviceArray<float> la(run.logits_a), lb(run.logits_b);
    DeviceArray<k::PairBlockStats> want_d(static_cast<size_t>(kRows * blocks));
    auto source = [](const float* p) {
      kc::LogitsSource s;
      s.type = k::FloatType::kFloat32;
      s.data = p;
      s.ld = kV;
      s.cols = kV;
      s.transform.head = true;
      return s;
    };
    const kc::LogitsSource sa = source(la.get()), sb = source(lb.get());
    ASSERT_CUDA(kc::LaunchBlockStats(sa, &sb, kRows, want_d.get(), blocks, 0, nullptr));
    DeviceArray<int32_t> dids(ids_);
    DeviceArray<float> want_targets(ids_.size());
    ASSERT_CUDA(
        kc::LaunchGatherTargets(sa, kRows, dids.get(), kIdsPerRow, want_targets.get(), nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<k::PairBlockStats> want = want_d.ToHost();
    const std::vector<float> want_t = want_targets.ToHost();
    int failures = 0;
    for (int64_t r = 0; r < kRows && failures < 10; ++r) {
      SCOPED_TRACE("row " + std::to_string(r));
      const Finished got = Finish(run.stats, r, blocks);
      const Finished ref = Finish(want, r, blocks);
      const bool ok = got.p.a.flags == ref.p.a.flags && got.p.b.flags == ref.p.b.flags &&
                      SameBits(got.p.a.m, ref.p.a.m) && SameBits(got.p.b.m, ref.p.b.m);
      const bool bad = (ref.p.a.flags | ref.p.b.flags) & (k::kFlagNaN | k::kFlagPosInf);
      const bool close = bad || (Close(got.h_a, ref.h_a) && Close(got.h_b, ref.h_b) &&
                                 Close(got.kl_ab, ref.kl_ab) && Close(got.kl_ba, ref.kl_ba));
      if (!ok || !close) {
        ++failures;
        ADD_FAILURE() << "flags " << got.p.a.flags << "/" << got.p.b.flags << " vs "
                      << ref.p.a.flags << "/" << ref.p.b.flags << "; M " << got.p.a.m << "/"
                      << got.p.b.m << " vs " << ref.p.a.m << "/" << ref.p.b.m << "; H " << got.h_a
                      << "/" << got.h_b << " vs " << ref.h_a << "/" << ref.h_b << "; KL "
                      << got.kl_ab << "/" << got.kl_ba << " vs " << ref.kl_ab << "/" << ref.kl_ba;
      }
      if (bad) {
        EXPECT_EQ(r, kInfRow) << "only row 4 holds +inf";
      }
      for (int32_t q = 0; q < kIdsPerRow; ++q) {
        const size_t i = static_cast<size_t>(r * kIdsPerRow + q);
        if (ids_[i] < 0) continue;
        if (!SameBits(run.targets[i], want_t[i]) && !(bad && std::isnan(want_t[i]))) {
          ++failures;
          ADD_FAILURE() << "target " << ids_[i] << ": " << run.targets[i] << " vs " << want_t[i];
        }
      }
    }
    // Row 4 holds +inf: its records carry the bad-input flag; row 2 has masked tokens.
    EXPECT_TRUE(Finish(run.stats, kInfRow, blocks).p.a.flags & (k::kFlagNaN | k::kFlagPosInf));
    EXPECT_TRUE(Finish(run.stats, 2, blocks).p.a.flags &
                (k::kFlagASupportsBMasked | k::kFlagBSupportsAMasked));
  }
}

// A head transform (bias, softcap, temperature: the general epilogue) against the statistics
// kernel with the same transform over the raw logits.
TEST_P(HiddenStats, HeadTransformMatchesTheStatisticsKernel) {
  const DeviceOperand da(a_, kRows, kV);
  std::mt19937_64 rng(9);
  DeviceArray<float> bias(RandomNormal(rng, kV, 2.0));
  kc::LoadTransform t;
  t.head = true;
  t.bias = bias.get();
  t.softcap = 30.0f;
  t.temperature = 0.7f;
  const int64_t blocks = k::NumBlocks(kV);
  const Outputs run = Launch(da, nullptr, kRows, GetParam(), true, ids_, &t);
  DeviceArray<float> la(run.logits_a);
  kc::LogitsSource s;
  s.type = k::FloatType::kFloat32;
  s.data = la.get();
  s.ld = kV;
  s.cols = kV;
  s.transform = t;
  DeviceArray<k::PairBlockStats> want_d(static_cast<size_t>(kRows * blocks));
  ASSERT_CUDA(kc::LaunchBlockStats(s, nullptr, kRows, want_d.get(), blocks, 0, nullptr));
  DeviceArray<int32_t> dids(ids_);
  DeviceArray<float> want_targets(ids_.size());
  ASSERT_CUDA(
      kc::LaunchGatherTargets(s, kRows, dids.get(), kIdsPerRow, want_targets.get(), nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<k::PairBlockStats> want = want_d.ToHost();
  const std::vector<float> want_t = want_targets.ToHost();
  int failures = 0;
  for (int64_t r = 0; r < kRows && failures < 10; ++r) {
    if (r == 4) continue;  // +inf: flags only (compared by the test above)
    const Finished got = Finish(run.stats, r, blocks), ref = Finish(want, r, blocks);
    if (got.p.a.flags != ref.p.a.flags || !SameBits(got.p.a.m, ref.p.a.m) ||
        !Close(got.h_a, ref.h_a)) {
      ++failures;
      ADD_FAILURE() << "row " << r << ": M " << got.p.a.m << " vs " << ref.p.a.m << ", H "
                    << got.h_a << " vs " << ref.h_a;
    }
    for (int32_t q = 0; q < kIdsPerRow; ++q) {
      const size_t i = static_cast<size_t>(r * kIdsPerRow + q);
      if (ids_[i] >= 0 && !SameBits(run.targets[i], want_t[i])) {
        ++failures;
        ADD_FAILURE() << "row " << r << " target " << ids_[i] << ": " << run.targets[i] << " vs "
                      << want_t[i];
      }
    }
  }
}

bool SameRecord(const k::PairBlockStats& x, const k::PairBlockStats& y) {
  return std::memcmp(&x, &y, sizeof(x)) == 0;
}

// The determinism the backend promises, at the kernel: a row's records are the same bits alone or
// among others, for every cluster shape, and for hidden states in one bf16 part or three (the
// fp32 split of the same values); the model side of the pair form is the single form's.
TEST_P(HiddenStats, RecordsAreBitwiseInvariant) {
  const DeviceOperand da(a_, kRows, kV), db(b_, kRows, kV);
  const int64_t blocks = k::NumBlocks(kV);
  const kc::HiddenCluster c = GetParam();
  const Outputs base = Launch(da, &db, kRows, c, false, ids_);
  // Against the 1x1 cluster (one CTA loading everything itself).
  if (c != kc::HiddenCluster::k1x1) {
    const Outputs run = Launch(da, &db, kRows, kc::HiddenCluster::k1x1, false, ids_);
    for (size_t i = 0; i < base.stats.size(); ++i) {
      ASSERT_TRUE(SameRecord(run.stats[i], base.stats[i])) << "vs 1x1, record " << i;
    }
  }
  {
    const Outputs run = Launch(da, &db, kRows, c, false, ids_);
    for (size_t i = 0; i < base.stats.size(); ++i) {
      ASSERT_TRUE(SameRecord(run.stats[i], base.stats[i])) << "record " << i;
    }
    // (Row 4 aside: where one side of a pair block holds NaN / +inf, the pair form leaves both
    // sides' sums empty, as PairItem does; its request fails either way.)
    const Outputs single = Launch(da, nullptr, kRows, c, false, ids_);
    for (size_t i = 0; i < base.stats.size(); ++i) {
      if (static_cast<int64_t>(i) / blocks == 4) continue;
      const k::BlockStats& s = single.stats[i].a;
      const k::BlockStats& p = base.stats[i].a;
      ASSERT_TRUE(SameBits(s.m, p.m) && SameBits(s.s, p.s) && SameBits(s.w, p.w))
          << "single vs pair, record " << i;
    }
  }
  // Row 150 alone, at position 0 of a one-row launch.
  for (const int64_t r : {int64_t{150}, int64_t{299}}) {
    HostOperand a1 = a_, b1 = b_;
    a1.x.assign(a_.x.begin() + r * kKa, a_.x.begin() + (r + 1) * kKa);
    b1.x.assign(b_.x.begin() + r * kKb, b_.x.begin() + (r + 1) * kKb);
    const DeviceOperand one_a(a1, 1, kV), one_b(b1, 1, kV);
    const std::vector<int32_t> ids(ids_.begin() + r * kIdsPerRow,
                                   ids_.begin() + (r + 1) * kIdsPerRow);
    const Outputs alone = Launch(one_a, &one_b, 1, c, false, ids);
    for (int64_t j = 0; j < blocks; ++j) {
      EXPECT_TRUE(SameRecord(alone.stats[static_cast<size_t>(j)],
                             base.stats[static_cast<size_t>(r * blocks + j)]))
          << "row " << r << " block " << j;
    }
    for (int32_t q = 0; q < kIdsPerRow; ++q) {
      EXPECT_TRUE(SameBits(alone.targets[static_cast<size_t>(q)],
                           base.targets[static_cast<size_t>(r * kIdsPerRow + q)]));
    }
  }
  // Three parts: the values in the first, zeros in the others (as LaunchSplitToBf16 splits fp32
  // inputs that bf16 holds exactly).
  {
    HostOperand a3 = a_;
    a3.x.resize(3 * a_.x.size(), 0);
    DeviceOperand d3(a3, kRows, kV);
    kc::HiddenOperand o = d3.Get();
    o.x_parts = 3;
    const kc::HiddenOperand ob = db.Get();
    DeviceArray<k::PairBlockStats> stats(static_cast<size_t>(kRows * blocks));
    kc::HiddenStatsArgs args;
    args.rows = kRows;
    args.cols = kV;
    args.stats = stats.get();
    args.stats_ld = blocks;
    args.cluster = c;
    ASSERT_CUDA(kc::LaunchHiddenStats(o, &ob, args, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<k::PairBlockStats> got = stats.ToHost();
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(SameRecord(got[i], base.stats[i])) << "three parts, record " << i;
    }
  }
}

// Shapes at the edges: one row, a vocabulary inside one subtile, K below one step.
TEST_P(HiddenStats, TinyShapes) {
  for (const auto& [rows, vocab, kk] :
       {std::tuple<int64_t, int64_t, int64_t>{1, 100, 8}, {5, 2050, 64}, {129, 300, 24}}) {
    SCOPED_TRACE("rows " + std::to_string(rows) + " V " + std::to_string(vocab) + " K " +
                 std::to_string(kk));
    std::mt19937_64 rng(11);
    const HostOperand h = MakeOperand(rng, rows, vocab, kk);
    const DeviceOperand d(h, rows, vocab);
    const int64_t blocks = k::NumBlocks(vocab);
    DeviceArray<k::PairBlockStats> stats(static_cast<size_t>(rows * blocks));
    DeviceArray<float> logits(static_cast<size_t>(rows * vocab));
    kc::HiddenStatsArgs args;
    args.rows = rows;
    args.cols = vocab;
    args.stats = stats.get();
    args.stats_ld = blocks;
    args.logits_a = logits.get();
    args.logits_ld = vocab;
    args.cluster = GetParam();
    const kc::HiddenOperand o = d.Get();
    ASSERT_CUDA(kc::LaunchHiddenStats(o, nullptr, args, nullptr));
    kc::LogitsSource s;
    s.type = k::FloatType::kFloat32;
    s.data = logits.get();
    s.ld = vocab;
    s.cols = vocab;
    s.transform.head = true;
    DeviceArray<k::PairBlockStats> want_d(static_cast<size_t>(rows * blocks));
    ASSERT_CUDA(kc::LaunchBlockStats(s, nullptr, rows, want_d.get(), blocks, 0, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<k::PairBlockStats> got = stats.ToHost(), want = want_d.ToHost();
    for (int64_t r = 0; r < rows; ++r) {
      const Finished g = Finish(got, r, blocks), w = Finish(want, r, blocks);
      EXPECT_EQ(g.p.a.flags, w.p.a.flags) << "row " << r;
      // A row with NaN / +inf logits (row 4 always, row 2 here too: its extreme term times a
      // weight above 1.13 overflows): flags only, as its request fails.
      if (w.p.a.flags & (k::kFlagNaN | k::kFlagPosInf)) continue;
      EXPECT_TRUE(SameBits(g.p.a.m, w.p.a.m) && Close(g.h_a, w.h_a))
          << "row " << r << ": M " << g.p.a.m << " vs " << w.p.a.m << ", H " << g.h_a << " vs "
          << w.h_a;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Clusters, HiddenStats, ::testing::ValuesIn(kClusters),
                         [](const ::testing::TestParamInfo<kc::HiddenCluster>& info) {
                           return "cluster_" + Name(info.param);
                         });

}  // namespace
}  // namespace logitserve::testing
