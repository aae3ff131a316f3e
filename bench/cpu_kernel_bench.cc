// logitserve-cpu-bench: the CPU backend on raw fp32 logits against the machine's memory-read floor
// measured in the same run, and hidden mode against the bare oneDNN GEMM of the same shape. Also a
// correctness check: for 16 sample rows every output of the op is compared with the fp64
// reference (kernels/reference) and values outside tolerance are counted as #wrong (as
// nccl-tests does).
//
//   logitserve-cpu-bench [--rows 2048] [--vocab 32000] [--iters 5] [--threads 0] [--json FILE]
//                        [--no-logits] [--hidden 1024] [--hidden-rows 2048] [--hidden-vocab 32000]
//                        [--gemm auto|fp32]
//
// Logits mode. Floor: the time to read the op's input bytes once (one read for logprobs / entropy
// / top-k, two for KL and JSD, which take two logits tensors), at the bandwidth of a
// multi-threaded SIMD sum over the same buffers. Ratio = time / floor (1.0 is the hardware limit).
//
// Hidden mode (SPEC §9: <= 1.10x the bare oneDNN GEMM of the same shape, that GEMM at >= 80 % of
// the CPU's FMA peak): bf16 hidden states [N, H] and a bf16 head [V, H]; the backend scores
// logprobs + entropy, and policy + reference (two heads) logprobs + both entropies + forward KL.
// Floor: one oneDNN matmul [N, H] x [H, V] per head, on --threads, in the precision the backend
// runs (bf16 where oneDNN has native bf16 matmuls, else fp32; --gemm fp32 forces fp32 for both);
// the FMA peak is measured by independent FMA (fp32) / bf16 dot-product (vdpbf16ps) chains.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "hwy/highway.h"
#include "nlohmann/json.hpp"
#include "oneapi/dnnl/dnnl.hpp"
#include "server/backend/backend.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/cpu/cpu_tile_gemm.h"
#include "tests/reference/job_reference.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace hn = hwy::HWY_NAMESPACE;
using logitserve::ScoreJob;
using logitserve::ScoreResult;

