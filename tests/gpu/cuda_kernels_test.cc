// Unit tests of the CUDA kernels through their launchers (cuda_kernels.h), on small shapes: a few
// rows of V = 5000 (blocks of 2048, 2048 and 904 ids). Runs in seconds, so it is the program to
// run under compute-sanitizer (memcheck, racecheck, synccheck, initcheck).
//
// Oracles: the CPU kernels (cpu_kernels.h) on the very same fp32 values, and block_stats.h folded
// on the host. The two implementations sum in different orders and use different exp / log
// implementations, so they agree to the named tolerances below; maxima, flags, top-k lists and
// target logits are exact and compared bit for bit. GPU-vs-GPU properties that the determinism
// promise rests on (pair statistics == single statistics for the model side, dtype invariance,
// shard-layout invariance of the fold) are compared bit for bit.
//
// Long file: one program, so one compute-sanitizer run covers every kernel.
#include "logitserve/kernels/cuda_kernels.h"

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "logitserve/kernels/block_stats.h"
#include "logitserve/kernels/cpu_kernels.h"
#include "logitserve/kernels/dtype.h"
#include "tests/gpu/device_array.h"
#include "tests/gpu/gpu_test_env.h"
#include "tests/kernels/expect_reference.h"
#include "tests/kernels/job_builder.h"

namespace logitserve::testing {
namespace {

namespace k = kernels;
namespace kc = kernels::cuda;

constexpr double kU = 0x1p-24;
constexpr float kInf = std::numeric_limits<float>::infinity();

// Block sums (s, w, cross terms) of GPU and CPU: each exp is within 2 ulp on either side
// (ex2.approx, the instruction behind CUDA's exp2f; Highway's polynomial), i.e. <= 4 u apart per
// term, and the sums run in different orders with dependent-add chains of <= 38 (GPU: 32 per
// accumulator, 64 values a lane in two accumulators, one add of the two, 5 butterfly steps) and <=
// 256 (CPU, AVX2: 2048 / 8 lanes) additions. Worst case ~ 298 u; same-sign rounding errors add like
// a random walk, so 64 u (~ 3.7 sqrt(298) u) bounds it at many sigmas. Relative to the sum of
// |terms|.
constexpr double kBlockSumRelTol = 64 * kU;
// Fold and final formulas (host glibc vs device expf/logf, each <= 2 ulp, <= 3 folds of 6 scalar
// exps each, then one log): relative to (1 + |value|), 64 u is ample.
constexpr double kFoldRelTol = 64 * kU;

constexpr int64_t kV = 5000;
constexpr int64_t kRows = 7;

// Model logits: rows of different character.
//   0: normal(0, 3)        1: 20% masked        2: block 1 fully masked
//   3: finite extremes (+3e38 at 10, -3e38 at 4000: overflowing shift acts as masked)
//   4: values k/16 with many ties      5: one unmasked token (one-hot)      6: normal(0, 30)
std::vector<float> ModelValues(std::mt19937_64& rng) {
  std::vector<float> v = RandomNormal(rng, kRows * kV, 3.0);
  std::bernoulli_distribution coin(0.2);
  std::uniform_int_distribution<int> small(-40, 40);
  for (int64_t j = 0; j < kV; ++j) {
    if (coin(rng)) v[1 * kV + j] = -kInf;
    if (j >= 2048 && j < 4096) v[2 * kV + j] = -kInf;
    v[4 * kV + j] = small(rng) / 16.0f;
    v[5 * kV + j] = j == 3000 ? 1.5f : -kInf;
    v[6 * kV + j] *= 10.0f;
  }
  v[3 * kV + 10] = 3e38f;
  v[3 * kV + 4000] = -3e38f;
  return v;
}

// Reference logits: the model plus noise, with masks of their own (support mismatches both ways).
std::vector<float> ReferenceValues(std::mt19937_64& rng, const std::vector<float>& m) {
  std::vector<float> r = m;
  const std::vector<float> noise = RandomNormal(rng, kRows * kV, 1.0);
  std::bernoulli_distribution coin(0.05);
  for (int64_t i = 0; i < kRows * kV; ++i) {
    if (std::isfinite(r[i]) && std::abs(r[i]) < 1e30f) r[i] += noise[i];
    if (i / kV == 0 && coin(rng)) r[i] = -kInf;  // reference masks what the model keeps
    if (i / kV == 1 && !std::isfinite(m[i])) r[i] = noise[i];  // reference keeps what it masks
  }
  return r;
}

kc::LogitsSource SourceOf(const void* data, k::FloatType t, int64_t col0, int64_t cols,
                          float temperature = 1.0f) {
  kc::LogitsSource s;
  s.type = t;
  s.data = data;
  s.ld = kV;
  s.col0 = col0;
  s.cols = cols;
  s.transform.temperature = temperature;
  return s;
}

// The fp32 values the kernels see for row r of an encoded matrix, after the temperature.
std::vector<float> Decoded(const HostMatrix& m, int64_t r, float temperature) {
  std::vector<float> z(static_cast<size_t>(m.cols));
  for (int64_t j = 0; j < m.cols; ++j) {
    const float x = m.at(r, j);
    z[static_cast<size_t>(j)] = temperature == 1.0f ? x : x / temperature;
  }
  return z;
}

// Sum of |cross terms| of a block (both directions), the scale of c_ab / c_ba's rounding: over
// tokens both sides support, exp(clamped shift) times the unclamped shift difference.
double SumAbsCross(const float* a, const float* b, int64_t n, float ma, float mb) {
  double sum = 0.0;
  const float sha = std::isinf(ma) ? 0.0f : ma, shb = std::isinf(mb) ? 0.0f : mb;
  for (int64_t j = 0; j < n; ++j) {
    const float da = a[j] - sha, db = b[j] - shb;
    if (std::isinf(da) || std::isinf(db)) continue;
    const double diff = std::abs(static_cast<double>(da) - db);
    sum += (std::exp(std::max(double{da}, -200.0)) + std::exp(std::max(double{db}, -200.0))) * diff;
  }
  return sum;
}

::testing::AssertionResult SameStats(const k::BlockStats& got, const k::BlockStats& want,
                                     double w_scale) {
  if (!SameBits(got.m, want.m)) {
    return ::testing::AssertionFailure() << "m " << Bits(got.m) << " vs CPU " << Bits(want.m);
  }
  if (got.flags != want.flags) {
    return ::testing::AssertionFailure() << "flags " << got.flags << " vs CPU " << want.flags;
  }
  if (std::abs(static_cast<double>(got.s) - want.s) > kBlockSumRelTol * std::abs(want.s)) {
    return ::testing::AssertionFailure() << "s " << Bits(got.s) << " vs CPU " << Bits(want.s);
  }
  // The floor covers terms below 2^-125 that the CPU flushes to zero and the GPU keeps.
  if (std::abs(static_cast<double>(got.w) - want.w) > kBlockSumRelTol * w_scale + 1e-30) {
    return ::testing::AssertionFailure()
           << "w " << Bits(got.w) << " vs CPU " << Bits(want.w) << " (scale " << w_scale << ")";
  }
  return ::testing::AssertionSuccess();
}

class CudaKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937_64 rng(42);
    model_ = ModelValues(rng);
    ref_ = ReferenceValues(rng, model_);
  }
  std::vector<float> model_, ref_;
};

