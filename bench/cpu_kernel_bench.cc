// logitserve-cpu-bench: the CPU backend on raw fp32 logits against the machine's memory-read floor
// measured in the same run. Also a correctness check: for 16 sample rows every output of the op
// is compared with the fp64 reference (kernels/reference) and values outside tolerance are
// counted as #wrong (as nccl-tests does).
//
//   logitserve-cpu-bench [--rows 2048] [--vocab 32000] [--iters 5] [--threads 0] [--json FILE]
//
// Floor: the time to read the op's input bytes once (one read for logprobs / entropy / top-k, two
// for KL and JSD, which take two logits tensors), at the bandwidth of a multi-threaded SIMD sum
// over the same buffers. Ratio = time / floor (1.0 is the hardware limit).
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
#include "server/backend/backend.h"
#include "server/backend/cpu/cpu_backend.h"
#include "tests/reference/job_reference.h"

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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"logitserve CPU kernel benchmark (fp32 logits)"};
  int64_t rows = 2048, vocab = 32000;
  int iters = 5, threads = 0;
  std::string json_path;
  app.add_option("--rows", rows, "token rows N");
  app.add_option("--vocab", vocab, "vocabulary V");
  app.add_option("--iters", iters, "timed repetitions (best is reported)");
  app.add_option("--threads", threads, "threads (0 = all)");
  app.add_option("--json", json_path, "also write results as JSON");
  CLI11_PARSE(app, argc, argv);
  if (threads <= 0) threads = omp_get_num_procs();

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

  auto backend = logitserve::CreateCpuBackend({threads, 1, {}});
  if (!backend.ok()) {
    std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
    return 1;
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
  nlohmann::json out;
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
    ScoreResult result;
    absl::Status status;
    const double ms = BestMs(iters, [&] { status = (*backend)->Score(job, &result); });
    if (!status.ok()) {
      std::fprintf(stderr, "%s: %s\n", op.name.c_str(), status.ToString().c_str());
      return 1;
    }
    const int wrong = CountWrong(job, result);
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
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  return total_wrong == 0 ? 0 : 3;
}