namespace {

// Sum of a large buffer with `threads` threads; its bandwidth is the read floor.
float ParallelSum(const float* x, size_t n, int threads) {
  double total = 0.0;
#pragma omp parallel for num_threads(threads) reduction(+ : total) schedule(static)
  for (int64_t c = 0; c < static_cast<int64_t>(n / 4096); ++c) {
    const hn::ScalableTag<float> d;
    auto a0 = hn::Zero(d), a1 = hn::Zero(d), a2 = hn::Zero(d), a3 = hn::Zero(d);
    const float* p = x + c * 4096;
    const size_t l = hn::Lanes(d);
    for (size_t i = 0; i < 4096; i += 4 * l) {
      a0 = hn::Add(a0, hn::LoadU(d, p + i));
      a1 = hn::Add(a1, hn::LoadU(d, p + i + l));
      a2 = hn::Add(a2, hn::LoadU(d, p + i + 2 * l));
      a3 = hn::Add(a3, hn::LoadU(d, p + i + 3 * l));
    }
    total += hn::GetLane(hn::SumOfLanes(d, hn::Add(hn::Add(a0, a1), hn::Add(a2, a3))));
  }
  return static_cast<float>(total);
}

template <typename F>
double BestMs(int iters, F&& f) {
  double best = 1e30;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(
        best,
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

// |got - want| <= kAbsTol + kRelTol |want|. Rows hold 32000 N(0, 3) logits, |z| < 20: fp32
// rounding of z - M and of the sums over V terms gives errors ~ V eps |z| ~ 1e-3 worst case,
// typically 1e-5; the bound catches any real defect (a wrong or missing block is >= 1e-3).
constexpr double kAbsTol = 2e-4;
constexpr double kRelTol = 1e-5;

bool Close(double got, double want) {
  if (std::isnan(want) || std::isnan(got)) return std::isnan(want) && std::isnan(got);
  if (std::isinf(want) || std::isinf(got)) return got == want;
  return std::abs(got - want) <= kAbsTol + kRelTol * std::abs(want);
}

// Compares every requested output of 16 sample rows with the fp64 reference.
int CountWrong(const ScoreJob& job, const ScoreResult& r) {
  int wrong = 0;
  for (int64_t row = 0; row < job.rows; row += std::max<int64_t>(1, job.rows / 16)) {
    const auto ref = logitserve::reference::ScoreReferenceRow(job, row);
    const size_t i = static_cast<size_t>(row);
    for (int64_t j = 0; j < job.ids_per_row; ++j) {
      const size_t t = static_cast<size_t>(row * job.ids_per_row + j);
      wrong += !Close(r.target_logprobs[t], ref.target_logprobs[static_cast<size_t>(j)]);
    }
    for (int64_t j = 0; j < job.top_k; ++j) {
      const size_t t = static_cast<size_t>(row * job.top_k + j);
      wrong += !Close(r.top_k_logprobs[t], ref.top_k[static_cast<size_t>(j)].logprob);
    }
    if (job.entropy) wrong += !Close(r.entropy[i], ref.entropy);
    if (job.forward_kl) wrong += !Close(r.forward_kl[i], ref.forward_kl);
    if (job.reverse_kl) wrong += !Close(r.reverse_kl[i], ref.reverse_kl);
    if (job.jsd_beta) wrong += !Close(r.jsd[i], ref.jsd);
  }
  return wrong;
}

// The best time of `iters` Score calls of `job` and its #wrong; ms < 0 when Score failed (said on
// stderr under `name`).
struct Timed {
  double ms;
  int wrong;
};
Timed TimeScore(logitserve::Backend& backend, const ScoreJob& job, int iters,
                const std::string& name) {
  ScoreResult result;
  absl::Status status;
  const double ms = BestMs(iters, [&] { status = backend.Score(job, &result); });
  if (!status.ok()) {
    std::fprintf(stderr, "%s: %s\n", name.c_str(), status.ToString().c_str());
    return {-1.0, 0};
  }
  return {ms, CountWrong(job, result)};
}

// ---- Hidden mode -----------------------------------------------------------------------------

#if defined(__x86_64__)
// Sixteen independent chains of the widest multiply-add, each from its own opaque start (equal
// chains would be merged by the compiler), enough to cover the latency of two units: one
// thread's steps. Sixteen of 32 vector registers; no memory traffic.
volatile float chain_seed = 0.0f;
#define LOGITSERVE_X16(F) \
  F(a0)                   \
  F(a1) F(a2) F(a3) F(a4) F(a5) F(a6) F(a7) F(a8) F(a9) F(a10) F(a11) F(a12) F(a13) F(a14) F(a15)
#define LOGITSERVE_START16()                                                                    \
  const float f0 = chain_seed;                                                                  \
  __m512 a0 = _mm512_set1_ps(f0), a1 = _mm512_set1_ps(f0 + 1), a2 = _mm512_set1_ps(f0 + 2),     \
         a3 = _mm512_set1_ps(f0 + 3), a4 = _mm512_set1_ps(f0 + 4), a5 = _mm512_set1_ps(f0 + 5), \
         a6 = _mm512_set1_ps(f0 + 6), a7 = _mm512_set1_ps(f0 + 7), a8 = _mm512_set1_ps(f0 + 8), \
         a9 = _mm512_set1_ps(f0 + 9), a10 = _mm512_set1_ps(f0 + 10),                            \
         a11 = _mm512_set1_ps(f0 + 11), a12 = _mm512_set1_ps(f0 + 12),                          \
         a13 = _mm512_set1_ps(f0 + 13), a14 = _mm512_set1_ps(f0 + 14),                          \
         a15 = _mm512_set1_ps(f0 + 15)
#define LOGITSERVE_ADD(x) s = _mm512_add_ps(s, x);
// A function `name` compiled for `isa` that runs `iters` steps of `step` (a statement on x) on the
// sixteen chains, after `setup`. The lanes are summed from memory: gcc 12 warns of an
// uninitialised operand inside _mm512_reduce_add_ps (a false positive, printed in CI's build).
#define LOGITSERVE_CHAINS(name, isa, setup, step)          \
  __attribute__((target(isa))) float name(int64_t iters) { \
    LOGITSERVE_START16();                                  \
    setup;                                                 \
    for (int64_t i = 0; i < iters; ++i) {                  \
      LOGITSERVE_X16(step)                                 \
    }                                                      \
    __m512 s = _mm512_setzero_ps();                        \
    LOGITSERVE_X16(LOGITSERVE_ADD)                         \
    alignas(64) float lanes[16];                           \
    _mm512_store_ps(lanes, s);                             \
    float sum = 0.0f;                                      \
    for (const float v : lanes) sum += v;                  \
    return sum;                                            \
  }
#define LOGITSERVE_FMA(x) x = _mm512_fmadd_ps(x, b, c);
#define LOGITSERVE_DOT(x) x = _mm512_dpbf16_ps(x, bh, ch);
LOGITSERVE_CHAINS(Fp32FmaChains, "avx512f", const __m512 b = _mm512_set1_ps(0.999999f);
                  const __m512 c = _mm512_set1_ps(1e-7f), LOGITSERVE_FMA)
LOGITSERVE_CHAINS(Bf16DotChains, "avx512f,avx512bf16",
                  const __m512bh bh = (__m512bh)_mm512_set1_epi16(0x3f80);
                  const __m512bh ch = (__m512bh)_mm512_set1_epi16(0x3c00), LOGITSERVE_DOT)
#endif

// The peak FLOP/s of `threads` threads running `chains` (flops_per_step per iteration), best of 3.
template <typename Chains>
double PeakGflops(int threads, double flops_per_step, Chains chains) {
  constexpr int64_t kIters = 10'000'000;
  double best = 0.0;
  for (int rep = 0; rep < 3; ++rep) {
    volatile float sink = 0.0f;
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
    {
      const float r = chains(kIters);
#pragma omp critical
      sink = sink + r;
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, flops_per_step * static_cast<double>(kIters) * threads / s / 1e9);
  }
  return best;
}

// Best ms of one oneDNN matmul [m, k] x [k, n] -> fp32 (weights pre-packed), on the default
// team (main sets it to --threads).
double BareGemmMs(bool bf16, int64_t m, int64_t k, int64_t n, int iters) {
  using dnnl::memory;
  const auto in = bf16 ? memory::data_type::bf16 : memory::data_type::f32;
  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(eng);
  const memory::desc a_md({m, k}, in, memory::dims{k, 1});
  const memory::desc w_md({k, n}, in, memory::format_tag::any);
  const memory::desc c_md({m, n}, memory::data_type::f32, memory::dims{n, 1});
  const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, w_md, c_md), eng);
  memory a(a_md, eng), w(pd.weights_desc(), eng), c(c_md, eng);
  // Small values (bf16 0.5 / fp32 0.5): no denormals, no overflow; the time does not depend on
  // them.
  if (bf16) {
    std::fill_n(static_cast<uint16_t*>(a.get_data_handle()), a_md.get_size() / 2, 0x3f00);
    std::fill_n(static_cast<uint16_t*>(w.get_data_handle()), pd.weights_desc().get_size() / 2,
                0x3f00);
  } else {
    std::fill_n(static_cast<float*>(a.get_data_handle()), a_md.get_size() / 4, 0.5f);
    std::fill_n(static_cast<float*>(w.get_data_handle()), pd.weights_desc().get_size() / 4, 0.5f);
  }
  const dnnl::matmul mm(pd);
  return BestMs(iters, [&] {
    mm.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DST, c}});
    stream.wait();
  });
}