// Single and pair block statistics against the CPU kernels, for every input dtype and with a
// temperature; the pair's model side must equal the single statistics bit for bit.
TEST_F(CudaKernels, BlockStatsMatchCpu) {
  const int64_t blocks = k::NumBlocks(kV);
  for (k::FloatType t : {k::FloatType::kFloat32, k::FloatType::kBFloat16, k::FloatType::kFloat16}) {
    for (float temperature : {1.0f, 0.7f}) {
      SCOPED_TRACE(DTypeName(t) + " temperature " + std::to_string(temperature));
      const HostMatrix hm = Encode(t, kRows, kV, model_);
      const HostMatrix hr = Encode(t, kRows, kV, ref_);
      DeviceArray<uint8_t> dm(hm.bytes), dr(hr.bytes);
      DeviceArray<k::PairBlockStats> single(kRows * blocks), pair(kRows * blocks);
      const kc::LogitsSource a = SourceOf(dm.get(), t, 0, kV, temperature);
      const kc::LogitsSource b = SourceOf(dr.get(), t, 0, kV, temperature);
      ASSERT_CUDA(kc::LaunchBlockStats(a, nullptr, kRows, single.get(), blocks, 0, nullptr));
      ASSERT_CUDA(kc::LaunchBlockStats(a, &b, kRows, pair.get(), blocks, 0, nullptr));
      ASSERT_CUDA(cudaDeviceSynchronize());
      const std::vector<k::PairBlockStats> gs = single.ToHost(), gp = pair.ToHost();
      for (int64_t r = 0; r < kRows; ++r) {
        const std::vector<float> za = Decoded(hm, r, temperature), zb = Decoded(hr, r, temperature);
        for (int64_t blk = 0; blk < blocks; ++blk) {
          SCOPED_TRACE("row " + std::to_string(r) + " block " + std::to_string(blk));
          const int64_t n = std::min(k::kVocabBlock, kV - blk * k::kVocabBlock);
          const float* pa = za.data() + blk * k::kVocabBlock;
          const float* pb = zb.data() + blk * k::kVocabBlock;
          const k::BlockStats cpu_a = k::CpuBlockStats(pa, n);
          const k::PairBlockStats cpu_p = k::CpuPairBlockStats(pa, pb, n);
          const k::PairBlockStats& s = gs[static_cast<size_t>(r * blocks + blk)];
          const k::PairBlockStats& p = gp[static_cast<size_t>(r * blocks + blk)];
          // |w| is a sum of same-sign terms, so it is its own scale.
          EXPECT_TRUE(SameStats(s.a, cpu_a, std::abs(cpu_a.w)));
          EXPECT_EQ(s.b.s, 0.0f);
          EXPECT_TRUE(SameStats(p.a, cpu_p.a, std::abs(cpu_p.a.w)));
          EXPECT_TRUE(SameStats(p.b, cpu_p.b, std::abs(cpu_p.b.w)));
          const double cross = SumAbsCross(pa, pb, n, cpu_p.a.m, cpu_p.b.m);
          EXPECT_LE(std::abs(static_cast<double>(p.c_ab) - cpu_p.c_ab),
                    kBlockSumRelTol * cross + 1e-30)
              << "c_ab " << Bits(p.c_ab) << " vs CPU " << Bits(cpu_p.c_ab);
          EXPECT_LE(std::abs(static_cast<double>(p.c_ba) - cpu_p.c_ba),
                    kBlockSumRelTol * cross + 1e-30)
              << "c_ba " << Bits(p.c_ba) << " vs CPU " << Bits(cpu_p.c_ba);
          // The model side of a pair job is the model-only job's record, bit for bit (outputs
          // must not depend on which other outputs a request asks for).
          EXPECT_TRUE(SameBits(p.a.m, s.a.m) && SameBits(p.a.s, s.a.s) && SameBits(p.a.w, s.a.w))
              << "pair a (" << Bits(p.a.s) << ", " << Bits(p.a.w) << ") vs single (" << Bits(s.a.s)
              << ", " << Bits(s.a.w) << ")";
        }
      }
    }
  }
}

// The same values as fp32, bf16 and fp16 (k/16, |k| <= 255, and -inf) give identical records,
// single and pair, with masked tokens (the clamped path) and without (the fast path).
TEST_F(CudaKernels, SameRecordsForEveryDtype) {
  for (double p_masked : {0.05, 0.0}) {
    SCOPED_TRACE("masked fraction " + std::to_string(p_masked));
    std::mt19937_64 rng(7);
    std::uniform_int_distribution<int> q(-255, 255);
    std::bernoulli_distribution masked(p_masked);
    std::vector<float> v(kRows * kV), w(kRows * kV);
    for (float& x : v) x = masked(rng) ? -kInf : q(rng) / 16.0f;
    for (float& x : w) x = masked(rng) ? -kInf : q(rng) / 16.0f;
    const int64_t blocks = k::NumBlocks(kV);
    std::vector<std::vector<k::PairBlockStats>> got_pair, got_single;
    for (k::FloatType t :
         {k::FloatType::kFloat32, k::FloatType::kBFloat16, k::FloatType::kFloat16}) {
      DeviceArray<uint8_t> dv(Encode(t, kRows, kV, v).bytes), dw(Encode(t, kRows, kV, w).bytes);
      DeviceArray<k::PairBlockStats> pair(kRows * blocks), single(kRows * blocks);
      const kc::LogitsSource a = SourceOf(dv.get(), t, 0, kV, 0.7f);
      const kc::LogitsSource b = SourceOf(dw.get(), t, 0, kV, 0.7f);
      ASSERT_CUDA(kc::LaunchBlockStats(a, &b, kRows, pair.get(), blocks, 0, nullptr));
      ASSERT_CUDA(kc::LaunchBlockStats(a, nullptr, kRows, single.get(), blocks, 0, nullptr));
      ASSERT_CUDA(cudaDeviceSynchronize());
      got_pair.push_back(pair.ToHost());
      got_single.push_back(single.ToHost());
    }
    const size_t bytes = got_pair[0].size() * sizeof(k::PairBlockStats);
    for (size_t i = 1; i < got_pair.size(); ++i) {
      EXPECT_EQ(std::memcmp(got_pair[i].data(), got_pair[0].data(), bytes), 0)
          << "dtype " << i << " gives other pair record bits than fp32";
      EXPECT_EQ(std::memcmp(got_single[i].data(), got_single[0].data(), bytes), 0)
          << "dtype " << i << " gives other single record bits than fp32";
    }
  }
}

