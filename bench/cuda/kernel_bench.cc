// logitserve-kernel-bench: the CUDA backend against the hardware floors of SPEC §9, measured in the
// same run, and a correctness check of sampled rows against fp64 (#wrong, as nccl-tests reports).
//
//   logitserve-kernel-bench [--rows 8192] [--vocab 75968] [--dtypes bf16,fp16,fp32] [--iters 10]
//                           [--hidden-rows 8192] [--hidden 4096] [--hidden-vocab 151936]
//                           [--no-logits] [--no-hidden] [--json FILE]
//
// Logits mode: each op is one CudaBackend::Score over device-resident logits (read in place; no
// host copy), timed wall-clock around Score (it returns after the outputs are back on the host),
// best of --iters after warm-up. Floor: the time to read the op's input bytes (one tensor for
// logprobs / entropy / top-k, two for KL / JSD) with a plain 16-byte-load reduction kernel, timed
// with CUDA events in the same run; ratio = time / floor. A device-to-device copy of one tensor is
// printed too (read + write bandwidth).
//
// Hidden mode (N x H x V): policy + reference heads (bf16), outputs target logprobs + entropy of
// both + forward KL, against two bare cuBLASLt bf16 GEMMs of the same shape (the best heuristic
// algorithm, bf16 output); also the backend's fixed tile GEMMs alone (its row tile x one slot, or x
// 8192 columns: the GEMM cost of the pipeline without the statistics), the fused GEMM +
// statistics kernel (--fused-configs: CudaBackendOptions::hidden_fused, with the largest gap of its
// outputs to the default path's), one GPU with the hidden states in pageable host memory (the
// service's case: copied per row tile), and two GPUs when visible (SPEC: >= 1.9x one GPU).
//
// Long file: one program prints the whole side-by-side table of docs/PERFORMANCE.md (logits and
// hidden mode, their floors and the configuration sweeps) from one run on one warm GPU; split, the
// rows would come from different processes and GPU states.
//
// Exit status: 0, or 3 when any sampled row is outside the backstop tolerance
// |err| <= 1e-4 + 1e-5 |x| (the tests hold far tighter, derived tolerances).
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "bench/cuda/bench_fill.h"
#include "logitserve/kernels/cuda_kernels.h"
#include "logitserve/kernels/dtype.h"
#include "nlohmann/json.hpp"
#include "server/backend/backend.h"
#include "server/backend/cuda/cuda_backend.h"
#include "server/backend/cuda/cuda_tile_gemm.h"
#include "tests/reference/job_reference.h"

namespace {

using logitserve::DistributionInput;
using logitserve::ScoreJob;
using logitserve::ScoreResult;
using logitserve::kernels::FloatType;
namespace kc = logitserve::kernels::cuda;

#define CHECK_CUDA(expr)                                                         \
  do {                                                                           \
    const auto e_ = (expr);                                                      \
    if (static_cast<int>(e_) != 0) {                                             \
      std::fprintf(stderr, "%s:%d: %s failed (%d)\n", __FILE__, __LINE__, #expr, \
                   static_cast<int>(e_));                                        \
      std::exit(1);                                                              \
    }                                                                            \
  } while (0)

template <typename F>
double BestWallMs(int warmup, int iters, F&& f) {
  for (int i = 0; i < warmup; ++i) f();
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

// Best of `iters` CUDA-event timings of `f` enqueued on `stream`.
template <typename F>
double BestEventMs(cudaStream_t stream, int warmup, int iters, F&& f) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) f();
  double best = 1e30;
  for (int i = 0; i < iters; ++i) {
    CHECK_CUDA(cudaEventRecord(a, stream));
    f();
    CHECK_CUDA(cudaEventRecord(b, stream));
    CHECK_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
    best = std::min(best, static_cast<double>(ms));
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return best;
}

void* DeviceAlloc(size_t bytes) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, bytes));
  return p;
}

std::string Name(FloatType t) {
  return t == FloatType::kFloat32 ? "fp32" : (t == FloatType::kBFloat16 ? "bf16" : "fp16");
}

bool Wrong(double got, double want) {
  if (std::isnan(want)) return !std::isnan(got);
  if (std::isinf(want)) return got != want;
  return !(std::abs(got - want) <= 1e-4 + 1e-5 * std::abs(want));
}

// A row of a device matrix decoded to double.
std::vector<double> DeviceRow(const void* data, FloatType t, int64_t cols, int64_t row) {
  const int64_t es = logitserve::kernels::SizeOf(t);
  std::vector<uint8_t> bytes(static_cast<size_t>(cols * es));
  CHECK_CUDA(cudaMemcpy(bytes.data(), static_cast<const uint8_t*>(data) + row * cols * es,
                        bytes.size(), cudaMemcpyDeviceToHost));
  std::vector<double> z(static_cast<size_t>(cols));
  for (int64_t j = 0; j < cols; ++j)
    z[static_cast<size_t>(j)] = logitserve::kernels::LoadAsFloat(t, bytes.data(), j);
  return z;
}

double FreeDeviceBytes(int device) {
  size_t free_b = 0, total = 0;
  cudaSetDevice(device);
  cudaMemGetInfo(&free_b, &total);
  return static_cast<double>(free_b);
}