// A bf16 matrix of normal(0, stddev) values (bits), rounded to nearest even.
std::vector<uint8_t> Bf16Normal(std::mt19937_64& rng, int64_t count, float stddev) {
  std::normal_distribution<float> nd(0.0f, stddev);
  std::vector<uint8_t> out(static_cast<size_t>(count) * 2);
  auto* bits = reinterpret_cast<uint16_t*>(out.data());
  for (int64_t i = 0; i < count; ++i) bits[i] = logitserve::kernels::FloatToBFloat16(nd(rng));
  return out;
}

int RunHidden(int64_t rows, int64_t hidden, int64_t vocab, int iters, int threads,
              logitserve::CpuGemm gemm, nlohmann::json* out) {
  using logitserve::kernels::FloatType;
  const bool bf16 = gemm == logitserve::CpuGemm::kAuto && logitserve::CpuHasNativeBf16Gemm();
  double fp32_peak = 0.0, bf16_peak = 0.0;
#if defined(__x86_64__)
  if (__builtin_cpu_supports("avx512f")) fp32_peak = PeakGflops(threads, 16 * 32, Fp32FmaChains);
  if (__builtin_cpu_supports("avx512bf16")) {
    bf16_peak = PeakGflops(threads, 16 * 64, Bf16DotChains);
  }
#endif
  const double peak = bf16 ? bf16_peak : fp32_peak;
  // The floor is timed before and after the backend's runs and the faster kept (the clock of a
  // busy CPU drifts between phases).
  double gemm_ms = BareGemmMs(bf16, rows, hidden, vocab, iters);
  const double gflop = 2.0 * static_cast<double>(rows) * hidden * vocab / 1e9;
  std::printf("\nhidden mode: N %ld, H %ld, V %ld, bf16 hidden states and heads, %d threads\n",
              static_cast<long>(rows), static_cast<long>(hidden), static_cast<long>(vocab),
              threads);
  std::printf("FMA peak (measured): fp32 %.0f GFLOP/s, bf16 dot %.0f GFLOP/s%s\n", fp32_peak,
              bf16_peak, fp32_peak == 0.0 ? " (no AVX-512 here: not measured)" : "");

  logitserve::CpuBackendOptions options;
  options.threads = threads;
  options.gemm = gemm;
  auto backend = logitserve::CreateCpuBackend(options);
  if (!backend.ok()) {
    std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
    return -1;
  }
  std::mt19937_64 rng(11);
  auto make_head = [&](const char* name) {
    auto w = std::make_shared<logitserve::HeadWeights>();
    w->name = name;
    w->vocab_size = vocab;
    w->hidden_size = hidden;
    w->dtype = FloatType::kBFloat16;
    w->weight = Bf16Normal(rng, vocab * hidden, 3.0f / std::sqrt(static_cast<float>(hidden)));
    return (*backend)->PrepareHead(std::move(w));
  };
  auto policy = make_head("policy");
  auto reference = make_head("reference");
  if (!policy.ok() || !reference.ok()) {
    std::fprintf(stderr, "head: %s\n",
                 (policy.ok() ? reference.status() : policy.status()).ToString().c_str());
    return -1;
  }
  const std::vector<uint8_t> h = Bf16Normal(rng, rows * hidden, 1.0f);
  const std::vector<uint8_t> hr = Bf16Normal(rng, rows * hidden, 1.0f);
  std::vector<int32_t> ids(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) ids[static_cast<size_t>(i)] = (i * 7919) % vocab;

  struct Op {
    std::string name;
    int gemms;
    bool pair;
  };
  struct Row {
    std::string name;
    double ms;
    int gemms;
    int wrong;
  };
  std::vector<Row> timed;
  for (const Op& op : {Op{"logprobs + entropy", 1, false},
                       Op{"policy + ref: logprobs, entropies, fwd KL", 2, true}}) {
    ScoreJob job;
    job.rows = rows;
    job.vocab = vocab;
    job.model.head = *policy;
    job.model.hidden = {FloatType::kBFloat16, rows, hidden, h.data()};
    job.model.field = "hidden";
    job.target_ids = ids;
    job.ids_per_row = 1;
    job.entropy = true;
    if (op.pair) {
      job.reference.head = *reference;
      job.reference.hidden = {FloatType::kBFloat16, rows, hidden, hr.data()};
      job.reference.field = "reference_hidden";
      job.reference_entropy = true;
      job.forward_kl = true;
    }
    const Timed t = TimeScore(**backend, job, iters, op.name);
    if (t.ms < 0) return -1;
    timed.push_back({op.name, t.ms, op.gemms, t.wrong});
  }
  const double gemm_after_ms = BareGemmMs(bf16, rows, hidden, vocab, iters);
  std::printf(
      "bare oneDNN GEMM, %s: %.2f ms before, %.2f after = %.0f GFLOP/s = %.0f %% of the "
      "%s peak\n",
      bf16 ? "bf16" : "fp32", gemm_ms, gemm_after_ms,
      gflop / (std::min(gemm_ms, gemm_after_ms) / 1e3),
      peak > 0 ? 100.0 * gflop / (std::min(gemm_ms, gemm_after_ms) / 1e3) / peak : 0.0,
      bf16 ? "bf16" : "fp32");
  gemm_ms = std::min(gemm_ms, gemm_after_ms);
  std::printf("%-44s %10s %10s %8s %7s\n", "op", "time_ms", "gemm_ms", "ratio", "#wrong");
  int total_wrong = 0;
  for (const Row& r : timed) {
    total_wrong += r.wrong;
    const double floor_ms = gemm_ms * r.gemms;
    std::printf("%-44s %10.2f %10.2f %8.2f %7d\n", r.name.c_str(), r.ms, floor_ms, r.ms / floor_ms,
                r.wrong);
    (*out)["hidden"].push_back({{"op", r.name},
                                {"ms", r.ms},
                                {"gemm_ms", floor_ms},
                                {"ratio", r.ms / floor_ms},
                                {"wrong", r.wrong}});
  }
  (*out)["hidden_shape"] = {{"rows", rows}, {"hidden", hidden}, {"vocab", vocab}};
  (*out)["fma_peak_gflops"] = {{"fp32", fp32_peak}, {"bf16", bf16_peak}};
  (*out)["bare_gemm"] = {{"precision", bf16 ? "bf16" : "fp32"},
                         {"ms", gemm_ms},
                         {"gflops", gflop / (gemm_ms / 1e3)},
                         {"fraction_of_peak", peak > 0 ? gflop / (gemm_ms / 1e3) / peak : 0.0}};
  return total_wrong;
}

