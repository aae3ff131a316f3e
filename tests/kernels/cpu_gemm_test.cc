// The CPU backend's two hidden-mode GEMM precisions (server/backend/cpu/cpu_tile_gemm.h): fp32,
// and bf16 operands as exact bf16 parts where oneDNN has native bf16 matmuls (AVX512-BF16). Both
// against the fp64 reference, and the bf16 form's claim that leaving out a part that is zero
// throughout a row tile changes no bit: a row's bits do not depend on the parts its tile
// companions need.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/cpu/cpu_tile_gemm.h"
#include "tests/kernels/expect_reference.h"
#include "tests/kernels/job_builder.h"

namespace logitserve::testing {
namespace {

constexpr int64_t kHidden = 96;
constexpr int64_t kVocab = 5000;  // two full blocks and a short one

std::unique_ptr<Backend> MakeBackend(CpuGemm gemm, int shards = 1, int threads = 2) {
  CpuBackendOptions o;
  o.threads = threads;
  o.shards = shards;
  o.gemm = gemm;
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateCpuBackend(o);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? *std::move(b) : nullptr;
}

std::shared_ptr<const PreparedHead> Prepare(Backend& backend, std::shared_ptr<HeadWeights> w) {
  absl::StatusOr<std::shared_ptr<const PreparedHead>> p = backend.PrepareHead(std::move(w));
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *p : nullptr;
}

std::string Describe(CpuGemm gemm) {
  if (gemm == CpuGemm::kFp32) return "fp32 GEMM";
  return CpuHasNativeBf16Gemm() ? "auto = bf16 GEMM" : "auto = fp32 GEMM (no native bf16 here)";
}

// Both precisions, weight / hidden dtype pairs that take one to three bf16 parts on either side,
// every output against the fp64 reference, on one shard and (bf16) two.
TEST(CpuGemm, BothPrecisionsMatchReference) {
  struct Case {
    FloatType w, h;
    int shards;
  };
  const Case cases[] = {{FloatType::kBFloat16, FloatType::kBFloat16, 1},
                        {FloatType::kBFloat16, FloatType::kBFloat16, 2},
                        {FloatType::kFloat16, FloatType::kFloat16, 1},
                        {FloatType::kFloat32, FloatType::kFloat32, 1},
                        {FloatType::kBFloat16, FloatType::kFloat32, 1},
                        {FloatType::kFloat32, FloatType::kBFloat16, 1}};
  for (CpuGemm gemm : {CpuGemm::kAuto, CpuGemm::kFp32}) {
    SCOPED_TRACE(Describe(gemm));
    for (const Case& c : cases) {
      SCOPED_TRACE(std::to_string(c.shards) + " shards, W " + DTypeName(c.w) + ", h " +
                   DTypeName(c.h));
      std::unique_ptr<Backend> backend = MakeBackend(gemm, c.shards);
      ASSERT_NE(backend, nullptr);
      std::mt19937_64 rng(77 + static_cast<uint64_t>(c.w) * 5 + static_cast<uint64_t>(c.h));
      const double w_std = 3.0 / std::sqrt(static_cast<double>(kHidden));
      HeadTransform t;
      auto model = Prepare(*backend, RandomHead(rng, kVocab, kHidden, c.w, w_std, true, t));
      auto ref = Prepare(*backend,
                         RandomHead(rng, kVocab, kHidden, FloatType::kBFloat16, w_std, false, t));
      ASSERT_NE(model, nullptr);
      ASSERT_NE(ref, nullptr);
      const int64_t n = kGemmRows + kGemmRows / 3;  // a full GEMM of rows and a short one
      OwnedJob j;
      j.SetModelHidden(model, Share(Encode(c.h, n, kHidden, RandomNormal(rng, n * kHidden, 1.0))))
          .SetReferenceHidden(ref,
                              Share(Encode(c.h, n, kHidden, RandomNormal(rng, n * kHidden, 1.0))));
      j.WithEverything(RandomTargets(rng, n, 2, kVocab, -100, 0.1), 2, 4, 0.4f);
      LOGITSERVE_ASSERT_SCORE(got, *backend, j.job);
      ExpectMatchesReference(j.job, got);
    }
  }
}

// bf16 GEMM only: row r's hidden states are bf16 values (one non-zero part) given as fp32. Alone,
// its tile runs one GEMM per weight part; among rows of full fp32 values (three parts), its tile
// runs three, whose extra products are exactly +0 for row r. Its bits must not change; nor those
// of an all-zero row (every part zero: no GEMM at all when alone).
TEST(CpuGemm, Bf16RowBitsDoNotDependOnTheTilesParts) {
  if (!CpuHasNativeBf16Gemm()) {
    GTEST_SKIP() << "this CPU has no native bf16 matmul: the backend runs fp32 GEMMs only";
  }
  std::unique_ptr<Backend> backend = MakeBackend(CpuGemm::kAuto);
  ASSERT_NE(backend, nullptr);
  for (FloatType w : {FloatType::kBFloat16, FloatType::kFloat32}) {
    SCOPED_TRACE("W " + DTypeName(w));
    std::mt19937_64 rng(91 + static_cast<uint64_t>(w));
    auto head = Prepare(
        *backend, RandomHead(rng, kVocab, kHidden, w, 3.0 / std::sqrt(static_cast<double>(kHidden)),
                             true, HeadTransform{}));
    ASSERT_NE(head, nullptr);
    std::vector<float> bf16_row = RandomNormal(rng, kHidden, 1.0);
    for (float& x : bf16_row) x = RoundTo(FloatType::kBFloat16, x);
    const std::vector<float> zero_row(kHidden, 0.0f);
    // Tile companions: full fp32 values (RandomNormal's are not bf16-exact).
    const int64_t n = 64;
    std::vector<float> mixed = RandomNormal(rng, n * kHidden, 1.0);
    std::copy(bf16_row.begin(), bf16_row.end(), mixed.begin() + 17 * kHidden);
    std::copy(zero_row.begin(), zero_row.end(), mixed.begin() + 40 * kHidden);
    const std::vector<int32_t> ids = RandomTargets(rng, n, 1, kVocab, -100, 0.0);
    auto score = [&](const std::vector<float>& values, int64_t rows,
                     const std::vector<int32_t>& row_ids) {
      OwnedJob j;
      j.SetModelHidden(head, Share(Encode(FloatType::kFloat32, rows, kHidden, values)));
      j.WithTargets(row_ids, 1).WithTopK(3).WithEntropy();
      return j;
    };
    const OwnedJob batch = score(mixed, n, ids);
    LOGITSERVE_ASSERT_SCORE(all, *backend, batch.job);
    ExpectMatchesReference(batch.job, all);
    const OwnedJob alone = score(bf16_row, 1, {ids[17]});
    LOGITSERVE_ASSERT_SCORE(one, *backend, alone.job);
    ExpectRowBitwiseEqual(all, 17, one, 0, 1, 3);
    const OwnedJob zero = score(zero_row, 1, {ids[40]});
    LOGITSERVE_ASSERT_SCORE(z, *backend, zero.job);
    ExpectRowBitwiseEqual(all, 40, z, 0, 1, 3);
    ExpectMatchesReference(zero.job, z);  // logits = the bias alone
  }
}

// The threads of this process now (Linux: one entry per thread in /proc/self/task).
int ThreadsNow() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

// The most threads this process had while it lived (sampled every 50 us by a thread of its own,
// counted in), from its first sample on.
class ThreadSampler {
 public:
  ThreadSampler() : sampler_([this] { Run(); }) {
    while (most_.load() == 0) std::this_thread::yield();
  }
  ~ThreadSampler() { Stop(); }
  int Stop() {
    if (sampler_.joinable()) {
      stop_.store(true);
      sampler_.join();
    }
    return most_.load();
  }