// Two bare cuBLASLt bf16 GEMMs out[n, v] = h[n, k] . W[v, k]^T (bf16 out, fp32 accumulate), the
// heuristic's first choice: the reference point of hidden mode.
double BareGemmMs(int64_t n, int64_t k, int64_t v, const void* h1, const void* h2, const void* w1,
                  const void* w2, int iters, std::string* algo) {
  cublasLtHandle_t lt;
  CHECK_CUDA(cublasLtCreate(&lt));
  cublasLtMatmulDesc_t desc;
  CHECK_CUDA(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  CHECK_CUDA(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  CHECK_CUDA(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  cublasLtMatrixLayout_t la, lb, lc;
  CHECK_CUDA(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, k, v, k));
  CHECK_CUDA(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, n, k));
  CHECK_CUDA(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, v, n, v));
  cublasLtMatmulPreference_t pref;
  CHECK_CUDA(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws_bytes = logitserve::kCublasWorkspaceBytes;
  CHECK_CUDA(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                  &ws_bytes, sizeof(ws_bytes)));
  cublasLtMatmulHeuristicResult_t res{};
  int returned = 0;
  CHECK_CUDA(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &res, &returned));
  if (returned < 1) {
    std::fprintf(stderr, "no cuBLASLt algorithm for the bare GEMM\n");
    std::exit(1);
  }
  int32_t id = 0, tile = 0, split = 0;
  size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&res.algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id),
                                       &written);
  cublasLtMatmulAlgoConfigGetAttribute(&res.algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile),
                                       &written);
  cublasLtMatmulAlgoConfigGetAttribute(&res.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split,
                                       sizeof(split), &written);
  *algo = "algo id " + std::to_string(id) + ", tile " + std::to_string(tile) + ", split-k " +
          std::to_string(split);
  void* out = DeviceAlloc(static_cast<size_t>(n * v) * 2);
  void* ws = DeviceAlloc(ws_bytes);
  cudaStream_t s;
  CHECK_CUDA(cudaStreamCreate(&s));
  const float alpha = 1.0f, beta = 0.0f;
  const double ms = BestEventMs(s, 1, iters, [&] {
    CHECK_CUDA(cublasLtMatmul(lt, desc, &alpha, w1, la, h1, lb, &beta, out, lc, out, lc, &res.algo,
                              ws, res.workspaceSize, s));
    CHECK_CUDA(cublasLtMatmul(lt, desc, &alpha, w2, la, h2, lb, &beta, out, lc, out, lc, &res.algo,
                              ws, res.workspaceSize, s));
  });
  cudaStreamDestroy(s);
  cudaFree(out);
  cudaFree(ws);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lc);
  cublasLtMatmulDescDestroy(desc);
  cublasLtDestroy(lt);
  return ms;
}