// Aligned and misaligned sources of the same values write the same records bit for bit, single
// and pair, every dtype. For fp32 single statistics that is the streamed kernel (rows 16-byte
// aligned; each warp walks many items through its ring of bulk copies) against the direct one;
// otherwise the direct kernel's vector loads against its scalar ones. Enough rows that every warp
// of the persistent grid refills its ring several times, and a shard of 4997 columns whose last
// block (901 values) ends one fp32 value past a 16-byte unit (that value comes from global memory,
// not the copy).
TEST_F(CudaKernels, StreamedAndDirectKernelsWriteTheSameRecords) {
  constexpr int64_t kManyRows = 4096;
  std::vector<float> model(kManyRows * kV), ref(kManyRows * kV);
  for (int64_t r = 0; r < kManyRows; ++r) {  // the 7 rows of character, rotated row by row
    for (int64_t j = 0; j < kV; ++j) {
      const int64_t from = (r % kRows) * kV + (j + r) % kV;
      model[static_cast<size_t>(r * kV + j)] = model_[static_cast<size_t>(from)];
      ref[static_cast<size_t>(r * kV + j)] = ref_[static_cast<size_t>(from)];
    }
  }
  for (k::FloatType t : {k::FloatType::kFloat32, k::FloatType::kBFloat16, k::FloatType::kFloat16}) {
    const HostMatrix hm = Encode(t, kManyRows, kV, model);
    const HostMatrix hr = Encode(t, kManyRows, kV, ref);
    const size_t es = static_cast<size_t>(k::SizeOf(t));
    // Aligned copies (cudaMalloc: 256 bytes) and copies one element past that.
    DeviceArray<uint8_t> am(hm.bytes), ar(hr.bytes);
    DeviceArray<uint8_t> um(hm.bytes.size() + 16), ur(hr.bytes.size() + 16);
    ASSERT_CUDA(
        cudaMemcpy(um.get() + es, hm.bytes.data(), hm.bytes.size(), cudaMemcpyHostToDevice));
    ASSERT_CUDA(
        cudaMemcpy(ur.get() + es, hr.bytes.data(), hr.bytes.size(), cudaMemcpyHostToDevice));
    for (int64_t cols : {kV, kV - 3}) {
      SCOPED_TRACE(DTypeName(t) + ", " + std::to_string(cols) + " columns");
      const int64_t blocks = k::NumBlocks(cols);
      const size_t n = static_cast<size_t>(kManyRows * blocks);
      std::vector<std::vector<k::PairBlockStats>> got;
      for (bool aligned : {true, false}) {
        const kc::LogitsSource a = SourceOf(aligned ? am.get() : um.get() + es, t, 0, cols, 0.7f);
        const kc::LogitsSource b = SourceOf(aligned ? ar.get() : ur.get() + es, t, 0, cols, 0.7f);
        DeviceArray<k::PairBlockStats> single(n), pair(n);
        ASSERT_CUDA(kc::LaunchBlockStats(a, nullptr, kManyRows, single.get(), blocks, 0, nullptr));
        ASSERT_CUDA(kc::LaunchBlockStats(a, &b, kManyRows, pair.get(), blocks, 0, nullptr));
        ASSERT_CUDA(cudaDeviceSynchronize());
        got.push_back(single.ToHost());
        got.push_back(pair.ToHost());
      }
      const size_t bytes = n * sizeof(k::PairBlockStats);
      EXPECT_EQ(std::memcmp(got[0].data(), got[2].data(), bytes), 0) << "single records differ";
      EXPECT_EQ(std::memcmp(got[1].data(), got[3].data(), bytes), 0) << "pair records differ";
      // Not vacuous: the rows' maxima are finite, so a wrong stage would show.
      EXPECT_TRUE(std::isfinite(got[0][0].a.m) && got[0][0].a.s >= 1.0f);
    }
  }
}