 private:
  void Run() {
    while (!stop_.load()) {
      most_.store(std::max(most_.load(), ThreadsNow()));
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
  std::atomic<bool> stop_{false};
  std::atomic<int> most_{0};
  std::thread sampler_;
};

// A backend given one thread computes on one thread: no thread is started while it prepares a
// head or runs jobs (oneDNN's regions inside the backend's one-thread regions used to start a
// team of every core for each GEMM and each weight block's packing), and the caller's default
// OpenMP team size is its own again after.
TEST(CpuGemm, OneThreadBackendStartsNoThreads) {
  if (omp_get_num_procs() < 2) GTEST_SKIP() << "one core: a team of every core is one thread";
  for (int shards : {1, 2}) {  // two shards of one thread each: a rank thread, one thread a rank
    SCOPED_TRACE(std::to_string(shards) + " shards");
    std::unique_ptr<Backend> backend = MakeBackend(CpuGemm::kAuto, shards, /*threads=*/shards);
    ASSERT_NE(backend, nullptr);
    std::mt19937_64 rng(5);
    std::shared_ptr<HeadWeights> weights =
        RandomHead(rng, kVocab, kHidden, FloatType::kBFloat16,
                   3.0 / std::sqrt(static_cast<double>(kHidden)), false, HeadTransform{});
    const int64_t n = 2 * kGemmRows;
    const std::vector<float> hidden = RandomNormal(rng, n * kHidden, 1.0);
    const std::vector<int32_t> ids = RandomTargets(rng, n, 1, kVocab, -100, 0.0);
    const int team_before = omp_get_max_threads();
    ThreadSampler sampler;
    const int before = ThreadsNow();  // this thread, the sampler, and whatever ran earlier
    auto head = Prepare(*backend, std::move(weights));
    ASSERT_NE(head, nullptr);
    OwnedJob j;
    j.SetModelHidden(head, Share(Encode(FloatType::kBFloat16, n, kHidden, hidden)));
    j.WithTargets(ids, 1).WithEntropy();
    for (int i = 0; i < 5; ++i) {
      LOGITSERVE_ASSERT_SCORE(got, *backend, j.job);
      ExpectMatchesReference(j.job, got);
    }
    // Allowed: the head's preparation runs a team of --threads (= shards) threads, whose helpers
    // libgomp keeps, and each shard past the first runs on a thread of its own while a job lasts.
    EXPECT_LE(sampler.Stop(), before + (shards - 1) + (shards - 1)) << "threads were started";
    EXPECT_EQ(omp_get_max_threads(), team_before);
  }
}
}  // namespace
}  // namespace logitserve::testing