// ---- Logits mode -----------------------------------------------------------------------------

int RunLogits(int64_t rows, int64_t vocab, int iters, int threads, nlohmann::json* out_json) {
  nlohmann::json& out = *out_json;
  const size_t n = static_cast<size_t>(rows * vocab);
  std::vector<float> a(n), b(n);
  {
    std::mt19937_64 rng(7);
    std::normal_distribution<float> nd(0.0f, 3.0f);
    for (auto& x : a) x = nd(rng);
    for (auto& x : b) x = nd(rng);
  }
  std::vector<int32_t> ids(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i)
    ids[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919) % vocab);

  volatile float sink = 0;
  const double read_ms = BestMs(iters, [&] { sink = sink + ParallelSum(a.data(), n, threads); });
  const double bytes = static_cast<double>(n) * sizeof(float);
  const double floor_gbs = bytes / (read_ms * 1e6);

  auto backend = logitserve::CreateCpuBackend({threads, 1, {}, logitserve::CpuGemm::kAuto});
  if (!backend.ok()) {
    std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
    return -1;
  }
  struct Op {
    std::string name;
    int reads;
    std::function<void(ScoreJob&)> set;
  };
  const std::vector<Op> ops = {
      {"logprobs", 1, [](ScoreJob&) {}},
      {"entropy", 1, [](ScoreJob& j) { j.entropy = true; }},
      {"top_k=8", 1, [](ScoreJob& j) { j.top_k = 8; }},
      {"kl (fwd+rev)", 2, [](ScoreJob& j) { j.forward_kl = j.reverse_kl = true; }},
      {"jsd(0.5)", 2, [](ScoreJob& j) { j.jsd_beta = 0.5f; }},
  };
  std::printf("logitserve-cpu-bench: fp32 logits [%ld x %ld], %d threads\n",
              static_cast<long>(rows), static_cast<long>(vocab), threads);
  std::printf("read floor: %.2f GB/s (parallel SIMD sum over %.0f MB)\n", floor_gbs, bytes / 1e6);
  std::printf("%-14s %10s %10s %10s %8s %7s\n", "op", "time_ms", "GB/s", "floor_ms", "ratio",
              "#wrong");
  out["rows"] = rows;
  out["vocab"] = vocab;
  out["threads"] = threads;
  out["floor_gbs"] = floor_gbs;
  int total_wrong = 0;
  for (const Op& op : ops) {
    ScoreJob job;
    job.rows = rows;
    job.vocab = vocab;
    job.model.logits = {logitserve::kernels::FloatType::kFloat32, rows, vocab, a.data()};
    job.model.field = "logits";
    job.reference.logits = {logitserve::kernels::FloatType::kFloat32, rows, vocab, b.data()};
    job.reference.field = "reference_logits";
    job.target_ids = ids;
    job.ids_per_row = 1;
    op.set(job);
    const Timed t = TimeScore(**backend, job, iters, op.name);
    if (t.ms < 0) return -1;
    const double ms = t.ms;
    const int wrong = t.wrong;
    total_wrong += wrong;
    const double op_bytes = bytes * op.reads;
    const double floor_ms = op_bytes / (floor_gbs * 1e6);
    std::printf("%-14s %10.2f %10.2f %10.2f %8.2f %7d\n", op.name.c_str(), ms,
                op_bytes / (ms * 1e6), floor_ms, ms / floor_ms, wrong);
    out["ops"].push_back({{"op", op.name},
                          {"ms", ms},
                          {"floor_ms", floor_ms},
                          {"ratio", ms / floor_ms},
                          {"wrong", wrong}});
  }
  return total_wrong;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"logitserve CPU benchmark (fp32 logits; hidden mode against the bare GEMM)"};
  int64_t rows = 2048, vocab = 32000, hidden = 1024, hidden_rows = 2048, hidden_vocab = 32000;
  int iters = 5, threads = 0;
  bool no_logits = false, no_hidden = false;
  std::string json_path, gemm = "auto";
  app.add_option("--rows", rows, "logits mode: token rows N");
  app.add_option("--vocab", vocab, "logits mode: vocabulary V");
  app.add_option("--hidden", hidden, "hidden mode: hidden size H");
  app.add_option("--hidden-rows", hidden_rows, "hidden mode: token rows N");
  app.add_option("--hidden-vocab", hidden_vocab, "hidden mode: vocabulary V");
  app.add_option("--gemm", gemm, "hidden mode's GEMM: auto (bf16 where native) or fp32")
      ->check(CLI::IsMember({"auto", "fp32"}));
  app.add_flag("--no-logits", no_logits, "skip logits mode");
  app.add_flag("--no-hidden", no_hidden, "skip hidden mode");
  app.add_option("--iters", iters, "timed repetitions (best is reported)");
  app.add_option("--threads", threads, "threads (0 = all)");
  app.add_option("--json", json_path, "also write results as JSON");
  CLI11_PARSE(app, argc, argv);
  if (threads <= 0) threads = omp_get_num_procs();
  omp_set_num_threads(threads);  // the bare GEMMs' oneDNN teams: the backend's thread count
  nlohmann::json out;
  int wrong = 0;
  if (!no_logits) {
    const int w = RunLogits(rows, vocab, iters, threads, &out);
    if (w < 0) return 1;
    wrong += w;
  }
  if (!no_hidden) {
    const int w =
        RunHidden(hidden_rows, hidden, hidden_vocab, iters, threads,
                  gemm == "fp32" ? logitserve::CpuGemm::kFp32 : logitserve::CpuGemm::kAuto, &out);
    if (w < 0) return 1;
    wrong += w;
  }
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  return wrong == 0 ? 0 : 3;
}
