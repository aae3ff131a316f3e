// CudaBackend end to end (Score on host inputs, as the service calls it).
//
//   Agreement: every op x input dtype x V in {1, 17, 111, 32000, 151936} x N in {0, 1, 7, 257}
//     against the fp64 reference (tests/kernels/expect_reference.h: its named tolerances) and
//     against the CPU backend on the same job (kGpuCpuRelTol, a backstop that prints the worst
//     row); hidden mode over head dtypes x hidden dtypes x transforms.
//   Determinism (bit for bit): a row alone vs inside batches at positions that straddle tiles;
//     one GPU vs a virtual three-shard layout with an empty shard vs two GPUs (skipped, with a
//     message, when fewer are visible); hidden states given as fp32 / bf16 / fp16 with equal
//     values; logits resident on the device (read in place) vs host logits.
//   Errors: NaN / +inf messages are the CPU backend's, word for word; one rank failing or a stop
//     (cancelled / expired) ends the job on every rank at the same tile, and the backend recovers.
//
// Long file: one sweep table and its GPU fixtures; split, each program would re-create the
// devices' contexts (seconds each on the GPU machine).
#include "server/backend/cuda/cuda_backend.h"

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "logitserve/kernels/cuda_kernels.h"
#include "logitserve/kernels/dtype.h"
#include "server/backend/backend.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/cuda/cuda_tile_gemm.h"
#include "tests/gpu/cuda_factories.h"
#include "tests/gpu/device_array.h"
#include "tests/gpu/gpu_test_env.h"
#include "tests/kernels/expect_reference.h"
#include "tests/kernels/job_builder.h"

namespace logitserve::testing {
namespace {

constexpr double kLogitStd = 3.0;  // realistic spread of LM-head logits

constexpr float kInf = std::numeric_limits<float>::infinity();

int64_t RoundUpTo8(int64_t x) { return (x + 7) / 8 * 8; }

// GPU vs CPU backend, both fp32 with different summation orders and exp/log implementations.
// Each is within the reference's tolerance of the exact value (checked separately), and for the
// outputs here those tolerances stay below 256 u (1 + |x|) (kSumRelTol = 64 u times the output's
// condition, at most ~ 2 H + 2 log V + 1 <= 4 (1 + |x|) for entropies, KLs and logprobs of
// normal(0, 3) logits); two of them apart gives 512 u. A backstop, reported with the worst row.
constexpr double kGpuCpuRelTol = 512 * kU;
// Hidden mode adds each backend's GEMM rounding, H u sum |h W| (up to ~ 30 u |z| here), on both
// sides.
constexpr double kGpuCpuHiddenRelTol = 4096 * kU;

std::unique_ptr<Backend> MustCreate(const BackendFactory& f) {
  absl::StatusOr<std::unique_ptr<Backend>> b = f.create();
  EXPECT_TRUE(b.ok()) << f.name << ": " << b.status();
  return b.ok() ? *std::move(b) : nullptr;
}

std::unique_ptr<Backend> Cpu() {
  CpuBackendOptions o;
  o.threads = 0;
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateCpuBackend(o);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? *std::move(b) : nullptr;
}

// GPU 0 cut into `shards` vocabulary shards (0 = one) with logits-mode row tiles of `tile_rows`
// (0 = by job).
absl::StatusOr<std::unique_ptr<Backend>> TiledCuda(int shards, int64_t tile_rows) {
  CudaBackendOptions o;
  o.devices = {0};
  o.shards = shards;
  o.logits_tile_rows = tile_rows;
  return CreateCudaBackend(o);
}

// Worst |gpu - cpu| / (1 + |cpu|) of one output; NaN and infinities must match exactly.
void CompareOutput(const std::string& name, const std::vector<float>& gpu,
                   const std::vector<float>& cpu, int64_t per_row, double rel_tol) {
  ASSERT_EQ(gpu.size(), cpu.size()) << name;
  double worst = 0.0;
  size_t at = 0;
  for (size_t i = 0; i < gpu.size(); ++i) {
    const float g = gpu[i], c = cpu[i];
    if (std::isnan(c) || std::isinf(c)) {
      if (!(std::isnan(c) ? std::isnan(g) : g == c)) {
        ADD_FAILURE() << name << " row " << i / per_row << " element " << i % per_row << ": GPU "
                      << g << ", CPU " << c;
        return;
      }
      continue;
    }
    const double err = std::abs(static_cast<double>(g) - c) / (1.0 + std::abs(c));
    if (!(err <= worst)) {
      worst = err;
      at = i;
    }
  }
  EXPECT_LE(worst, rel_tol) << name << ": worst at row " << at / per_row << " element "
                            << at % per_row << ": GPU " << gpu[at] << ", CPU " << cpu[at]
                            << " (relative " << worst << ", tolerance " << rel_tol << ")";
}

// GPU vs CPU on every output (top-k ids may swap only between near-tied values).
void CompareWithCpu(const ScoreJob& job, const ScoreResult& gpu, const ScoreResult& cpu,
                    double rel_tol) {
  CompareOutput("target_logprobs", gpu.target_logprobs, cpu.target_logprobs,
                std::max(job.ids_per_row, 1), rel_tol);
  CompareOutput("top_k_logprobs", gpu.top_k_logprobs, cpu.top_k_logprobs, std::max(job.top_k, 1),
                rel_tol);
  ASSERT_EQ(gpu.top_k_ids.size(), cpu.top_k_ids.size());
  for (size_t i = 0; i < gpu.top_k_ids.size(); ++i) {
    if (gpu.top_k_ids[i] == cpu.top_k_ids[i]) continue;
    const double gap = std::abs(static_cast<double>(gpu.top_k_logprobs[i]) - cpu.top_k_logprobs[i]);
    EXPECT_LE(gap, rel_tol * (1.0 + std::abs(cpu.top_k_logprobs[i])))
        << "top_k_ids row " << i / job.top_k << " position " << i % job.top_k << ": GPU id "
        << gpu.top_k_ids[i] << ", CPU id " << cpu.top_k_ids[i] << " (not a near-tie)";
  }
  CompareOutput("entropy", gpu.entropy, cpu.entropy, 1, rel_tol);
  CompareOutput("reference_entropy", gpu.reference_entropy, cpu.reference_entropy, 1, rel_tol);
  CompareOutput("forward_kl", gpu.forward_kl, cpu.forward_kl, 1, rel_tol);
  CompareOutput("reverse_kl", gpu.reverse_kl, cpu.reverse_kl, 1, rel_tol);
  CompareOutput("jsd", gpu.jsd, cpu.jsd, 1, rel_tol);
}

void ExpectSameBits(const std::vector<float>& a, const std::vector<float>& b, const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) {
      ADD_FAILURE() << what << " row " << i << ": " << a[i] << " vs " << b[i];
      return;
    }
  }
}

// ---- (a) agreement -------------------------------------------------------------------------

struct LogitsCase {
  BackendFactory backend;
  FloatType dtype;
  int64_t vocab;
  std::vector<int64_t> rows;
};

std::vector<LogitsCase> LogitsCases() {
  std::vector<LogitsCase> cases;
  const BackendFactory all = CudaFactory("cuda_all_gpus", 0, {}, 0);
  const BackendFactory split = CudaFactory("cuda_shards_1_0_2", 3, {1, 0, 2}, 0);
  for (FloatType t : {FloatType::kFloat32, FloatType::kBFloat16, FloatType::kFloat16}) {
    for (int64_t v : {1, 17, 111, 32000, 151936}) {
      cases.push_back({all, t, v, {0, 1, 7, 257}});
      cases.push_back(
          {split, t, v,
           v == 151936 ? std::vector<int64_t>{1, 7} : std::vector<int64_t>{0, 1, 7, 257}});
    }
  }
  return cases;
}

void PrintTo(const LogitsCase& c, std::ostream* os) {
  *os << c.backend.name << " " << DTypeName(c.dtype) << " V=" << c.vocab;
}

class CudaLogits : public ::testing::TestWithParam<LogitsCase> {};