// A synthetic bf16 head [v, k], entries ~ uniform with standard deviation `stddev` (host).
std::shared_ptr<logitserve::HeadWeights> SyntheticHead(const std::string& name, int64_t v,
                                                       int64_t k, float stddev, uint64_t seed) {
  auto w = std::make_shared<logitserve::HeadWeights>();
  w->name = name;
  w->vocab_size = v;
  w->hidden_size = k;
  w->dtype = FloatType::kBFloat16;
  w->weight.resize(static_cast<size_t>(v * k) * 2);
  auto* bits = reinterpret_cast<uint16_t*>(w->weight.data());
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  const float scale = stddev * std::sqrt(3.0f) / 2147483648.0f;  // uniform(-a, a), a = sqrt(3) std
  for (size_t i = 0; i < static_cast<size_t>(v * k); ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    bits[i] = logitserve::kernels::FloatToBFloat16(
        static_cast<float>(static_cast<int32_t>(x >> 32)) * scale);
  }
  w->source = "synthetic:bench";
  return w;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"logitserve CUDA kernel benchmark (SPEC §9)"};
  int64_t rows = 8192, vocab = 75968, hrows = 8192, hidden = 4096, hvocab = 151936;
  int iters = 10, hidden_iters = 3;
  double jsd_tile_mb = 0;
  std::vector<std::string> dtypes = {"bf16", "fp16", "fp32"};
  std::vector<int64_t> tile_rows_list;
  std::vector<int64_t> tile_gemm_rows = {logitserve::kCudaRowTile};
  const int64_t slot_cols =
      logitserve::CudaBackendOptions{}.hidden_stats_chunks * logitserve::kCudaVocabChunk;
  std::vector<int64_t> tile_gemm_cols = {slot_cols};
  if (slot_cols != logitserve::kCudaVocabChunk)
    tile_gemm_cols.push_back(logitserve::kCudaVocabChunk);
  int tile_gemm_candidates = 0;
  std::vector<int> tile_gemm_free = {logitserve::CudaBackendOptions{}.hidden_stats_sms};
  std::vector<std::string> hidden_configs;
  std::vector<std::string> fused_configs = {"2x2:2048", "2x1:2048"};
  bool no_logits = false, no_hidden = false;
  std::string json_path;
  app.add_option("--rows", rows, "logits mode: token rows N");
  app.add_option("--vocab", vocab, "logits mode: vocabulary V");
  app.add_option("--dtypes", dtypes, "logits mode: input dtypes")->delimiter(',');
  app.add_option("--iters", iters, "logits mode: timed repetitions (best is reported)");
  app.add_option("--hidden-rows", hrows, "hidden mode: token rows N");
  app.add_option("--hidden", hidden, "hidden mode: hidden size H");
  app.add_option("--hidden-vocab", hvocab, "hidden mode: vocabulary V");
  app.add_option("--hidden-iters", hidden_iters, "hidden mode: timed repetitions");
  app.add_option("--jsd-tile-mb", jsd_tile_mb,
                 "logits mode: CudaBackendOptions::jsd_tile_bytes in MB (0 = no cap)");
  app.add_option("--logits-tile-rows", tile_rows_list,
                 "logits mode: CudaBackendOptions::logits_tile_rows to compare (the first gives "
                 "the main table, each other one extra lines; default: the option's default)")
      ->delimiter(',');
  app.add_option("--tile-gemm-rows", tile_gemm_rows,
                 "hidden mode: row counts of the tile GEMMs timed alone (the first should be "
                 "the pipeline's row tile, kCudaRowTile)")
      ->delimiter(',');
  app.add_option("--tile-gemm-cols", tile_gemm_cols,
                 "hidden mode: column counts of the tile GEMMs timed alone (multiples of 8192; "
                 "the first should be the pipeline's, one slot)")
      ->delimiter(',');
  app.add_option("--tile-gemm-candidates", tile_gemm_candidates,
                 "hidden mode: also time each shape with cuBLASLt's first N algorithms without "
                 "split-K (the backend pins the first with a preferred tile shape)");
  app.add_option("--tile-gemm-free", tile_gemm_free,
                 "hidden mode: time the tile GEMMs alone planned for the GPU's SMs minus each of "
                 "these (cuBLASLt's SM count target; 0 = every SM; -1 = by hidden size; default: "
                 "the backend's hidden_stats_sms)")
      ->delimiter(',');
  app.add_option("--hidden-configs", hidden_configs,
                 "hidden mode: also run the 1-GPU Score with these "
                 "ROWS:CHUNKS[:serial][:2s][:cg][:algN][:slotsN][:freeN] "
                 "(CudaBackendOptions::hidden_row_tile, hidden_stats_chunks, serial = "
                 "overlap_hidden_gemms off, 2s = hidden_gemm_streams 2, cg = a GEMM per "
                 "8192-id chunk: hidden_slot_gemms off, algN = hidden_gemm_candidate N, "
                 "slotsN = hidden_slots N, freeN = hidden_stats_sms N)")
      ->delimiter(',');
  app.add_flag("--no-logits", no_logits, "skip logits mode");
  app.add_flag("--no-hidden", no_hidden, "skip hidden mode");
  app.add_option("--fused-configs", fused_configs,
                 "hidden mode: also run the 1-GPU Score through the fused GEMM + statistics kernel "
                 "with these CLUSTER:ROWS (CudaBackendOptions::hidden_fused_cluster, "
                 "hidden_fused_tile_rows; ROWS 0 = its default); empty = none")
      ->delimiter(',');
  app.add_option("--json", json_path, "also write results as JSON");
  CLI11_PARSE(app, argc, argv);

  if (absl::Status s = logitserve::CheckCudaDevices(); !s.ok()) {
    std::fprintf(stderr, "%s\n", s.ToString().c_str());
    return 1;
  }
  int devices = 0;
  CHECK_CUDA(cudaGetDeviceCount(&devices));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("logitserve-kernel-bench: %s, %d SMs, L2 %.0f MB, %.1f GB, %d device(s)\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize / 1e6, prop.totalGlobalMem / 1e9, devices);
  nlohmann::json out;
  out["device"] = prop.name;
  out["devices"] = devices;
  int total_wrong = 0;
  cudaStream_t stream;
  CHECK_CUDA(cudaSetDevice(0));
  CHECK_CUDA(cudaStreamCreate(&stream));
  uint32_t* sink = static_cast<uint32_t*>(DeviceAlloc(1024 * sizeof(uint32_t)));

  if (!no_logits) {
    const double free_before = FreeDeviceBytes(0);
    // One backend per tile size compared (the first for the main table), labelled by it.
    std::vector<std::pair<std::string, std::unique_ptr<logitserve::Backend>>> backends;
    if (tile_rows_list.empty()) tile_rows_list.push_back(-1);
    auto add_backend = [&](int64_t tile_rows) {
      logitserve::CudaBackendOptions options;
      options.devices = {0};
      options.jsd_tile_bytes = static_cast<size_t>(jsd_tile_mb * 1e6);
      if (tile_rows >= 0) options.logits_tile_rows = tile_rows;
      auto made = logitserve::CreateCudaBackend(options);
      if (!made.ok()) {
        std::fprintf(stderr, "%s\n", made.status().ToString().c_str());
        return false;
      }
      backends.emplace_back("logits_tile_rows " + std::to_string(options.logits_tile_rows),
                            std::move(*made));
      return true;
    };
    for (int64_t tile_rows : tile_rows_list) {
      if (!add_backend(tile_rows)) return 1;
    }
    std::printf("main table: %s (logits_tile_rows 0 = by job)\n", backends[0].first.c_str());
    std::vector<int32_t> ids(static_cast<size_t>(rows));
    for (int64_t i = 0; i < rows; ++i)
      ids[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919) % vocab);
    struct Op {
      std::string name;
      int reads;
      std::function<void(ScoreJob&)> set;
    };
    const std::vector<Op> ops = {
        {"logprobs", 1, [](ScoreJob& j) { j.ids_per_row = 1; }},
        {"entropy", 1, [](ScoreJob& j) { j.entropy = true; }},
        {"top_k=64", 1, [](ScoreJob& j) { j.top_k = 64; }},
        {"top_k=1024", 1, [](ScoreJob& j) { j.top_k = 1024; }},
        {"kl (fwd+rev)", 2, [](ScoreJob& j) { j.forward_kl = j.reverse_kl = true; }},
        {"jsd(0.5)", 2, [](ScoreJob& j) { j.jsd_beta = 0.5f; }},
    };
    std::printf("\nlogits mode [%ld x %ld], CudaBackend on GPU 0, device-resident inputs\n",
                static_cast<long>(rows), static_cast<long>(vocab));
    std::printf("%-6s %-14s %10s %10s %10s %8s %7s\n", "dtype", "op", "time_ms", "GB/s", "floor_ms",
                "ratio", "#wrong");
    // L2's read bandwidth (the budget of a fused GEMM + statistics kernel's operand reads):
    // buffers that fit in L2, read 20 times per launch.
    for (const size_t mb : {size_t{16}, size_t{32}}) {
      const size_t bytes = mb << 20;
      void* buf = DeviceAlloc(bytes);
      CHECK_CUDA(cudaMemset(buf, 1, bytes));
      constexpr int kPasses = 20;
      const double ms = BestEventMs(stream, 2, iters, [&] {
        CHECK_CUDA(logitserve::bench::ReadResident(buf, bytes, kPasses, sink, stream));
      });
      std::printf("L2 read, %zu MiB resident x %d passes: %.3f ms = %.2f TB/s\n", mb, kPasses, ms,
                  kPasses * static_cast<double>(bytes) / (ms * 1e9));
      cudaFree(buf);
    }
    // A top-k Score returns rows * k (id, logprob) pairs on the host: the device-to-host copy of
    // those bytes (into pinned memory, the fastest there is) bounds it from below, whatever the
    // kernels do.
    for (const int64_t k : {int64_t{64}, int64_t{1024}}) {
      const size_t out = static_cast<size_t>(rows * k) * 8;
      void* dev = DeviceAlloc(out);
      void* host = nullptr;
      CHECK_CUDA(cudaMallocHost(&host, out));
      const double d2h = BestEventMs(stream, 2, iters, [&] {
        CHECK_CUDA(cudaMemcpyAsync(host, dev, out, cudaMemcpyDeviceToHost, stream));
      });
      std::printf("top-k %ld outputs: %.1f MB device -> pinned host %.3f ms (%.1f GB/s)\n",
                  static_cast<long>(k), out / 1e6, d2h, out / (d2h * 1e6));
      cudaFreeHost(host);
      cudaFree(dev);
    }
    for (const std::string& dname : dtypes) {
      const FloatType t = dname == "fp32"
                              ? FloatType::kFloat32
                              : (dname == "fp16" ? FloatType::kFloat16 : FloatType::kBFloat16);
      const size_t count = static_cast<size_t>(rows * vocab);
      const size_t bytes = count * static_cast<size_t>(logitserve::kernels::SizeOf(t));
      void* a = DeviceAlloc(bytes);
      void* b = DeviceAlloc(bytes);
      CHECK_CUDA(logitserve::bench::FillNormal(t, a, count, 1, 3.0f, stream));
      CHECK_CUDA(logitserve::bench::FillNormal(t, b, count, 2, 3.0f, stream));
      CHECK_CUDA(cudaStreamSynchronize(stream));
      const double one_read = BestEventMs(
          stream, 2, iters, [&] { CHECK_CUDA(kc::LaunchReadFloor(a, bytes, sink, stream)); });
      const double two_reads = BestEventMs(stream, 2, iters, [&] {
        CHECK_CUDA(kc::LaunchReadFloor(a, bytes, sink, stream));
        CHECK_CUDA(kc::LaunchReadFloor(b, bytes, sink, stream));
      });
      void* c = DeviceAlloc(bytes);
      const double copy = BestEventMs(stream, 2, iters, [&] {
        CHECK_CUDA(cudaMemcpyAsync(c, a, bytes, cudaMemcpyDeviceToDevice, stream));
      });
      cudaFree(c);
      std::printf(
          "%-6s floors: one read %.3f ms (%.0f GB/s), two reads %.3f ms; D2D copy %.3f ms "
          "(%.0f GB/s read+write)\n",
          dname.c_str(), one_read, bytes / (one_read * 1e6), two_reads, copy,
          2.0 * bytes / (copy * 1e6));
      // fp64 reference of sampled rows.
      constexpr int kSamples = 8;
      std::vector<int64_t> sample_rows;
      std::vector<std::vector<double>> lpa, lpb;
      for (int i = 0; i < kSamples; ++i) {
        const int64_t r = (rows - 1) * i / (kSamples - 1);
        sample_rows.push_back(r);
        lpa.push_back(logitserve::reference::LogSoftmax(DeviceRow(a, t, vocab, r)));
        lpb.push_back(logitserve::reference::LogSoftmax(DeviceRow(b, t, vocab, r)));
      }
      for (const Op& op : ops) {
        ScoreJob job;
        job.rows = rows;
        job.vocab = vocab;
        job.model.logits = {t, rows, vocab, a};
        job.model.field = "logits";
        job.reference.logits = {t, rows, vocab, b};
        job.reference.field = "reference_logits";
        op.set(job);
        if (job.ids_per_row > 0) job.target_ids = ids;
        ScoreResult result;
        absl::Status status;
        const double floor_ms = op.reads == 1 ? one_read : two_reads;
        for (size_t bi = 1; bi < backends.size(); ++bi) {  // the other tile sizes
          ScoreResult other;
          const double other_ms =
              BestWallMs(2, iters, [&] { status = backends[bi].second->Score(job, &other); });
          if (!status.ok()) {
            std::fprintf(stderr, "%s: %s\n", op.name.c_str(), status.ToString().c_str());
            return 1;
          }
          std::printf("%-6s %-14s %10.3f %10s %10.3f %8.2f  (%s)\n", dname.c_str(), op.name.c_str(),
                      other_ms, "", floor_ms, other_ms / floor_ms, backends[bi].first.c_str());
        }
        const double ms =
            BestWallMs(2, iters, [&] { status = backends[0].second->Score(job, &result); });
        if (!status.ok()) {
          std::fprintf(stderr, "%s: %s\n", op.name.c_str(), status.ToString().c_str());
          return 1;
        }
        int wrong = 0;
        for (size_t i = 0; i < sample_rows.size(); ++i) {
          const size_t r = static_cast<size_t>(sample_rows[i]);
          const auto& la = lpa[i];
          const auto& lb = lpb[i];
          if (!result.target_logprobs.empty())
            wrong += Wrong(result.target_logprobs[r], la[static_cast<size_t>(ids[r])]);
          if (!result.entropy.empty())
            wrong += Wrong(result.entropy[r], logitserve::reference::Entropy(la));
          if (!result.top_k_ids.empty()) {  // every entry's log-probability, best first
            const size_t k = static_cast<size_t>(job.top_k);
            const auto top = logitserve::reference::TopK(la, static_cast<int>(k));
            for (size_t j = 0; j < k; ++j)
              wrong += Wrong(result.top_k_logprobs[r * k + j], top[j].logprob);
          }
          if (!result.forward_kl.empty())
            wrong += Wrong(result.forward_kl[r], logitserve::reference::Kl(lb, la));
          if (!result.reverse_kl.empty())
            wrong += Wrong(result.reverse_kl[r], logitserve::reference::Kl(la, lb));
          if (!result.jsd.empty())
            wrong += Wrong(result.jsd[r], logitserve::reference::Jsd(la, lb, 0.5));
        }
        total_wrong += wrong;
        const double op_bytes = static_cast<double>(bytes) * op.reads;
        std::printf("%-6s %-14s %10.3f %10.0f %10.3f %8.2f %7d\n", dname.c_str(), op.name.c_str(),
                    ms, op_bytes / (ms * 1e6), floor_ms, ms / floor_ms, wrong);
        out["logits"].push_back({{"dtype", dname},
                                 {"op", op.name},
                                 {"ms", ms},
                                 {"floor_ms", floor_ms},
                                 {"ratio", ms / floor_ms},
                                 {"gbs", op_bytes / (ms * 1e6)},
                                 {"wrong", wrong}});
      }
      // The kernels alone (CUDA events, no backend overhead): statistics of every (row, block),
      // single and pair, and the fold of one rank's records with entropy and KL outputs.
      {
        const int64_t blocks = logitserve::kernels::NumBlocks(vocab);
        const kc::TileMessage msg = kc::MakeTileMessage(rows, blocks, 0, 0);
        auto* records = static_cast<logitserve::kernels::PairBlockStats*>(DeviceAlloc(msg.bytes));
        auto* folded = static_cast<logitserve::kernels::RowStats*>(
            DeviceAlloc(2 * static_cast<size_t>(rows) * sizeof(logitserve::kernels::RowStats)));
        auto* outs =
            static_cast<float*>(DeviceAlloc(3 * static_cast<size_t>(rows) * sizeof(float)));
        auto* bad = static_cast<int32_t*>(DeviceAlloc(2 * sizeof(int32_t)));
        kc::LogitsSource sa, sb;
        sa.type = sb.type = t;
        sa.data = a;
        sb.data = b;
        sa.ld = sb.ld = vocab;
        sa.cols = sb.cols = vocab;
        const double single_ms = BestEventMs(stream, 2, iters, [&] {
          CHECK_CUDA(kc::LaunchBlockStats(sa, nullptr, rows, records, blocks, 0, stream));
        });
        const double pair_ms = BestEventMs(stream, 2, iters, [&] {
          CHECK_CUDA(kc::LaunchBlockStats(sa, &sb, rows, records, blocks, 0, stream));
        });
        kc::GatheredTile tile;
        tile.messages = reinterpret_cast<const uint8_t*>(records);
        tile.layout = msg;
        tile.shards.ranks = 1;
        tile.shards.begin[1] = static_cast<int32_t>(blocks);
        tile.num_blocks = blocks;
        tile.pair = true;
        kc::RowOutputs o;
        o.entropy = outs;
        o.forward_kl = outs + rows;
        o.reverse_kl = outs + 2 * rows;
        const double fold_ms = BestEventMs(stream, 2, iters, [&] {
          CHECK_CUDA(kc::LaunchFoldRows(tile, rows, 0, kc::FoldedRows{folded, folded + rows}, bad,
                                        &o, stream));
        });
        std::printf(
            "%-6s kernels alone: single stats %.3f ms (%.2f x one read), pair stats %.3f ms "
            "(%.2f x two reads), pair fold + outputs %.3f ms\n",
            dname.c_str(), single_ms, single_ms / one_read, pair_ms, pair_ms / two_reads, fold_ms);
        // Statistics + top-k (one read, topk_kernel.cu), counts cleared first as the backend does.
        double topk_ms[2] = {0.0, 0.0};
        const int32_t topk_k[2] = {64, 1024};
        for (int i = 0; i < 2; ++i) {
          const int32_t kk = topk_k[i];
          auto* lists = static_cast<logitserve::kernels::TopKEntry*>(
              DeviceAlloc(static_cast<size_t>(rows * kk) * sizeof(logitserve::kernels::TopKEntry)));
          auto* counts = static_cast<int32_t*>(DeviceAlloc(static_cast<size_t>(rows) * 4));
          auto* scratch = static_cast<float*>(DeviceAlloc(kc::TopKScratchBytes(rows, blocks)));
          topk_ms[i] = BestEventMs(stream, 2, iters, [&] {
            CHECK_CUDA(cudaMemsetAsync(counts, 0, static_cast<size_t>(rows) * 4, stream));
            CHECK_CUDA(kc::LaunchBlockStatsTopK(sa, nullptr, rows, records, blocks, 0, kk, lists,
                                                counts, scratch, stream));
          });
          // Its two halves (the pipeline runs them on different streams).
          const double lane_ms = BestEventMs(stream, 2, iters, [&] {
            CHECK_CUDA(
                kc::LaunchTopKLaneMax(sa, nullptr, rows, records, blocks, 0, kk, scratch, stream));
          });
          const double select_ms = BestEventMs(stream, 2, iters, [&] {
            CHECK_CUDA(cudaMemsetAsync(counts, 0, static_cast<size_t>(rows) * 4, stream));
            CHECK_CUDA(kc::LaunchTopKSelect(sa, rows, kk, lists, counts, scratch, stream));
          });
          std::printf(
              "%-6s kernels alone: top-k %d halves: stats + lane maxima %.3f ms, "
              "selection + fallback %.3f ms\n",
              dname.c_str(), kk, lane_ms, select_ms);
          cudaFree(lists);
          cudaFree(counts);
          cudaFree(scratch);
        }
        std::printf(
            "%-6s kernels alone: stats + top-k 64 %.3f ms (%.2f x one read), stats + top-k 1024 "
            "%.3f ms (%.2f x one read)\n",
            dname.c_str(), topk_ms[0], topk_ms[0] / one_read, topk_ms[1], topk_ms[1] / one_read);
        out["kernels"].push_back({{"dtype", dname},
                                  {"single_stats_ms", single_ms},
                                  {"pair_stats_ms", pair_ms},
                                  {"fold_ms", fold_ms},
                                  {"stats_topk64_ms", topk_ms[0]},
                                  {"stats_topk1024_ms", topk_ms[1]},
                                  {"one_read_ms", one_read},
                                  {"two_reads_ms", two_reads}});
        cudaFree(records);
        cudaFree(folded);
        cudaFree(outs);
        cudaFree(bad);
      }
      cudaFree(a);
      cudaFree(b);
    }
    const double used = free_before - FreeDeviceBytes(0);
    std::printf("backend device memory after the logits runs (workspaces, cuBLAS): %.1f MB\n",
                used / 1e6);
    out["logits_backend_memory_mb"] = used / 1e6;
  }

  if (!no_hidden) {
    std::printf(
        "\nhidden mode N=%ld H=%ld V=%ld: policy + reference (bf16 heads), target logprobs + "
        "entropy x2 + forward KL\n",
        static_cast<long>(hrows), static_cast<long>(hidden), static_cast<long>(hvocab));
    const float w_std = 3.0f / std::sqrt(static_cast<float>(hidden));
    auto w1 = SyntheticHead("policy", hvocab, hidden, w_std, 11);
    auto w2 = SyntheticHead("reference", hvocab, hidden, w_std, 12);
    const size_t hcount = static_cast<size_t>(hrows * hidden);
    void* h1 = DeviceAlloc(hcount * 2);
    void* h2 = DeviceAlloc(hcount * 2);
    CHECK_CUDA(logitserve::bench::FillNormal(FloatType::kBFloat16, h1, hcount, 3, 1.0f, stream));
    CHECK_CUDA(logitserve::bench::FillNormal(FloatType::kBFloat16, h2, hcount, 4, 1.0f, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
    std::vector<int32_t> ids(static_cast<size_t>(hrows));
    for (int64_t i = 0; i < hrows; ++i)
      ids[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919) % hvocab);

    // Bare GEMMs (need the heads on the device as plain [V, H] bf16).
    std::string bare_algo;
    double bare_ms = 0;
    {
      void* dw1 = DeviceAlloc(w1->weight.size());
      void* dw2 = DeviceAlloc(w2->weight.size());
      CHECK_CUDA(cudaMemcpy(dw1, w1->weight.data(), w1->weight.size(), cudaMemcpyHostToDevice));
      CHECK_CUDA(cudaMemcpy(dw2, w2->weight.data(), w2->weight.size(), cudaMemcpyHostToDevice));
      bare_ms = BareGemmMs(hrows, hidden, hvocab, h1, h2, dw1, dw2, hidden_iters + 2, &bare_algo);
      cudaFree(dw1);
      cudaFree(dw2);
    }
    const double flops = 2.0 * 2.0 * static_cast<double>(hrows) * hidden * hvocab;
    std::printf("two bare cuBLASLt bf16 GEMMs %ldx%ldx%ld: %.3f ms (%.0f TFLOP/s; %s)\n",
                static_cast<long>(hrows), static_cast<long>(hidden), static_cast<long>(hvocab),
                bare_ms, flops / (bare_ms * 1e9), bare_algo.c_str());
    out["hidden"]["bare_gemms_ms"] = bare_ms;

    // host_inputs: the hidden states in pageable host memory, as the service hands them over
    // (copied per row tile), instead of resident on GPU 0.
    // Every backend but the default one is configured by a function of its options.
    using Configure = std::function<void(logitserve::CudaBackendOptions&)>;
    // The cuBLASLt tiles at every hidden size (hidden_fused_max_hidden 0).
    const Configure tiles_only = [](logitserve::CudaBackendOptions& o) {
      o.hidden_fused_max_hidden = 0;
    };
    ScoreResult first_result;  // the default run's, to compare the other paths with
    auto run_backend = [&](std::vector<int> devs, const char* label, bool host_inputs,
                           const Configure& configure = nullptr) -> double {
      logitserve::CudaBackendOptions options;
      if (configure) configure(options);
      options.devices = devs;
      const double free_before = FreeDeviceBytes(0);
      auto backend = logitserve::CreateCudaBackend(options);
      if (!backend.ok()) {
        std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
        std::exit(1);
      }
      auto p1 = (*backend)->PrepareHead(w1);
      auto p2 = (*backend)->PrepareHead(w2);
      if (!p1.ok() || !p2.ok()) {
        std::fprintf(stderr, "PrepareHead: %s %s\n", p1.status().ToString().c_str(),
                     p2.status().ToString().c_str());
        std::exit(1);
      }
      const double heads_mb = (free_before - FreeDeviceBytes(0)) / 1e6;
      std::vector<uint8_t> host1, host2;
      const void* in1 = h1;
      const void* in2 = h2;
      if (host_inputs) {
        host1.resize(hcount * 2);
        host2.resize(hcount * 2);
        CHECK_CUDA(cudaMemcpy(host1.data(), h1, host1.size(), cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(host2.data(), h2, host2.size(), cudaMemcpyDeviceToHost));
        in1 = host1.data();
        in2 = host2.data();
      }
      ScoreJob job;
      job.rows = hrows;
      job.vocab = hvocab;
      job.model.head = *p1;
      job.model.hidden = {FloatType::kBFloat16, hrows, hidden, in1};
      job.model.field = "hidden";
      job.reference.head = *p2;
      job.reference.hidden = {FloatType::kBFloat16, hrows, hidden, in2};
      job.reference.field = "reference_hidden";
      job.target_ids = ids;
      job.ids_per_row = 1;
      job.entropy = job.reference_entropy = job.forward_kl = true;
      ScoreResult result;
      absl::Status status;
      const double free_mid = FreeDeviceBytes(0);
      const double ms =
          BestWallMs(1, hidden_iters, [&] { status = (*backend)->Score(job, &result); });
      if (!status.ok()) {
        std::fprintf(stderr, "hidden Score: %s\n", status.ToString().c_str());
        std::exit(1);
      }
      const double extra_mb = (free_mid - FreeDeviceBytes(0)) / 1e6;
      // fp64 reference of two sampled rows (host copies of their hidden states).
      int wrong = 0;
      for (int64_t r : {int64_t{0}, hrows - 1}) {
        std::vector<uint8_t> hb1(static_cast<size_t>(hidden) * 2),
            hb2(static_cast<size_t>(hidden) * 2);
        CHECK_CUDA(cudaMemcpy(hb1.data(), static_cast<uint8_t*>(h1) + r * hidden * 2, hb1.size(),
                              cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(hb2.data(), static_cast<uint8_t*>(h2) + r * hidden * 2, hb2.size(),
                              cudaMemcpyDeviceToHost));
        ScoreJob one = job;
        one.rows = 1;
        one.model.hidden = {FloatType::kBFloat16, 1, hidden, hb1.data()};
        one.reference.hidden = {FloatType::kBFloat16, 1, hidden, hb2.data()};
        one.target_ids = {ids[static_cast<size_t>(r)]};
        const logitserve::reference::ReferenceResult ref =
            logitserve::reference::ScoreReference(one);
        const size_t i = static_cast<size_t>(r);
        wrong += Wrong(result.target_logprobs[i], ref.target_logprobs[0]);
        wrong += Wrong(result.entropy[i], ref.entropy[0]);
        wrong += Wrong(result.reference_entropy[i], ref.reference_entropy[0]);
        wrong += Wrong(result.forward_kl[i], ref.forward_kl[0]);
      }
      total_wrong += wrong;
      // Against the first run (fused and unfused agree to rounding: report the largest gap).
      double gap = 0;
      if (first_result.entropy.empty()) {
        first_result = result;
      } else {
        auto worst = [&](const std::vector<float>& x, const std::vector<float>& y) {
          for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
            gap = std::max(gap, std::abs(static_cast<double>(x[i]) - y[i]) /
                                    (1.0 + std::abs(static_cast<double>(y[i]))));
          }
        };
        worst(result.target_logprobs, first_result.target_logprobs);
        worst(result.entropy, first_result.entropy);
        worst(result.reference_entropy, first_result.reference_entropy);
        worst(result.forward_kl, first_result.forward_kl);
      }
      std::printf(
          "%-10s Score %.3f ms = %.3f x the two bare GEMMs (SPEC: <= 1.10); %.0f TFLOP/s; heads "
          "%.0f MB on GPU 0, job workspace %.0f MB; #wrong %d; max |d|/(1+|x|) vs the first "
          "run %.2e\n",
          label, ms, ms / bare_ms, flops / (ms * 1e9), heads_mb, extra_mb, wrong, gap);
      out["hidden"][label] = {{"ms", ms},
                              {"ratio_to_bare", ms / bare_ms},
                              {"wrong", wrong},
                              {"heads_mb", heads_mb},
                              {"workspace_mb", extra_mb}};
      return ms;
    };

    // The pipeline's own GEMMs alone: its fixed row tile x one slot (or one chunk) x H, as many
    // as one job runs (and, for comparison, other shapes: --tile-gemm-rows, --tile-gemm-cols).
    const int64_t k_pad = (hidden + 7) / 8 * 8;  // the backend's padded hidden size
    const int default_free_sms =
        logitserve::HiddenStatsSms(logitserve::CudaBackendOptions{}.hidden_stats_sms, k_pad);
    auto time_tile_gemms = [&](int64_t gemm_rows, int64_t gemm_cols, int candidate,
                               int free_sms) -> bool {
      cublasLtHandle_t lt;
      CHECK_CUDA(cublasLtCreate(&lt));
      logitserve::TileGemmShape shape{gemm_rows, gemm_cols, gemm_cols};
      shape.candidate = candidate;
      free_sms = logitserve::HiddenStatsSms(free_sms, k_pad);
      shape.sm_count = logitserve::TileGemmSmCount(prop.multiProcessorCount, free_sms);
      if (free_sms > 0 && shape.sm_count == 0) {
        std::printf("  --tile-gemm-free %d: the backend would keep every one of the GPU's %d SMs\n",
                    free_sms, prop.multiProcessorCount);
        cublasLtDestroy(lt);
        return false;
      }
      auto gemm = logitserve::CudaTileGemm::Create(lt, k_pad, shape);
      if (!gemm.ok()) {
        std::printf("  %ld x %ld, candidate %d: %s\n", static_cast<long>(gemm_rows),
                    static_cast<long>(gemm_cols), candidate, gemm.status().ToString().c_str());
        cublasLtDestroy(lt);
        return false;
      }
      const int64_t k = (*gemm)->k();
      void* w = DeviceAlloc(static_cast<size_t>(gemm_cols * k) * 2);
      void* x = DeviceAlloc(static_cast<size_t>(gemm_rows * k) * 2);
      void* o = DeviceAlloc(static_cast<size_t>(gemm_rows * gemm_cols) * 4);
      void* ws = DeviceAlloc(logitserve::kCublasWorkspaceBytes);
      CHECK_CUDA(cudaMemset(w, 0, static_cast<size_t>(gemm_cols * k) * 2));
      CHECK_CUDA(cudaMemset(x, 0, static_cast<size_t>(gemm_rows * k) * 2));
      const int64_t tiles = (hrows + gemm_rows - 1) / gemm_rows;
      const int64_t gemms_per_tile = (hvocab + gemm_cols - 1) / gemm_cols;
      const double ms = BestEventMs(stream, 1, hidden_iters, [&] {
        for (int64_t i = 0; i < 2 * tiles * gemms_per_tile; ++i) {
          absl::Status s = (*gemm)->Run(lt, static_cast<uint16_t*>(w), static_cast<uint16_t*>(x),
                                        static_cast<float*>(o), false, ws, stream);
          if (!s.ok()) {
            std::fprintf(stderr, "%s\n", s.ToString().c_str());
            std::exit(1);
          }
        }
      });
      const bool pipeline = gemm_rows == logitserve::kCudaRowTile && gemm_cols == slot_cols &&
                            candidate < 0 && free_sms == default_free_sms;
      std::printf(
          "%s tile GEMMs alone (%ld x %ldx%ldx%ld, zeros): %.3f ms = %.3f x the bare "
          "GEMMs\n  %s\n",
          pipeline ? "pipeline" : "other", static_cast<long>(2 * tiles * gemms_per_tile),
          static_cast<long>(gemm_rows), static_cast<long>(gemm_cols), static_cast<long>(k), ms,
          ms / bare_ms, (*gemm)->description().c_str());
      if (pipeline) {
        out["hidden"]["tile_gemms_ms"] = ms;
        out["hidden"]["tile_gemm"] = (*gemm)->description();
      } else {
        out["hidden"]["tile_gemms_ms_by_shape"]
           [std::to_string(gemm_rows) + "x" + std::to_string(gemm_cols) + "#" +
            std::to_string(candidate) + "-" + std::to_string(free_sms)] = ms;
      }
      cudaFree(w);
      cudaFree(x);
      cudaFree(o);
      cudaFree(ws);
      cublasLtDestroy(lt);
      return true;
    };
    for (const int free_sms : tile_gemm_free) {
      for (const int64_t gemm_rows : tile_gemm_rows) {
        for (const int64_t gemm_cols : tile_gemm_cols) {
          for (int c = -1;
               c < tile_gemm_candidates && time_tile_gemms(gemm_rows, gemm_cols, c, free_sms);
               ++c) {
          }
        }
      }
    }
    // The default path: the fused kernel for heads of H <= hidden_fused_max_hidden, else the
    // tiles; then each path forced.
    const double one = run_backend({0}, "1 GPU", false);
    if (hidden <= logitserve::CudaBackendOptions{}.hidden_fused_max_hidden) {
      run_backend({0}, "1 GPU, cuBLASLt tiles", false, tiles_only);
    }
    for (const std::string& config : fused_configs) {
      // CLUSTER:ROWS
      const std::vector<std::string> f = absl::StrSplit(config, ':');
      int64_t tile_rows = 0;
      if (f.size() != 2 || !absl::SimpleAtoi(f[1], &tile_rows)) {
        std::fprintf(stderr, "--fused-configs: bad entry '%s'\n", config.c_str());
        return 1;
      }
      const std::string label = "1 GPU, fused, cluster " + f[0] + ", row tile " + f[1];
      run_backend({0}, label.c_str(), false, [&](logitserve::CudaBackendOptions& o) {
        o.hidden_fused = true;
        o.hidden_fused_cluster = f[0];
        o.hidden_fused_tile_rows = tile_rows;
      });
    }

    for (const std::string& config : hidden_configs) {
      // ROWS:CHUNKS[:serial][:2s][:cg][:algN][:slotsN]
      const std::vector<std::string> f = absl::StrSplit(config, ':');
      logitserve::CudaBackendOptions c;
      tiles_only(c);
      c.hidden_gemm_streams = 1;  // ":2s" for two
      std::string label;
      bool bad = f.size() < 2 || !absl::SimpleAtoi(f[0], &c.hidden_row_tile) ||
                 !absl::SimpleAtoi(f[1], &c.hidden_stats_chunks);
      for (size_t i = 2; i < f.size() && !bad; ++i) {
        int n = 0;
        if (f[i] == "serial") {
          c.overlap_hidden_gemms = false;
          label += ", GEMMs on the statistics stream";
        } else if (f[i] == "2s") {
          c.hidden_gemm_streams = 2;
          label += ", two GEMM streams";
        } else if (f[i] == "cg") {
          c.hidden_slot_gemms = false;
          label += ", a GEMM per 8192 ids";
        } else if (absl::StartsWith(f[i], "alg") && absl::SimpleAtoi(f[i].substr(3), &n) &&
                   n >= 0) {
          c.hidden_gemm_candidate = n;
          label += ", cuBLASLt candidate " + std::to_string(n);
        } else if (absl::StartsWith(f[i], "slots") && absl::SimpleAtoi(f[i].substr(5), &n)) {
          c.hidden_slots = n;
          label += ", " + std::to_string(n) + " slots";
        } else if (absl::StartsWith(f[i], "free") && absl::SimpleAtoi(f[i].substr(4), &n)) {
          c.hidden_stats_sms = n;
          label += ", " + std::to_string(n) + " SMs left to the statistics";
        } else {
          bad = true;
        }
      }
      if (bad) {
        std::fprintf(stderr, "--hidden-configs: bad entry '%s'\n", config.c_str());
        return 1;
      }
      label = "1 GPU, row tile " + f[0] + ", stats chunks " + f[1] + label;
      // (run_backend sets the devices after this.)
      run_backend({0}, label.c_str(), false, [c](logitserve::CudaBackendOptions& o) { o = c; });
    }
    if (!hidden_configs.empty()) {
      run_backend({0}, "1 GPU, GEMMs on the statistics stream", false,
                  [&](logitserve::CudaBackendOptions& o) {
                    tiles_only(o);
                    o.overlap_hidden_gemms = false;
                  });
    }
    run_backend({0}, "1 GPU, host hidden states", true);
    if (devices >= 2) {
      const double two = run_backend({0, 1}, "2 GPUs", false);
      std::printf("two GPUs: %.2f x one GPU (SPEC: >= 1.9)\n", one / two);
      out["hidden"]["two_gpu_speedup"] = one / two;
    } else {
      std::printf("two GPUs: skipped (%d device visible)\n", devices);
    }
    cudaFree(h1);
    cudaFree(h2);
  }
  if (!json_path.empty()) std::ofstream(json_path) << out.dump(2) << "\n";
  std::printf("\n#wrong total: %d\n", total_wrong);
  return total_wrong == 0 ? 0 : 3;
}