// NaN and +inf raise their flags (and leave the statistics empty); -inf alone does not.
TEST_F(CudaKernels, BadInputFlags) {
  std::vector<float> v(3 * kV, 0.5f);
  v[0 * kV + 2100] = std::numeric_limits<float>::quiet_NaN();
  v[1 * kV + 4500] = kInf;
  for (int64_t j = 0; j < kV; ++j) v[2 * kV + j] = -kInf;
  const int64_t blocks = k::NumBlocks(kV);
  DeviceArray<float> d(v);
  DeviceArray<k::PairBlockStats> out(3 * blocks);
  ASSERT_CUDA(kc::LaunchBlockStats(SourceOf(d.get(), k::FloatType::kFloat32, 0, kV), nullptr, 3,
                                   out.get(), blocks, 0, nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<k::PairBlockStats> g = out.ToHost();
  for (int64_t r = 0; r < 3; ++r) {
    for (int64_t blk = 0; blk < blocks; ++blk) {
      SCOPED_TRACE("row " + std::to_string(r) + " block " + std::to_string(blk));
      const k::BlockStats& s = g[static_cast<size_t>(r * blocks + blk)].a;
      uint32_t want = 0;
      if (r == 0 && blk == 1) want = k::kFlagNaN;
      if (r == 1 && blk == 2) want = k::kFlagPosInf;
      EXPECT_EQ(s.flags, want);
      if (want != 0 || r == 2) {
        EXPECT_EQ(s.s, 0.0f);
        EXPECT_EQ(s.m, -kInf);
      } else {
        EXPECT_EQ(s.m, 0.5f);
      }
    }
  }
}

// Target gather returns the exact transformed logit of ids inside the source only.
TEST_F(CudaKernels, GatherTargets) {
  const HostMatrix hm = Encode(k::FloatType::kBFloat16, kRows, kV, model_);
  DeviceArray<uint8_t> dm(hm.bytes);
  const std::vector<int32_t> ids = {0, 2047, 2048, 4999, -100, 3000, 4096};
  const int32_t per_row = 1;
  DeviceArray<int32_t> dids(ids);
  std::vector<float> init(ids.size(), 123.0f);
  DeviceArray<float> out(init);
  // A source holding ids [2048, 5000) (a second shard's view).
  kc::LogitsSource s =
      SourceOf(dm.get() + 2048 * 2, k::FloatType::kBFloat16, 2048, kV - 2048, 0.7f);
  ASSERT_CUDA(kc::LaunchGatherTargets(s, static_cast<int64_t>(ids.size()), dids.get(), per_row,
                                      out.get(), nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> g = out.ToHost();
  for (size_t r = 0; r < ids.size(); ++r) {
    SCOPED_TRACE("row " + std::to_string(r) + " id " + std::to_string(ids[r]));
    if (ids[r] >= 2048) {
      EXPECT_TRUE(SameBits(g[r], hm.at(static_cast<int64_t>(r), ids[r]) / 0.7f)) << Bits(g[r]);
    } else {
      EXPECT_EQ(g[r], 123.0f) << "an id outside the source was written";
    }
  }
}

// The statistics kernel's own target logits (LaunchBlockStats with TargetsOut, fp32 sources: hidden
// mode's GEMM output) are LaunchGatherTargets's, bit for bit, single and pair, with and without a
// transform tail (bias, softcap, temperature), over a source whose last block is partial, with a
// -0 logit, ignore_index and ids of another shard; and the records do not change.
TEST_F(CudaKernels, BlockStatsWriteTheGatheredTargets) {
  std::vector<float> model = model_;
  model[3 * kV + 2048 + 5] = -0.0f;  // row 3, the source's column 5
  DeviceArray<float> dm(model);
  DeviceArray<float> dr(ref_);
  std::vector<float> bias(kV);
  for (int64_t c = 0; c < kV; ++c)
    bias[static_cast<size_t>(c)] = 0.01f * static_cast<float>(c % 17);
  DeviceArray<float> dbias(bias);
  // Two ids a row: one per row in the source's full block, its partial block or elsewhere.
  const int32_t per_row = 2;
  std::vector<int32_t> ids;
  for (int64_t r = 0; r < kRows; ++r) {
    const int32_t pick[][2] = {{2053, 4999}, {0, 4096},    {-100, 3000}, {2053, 2048},
                               {4500, 100},  {2047, 4095}, {2049, -100}};
    ids.push_back(pick[r][0]);
    ids.push_back(pick[r][1]);
  }
  DeviceArray<int32_t> dids(ids);
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE("transform variant " + std::to_string(variant));
    // A source holding ids [2048, 5000) (a second shard's view): blocks of 2048 and 904 ids.
    auto source = [&](const float* data) {
      kc::LogitsSource src = SourceOf(data + 2048, k::FloatType::kFloat32, 2048, kV - 2048);
      src.transform.head = true;
      if (variant >= 1) src.transform.bias = dbias.get() + 2048;
      if (variant == 2) {
        src.transform.softcap = 30.0f;
        src.transform.temperature = 0.7f;
      }
      return src;
    };
    const kc::LogitsSource a = source(dm.get());
    const kc::LogitsSource b = source(dr.get());
    const int64_t blocks = a.blocks();
    for (bool pair : {false, true}) {
      SCOPED_TRACE(pair ? "pair" : "single");
      const std::vector<float> init(ids.size(), 123.0f);
      DeviceArray<float> gathered(init), fused(init);
      DeviceArray<k::PairBlockStats> plain(kRows * blocks), with(kRows * blocks);
      ASSERT_CUDA(kc::LaunchGatherTargets(a, kRows, dids.get(), per_row, gathered.get(), nullptr));
      ASSERT_CUDA(
          kc::LaunchBlockStats(a, pair ? &b : nullptr, kRows, plain.get(), blocks, 0, nullptr));
      ASSERT_CUDA(kc::LaunchBlockStats(a, pair ? &b : nullptr, kRows, with.get(), blocks, 0,
                                       nullptr, kc::TargetsOut{dids.get(), per_row, fused.get()}));
      ASSERT_CUDA(cudaDeviceSynchronize());
      const std::vector<float> g = gathered.ToHost(), f = fused.ToHost();
      for (size_t i = 0; i < ids.size(); ++i) {
        SCOPED_TRACE("entry " + std::to_string(i) + " id " + std::to_string(ids[i]));
        EXPECT_TRUE(SameBits(f[i], g[i])) << Bits(f[i]) << " vs " << Bits(g[i]);
        EXPECT_EQ(f[i] == 123.0f, ids[i] < 2048) << "written iff the source holds the id";
      }
      EXPECT_TRUE(SameBits(f[6], 0.0f) || variant > 0) << "-0 reads as +0: " << Bits(f[6]);
      const std::vector<k::PairBlockStats> p = plain.ToHost(), w = with.ToHost();
      EXPECT_EQ(std::memcmp(p.data(), w.data(), p.size() * sizeof(p[0])), 0);
    }
  }
  // A 16-bit source cannot write targets (its values are not transformed in place).
  const HostMatrix hm = Encode(k::FloatType::kBFloat16, kRows, kV, model_);
  DeviceArray<uint8_t> d16(hm.bytes);
  DeviceArray<k::PairBlockStats> rec(kRows * 3);
  DeviceArray<float> out(ids.size());
  EXPECT_EQ(kc::LaunchBlockStats(SourceOf(d16.get(), k::FloatType::kBFloat16, 0, kV), nullptr,
                                 kRows, rec.get(), 3, 0, nullptr,
                                 kc::TargetsOut{dids.get(), per_row, out.get()}),
            cudaErrorInvalidValue);
}

// Row r of a one-source (g, c) and a two-source (g2, c2) GPU top-k result equals the CPU's list
// `want` of `count` entries, bit for bit.
void ExpectListsEqualCpu(const std::vector<k::TopKEntry>& g, const std::vector<int32_t>& c,
                         const std::vector<k::TopKEntry>& g2, const std::vector<int32_t>& c2,
                         int64_t r, int32_t top, const std::vector<k::TopKEntry>& want, int count) {
  ASSERT_EQ(c[static_cast<size_t>(r)], count);
  ASSERT_EQ(c2[static_cast<size_t>(r)], count);
  for (int i = 0; i < count; ++i) {
    const k::TopKEntry& x = g[static_cast<size_t>(r * top + i)];
    const k::TopKEntry& y = g2[static_cast<size_t>(r * top + i)];
    const k::TopKEntry& w = want[static_cast<size_t>(i)];
    ASSERT_TRUE(x.id == w.id && SameBits(x.value, w.value))
        << "position " << i << ": GPU (" << x.id << ", " << Bits(x.value) << ") vs CPU (" << w.id
        << ", " << Bits(w.value) << ")";
    ASSERT_TRUE(y.id == w.id && SameBits(y.value, w.value))
        << "two-source list, position " << i << ": (" << y.id << ", " << Bits(y.value) << ")";
  }
}

// Top-k: identical (bit for bit) to the CPU's lists, for k from 1 to the cap, with ties and
// masked tokens; and a list built over two sources (two shards) equals the one-source list.
TEST_F(CudaKernels, TopKMatchesCpu) {
  const HostMatrix hm = Encode(k::FloatType::kFloat16, kRows, kV, model_);
  DeviceArray<uint8_t> dm(hm.bytes);
  for (int32_t top : {1, 5, 64, 1024}) {
    SCOPED_TRACE("k = " + std::to_string(top));
    DeviceArray<k::TopKEntry> lists(kRows * top), lists2(kRows * top);
    DeviceArray<int32_t> counts(kRows), counts2(kRows);
    DeviceArray<float> scratch(kc::TopKScratchBytes(kRows, k::NumBlocks(kV)) / sizeof(float));
    ASSERT_CUDA(kc::LaunchTopKUpdate(SourceOf(dm.get(), k::FloatType::kFloat16, 0, kV), kRows, top,
                                     lists.get(), counts.get(), scratch.get(), nullptr));
    ASSERT_CUDA(kc::LaunchTopKUpdate(SourceOf(dm.get(), k::FloatType::kFloat16, 0, 2048), kRows,
                                     top, lists2.get(), counts2.get(), scratch.get(), nullptr));
    ASSERT_CUDA(
        kc::LaunchTopKUpdate(SourceOf(dm.get() + 2048 * 2, k::FloatType::kFloat16, 2048, kV - 2048),
                             kRows, top, lists2.get(), counts2.get(), scratch.get(), nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<k::TopKEntry> g = lists.ToHost(), g2 = lists2.ToHost();
    const std::vector<int32_t> c = counts.ToHost(), c2 = counts2.ToHost();
    for (int64_t r = 0; r < kRows; ++r) {
      SCOPED_TRACE("row " + std::to_string(r));
      const std::vector<float> z = Decoded(hm, r, 1.0f);
      std::vector<k::TopKEntry> want(static_cast<size_t>(top));
      int count = 0;
      for (int64_t blk = 0; blk < k::NumBlocks(kV); ++blk) {
        const int64_t n = std::min(k::kVocabBlock, kV - blk * k::kVocabBlock);
        k::CpuTopKBlock(z.data() + blk * k::kVocabBlock, n,
                        static_cast<int32_t>(blk * k::kVocabBlock), top, want.data(), &count);
      }
      ASSERT_NO_FATAL_FAILURE(ExpectListsEqualCpu(g, c, g2, c2, r, top, want, count));
    }
  }
}

// The one-read top-k (topk_kernel.cu) on a vocabulary long enough for its threshold (17 blocks,
// 544 lane maxima), on rows that take each of its paths: the threshold path (normal logits, 30%
// masked, bf16-like ties at the top), and the exact fallback (every value equal: candidates
// overflow; 100 finite values: too few for k > 100). Lists equal the CPU's bit for bit, for one
// source and for two sources (the second offered to a full list), in every dtype; the fused
// launcher's statistics records equal LaunchBlockStats's bit for bit.
TEST_F(CudaKernels, OneReadTopKMatchesCpuOnEveryPath) {
  constexpr int64_t kLongV = 16 * 2048 + 232;
  constexpr int64_t kLongRows = 6;
  constexpr int64_t kSplit = 3 * 2048;
  constexpr float kTemperature = 0.7f;
  std::mt19937_64 rng(1234);
  std::vector<float> v = RandomNormal(rng, kLongRows * kLongV, 3.0);
  std::bernoulli_distribution coin(0.3);
  std::uniform_int_distribution<int> small(-40, 40);
  for (int64_t j = 0; j < kLongV; ++j) {
    if (coin(rng)) v[1 * kLongV + j] = -kInf;
    v[2 * kLongV + j] = small(rng) / 16.0f;
    v[3 * kLongV + j] = 0.25f;
    if (j % 331 != 7) v[4 * kLongV + j] = -kInf;  // 100 finite values
  }
  auto source = [&](const uint8_t* base, k::FloatType t, int64_t col0, int64_t cols) {
    kc::LogitsSource s;
    s.type = t;
    s.data = base + col0 * k::SizeOf(t);
    s.ld = kLongV;
    s.col0 = col0;
    s.cols = cols;
    s.transform.temperature = kTemperature;
    return s;
  };
  for (k::FloatType t : {k::FloatType::kBFloat16, k::FloatType::kFloat16, k::FloatType::kFloat32}) {
    const HostMatrix hm = Encode(t, kLongRows, kLongV, v);
    DeviceArray<uint8_t> dm(hm.bytes);
    const int64_t blocks = k::NumBlocks(kLongV);
    for (int32_t top : {1, 64, 500, 1024}) {
      SCOPED_TRACE("dtype " + std::to_string(static_cast<int>(t)) + ", k = " + std::to_string(top));
      DeviceArray<k::TopKEntry> lists(kLongRows * top), lists2(kLongRows * top);
      DeviceArray<int32_t> counts(kLongRows), counts2(kLongRows);
      DeviceArray<k::PairBlockStats> fused(kLongRows * blocks), plain(kLongRows * blocks);
      DeviceArray<float> scratch(kc::TopKScratchBytes(kLongRows, blocks) / sizeof(float));
      const kc::LogitsSource all = source(dm.get(), t, 0, kLongV);
      ASSERT_CUDA(kc::LaunchBlockStatsTopK(all, nullptr, kLongRows, fused.get(), blocks, 0, top,
                                           lists.get(), counts.get(), scratch.get(), nullptr));
      ASSERT_CUDA(kc::LaunchBlockStats(all, nullptr, kLongRows, plain.get(), blocks, 0, nullptr));
      ASSERT_CUDA(kc::LaunchTopKUpdate(source(dm.get(), t, 0, kSplit), kLongRows, top, lists2.get(),
                                       counts2.get(), scratch.get(), nullptr));
      ASSERT_CUDA(kc::LaunchTopKUpdate(source(dm.get(), t, kSplit, kLongV - kSplit), kLongRows, top,
                                       lists2.get(), counts2.get(), scratch.get(), nullptr));
      ASSERT_CUDA(cudaDeviceSynchronize());
      const std::vector<k::PairBlockStats> f = fused.ToHost(), p = plain.ToHost();
      ASSERT_EQ(std::memcmp(f.data(), p.data(), f.size() * sizeof(k::PairBlockStats)), 0)
          << "fused statistics records differ from LaunchBlockStats's";
      const std::vector<k::TopKEntry> g = lists.ToHost(), g2 = lists2.ToHost();
      const std::vector<int32_t> c = counts.ToHost(), c2 = counts2.ToHost();
      for (int64_t r = 0; r < kLongRows; ++r) {
        SCOPED_TRACE("row " + std::to_string(r));
        std::vector<float> z(static_cast<size_t>(kLongV));
        for (int64_t j = 0; j < kLongV; ++j) z[static_cast<size_t>(j)] = hm.at(r, j) / kTemperature;
        std::vector<k::TopKEntry> want(static_cast<size_t>(top));
        int count = 0;
        k::CpuTopKBlock(z.data(), kLongV, 0, top, want.data(), &count);
        ASSERT_NO_FATAL_FAILURE(ExpectListsEqualCpu(g, c, g2, c2, r, top, want, count));
      }
    }
  }
}

// The warp-per-row selection (topk_kernel.cu, k <= 64, 8 to 80 blocks) and the wide CTA selection
// (k = 256, 1024) on a vocabulary of Qwen's size (75 blocks: the warp variant holding 80 lane
// maxima a thread) and on a split into 41 + 34 blocks (the 34-block part is offered to full
// lists): rows of normal logits with and without a temperature, a row with heavy ties at the top
// (81 distinct values: for k <= 64 candidates overflow, so the fallback serves it; for k = 1024
// the ties at the k-th value are ranked by id), a row whose only finite values are 41 (fewer than
// k), and a row with
// 256 large values in its first block, 8 a lane (every top-k member in one block), a row whose
// 103 finite values lie in one block (every other lane maximum -inf: the threshold search counts
// all the keys), and a row whose largest values are zeros of both signs, each its lane's maximum
// (such a lane is always loaded again, so each zero keeps its sign bit). Lists equal the CPU's bit
// for bit.
TEST_F(CudaKernels, SelectionTopKMatchesCpuOnLongRows) {
  constexpr int64_t kLongV = 151936;
  constexpr int64_t kLongRows = 7;
  constexpr int64_t kSplit = 41 * 2048;
  std::mt19937_64 rng(4321);
  std::vector<float> v = RandomNormal(rng, kLongRows * kLongV, 2.0);
  std::uniform_int_distribution<int> small(-40, 40);
  for (int64_t j = 0; j < kLongV; ++j) {
    v[2 * kLongV + j] = small(rng) / 16.0f;
    if (j % 3791 != 11) v[3 * kLongV + j] = -kInf;  // 41 finite values
    if (j < 5 * 2048 || j >= 6 * 2048 || j % 20 != 0) v[5 * kLongV + j] = -kInf;
    // Row 6: the row's largest values are 101 zeros, -0 and +0 alternating, each its lane's
    // maximum (the lists must keep each zero's own sign bit).
    float& z = v[6 * kLongV + j];
    z = j % 1499 == 7 ? ((j / 1499) % 2 == 0 ? -0.0f : 0.0f) : -0.5f - std::fabs(z);
  }
  for (int64_t j = 0; j < 2048; j += 8) v[4 * kLongV + j + 3] = 20.0f + static_cast<float>(j) / 64;
  for (k::FloatType t : {k::FloatType::kBFloat16, k::FloatType::kFloat16, k::FloatType::kFloat32}) {
    const HostMatrix hm = Encode(t, kLongRows, kLongV, v);
    DeviceArray<uint8_t> dm(hm.bytes);
    const int64_t blocks = k::NumBlocks(kLongV);
    for (float temperature : {1.0f, 0.7f}) {
      auto source = [&](int64_t col0, int64_t cols) {
        kc::LogitsSource s;
        s.type = t;
        s.data = dm.get() + col0 * k::SizeOf(t);
        s.ld = kLongV;
        s.col0 = col0;
        s.cols = cols;
        s.transform.temperature = temperature;
        return s;
      };
      for (int32_t top : {1, 7, 64, 256, 1024}) {
        SCOPED_TRACE("dtype " + std::to_string(static_cast<int>(t)) + ", temperature " +
                     std::to_string(temperature) + ", k = " + std::to_string(top));
        DeviceArray<k::TopKEntry> lists(kLongRows * top), lists2(kLongRows * top);
        DeviceArray<int32_t> counts(kLongRows), counts2(kLongRows);
        DeviceArray<k::PairBlockStats> records(kLongRows * blocks);
        DeviceArray<float> scratch(kc::TopKScratchBytes(kLongRows, blocks) / sizeof(float));
        ASSERT_CUDA(kc::LaunchBlockStatsTopK(source(0, kLongV), nullptr, kLongRows, records.get(),
                                             blocks, 0, top, lists.get(), counts.get(),
                                             scratch.get(), nullptr));
        ASSERT_CUDA(kc::LaunchTopKUpdate(source(0, kSplit), kLongRows, top, lists2.get(),
                                         counts2.get(), scratch.get(), nullptr));
        ASSERT_CUDA(kc::LaunchTopKUpdate(source(kSplit, kLongV - kSplit), kLongRows, top,
                                         lists2.get(), counts2.get(), scratch.get(), nullptr));
        ASSERT_CUDA(cudaDeviceSynchronize());
        const std::vector<k::TopKEntry> g = lists.ToHost(), g2 = lists2.ToHost();
        const std::vector<int32_t> c = counts.ToHost(), c2 = counts2.ToHost();
        for (int64_t r = 0; r < kLongRows; ++r) {
          SCOPED_TRACE("row " + std::to_string(r));
          std::vector<float> z(static_cast<size_t>(kLongV));
          for (int64_t j = 0; j < kLongV; ++j)
            z[static_cast<size_t>(j)] = hm.at(r, j) / temperature;
          std::vector<k::TopKEntry> want(static_cast<size_t>(top));
          int count = 0;
          k::CpuTopKBlock(z.data(), kLongV, 0, top, want.data(), &count);
          ASSERT_NO_FATAL_FAILURE(ExpectListsEqualCpu(g, c, g2, c2, r, top, want, count));
        }
      }
    }
  }
}

// Builds the gathered messages of a row tile for a shard layout given as block boundaries
// (ranks own [begin[r], begin[r + 1])), running the statistics, target and top-k kernels per
// rank exactly as the backend does.
struct Gathered {
  kc::TileMessage layout;
  kc::ShardBlocks shards;
  std::unique_ptr<DeviceArray<uint8_t>> messages;
};

void BuildGathered(const void* model, const void* ref, k::FloatType t,
                   const std::vector<int32_t>& begin, const int32_t* dids, int32_t per_row,
                   int32_t top, Gathered* g) {
  const int ranks = static_cast<int>(begin.size()) - 1;
  int64_t max_blocks = 0;
  for (int r = 0; r < ranks; ++r)
    max_blocks = std::max<int64_t>(max_blocks, begin[r + 1] - begin[r]);
  g->layout = kc::MakeTileMessage(kRows, max_blocks, top, per_row);
  g->shards.ranks = ranks;
  for (int r = 0; r <= ranks; ++r) g->shards.begin[r] = begin[static_cast<size_t>(r)];
  g->messages =
      std::make_unique<DeviceArray<uint8_t>>(g->layout.bytes * static_cast<size_t>(ranks));
  const int64_t es = k::SizeOf(t);
  for (int r = 0; r < ranks; ++r) {
    uint8_t* m = g->messages->get() + static_cast<size_t>(r) * g->layout.bytes;
    const int64_t c0 = int64_t{begin[static_cast<size_t>(r)]} * k::kVocabBlock;
    const int64_t c1 = std::min(kV, int64_t{begin[static_cast<size_t>(r) + 1]} * k::kVocabBlock);
    if (c1 <= c0) continue;
    const kc::LogitsSource a =
        SourceOf(static_cast<const uint8_t*>(model) + c0 * es, t, c0, c1 - c0);
    const kc::LogitsSource b = SourceOf(static_cast<const uint8_t*>(ref) + c0 * es, t, c0, c1 - c0);
    ASSERT_CUDA(kc::LaunchBlockStats(
        a, &b, kRows, reinterpret_cast<k::PairBlockStats*>(m + g->layout.stats_offset), max_blocks,
        0, nullptr));
    ASSERT_CUDA(kc::LaunchGatherTargets(
        a, kRows, dids, per_row, reinterpret_cast<float*>(m + g->layout.target_offset), nullptr));
    DeviceArray<float> scratch(kc::TopKScratchBytes(kRows, a.blocks()) / sizeof(float));
    ASSERT_CUDA(kc::LaunchTopKUpdate(
        a, kRows, top, reinterpret_cast<k::TopKEntry*>(m + g->layout.topk_offset),
        reinterpret_cast<int32_t*>(m + g->layout.count_offset), scratch.get(), nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());  // before the scratch is freed
  }
  ASSERT_CUDA(cudaDeviceSynchronize());
}

struct FoldOut {
  std::vector<k::RowStats> a, b;
  std::vector<float> target, topk_lp, entropy, ref_entropy, fkl, rkl;
  std::vector<int32_t> topk_ids, bad;
};

void RunFold(const Gathered& g, const int32_t* dids, int32_t per_row, int32_t top, FoldOut* out) {
  DeviceArray<k::RowStats> fa(kRows), fb(kRows);
  DeviceArray<int32_t> bad(std::vector<int32_t>{0x7f7f7f7f, 0x7f7f7f7f});
  DeviceArray<float> target(kRows * per_row), topk_lp(kRows * top), ent(kRows), rent(kRows),
      fkl(kRows), rkl(kRows);
  DeviceArray<int32_t> topk_ids(kRows * top);
  kc::GatheredTile tile;
  tile.messages = g.messages->get();
  tile.layout = g.layout;
  tile.shards = g.shards;
  tile.num_blocks = k::NumBlocks(kV);
  tile.pair = true;
  kc::RowOutputs o;
  o.target_ids = dids;
  o.ids_per_row = per_row;
  o.target_logprobs = target.get();
  o.top_k = top;
  o.top_k_ids = topk_ids.get();
  o.top_k_logprobs = topk_lp.get();
  o.entropy = ent.get();
  o.reference_entropy = rent.get();
  o.forward_kl = fkl.get();
  o.reverse_kl = rkl.get();
  ASSERT_CUDA(kc::LaunchFoldRows(tile, kRows, 0, kc::FoldedRows{fa.get(), fb.get()}, bad.get(), &o,
                                 nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  out->a = fa.ToHost();
  out->b = fb.ToHost();
  out->target = target.ToHost();
  out->topk_lp = topk_lp.ToHost();
  out->topk_ids = topk_ids.ToHost();
  out->entropy = ent.ToHost();
  out->ref_entropy = rent.ToHost();
  out->fkl = fkl.ToHost();
  out->rkl = rkl.ToHost();
  out->bad = bad.ToHost();
}

::testing::AssertionResult NearFold(float got, float want) {
  if (std::isnan(want) && std::isnan(got)) return ::testing::AssertionSuccess();
  if (std::isinf(want) && got == want) return ::testing::AssertionSuccess();
  if (std::abs(static_cast<double>(got) - want) <= kFoldRelTol * (1.0 + std::abs(want))) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << Bits(got) << " vs host " << Bits(want);
}

// The fold and final formulas on the GPU against block_stats.h run on the host over the same
// records; and the same tile gathered from three ranks (one of them empty) gives the same bits as
// from one rank: the fold order is the global block order whatever the shard layout.
TEST_F(CudaKernels, FoldMatchesHostAndIgnoresShardLayout) {
  const k::FloatType t = k::FloatType::kBFloat16;
  const HostMatrix hm = Encode(t, kRows, kV, model_), hr = Encode(t, kRows, kV, ref_);
  DeviceArray<uint8_t> dm(hm.bytes), dr(hr.bytes);
  const int32_t per_row = 2, top = 5;
  std::vector<int32_t> ids;
  for (int64_t r = 0; r < kRows; ++r) {
    ids.push_back(static_cast<int32_t>((r * 733) % kV));
    ids.push_back(r == 3 ? -100 : static_cast<int32_t>(kV - 1 - r));
  }
  DeviceArray<int32_t> dids(ids);
  Gathered one, three;
  BuildGathered(dm.get(), dr.get(), t, {0, 3}, dids.get(), per_row, top, &one);
  BuildGathered(dm.get(), dr.get(), t, {0, 1, 1, 3}, dids.get(), per_row, top, &three);
  FoldOut f1, f3;
  RunFold(one, dids.get(), per_row, top, &f1);
  RunFold(three, dids.get(), per_row, top, &f3);
  // Host fold of the one-rank records.
  std::vector<uint8_t> msg(one.layout.bytes);
  ASSERT_CUDA(cudaMemcpy(msg.data(), one.messages->get(), msg.size(), cudaMemcpyDeviceToHost));
  const auto* rec =
      reinterpret_cast<const k::PairBlockStats*>(msg.data() + one.layout.stats_offset);
  const auto* tz = reinterpret_cast<const float*>(msg.data() + one.layout.target_offset);
  for (int64_t r = 0; r < kRows; ++r) {
    SCOPED_TRACE("row " + std::to_string(r));
    k::PairRowStats p = k::EmptyPairRowStats();
    for (int64_t b = 0; b < k::NumBlocks(kV); ++b)
      k::FoldPairBlock(p, rec[r * one.layout.max_blocks + b]);
    EXPECT_TRUE(SameBits(f1.a[static_cast<size_t>(r)].m, p.a.m));
    EXPECT_TRUE(NearFold(f1.a[static_cast<size_t>(r)].s, p.a.s)) << "S";
    EXPECT_TRUE(NearFold(f1.entropy[static_cast<size_t>(r)], k::Entropy(p.a))) << "entropy";
    EXPECT_TRUE(NearFold(f1.ref_entropy[static_cast<size_t>(r)], k::Entropy(p.b))) << "ref entropy";
    EXPECT_TRUE(NearFold(f1.fkl[static_cast<size_t>(r)], k::KlBA(p))) << "forward KL";
    EXPECT_TRUE(NearFold(f1.rkl[static_cast<size_t>(r)], k::KlAB(p))) << "reverse KL";
    for (int32_t j = 0; j < per_row; ++j) {
      const size_t idx = static_cast<size_t>(r * per_row + j);
      const float want = ids[idx] == -100 ? 0.0f : k::LogProb(tz[idx], p.a);
      EXPECT_TRUE(NearFold(f1.target[idx], want)) << "target " << ids[idx];
      if (ids[idx] == -100) {
        EXPECT_TRUE(SameBits(f1.target[idx], 0.0f));
      }
    }
  }
  // Rows 0 (reference masks model tokens) and 1 (the other way) exercise the +inf KL flags.
  EXPECT_EQ(f1.rkl[0], kInf);
  EXPECT_EQ(f1.fkl[1], kInf);
  EXPECT_EQ(f1.bad[0], 0x7f7f7f7f);
  EXPECT_EQ(f1.bad[1], 0x7f7f7f7f);
  auto same = [](const auto& x, const auto& y, const char* what) {
    ASSERT_EQ(x.size(), y.size());
    EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(x[0])), 0)
        << what << ": three-rank fold differs from the one-rank fold";
  };
  same(f1.a, f3.a, "model rows");
  same(f1.b, f3.b, "reference rows");
  same(f1.target, f3.target, "target logprobs");
  same(f1.topk_ids, f3.topk_ids, "top-k ids");
  same(f1.topk_lp, f3.topk_lp, "top-k logprobs");
  same(f1.entropy, f3.entropy, "entropy");
  same(f1.fkl, f3.fkl, "forward KL");
  same(f1.rkl, f3.rkl, "reverse KL");
}

// JSD partials against CpuJsdBlock with the same row normalisation.
TEST_F(CudaKernels, JsdPartialsMatchCpu) {
  const k::FloatType t = k::FloatType::kFloat32;
  const int64_t blocks = k::NumBlocks(kV);
  DeviceArray<float> dm(model_), dr(ref_);
  // Row statistics from the CPU kernels, folded on the host; both sides use these.
  std::vector<k::RowStats> ns(kRows), nt(kRows);
  for (int64_t r = 0; r < kRows; ++r) {
    k::RowStats a = k::EmptyRowStats(), b = k::EmptyRowStats();
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t n = std::min(k::kVocabBlock, kV - blk * k::kVocabBlock);
      k::FoldBlock(a, k::CpuBlockStats(model_.data() + r * kV + blk * k::kVocabBlock, n));
      k::FoldBlock(b, k::CpuBlockStats(ref_.data() + r * kV + blk * k::kVocabBlock, n));
    }
    ns[static_cast<size_t>(r)] = a;
    nt[static_cast<size_t>(r)] = b;
  }
  DeviceArray<k::RowStats> dns(ns), dnt(nt);
  DeviceArray<float> partials(kRows * blocks);
  const float beta = 0.3f;
  ASSERT_CUDA(kc::LaunchJsdPartials(SourceOf(dm.get(), t, 0, kV), SourceOf(dr.get(), t, 0, kV),
                                    kRows, dns.get(), dnt.get(), beta, partials.get(), blocks, 0,
                                    nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> g = partials.ToHost();
  for (int64_t r = 0; r < kRows; ++r) {
    const k::RowNorm a = k::NormOf(ns[static_cast<size_t>(r)]),
                     b = k::NormOf(nt[static_cast<size_t>(r)]);
    for (int64_t blk = 0; blk < blocks; ++blk) {
      SCOPED_TRACE("row " + std::to_string(r) + " block " + std::to_string(blk));
      const int64_t n = std::min(k::kVocabBlock, kV - blk * k::kVocabBlock);
      const float* s = model_.data() + r * kV + blk * k::kVocabBlock;
      const float* tt = ref_.data() + r * kV + blk * k::kVocabBlock;
      const float want = k::CpuJsdBlock(s, tt, n, a, b, beta);
      // Each term p (lp - log m) is off by <= 8 u p (|lp| + |log m| + 1) on either side (exp,
      // log and the subtractions); summed, plus kBlockSumRelTol of the sum of |terms|.
      double scale = 0.0;
      for (int64_t j = 0; j < n; ++j) {
        const double lps = std::max(double{s[j]} - a.m - a.log_s, -200.0);
        const double lpt = std::max(double{tt[j]} - b.m - b.log_s, -200.0);
        const double ps = std::exp(lps), pt = std::exp(lpt);
        const double lm = std::log(std::max(beta * pt + (1 - beta) * ps, 1.17549435e-38));
        scale += beta * pt * (std::abs(lpt) + std::abs(lm) + 1) +
                 (1 - beta) * ps * (std::abs(lps) + std::abs(lm) + 1);
      }
      EXPECT_LE(std::abs(static_cast<double>(g[static_cast<size_t>(r * blocks + blk)]) - want),
                (8 * kU + kBlockSumRelTol) * scale + 1e-30)
          << "GPU " << Bits(g[static_cast<size_t>(r * blocks + blk)]) << " vs CPU " << Bits(want);
    }
  }
}

// x == hi + mid + lo exactly, each part a bf16; bf16 values need one part, fp16 values two.
TEST_F(CudaKernels, SplitToBf16IsExact) {
  std::mt19937_64 rng(3);
  std::vector<float> v = RandomNormal(rng, 4096, 100.0);
  const float extras[] = {
      0.0f,        -0.0f,    1e-30f, -3e38f, 3.3e38f,
      1.0f / 3.0f, 65504.0f, kInf,   -kInf,  std::numeric_limits<float>::quiet_NaN()};
  for (size_t i = 0; i < std::size(extras); ++i) v[i] = extras[i];
  const int64_t rows = 64, cols = 64;
  for (k::FloatType t : {k::FloatType::kFloat32, k::FloatType::kFloat16, k::FloatType::kBFloat16}) {
    SCOPED_TRACE(DTypeName(t));
    const HostMatrix m = Encode(t, rows, cols, v);
    DeviceArray<uint8_t> src(m.bytes);
    const int parts = kc::PartsFor(t);
    const int64_t dst_rows = rows + 3, dst_ld = cols + 8;  // zero padding on both sides
    const size_t stride = static_cast<size_t>(dst_rows * dst_ld);
    DeviceArray<uint16_t> dst(3 * stride);
    ASSERT_CUDA(kc::LaunchSplitToBf16(t, src.get(), cols, rows, cols, parts, dst.get(), dst_rows,
                                      dst_ld, stride, nullptr));
    ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<uint16_t> g = dst.ToHost();
    for (int64_t r = 0; r < dst_rows; ++r) {
      for (int64_t c = 0; c < dst_ld; ++c) {
        const size_t i = static_cast<size_t>(r * dst_ld + c);
        const float x = (r < rows && c < cols) ? m.at(r, c) : 0.0f;
        double sum = 0.0;
        for (int p = 0; p < parts; ++p) sum += k::BFloat16ToFloat(g[p * stride + i]);
        if (std::isnan(x)) {
          EXPECT_TRUE(std::isnan(k::BFloat16ToFloat(g[i])));
        } else if (std::abs(x) >= 1e-30f || x == 0.0f || std::isinf(x)) {
          ASSERT_EQ(sum, static_cast<double>(x))
              << "element (" << r << ", " << c << ") " << Bits(x);
        }
        for (int p = parts; p < 3 && t != k::FloatType::kFloat32; ++p) {
          EXPECT_EQ(g[p * stride + i], 0) << "parts beyond PartsFor must stay untouched (zero)";
        }
      }
    }
  }
}

// The read floor reads every byte (its XOR is the host's).
TEST_F(CudaKernels, ReadFloorReadsEverything) {
  std::vector<uint32_t> v(1 << 20);
  std::mt19937 rng(5);
  for (uint32_t& x : v) x = rng();
  uint32_t want = 0;
  for (uint32_t x : v) want ^= x;
  DeviceArray<uint32_t> d(v), sink(1024);
  ASSERT_CUDA(kc::LaunchReadFloor(d.get(), v.size() * 4, sink.get(), nullptr));
  ASSERT_CUDA(cudaDeviceSynchronize());
  uint32_t got = 0;
  for (uint32_t x : sink.ToHost()) got ^= x;
  EXPECT_EQ(got, want);
}

TEST_F(CudaKernels, KernelImageForThisDevice) { EXPECT_EQ(kc::CheckKernelImage(), cudaSuccess); }

}  // namespace
}  // namespace logitserve::testing