TEST_P(CudaLogits, EveryOpMatchesReferenceAndCpu) {
  const LogitsCase& c = GetParam();
  std::unique_ptr<Backend> gpu = MustCreate(c.backend);
  std::unique_ptr<Backend> cpu = Cpu();
  ASSERT_NE(gpu, nullptr);
  ASSERT_NE(cpu, nullptr);
  std::mt19937_64 rng(static_cast<uint64_t>(c.vocab) * 131 + static_cast<uint64_t>(c.dtype));
  const bool big = c.vocab >= 32000;
  for (int64_t n : c.rows) {
    SCOPED_TRACE("N = " + std::to_string(n));
    const LogitsPair in = MakeLogitsPair(rng, c.dtype, n, c.vocab, kLogitStd);
    const int32_t top = static_cast<int32_t>(std::min<int64_t>(c.vocab, 5));
    std::vector<std::pair<std::string, OwnedJob>> jobs;
    auto pair_job = [&](float tm = 1.0f, float tr = 1.0f) {
      OwnedJob j;
      j.SetModelLogits(in.model, tm).SetReferenceLogits(in.reference, tr);
      return j;
    };
    {  // model only: the single-distribution kernels
      OwnedJob j;
      j.SetModelLogits(in.model)
          .WithTargets(RandomTargets(rng, n, 3, c.vocab, -100, 0.15), 3)
          .WithTopK(top)
          .WithEntropy();
      jobs.emplace_back("targets + top_k + entropy (model only)", j);
    }
    if (!big) {  // each pair op on its own
      jobs.emplace_back("reference_entropy", pair_job().WithReferenceEntropy());
      jobs.emplace_back("forward_kl", pair_job().WithForwardKl());
      jobs.emplace_back("reverse_kl", pair_job().WithReverseKl());
      jobs.emplace_back("jsd 0.3", pair_job().WithJsd(0.3f));
      jobs.emplace_back(
          "top_k 1, ignore_index -1",
          pair_job().WithTopK(1).WithTargets(RandomTargets(rng, n, 1, c.vocab, -1, 0.3), 1, -1));
    }
    jobs.emplace_back(
        "everything, temperatures 0.7 / 1.3",
        pair_job(0.7f, 1.3f)
            .WithEverything(RandomTargets(rng, n, 2, c.vocab, -100, 0.15), 2, top, 0.3f));
    for (const auto& [name, j] : jobs) {
      SCOPED_TRACE(name);
      LOGITSERVE_ASSERT_SCORE(got, *gpu, j.job);
      ExpectMatchesReference(j.job, got);
      LOGITSERVE_ASSERT_SCORE(want, *cpu, j.job);
      CompareWithCpu(j.job, got, want, kGpuCpuRelTol);
    }
    // JSD endpoints copy the KL bits (explicit branches, not limits).
    for (float beta : {0.0f, 1.0f}) {
      SCOPED_TRACE("jsd endpoint " + std::to_string(beta));
      OwnedJob j = pair_job();
      j.WithForwardKl().WithReverseKl().WithJsd(beta);
      LOGITSERVE_ASSERT_SCORE(got, *gpu, j.job);
      ExpectSameBits(got.jsd, beta == 0.0f ? got.forward_kl : got.reverse_kl, "jsd vs KL");
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, CudaLogits, ::testing::ValuesIn(LogitsCases()),
                         [](const ::testing::TestParamInfo<LogitsCase>& info) {
                           return info.param.backend.name + "_" + DTypeName(info.param.dtype) +
                                  "_V" + std::to_string(info.param.vocab);
                         });

struct HiddenCase {
  FloatType head_dtype;
  FloatType hidden_dtype;
  std::string transform_name;
  HeadTransform transform;
  bool bias;
  double logit_std;
};

std::vector<HiddenCase> HiddenCases() {
  HeadTransform none, cohere, granite, gemma;
  cohere.logit_scale = 0.0625f;
  granite.logits_scaling = 8.0f;
  gemma.softcap = 30.0f;
  std::vector<HiddenCase> cases;
  for (FloatType w : {FloatType::kBFloat16, FloatType::kFloat16, FloatType::kFloat32}) {
    for (FloatType h : {FloatType::kBFloat16, FloatType::kFloat16, FloatType::kFloat32}) {
      cases.push_back({w, h, "none", none, false, 3.0});
    }
    cases.push_back({w, FloatType::kBFloat16, "softcap_bias", gemma, true, 30.0});
    cases.push_back({w, FloatType::kFloat32, "logit_scale", cohere, false, 3.0});
    cases.push_back({w, FloatType::kFloat16, "logits_scaling_bias", granite, true, 3.0});
  }
  return cases;
}

void PrintTo(const HiddenCase& c, std::ostream* os) {
  *os << "head " << DTypeName(c.head_dtype) << ", hidden " << DTypeName(c.hidden_dtype) << ", "
      << c.transform_name;
}

class CudaHidden : public ::testing::TestWithParam<HiddenCase> {};

// V = 12000 (6 blocks, 2 GEMM chunks, the last partial), H = 130 (padded to 136 on the GPU), a
// reference head with its own hidden size; N up to 520 (two 512-row tiles) for bf16 heads, the
// main path (the fp64 reference costs N V H multiply-adds per head, so the others stop at 7).
TEST_P(CudaHidden, EveryOutputMatchesReferenceAndCpu) {
  const HiddenCase& c = GetParam();
  constexpr int64_t kVocab = 12000, kH = 130, kHRef = 72;
  std::unique_ptr<Backend> gpu = MustCreate(CudaFactory("cuda_all_gpus", 0, {}, 0));
  std::unique_ptr<Backend> cpu = Cpu();
  ASSERT_NE(gpu, nullptr);
  ASSERT_NE(cpu, nullptr);
  std::mt19937_64 rng(99 + static_cast<uint64_t>(c.head_dtype) * 3 +
                      static_cast<uint64_t>(c.hidden_dtype));
  const double gain = static_cast<double>(c.transform.logit_scale) / c.transform.logits_scaling;
  auto model_w = RandomHead(rng, kVocab, kH, c.head_dtype,
                            c.logit_std / std::sqrt(double{kH}) / gain, c.bias, c.transform);
  auto ref_w = RandomHead(rng, kVocab, kHRef, FloatType::kBFloat16, 3.0 / std::sqrt(double{kHRef}),
                          false, HeadTransform{});
  auto prepare = [](Backend& b, std::shared_ptr<HeadWeights> w) {
    absl::StatusOr<std::shared_ptr<const PreparedHead>> p = b.PrepareHead(std::move(w));
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *p : nullptr;
  };
  auto gm = prepare(*gpu, model_w), gr = prepare(*gpu, ref_w);
  auto cm = prepare(*cpu, model_w), cr = prepare(*cpu, ref_w);
  ASSERT_TRUE(gm && gr && cm && cr);
  const std::vector<int64_t> sizes = c.head_dtype == FloatType::kBFloat16
                                         ? std::vector<int64_t>{0, 1, 7, 520}
                                         : std::vector<int64_t>{0, 1, 7};
  for (int64_t n : sizes) {
    SCOPED_TRACE("N = " + std::to_string(n));
    const SharedMatrix h = Share(Encode(c.hidden_dtype, n, kH, RandomNormal(rng, n * kH, 1.0)));
    const SharedMatrix hr =
        Share(Encode(c.hidden_dtype, n, kHRef, RandomNormal(rng, n * kHRef, 1.0)));
    const std::vector<int32_t> ids = RandomTargets(rng, n, 2, kVocab, -100, 0.15);
    auto job = [&](std::shared_ptr<const PreparedHead> m, std::shared_ptr<const PreparedHead> r) {
      OwnedJob j;
      j.SetModelHidden(m, h, 0.9f).SetReferenceHidden(r, hr);
      j.WithEverything(ids, 2, 4, 0.3f);
      return j;
    };
    const OwnedJob jg = job(gm, gr), jc = job(cm, cr);
    LOGITSERVE_ASSERT_SCORE(got, *gpu, jg.job);
    ExpectMatchesReference(jg.job, got);
    LOGITSERVE_ASSERT_SCORE(want, *cpu, jc.job);
    CompareWithCpu(jg.job, got, want, kGpuCpuHiddenRelTol);
  }
}

INSTANTIATE_TEST_SUITE_P(Sweep, CudaHidden, ::testing::ValuesIn(HiddenCases()),
                         [](const ::testing::TestParamInfo<HiddenCase>& info) {
                           return "W" + DTypeName(info.param.head_dtype) + "_h" +
                                  DTypeName(info.param.hidden_dtype) + "_" +
                                  info.param.transform_name;
                         });

// The two hidden-mode paths of CudaBackend, each forced: the fused GEMM + statistics kernel (on
// compute capability 9.0; elsewhere this runs the cuBLASLt path twice) and cuBLASLt tiles read back
// by the statistics kernel. Each against the fp64 reference, and against each other on every
// output (they sum in different orders: GEMM roundings of both sides, as GPU vs CPU above).
TEST(CudaHiddenPaths, FusedAndTiledAgree) {
  constexpr int64_t kVocab = 9000, kH = 200, kHRef = 136, kN = 300;
  std::mt19937_64 rng(61);
  HeadTransform gemma;
  gemma.softcap = 30.0f;
  const auto model_w =
      RandomHead(rng, kVocab, kH, FloatType::kBFloat16, 3.0 / std::sqrt(200.0), true, gemma);
  const auto ref_w = RandomHead(rng, kVocab, kHRef, FloatType::kFloat32, 3.0 / std::sqrt(136.0),
                                false, HeadTransform{});
  const SharedMatrix h =
      Share(Encode(FloatType::kBFloat16, kN, kH, RandomNormal(rng, kN * kH, 1.0)));
  const SharedMatrix hr =
      Share(Encode(FloatType::kFloat16, kN, kHRef, RandomNormal(rng, kN * kHRef, 1.0)));
  const std::vector<int32_t> ids = RandomTargets(rng, kN, 2, kVocab, -100, 0.15);
  std::vector<ScoreResult> results;
  for (bool fused : {true, false}) {
    SCOPED_TRACE(fused ? "fused" : "cuBLASLt tiles");
    CudaBackendOptions o;
    o.devices = {0};
    o.hidden_fused = fused;
    o.hidden_fused_max_hidden = 0;
    absl::StatusOr<std::unique_ptr<Backend>> b = CreateCudaBackend(o);
    ASSERT_TRUE(b.ok()) << b.status();
    absl::StatusOr<std::shared_ptr<const PreparedHead>> m = (*b)->PrepareHead(model_w);
    absl::StatusOr<std::shared_ptr<const PreparedHead>> r = (*b)->PrepareHead(ref_w);
    ASSERT_TRUE(m.ok() && r.ok());
    OwnedJob j;
    j.SetModelHidden(*m, h, 0.8f).SetReferenceHidden(*r, hr);
    j.WithEverything(ids, 2, 4, 0.3f);
    LOGITSERVE_ASSERT_SCORE(got, **b, j.job);
    ExpectMatchesReference(j.job, got);
    results.push_back(got);
    if (fused) {
      OwnedJob k;  // top-k and JSD keep the fused kernel's logits: a job without them too
      k.SetModelHidden(*m, h).SetReferenceHidden(*r, hr).WithTargets(ids, 2).WithEntropy();
      k.WithForwardKl();
      LOGITSERVE_ASSERT_SCORE(plain, **b, k.job);
      ExpectMatchesReference(k.job, plain);
    }
  }
  OwnedJob shape;
  shape.WithEverything(ids, 2, 4, 0.3f);
  shape.job.rows = kN;
  CompareWithCpu(shape.job, results[0], results[1], kGpuCpuHiddenRelTol);
}

// With the default options a job takes the fused kernel when every head of it has a hidden size
// of at most hidden_fused_max_hidden (2048), else the tiles: the bits of the backend forced onto
// that path, for a small head, a head just past the limit, and a pair of the two (the widest
// decides, for both sides). Where the fused kernel cannot run, every job takes the tiles.
TEST(CudaHiddenPaths, DefaultPathByHiddenSize) {
  constexpr int64_t kVocab = 3000, kSmall = 64, kLarge = 2056, kN = 130;
  std::mt19937_64 rng(71);
  const auto small_w =
      RandomHead(rng, kVocab, kSmall, FloatType::kBFloat16, 3.0 / 8.0, false, HeadTransform{});
  const auto large_w = RandomHead(rng, kVocab, kLarge, FloatType::kBFloat16,
                                  3.0 / std::sqrt(2056.0), false, HeadTransform{});
  const SharedMatrix hs =
      Share(Encode(FloatType::kBFloat16, kN, kSmall, RandomNormal(rng, kN * kSmall, 1.0)));
  const SharedMatrix hl =
      Share(Encode(FloatType::kBFloat16, kN, kLarge, RandomNormal(rng, kN * kLarge, 1.0)));
  const std::vector<int32_t> ids = RandomTargets(rng, kN, 1, kVocab, -100, 0.1);
  CudaBackendOptions by_default, fused, tiles;
  by_default.devices = fused.devices = tiles.devices = {0};
  fused.hidden_fused = true;
  tiles.hidden_fused_max_hidden = 0;
  std::vector<std::unique_ptr<Backend>> backends;
  for (const CudaBackendOptions& o : {by_default, fused, tiles}) {
    absl::StatusOr<std::unique_ptr<Backend>> b = CreateCudaBackend(o);
    ASSERT_TRUE(b.ok()) << b.status();
    backends.push_back(*std::move(b));
  }
  const bool fused_runs = kernels::cuda::HiddenStatsSupported();
  struct Case {
    const char* name;
    bool small_model, with_ref, small_ref, want_fused;
  };
  for (const Case& c : {Case{"small head", true, false, false, true},
                        Case{"head past the limit", false, false, false, false},
                        Case{"small model, large reference", true, true, false, false}}) {
    SCOPED_TRACE(c.name);
    std::vector<ScoreResult> got;
    for (auto& b : backends) {
      absl::StatusOr<std::shared_ptr<const PreparedHead>> m =
          b->PrepareHead(c.small_model ? small_w : large_w);
      absl::StatusOr<std::shared_ptr<const PreparedHead>> r =
          b->PrepareHead(c.small_ref ? small_w : large_w);
      ASSERT_TRUE(m.ok() && r.ok());
      OwnedJob j;
      j.SetModelHidden(*m, c.small_model ? hs : hl).WithTargets(ids, 1).WithEntropy();
      if (c.with_ref) j.SetReferenceHidden(*r, c.small_ref ? hs : hl).WithForwardKl();
      LOGITSERVE_ASSERT_SCORE(result, *b, j.job);
      got.push_back(result);
    }
    ExpectBitwiseEqual(got[0], got[c.want_fused && fused_runs ? 1 : 2]);
    if (fused_runs) {  // the two paths round differently: the comparison above can tell them apart
      EXPECT_NE(std::memcmp(got[1].entropy.data(), got[2].entropy.data(),
                            got[1].entropy.size() * sizeof(float)),
                0);
    }
  }
}

// ---- (b) determinism -----------------------------------------------------------------------

// Layouts whose results must all be the same bits: one GPU, three shards on one GPU with an
// empty middle shard, trailing empty shards (clamped to [V, V), off a block boundary for the
// vocabularies used here), and (when visible) two GPUs through NCCL.
std::vector<BackendFactory> Layouts() {
  std::vector<BackendFactory> f = {CudaDevicesFactory("one_gpu", {0}),
                                   CudaFactory("cuda_shards_1_0_2_one_gpu", 3, {1, 0, 2}, 0),
                                   CudaFactory("cuda_shards_1_0", 2, {1, 0}, 0),
                                   CudaFactory("cuda_shards_2_1_0", 3, {2, 1, 0}, 0)};
  if (VisibleCudaDevices() >= 2) {
    f.push_back(CudaDevicesFactory("two_gpus", {0, 1}));
  } else {
    std::printf("[ skipped   ] two-GPU layout: only %d CUDA device visible\n",
                VisibleCudaDevices());
  }
  return f;
}

// Layouts() (one GPU) with slots of two GEMM chunks, one slot, and no SMs left to the statistics
// (the tile defaults before hidden_stats_sms): whole-slot GEMMs of 16384 ids, and a head shard's
// narrower last slot.
std::vector<BackendFactory> TwoChunkSlotLayouts() {
  std::vector<BackendFactory> f;
  for (const auto& [name, shards, weights] :
       {std::tuple<const char*, int, std::vector<int64_t>>{"two_chunks_one_gpu", 1, {}},
        {"two_chunks_shards_1_0_2_one_gpu", 3, {1, 0, 2}}}) {
    f.push_back(BackendFactory{name, [shards = shards, weights = weights]() {
                                 CudaBackendOptions o;
                                 o.devices = {0};
                                 o.shards = shards;
                                 o.shard_weights = weights;
                                 o.hidden_fused_max_hidden = 0;
                                 o.hidden_stats_chunks = 2;
                                 o.hidden_slots = 1;
                                 o.hidden_stats_sms = 0;
                                 return CreateCudaBackend(o);
                               }});
  }
  return f;
}

// Layouts() through the fused hidden-mode kernel (CudaBackendOptions::hidden_fused), in 512-row
// pipelined tiles (an 1100-row job: three, the last partial); the path's own bits must agree
// across them as the cuBLASLt path's do. The default cluster choice ("auto") runs the full tiles
// in 2x1 clusters and shorter launches (the partial tile, a row alone) in 2x2 ones; one layout
// pins 2x2 for every launch.
std::vector<BackendFactory> FusedLayouts() {
  struct L {
    const char* name;
    int shards;
    std::vector<int64_t> weights;
    std::vector<int> devices;
    const char* cluster;
  };
  std::vector<L> ls = {{"fused_one_gpu", 1, {}, {0}, "auto"},
                       {"fused_one_gpu_2x2", 1, {}, {0}, "2x2"},
                       {"fused_shards_1_0_2_one_gpu", 3, {1, 0, 2}, {0}, "auto"},
                       {"fused_shards_2_1_0_one_gpu", 3, {2, 1, 0}, {0}, "auto"}};
  if (VisibleCudaDevices() >= 2) ls.push_back({"fused_two_gpus", 0, {}, {0, 1}, "auto"});
  std::vector<BackendFactory> f;
  for (const L& l : ls) {
    f.push_back(BackendFactory{l.name, [l]() {
                                 CudaBackendOptions o;
                                 o.devices = l.devices;
                                 o.shards = l.shards;
                                 o.shard_weights = l.weights;
                                 o.hidden_fused = true;
                                 o.hidden_fused_tile_rows = 512;
                                 o.hidden_fused_cluster = l.cluster;
                                 return CreateCudaBackend(o);
                               }});
  }
  return f;
}

TEST(CudaDeterminism, LogitsRowBitsIndependentOfBatchPositionLayoutAndResidence) {
  constexpr int64_t kVocab = 151936;
  std::mt19937_64 rng(17);
  std::vector<float> m = RandomNormal(rng, kVocab, 3.0), r = RandomNormal(rng, kVocab, 3.0);
  MaskRandomTokens(rng, m, kVocab, 0, 0.05);
  const std::vector<int32_t> ids = {3, -100, static_cast<int32_t>(kVocab - 1)};
  constexpr int32_t kTopK = 8;
  auto embed = [&](const std::vector<float>& row, int64_t n, int64_t pos) {
    std::vector<float> out = RandomNormal(rng, n * kVocab, 3.0);
    std::copy(row.begin(), row.end(), out.begin() + pos * kVocab);
    return out;
  };
  auto embed_ids = [&](int64_t n, int64_t pos) {
    std::vector<int32_t> out = RandomTargets(rng, n, 3, kVocab, -100, 0.2);
    std::copy(ids.begin(), ids.end(), out.begin() + pos * 3);
    return out;
  };
  auto job = [&](const std::vector<float>& mm, const std::vector<float>& rr,
                 const std::vector<int32_t>& tt, int64_t n) {
    OwnedJob j;
    j.SetModelLogits(Share(Encode(FloatType::kBFloat16, n, kVocab, mm)), 0.9f)
        .SetReferenceLogits(Share(Encode(FloatType::kBFloat16, n, kVocab, rr)));
    j.WithEverything(tt, 3, kTopK, 0.3f);
    return j;
  };
  const OwnedJob alone = job(m, r, ids, 1);
  struct Placement {
    int64_t n, pos;
  };
  std::vector<std::pair<Placement, OwnedJob>> batches;
  for (Placement p : {Placement{13, 0}, Placement{13, 12}, Placement{40, 33}}) {
    batches.emplace_back(
        p, job(embed(m, p.n, p.pos), embed(r, p.n, p.pos), embed_ids(p.n, p.pos), p.n));
  }
  std::unique_ptr<ScoreResult> baseline;
  for (const BackendFactory& f : Layouts()) {
    SCOPED_TRACE(f.name);
    std::unique_ptr<Backend> b = MustCreate(f);
    ASSERT_NE(b, nullptr);
    LOGITSERVE_ASSERT_SCORE(got_alone, *b, alone.job);
    if (baseline == nullptr) {
      ExpectMatchesReference(alone.job, got_alone);
      baseline = std::make_unique<ScoreResult>(got_alone);
    } else {
      ExpectBitwiseEqual(got_alone, *baseline);
    }
    for (const auto& [p, j] : batches) {
      SCOPED_TRACE("batch of " + std::to_string(p.n) + " at " + std::to_string(p.pos));
      LOGITSERVE_ASSERT_SCORE(got, *b, j.job);
      ExpectRowBitwiseEqual(*baseline, 0, got, p.pos, 3, kTopK);
    }
  }
  // Logits already on the GPU are read in place (no staging copy): same bits.
  {
    SCOPED_TRACE("device-resident logits");
    std::unique_ptr<Backend> b = MustCreate(CudaDevicesFactory("one_gpu", {0}));
    ASSERT_NE(b, nullptr);
    const auto& [p, j] = batches[2];
    LOGITSERVE_ASSERT_SCORE(host, *b, j.job);
    void* dm = nullptr;
    void* dr = nullptr;
    const size_t bytes = static_cast<size_t>(p.n * kVocab) * 2;
    ASSERT_EQ(cudaMalloc(&dm, bytes), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dr, bytes), cudaSuccess);
    cudaMemcpy(dm, j.job.model.logits.data, bytes, cudaMemcpyHostToDevice);
    cudaMemcpy(dr, j.job.reference.logits.data, bytes, cudaMemcpyHostToDevice);
    ScoreJob dj = j.job;
    dj.model.logits.data = dm;
    dj.reference.logits.data = dr;
    absl::StatusOr<ScoreResult> dev = RunJob(*b, dj);
    cudaFree(dm);
    cudaFree(dr);
    ASSERT_TRUE(dev.ok()) << dev.status();
    ExpectBitwiseEqual(*dev, host);
  }
}

// Logits mode's row-tile pipeline (statistics of tile t + 1 beside the tail of tile t, two message
// slots, output slices copied back per tile): every tile size gives the bits of one tile, with
// logits read in place and staged from the host, on one and two shards; a single distribution
// (the fused statistics + lane maxima launch, then the selection on the other stream) and a pair
// with every output (JSD pass included). Rows with masked tokens and a row with fewer finite
// tokens than k send rows to the top-k fallback in some tiles. And the bad-row marker names the
// first bad row of the job when bad rows lie in several tiles.
TEST(CudaDeterminism, LogitsRowTilesDoNotChangeBits) {
  constexpr int64_t kRows = 70, kVocab = 5000;  // two shards: [0, 2048) and [2048, 5000)
  constexpr int32_t kTopK = 16;
  std::mt19937_64 rng(59);
  std::vector<float> m = RandomNormal(rng, kRows * kVocab, kLogitStd);
  std::vector<float> r = RandomNormal(rng, kRows * kVocab, kLogitStd);
  for (int64_t row = 0; row < kRows; row += 5) MaskRandomTokens(rng, m, kVocab, row, 0.3);
  for (int64_t c = 10; c < kVocab; ++c) m[41 * kVocab + c] = -kInf;  // 10 finite tokens < k
  const SharedMatrix hm = Share(Encode(FloatType::kBFloat16, kRows, kVocab, m));
  const SharedMatrix hr = Share(Encode(FloatType::kBFloat16, kRows, kVocab, r));
  const std::vector<int32_t> ids = RandomTargets(rng, kRows, 2, kVocab, -100, 0.2);
  OwnedJob single, pair;
  single.SetModelLogits(hm, 0.9f).WithTargets(ids, 2).WithTopK(kTopK).WithEntropy();
  pair.SetModelLogits(hm, 0.9f).SetReferenceLogits(hr).WithEverything(ids, 2, kTopK, 0.3f);

  const size_t bytes = static_cast<size_t>(kRows * kVocab) * 2;
  void* dm = nullptr;
  void* dr = nullptr;
  ASSERT_EQ(cudaMalloc(&dm, bytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dr, bytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dm, hm->bytes.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dr, hr->bytes.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  auto on_device = [&](const OwnedJob& j) {
    OwnedJob d = j;
    d.job.model.logits.data = dm;
    if (d.job.NeedsReference()) d.job.reference.logits.data = dr;
    return d;
  };
  const OwnedJob jobs[] = {single, pair, on_device(single), on_device(pair)};  // host ones first
  const char* names[] = {"single, host", "pair, host", "single, device", "pair, device"};

  // One tile, one shard, host logits; the device-resident jobs (the same values) must match it
  // too. (The reference reads host memory only.)
  std::vector<ScoreResult> baseline;
  for (int shards : {1, 2}) {
    for (int64_t tile_rows : {0, 1, 3, 16}) {
      SCOPED_TRACE(std::to_string(shards) + " shard(s), tile rows " + std::to_string(tile_rows));
      absl::StatusOr<std::unique_ptr<Backend>> b = TiledCuda(shards, tile_rows);
      ASSERT_TRUE(b.ok()) << b.status();
      for (size_t i = 0; i < std::size(jobs); ++i) {
        SCOPED_TRACE(names[i]);
        LOGITSERVE_ASSERT_SCORE(got, **b, jobs[i].job);
        if (baseline.size() < 2) {
          ExpectMatchesReference(jobs[i].job, got);
          baseline.push_back(got);
        } else {
          ExpectBitwiseEqual(got, baseline[i % 2]);
        }
      }
    }
  }

  // NaN in rows 50 and 20, +inf in the reference's row 33: tiles of 16 put them in tiles 3, 1
  // and 2, and tiles of 1 each in its own; the error names the first bad row either way.
  std::vector<float> bad_m = m, bad_r = r;
  bad_m[50 * kVocab + 7] = std::numeric_limits<float>::quiet_NaN();
  bad_m[20 * kVocab + 4999] = std::numeric_limits<float>::quiet_NaN();
  bad_r[33 * kVocab + 2500] = kInf;
  OwnedJob bad;
  bad.SetModelLogits(Share(Encode(FloatType::kBFloat16, kRows, kVocab, bad_m)))
      .SetReferenceLogits(Share(Encode(FloatType::kBFloat16, kRows, kVocab, bad_r)))
      .WithEverything(ids, 2, kTopK, 0.3f);
  std::unique_ptr<Backend> cpu = Cpu();
  const absl::StatusOr<ScoreResult> want = RunJob(*cpu, bad.job);
  ASSERT_FALSE(want.ok());
  for (int64_t tile_rows : {int64_t{1}, int64_t{16}}) {
    absl::StatusOr<std::unique_ptr<Backend>> b = TiledCuda(/*shards=*/0, tile_rows);
    ASSERT_TRUE(b.ok()) << b.status();
    const absl::StatusOr<ScoreResult> got = RunJob(**b, bad.job);
    ASSERT_FALSE(got.ok());
    EXPECT_EQ(got.status(), want.status());
    EXPECT_NE(std::string(got.status().message()).find("row 20"), std::string::npos)
        << got.status();
  }
  cudaFree(dm);
  cudaFree(dr);
}

// Outputs of a megabyte or more come back split over the reporting rank's kept host threads once
// every tile is queued (RankWorker::Finish): the same bits for every tile size and layout, and a
// job stopped mid-way leaves the backend serving the next one.
TEST(CudaDeterminism, LargeOutputsCopiedByThreads) {
  constexpr int64_t kRows = 2100, kVocab = 5000;  // 2100 x 64 x 8 B = 1.08 MB of top-k output
  constexpr int32_t kTopK = 64;
  std::mt19937_64 rng(61);
  std::vector<float> m = RandomNormal(rng, kRows * kVocab, kLogitStd);
  for (int64_t row = 0; row < kRows; row += 97) MaskRandomTokens(rng, m, kVocab, row, 0.5);
  const SharedMatrix hm = Share(Encode(FloatType::kBFloat16, kRows, kVocab, m));
  OwnedJob job;
  job.SetModelLogits(hm).WithTargets(RandomTargets(rng, kRows, 1, kVocab, -100, 0.1), 1);
  job.WithTopK(kTopK).WithEntropy();
  const size_t bytes = static_cast<size_t>(kRows * kVocab) * 2;
  void* dm = nullptr;
  ASSERT_EQ(cudaMalloc(&dm, bytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dm, hm->bytes.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  OwnedJob resident = job;
  resident.job.model.logits.data = dm;

  std::unique_ptr<ScoreResult> baseline;
  for (int shards : {1, 2}) {
    for (int64_t tile_rows : {8192, 0, 7, 300}) {
      SCOPED_TRACE(std::to_string(shards) + " shard(s), tile rows " + std::to_string(tile_rows));
      absl::StatusOr<std::unique_ptr<Backend>> b = TiledCuda(shards, tile_rows);
      ASSERT_TRUE(b.ok()) << b.status();
      LOGITSERVE_ASSERT_SCORE(host, **b, job.job);
      LOGITSERVE_ASSERT_SCORE(dev, **b, resident.job);
      if (baseline == nullptr) {
        ExpectMatchesReference(job.job, host);
        baseline = std::make_unique<ScoreResult>(host);
      }
      ExpectBitwiseEqual(host, *baseline);
      ExpectBitwiseEqual(dev, *baseline);
      // Stopped at the first stop check after the first tile's (one per tile per rank): every
      // size but the one tile is cut (by job, k = 64 runs 2048-row tiles: two for 2100 rows).
      std::atomic<int> calls{0};
      OwnedJob stopped = resident;
      stopped.job.stop = [&calls, shards](int64_t) {
        return ++calls > shards ? absl::CancelledError("stop") : absl::OkStatus();
      };
      const absl::StatusOr<ScoreResult> cut = RunJob(**b, stopped.job);
      if (tile_rows == 8192) {
        EXPECT_TRUE(cut.ok()) << cut.status();
      } else {
        ASSERT_FALSE(cut.ok());
        EXPECT_EQ(cut.status().code(), absl::StatusCode::kCancelled) << cut.status();
      }
      LOGITSERVE_ASSERT_SCORE(again, **b, resident.job);
      ExpectBitwiseEqual(again, *baseline);
    }
  }
  cudaFree(dm);
}

// Hidden mode: a row alone vs in batches of 1100 at positions 511 and 600 (other 512-row tiles,
// other offsets in them), hidden states as fp32 / bf16 / fp16 with equal values (k/16), heads in
// bf16 and fp32, on every layout; for each hidden-mode path (cuBLASLt tiles, the fused kernel).
TEST(CudaDeterminism, HiddenRowBitsIndependentOfBatchPositionLayoutAndDtype) {
  constexpr int64_t kVocab = 20000, kH = 256, kHRef = 128;
  std::mt19937_64 rng(29);
  HeadTransform gemma;
  gemma.softcap = 30.0f;
  const auto model_w = RandomHead(rng, kVocab, kH, FloatType::kBFloat16, 3.0 / 16.0, true, gemma);
  const auto ref_w = RandomHead(rng, kVocab, kHRef, FloatType::kFloat32, 3.0 / std::sqrt(128.0),
                                false, HeadTransform{});
  auto exact = [&](int64_t count) {
    std::vector<float> x = RandomNormal(rng, count, 1.0);
    for (float& e : x) e = std::round(std::clamp(e * 16.0f, -255.0f, 255.0f)) / 16.0f;
    return x;
  };
  const std::vector<float> row = exact(kH), row_ref = exact(kHRef);
  const std::vector<int32_t> ids = {0, static_cast<int32_t>(kVocab - 1), -100};
  constexpr int32_t kTopK = 4;
  struct Batch {
    int64_t n, pos;
    std::vector<float> h, hr;
    std::vector<int32_t> ids;
  };
  std::vector<Batch> batches;
  for (auto [n, pos] : {std::pair<int64_t, int64_t>{1100, 511}, {1100, 600}, {3, 0}}) {
    Batch b{n, pos, exact(n * kH), exact(n * kHRef), RandomTargets(rng, n, 3, kVocab, -100, 0.2)};
    std::copy(row.begin(), row.end(), b.h.begin() + pos * kH);
    std::copy(row_ref.begin(), row_ref.end(), b.hr.begin() + pos * kHRef);
    std::copy(ids.begin(), ids.end(), b.ids.begin() + pos * 3);
    batches.push_back(std::move(b));
  }
  // Each hidden-mode path has its own bits (they agree to rounding: CudaHiddenPaths), and so has
  // each tile GEMM configuration (the previous defaults: GEMMs of two chunks planned for every
  // SM, one slot).
  for (const std::vector<BackendFactory>& layouts :
       {Layouts(), FusedLayouts(), TwoChunkSlotLayouts()}) {
    std::unique_ptr<ScoreResult> baseline;
    for (const BackendFactory& f : layouts) {
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
        alone.SetModelHidden(*model, Share(Encode(t, 1, kH, row)))
            .SetReferenceHidden(*ref, Share(Encode(t, 1, kHRef, row_ref)));
        alone.WithEverything(ids, 3, kTopK, 0.3f);
        LOGITSERVE_ASSERT_SCORE(got_alone, *b, alone.job);
        if (baseline == nullptr) {
          ExpectMatchesReference(alone.job, got_alone);
          baseline = std::make_unique<ScoreResult>(got_alone);
        } else {
          ExpectBitwiseEqual(got_alone, *baseline);
        }
        for (const Batch& bt : batches) {
          SCOPED_TRACE("batch of " + std::to_string(bt.n) + " at " + std::to_string(bt.pos));
          OwnedJob j;
          j.SetModelHidden(*model, Share(Encode(t, bt.n, kH, bt.h)))
              .SetReferenceHidden(*ref, Share(Encode(t, bt.n, kHRef, bt.hr)));
          j.WithEverything(bt.ids, 3, kTopK, 0.3f);
          LOGITSERVE_ASSERT_SCORE(got, *b, j.job);
          ExpectRowBitwiseEqual(*baseline, 0, got, bt.pos, 3, kTopK);
        }
      }
    }
  }
}

// Hidden states in pageable host memory (staged through pinned buffers), in pinned host memory
// and resident on the GPU give the same bits, on one GPU and on two; with and without a JSD pass
// (the GEMMs fill the logits slots in turn on their own stream without one, keep every chunk of
// the row tile with one), also with both distributions' GEMMs on one stream (hidden_gemm_streams
// 1; by default the reference's have their own) and with one or three logits slots (hidden_slots;
// two by default), and with the first row tile of host inputs staged by the ranks once the job
// holds them instead of prestaged (prestage_bytes 0). V = 20000: three GEMM chunks per row tile
// (two slots of one chunk by default), so a tile reuses a logits slot; N = 4200: three row tiles
// of 2048 (the last short), so slots and pinned buffers are reused across tiles.
TEST(CudaDeterminism, HiddenStateResidenceAndStreamsDoNotChangeBits) {
  constexpr int64_t kVocab = 20000, kH = 96, kN = 4200;
  static_assert(kN > 2 * kCudaRowTile && kN < 3 * kCudaRowTile);
  std::mt19937_64 rng(47);
  const auto model_w = RandomHead(rng, kVocab, kH, FloatType::kBFloat16, 3.0 / std::sqrt(96.0),
                                  true, HeadTransform{});
  const auto ref_w = RandomHead(rng, kVocab, kH, FloatType::kBFloat16, 3.0 / std::sqrt(96.0), false,
                                HeadTransform{});
  const HostMatrix hm = Encode(FloatType::kBFloat16, kN, kH, RandomNormal(rng, kN * kH, 1.0));
  const HostMatrix hr = Encode(FloatType::kBFloat16, kN, kH, RandomNormal(rng, kN * kH, 1.0));
  const std::vector<int32_t> ids = RandomTargets(rng, kN, 2, kVocab, -100, 0.2);
  const size_t bytes = hm.bytes.size();
  std::vector<BackendFactory> layouts = {CudaDevicesFactory("one_gpu", {0})};
  layouts.push_back(BackendFactory{"one_gpu_one_gemm_stream", [] {
                                     CudaBackendOptions o;
                                     o.hidden_fused_max_hidden = 0;
                                     o.devices = {0};
                                     o.hidden_gemm_streams = 1;
                                     return CreateCudaBackend(o);
                                   }});
  layouts.push_back(BackendFactory{"one_gpu_no_prestage", [] {
                                     CudaBackendOptions o;
                                     o.hidden_fused_max_hidden = 0;
                                     o.devices = {0};
                                     o.prestage_bytes = 0;
                                     return CreateCudaBackend(o);
                                   }});
  for (int slots : {1, 3}) {
    layouts.push_back(BackendFactory{"one_gpu_slots_" + std::to_string(slots), [slots] {
                                       CudaBackendOptions o;
                                       o.hidden_fused_max_hidden = 0;
                                       o.devices = {0};
                                       o.hidden_slots = slots;
                                       return CreateCudaBackend(o);
                                     }});
  }
  if (VisibleCudaDevices() >= 2) layouts.push_back(CudaDevicesFactory("two_gpus", {0, 1}));
  void* pinned_m = nullptr;
  void* pinned_r = nullptr;
  void* dev_m = nullptr;
  void* dev_r = nullptr;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(&pinned_m, bytes), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(&pinned_r, bytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dev_m, bytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dev_r, bytes), cudaSuccess);
  std::memcpy(pinned_m, hm.bytes.data(), bytes);
  std::memcpy(pinned_r, hr.bytes.data(), bytes);
  ASSERT_EQ(cudaMemcpy(dev_m, hm.bytes.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dev_r, hr.bytes.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  for (bool jsd : {false, true}) {
    SCOPED_TRACE(jsd ? "with a JSD pass" : "without a JSD pass");
    std::unique_ptr<ScoreResult> baseline;
    for (const BackendFactory& f : layouts) {
      SCOPED_TRACE(f.name);
      std::unique_ptr<Backend> b = MustCreate(f);
      ASSERT_NE(b, nullptr);
      absl::StatusOr<std::shared_ptr<const PreparedHead>> model = b->PrepareHead(model_w);
      absl::StatusOr<std::shared_ptr<const PreparedHead>> ref = b->PrepareHead(ref_w);
      ASSERT_TRUE(model.ok()) << model.status();
      ASSERT_TRUE(ref.ok()) << ref.status();
      OwnedJob j;
      j.SetModelHidden(*model, Share(hm)).SetReferenceHidden(*ref, Share(hr));
      if (jsd) {
        j.WithEverything(ids, 2, 3, 0.3f);
      } else {
        j.WithTargets(ids, 2)
            .WithTopK(3)
            .WithEntropy()
            .WithReferenceEntropy()
            .WithForwardKl()
            .WithReverseKl();
      }
      LOGITSERVE_ASSERT_SCORE(pageable, *b, j.job);
      if (baseline == nullptr) {
        // Rows on either side of the tile boundaries against the fp64 reference.
        for (int64_t r : {int64_t{0}, kCudaRowTile - 1, kCudaRowTile, 2 * kCudaRowTile, kN - 1}) {
          SCOPED_TRACE("row " + std::to_string(r));
          ScoreJob row = j.job;
          row.rows = 1;
          row.model.hidden.rows = row.reference.hidden.rows = 1;
          row.model.hidden.data = hm.bytes.data() + r * kH * 2;
          row.reference.hidden.data = hr.bytes.data() + r * kH * 2;
          row.target_ids.assign(ids.begin() + r * 2, ids.begin() + r * 2 + 2);
          LOGITSERVE_ASSERT_SCORE(alone, *b, row);
          ExpectMatchesReference(row, alone);
          ExpectRowBitwiseEqual(alone, 0, pageable, r, 2, 3);
        }
        baseline = std::make_unique<ScoreResult>(pageable);
      } else {
        ExpectBitwiseEqual(pageable, *baseline);
      }
      for (auto [name, m, r] : {std::tuple<const char*, void*, void*>{"pinned", pinned_m, pinned_r},
                                {"on GPU 0", dev_m, dev_r}}) {
        SCOPED_TRACE(name);
        ScoreJob moved = j.job;
        moved.model.hidden.data = m;
        moved.reference.hidden.data = r;
        LOGITSERVE_ASSERT_SCORE(got, *b, moved);
        ExpectBitwiseEqual(got, *baseline);
      }
    }
  }
  cudaFreeHost(pinned_m);
  cudaFreeHost(pinned_r);
  cudaFree(dev_m);
  cudaFree(dev_r);
}

// The tile GEMM of a whole slot (CudaBackendOptions::hidden_slot_gemms): the pinned algorithm run
// on fewer columns (a head shard's last slot) or fewer rows (the short tiles) gives every output
// element the bits the full shape gives it, and those are the fp64 dot products to within the
// fp32 accumulation bound. Three chunks a slot, so both narrower column counts run.
TEST(CudaTileGemmTest, FewerColumnsAndRowsKeepEveryElementsBits) {
  constexpr int64_t kK = 200, kCols = 3 * kCudaVocabChunk, kRows = kCudaRowTile;
  std::mt19937_64 rng(53);
  // bf16 inputs from normal values: their products are exact in fp32, their sums round, so the
  // bits depend on the summation order.
  const HostMatrix w = Encode(FloatType::kBFloat16, kCols, kK, RandomNormal(rng, kCols * kK, 1.0));
  const HostMatrix x = Encode(FloatType::kBFloat16, kRows, kK, RandomNormal(rng, kRows * kK, 1.0));
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cublasLtHandle_t lt = nullptr;
  ASSERT_EQ(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
  absl::StatusOr<std::unique_ptr<CudaTileGemm>> gemm =
      CudaTileGemm::Create(lt, kK, TileGemmShape{kRows, kCols, kCols});
  ASSERT_TRUE(gemm.ok()) << gemm.status();
  const CudaTileGemm& g = **gemm;
  DeviceArray<uint16_t> dw(static_cast<size_t>(kCols * kK)), dx(static_cast<size_t>(kRows * kK));
  ASSERT_CUDA(cudaMemcpy(dw.get(), w.bytes.data(), w.bytes.size(), cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(dx.get(), x.bytes.data(), x.bytes.size(), cudaMemcpyHostToDevice));
  DeviceArray<uint8_t> workspace(kCublasWorkspaceBytes);
  const size_t out_elems = static_cast<size_t>(kRows * kCols);
  DeviceArray<float> full(out_elems), pieces(out_elems);
  ASSERT_TRUE(g.Run(lt, dw.get(), dx.get(), full.get(), false, workspace.get(), nullptr).ok());
  // Columns [0, 8192) alone, then [8192, 24576) as one GEMM of two chunks.
  ASSERT_TRUE(g.Run(lt, dw.get(), dx.get(), pieces.get(), false, workspace.get(), nullptr, 0,
                    kCudaVocabChunk)
                  .ok());
  ASSERT_TRUE(g.Run(lt, dw.get() + kCudaVocabChunk * kK, dx.get(), pieces.get() + kCudaVocabChunk,
                    false, workspace.get(), nullptr, 0, 2 * kCudaVocabChunk)
                  .ok());
  ASSERT_CUDA(cudaDeviceSynchronize());
  const std::vector<float> f = full.ToHost(), p = pieces.ToHost();
  int64_t differing = 0;
  for (size_t i = 0; i < out_elems; ++i) differing += SameBits(f[i], p[i]) ? 0 : 1;
  EXPECT_EQ(differing, 0) << "of " << out_elems << " elements";
  // A short tile of the first rows, every column count.
  int short_tiles = 0;
  for (const int64_t rows : kCudaShortRowTiles) {
    if (!g.Runs(rows)) continue;
    ++short_tiles;
    SCOPED_TRACE(std::to_string(rows) + " rows");
    DeviceArray<float> tile(out_elems);
    ASSERT_TRUE(g.Run(lt, dw.get(), dx.get(), tile.get(), false, workspace.get(), nullptr, rows,
                      kCudaVocabChunk)
                    .ok());
    ASSERT_TRUE(g.Run(lt, dw.get() + kCudaVocabChunk * kK, dx.get(), tile.get() + kCudaVocabChunk,
                      false, workspace.get(), nullptr, rows, 2 * kCudaVocabChunk)
                    .ok());
    ASSERT_CUDA(cudaDeviceSynchronize());
    const std::vector<float> t = tile.ToHost();
    int64_t diff = 0;
    for (size_t i = 0; i < static_cast<size_t>(rows * kCols); ++i)
      diff += SameBits(f[i], t[i]) ? 0 : 1;
    EXPECT_EQ(diff, 0);
  }
  EXPECT_GT(short_tiles, 0) << g.description();
  // RowsFor: an accepted row count that holds n, with no shorter accepted one that does.
  for (const int64_t n : {int64_t{1}, int64_t{128}, int64_t{129}, int64_t{700}, kRows - 1, kRows}) {
    const int64_t rows = g.RowsFor(n);
    EXPECT_GE(rows, n);
    EXPECT_TRUE(g.Runs(rows)) << rows;
    for (const int64_t t : kCudaShortRowTiles) {
      if (t >= n && t < rows) {
        EXPECT_FALSE(g.Runs(t)) << n << " rows fit the accepted " << t;
      }
    }
  }
  // Sampled elements against fp64: fp32 sums of exact products, |error| <= k u sum |w x|, twice
  // that since the tensor cores' additions may truncate rather than round.
  auto value = [](const HostMatrix& m, int64_t i) {
    uint16_t bits;
    std::memcpy(&bits, m.bytes.data() + 2 * i, 2);
    return static_cast<double>(kernels::BFloat16ToFloat(bits));
  };
  for (int s = 0; s < 2000; ++s) {
    const int64_t r = static_cast<int64_t>(rng() % kRows), c = static_cast<int64_t>(rng() % kCols);
    double exact = 0, magnitude = 0;
    for (int64_t q = 0; q < kK; ++q) {
      const double prod = value(w, c * kK + q) * value(x, r * kK + q);
      exact += prod;
      magnitude += std::abs(prod);
    }
    const double got = f[static_cast<size_t>(r * kCols + c)];
    ASSERT_LE(std::abs(got - exact), 2 * kK * kU * magnitude) << "row " << r << ", column " << c;
  }
  cublasLtDestroy(lt);
}

// ---- errors --------------------------------------------------------------------------------

TEST(CudaErrors, NaNAndInfMessagesMatchCpu) {
  constexpr int64_t kN = 40, kVocab = 5000;
  std::mt19937_64 rng(37);
  std::vector<float> m = RandomNormal(rng, kN * kVocab, 3.0), r = m;
  m[29 * kVocab + 4000] = std::numeric_limits<float>::quiet_NaN();
  m[33 * kVocab + 10] = kInf;
  r[17 * kVocab + 2] = kInf;
  std::unique_ptr<Backend> gpu = MustCreate(CudaFactory("cuda_all_gpus", 0, {}, 0));
  std::unique_ptr<Backend> cpu = Cpu();
  ASSERT_NE(gpu, nullptr);
  for (bool with_ref : {false, true}) {
    SCOPED_TRACE(with_ref ? "model + reference" : "model only");
    OwnedJob j;
    j.SetModelLogits(Share(Encode(FloatType::kFloat32, kN, kVocab, m)));
    if (with_ref) {
      j.SetReferenceLogits(Share(Encode(FloatType::kFloat32, kN, kVocab, r))).WithForwardKl();
    } else {
      j.WithEntropy();
    }
    const absl::StatusOr<ScoreResult> g = RunJob(*gpu, j.job);
    const absl::StatusOr<ScoreResult> c = RunJob(*cpu, j.job);
    ASSERT_FALSE(g.ok());
    ASSERT_FALSE(c.ok());
    EXPECT_EQ(g.status(), c.status());
    EXPECT_NE(std::string(g.status().message()).find(with_ref ? "row 17" : "row 29"),
              std::string::npos)
        << g.status();
  }
  {
    SCOPED_TRACE("hidden state overflow");
    auto w = RandomHead(rng, 300, 16, FloatType::kFloat32, 1.0, false, HeadTransform{});
    w->weight = Encode(FloatType::kFloat32, 300, 16, std::vector<float>(300 * 16, 1.0f)).bytes;
    auto gh = gpu->PrepareHead(w);
    auto ch = cpu->PrepareHead(w);
    ASSERT_TRUE(gh.ok() && ch.ok());
    std::vector<float> hs = RandomNormal(rng, 20 * 16, 1.0);
    for (int i = 0; i < 16; ++i) hs[13 * 16 + i] = 3e38f;
    const SharedMatrix h = Share(Encode(FloatType::kFloat32, 20, 16, hs));
    OwnedJob jg, jc;
    jg.SetModelHidden(*gh, h).WithEntropy();
    jc.SetModelHidden(*ch, h).WithEntropy();
    const absl::StatusOr<ScoreResult> g = RunJob(*gpu, jg.job);
    const absl::StatusOr<ScoreResult> c = RunJob(*cpu, jc.job);
    ASSERT_FALSE(g.ok());
    EXPECT_EQ(g.status(), c.status());
  }
}

// One rank failing (an injected error at one of its checkpoints) stops every rank at that same
// checkpoint: the job returns the failing rank's own error instead of hanging in a collective,
// and the backend then serves the next job with the bits of a backend that never failed.
TEST(CudaErrors, OneRankFailingStopsEveryRankAndTheBackendRecovers) {
  constexpr int64_t kVocab = 5000;  // shards [0, 2048) and [2048, 5000)
  constexpr int64_t kTileRows = 4;
  std::mt19937_64 rng(41);
  auto job_of = [](const LogitsPair& in, const std::vector<int32_t>& ids) {
    OwnedJob j;
    j.SetModelLogits(in.model).SetReferenceLogits(in.reference).WithEverything(ids, 2, 3, 0.3f);
    return j;
  };
  const LogitsPair big =
      MakeLogitsPair(rng, FloatType::kBFloat16, 4 * kTileRows, kVocab, kLogitStd);
  const std::vector<int32_t> big_ids = RandomTargets(rng, 4 * kTileRows, 2, kVocab, -100, 0.2);
  const LogitsPair small = MakeLogitsPair(rng, FloatType::kBFloat16, kTileRows, kVocab, kLogitStd);
  const std::vector<int32_t> small_ids = RandomTargets(rng, kTileRows, 2, kVocab, -100, 0.2);
  const OwnedJob big_job = job_of(big, big_ids);
  const OwnedJob small_job = job_of(small, small_ids);
  auto options = [&](int fail_rank, int64_t fail_step) {
    CudaBackendOptions o;
    o.shards = 2;
    o.devices = VisibleCudaDevices() >= 2 ? std::vector<int>{0, 1} : std::vector<int>{0};
    // Staging for kTileRows rows of the widest shard (2952 ids) of both bf16 distributions.
    o.logits_staging_bytes = static_cast<size_t>(kTileRows * 2952 * 2 * 2);
    o.test_fail_rank = fail_rank;
    o.test_fail_step = fail_step;
    return o;
  };
  absl::StatusOr<std::unique_ptr<Backend>> clean = CreateCudaBackend(options(-1, -1));
  ASSERT_TRUE(clean.ok()) << clean.status();
  LOGITSERVE_ASSERT_SCORE(expected, **clean, small_job.job);
  // The JSD pass makes two checkpoints per tile: 4 tiles of the big job give steps 0..7; the
  // small job (one tile) reaches steps 0 and 1 only.
  for (int fail_rank : {0, 1}) {
    for (int64_t fail_step : {0, 1, 2, 5, 7}) {
      SCOPED_TRACE("rank " + std::to_string(fail_rank) + " fails at checkpoint " +
                   std::to_string(fail_step));
      absl::StatusOr<std::unique_ptr<Backend>> b = CreateCudaBackend(options(fail_rank, fail_step));
      ASSERT_TRUE(b.ok()) << b.status();
      const absl::StatusOr<ScoreResult> failed = RunJob(**b, big_job.job);
      ASSERT_FALSE(failed.ok());
      EXPECT_EQ(failed.status().code(), absl::StatusCode::kInternal) << failed.status();
      EXPECT_NE(std::string(failed.status().message()).find("injected"), std::string::npos)
          << failed.status();
      if (fail_step >= 2) {
        LOGITSERVE_ASSERT_SCORE(after, **b, small_job.job);
        ExpectBitwiseEqual(after, expected);
      }
    }
  }
}

// A stop (job.stop turning CANCELLED or DEADLINE_EXCEEDED) is checked before every row tile on
// every rank: the job ends at that tile on every rank with the stop's own status (not ABORTED),
// no later tile starts (the callback is called exactly once per tile per rank up to the stopping
// tile), and the backend then serves the next job with the bits it gave before. One rank (one
// GPU) and two ranks (two GPUs through NCCL when visible, else two shards on GPU 0); logits mode
// with a JSD pass (two checkpoints per tile) and hidden mode.
TEST(CudaErrors, StopBeforeARowTileEndsTheJobOnEveryRankAndTheBackendRecovers) {
  constexpr int64_t kVocab = 5000;  // two shards: [0, 2048) and [2048, 5000)
  constexpr int64_t kTileRows = 4, kTiles = 4;
  constexpr int64_t kHidden = 64, kHiddenRows = 3 * kCudaRowTile - 100;  // 3 tiles
  std::mt19937_64 rng(43);
  const LogitsPair big =
      MakeLogitsPair(rng, FloatType::kBFloat16, kTiles * kTileRows, kVocab, kLogitStd);
  const std::vector<int32_t> big_ids = RandomTargets(rng, kTiles * kTileRows, 2, kVocab, -100, 0.2);
  const LogitsPair small = MakeLogitsPair(rng, FloatType::kBFloat16, kTileRows, kVocab, kLogitStd);
  const std::vector<int32_t> small_ids = RandomTargets(rng, kTileRows, 2, kVocab, -100, 0.2);
  const auto head_w =
      RandomHead(rng, kVocab, kHidden, FloatType::kBFloat16, 3.0 / 8.0, false, HeadTransform{});
  const SharedMatrix hidden = Share(Encode(FloatType::kBFloat16, kHiddenRows, kHidden,
                                           RandomNormal(rng, kHiddenRows * kHidden, 1.0)));
  const std::vector<int32_t> hidden_ids = RandomTargets(rng, kHiddenRows, 1, kVocab, -100, 0.2);
  OwnedJob small_job;
  small_job.SetModelLogits(small.model)
      .SetReferenceLogits(small.reference)
      .WithEverything(small_ids, 2, 3, 0.3f);

  struct Config {
    std::string name;
    int shards;
    std::vector<int> devices;
    int64_t widest;  // ids in the widest shard
  };
  std::vector<Config> configs = {{"one_gpu", 1, {0}, kVocab}};
  if (VisibleCudaDevices() >= 2) {
    configs.push_back({"two_gpus_nccl", 2, {0, 1}, 2952});
  } else {
    configs.push_back({"two_shards_one_gpu", 2, {0}, 2952});
  }
  for (const Config& c : configs) {
    SCOPED_TRACE(c.name);
    CudaBackendOptions o;
    o.shards = c.shards;
    o.devices = c.devices;
    // Staging for exactly kTileRows rows of the widest shard (ids rounded up to 8) of two bf16
    // distributions: kTiles tiles.
    o.logits_staging_bytes = static_cast<size_t>(kTileRows * RoundUpTo8(c.widest) * 2 * 2);
    // The hidden workload's three row tiles, on either hidden-mode path (the fused kernel's own
    // default tile is larger).
    o.hidden_fused_tile_rows = kCudaRowTile;
    absl::StatusOr<std::unique_ptr<Backend>> made = CreateCudaBackend(o);
    ASSERT_TRUE(made.ok()) << made.status();
    Backend& b = **made;
    absl::StatusOr<std::shared_ptr<const PreparedHead>> head = b.PrepareHead(head_w);
    ASSERT_TRUE(head.ok()) << head.status();
    LOGITSERVE_ASSERT_SCORE(expected, b, small_job.job);

    struct Workload {
      std::string name;
      OwnedJob job;
      int64_t tiles;
    };
    std::vector<Workload> workloads;
    {
      OwnedJob j;
      j.SetModelLogits(big.model)
          .SetReferenceLogits(big.reference)
          .WithEverything(big_ids, 2, 3, 0.3f);
      workloads.push_back({"logits_with_jsd", j, kTiles});
      OwnedJob h;
      h.SetModelHidden(*head, hidden).WithTargets(hidden_ids, 1).WithTopK(2).WithEntropy();
      workloads.push_back({"hidden", h, 3});
    }
    for (Workload& w : workloads) {
      SCOPED_TRACE(w.name);
      // Not stopped: one call per tile per rank, before it.
      {
        std::atomic<int64_t> calls{0};
        w.job.job.stop = [&calls](int64_t) {
          ++calls;
          return absl::OkStatus();
        };
        const absl::StatusOr<ScoreResult> done = RunJob(b, w.job.job);
        ASSERT_TRUE(done.ok()) << done.status();
        EXPECT_EQ(calls.load(), w.tiles * c.shards);
      }
      for (int64_t k : {int64_t{0}, int64_t{1}, w.tiles - 1}) {
        for (absl::StatusCode code :
             {absl::StatusCode::kCancelled, absl::StatusCode::kDeadlineExceeded}) {
          SCOPED_TRACE("stop at tile " + std::to_string(k) + " with " +
                       absl::StatusCodeToString(code));
          std::atomic<int64_t> calls{0};
          const int64_t ok_calls = k * c.shards;
          w.job.job.stop = [&calls, ok_calls, code](int64_t) {
            return ++calls > ok_calls ? absl::Status(code, "stopped by the test")
                                      : absl::OkStatus();
          };
          const absl::StatusOr<ScoreResult> stopped = RunJob(b, w.job.job);
          ASSERT_FALSE(stopped.ok());
          EXPECT_EQ(stopped.status().code(), code) << stopped.status();
          EXPECT_EQ(stopped.status().message(), "stopped by the test");
          // Every rank checked tile k (and stopped there); none reached tile k + 1.
          EXPECT_EQ(calls.load(), (k + 1) * c.shards);
          EXPECT_TRUE(b.Health().ok()) << b.Health();
          LOGITSERVE_ASSERT_SCORE(after, b, small_job.job);
          ExpectBitwiseEqual(after, expected);
        }
      }
      w.job.job.stop = nullptr;
    }
  }
}

TEST(CudaBackendSetup, DevicesAndOptions) {
  EXPECT_TRUE(CheckCudaDevices().ok()) << CheckCudaDevices();
  std::printf("[ gpu       ] built for CUDA architectures %s\n", CudaArchitecturesBuilt());
  CudaBackendOptions bad;
  bad.devices = {VisibleCudaDevices()};
  EXPECT_EQ(CreateCudaBackend(bad).status().code(), absl::StatusCode::kInvalidArgument);
  CudaBackendOptions twice;
  twice.devices = {0, 0};
  EXPECT_EQ(CreateCudaBackend(twice).status().code(), absl::StatusCode::kInvalidArgument);
  CudaBackendOptions streams;
  streams.hidden_gemm_streams = 3;
  EXPECT_EQ(CreateCudaBackend(streams).status().code(), absl::StatusCode::kInvalidArgument);
  for (int candidate : {-2, 32}) {
    CudaBackendOptions algo;
    algo.hidden_gemm_candidate = candidate;
    EXPECT_EQ(CreateCudaBackend(algo).status().code(), absl::StatusCode::kInvalidArgument)
        << candidate;
  }
  for (int slots : {0, 5}) {
    CudaBackendOptions o;
    o.hidden_slots = slots;
    EXPECT_EQ(CreateCudaBackend(o).status().code(), absl::StatusCode::kInvalidArgument) << slots;
  }
  CudaBackendOptions stats_sms;
  stats_sms.hidden_stats_sms = -2;
  EXPECT_EQ(CreateCudaBackend(stats_sms).status().code(), absl::StatusCode::kInvalidArgument);
  std::unique_ptr<Backend> b = MustCreate(CudaFactory("cuda_all_gpus", 0, {}, 0));
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->name(), "cuda");
}

}  // namespace
}  // namespace logitserve::testing
