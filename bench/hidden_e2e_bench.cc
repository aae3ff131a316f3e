// logitserve-hidden-bench: hidden-state scoring end to end over gRPC against a running server.
// Sends N rows of random bf16 hidden states for a head and times the Score RPC (logprobs of one
// target id per row + entropy), best of --iters. The matrix-unit floor is printed from
// --gemm-gflops (a GEMM rate measured by the caller; see bench/run_cpu_bench.py).
//
//   logitserve-hidden-bench --target 127.0.0.1:50051 --head policy --rows 2048 [--json FILE]
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "logitserve/kernels/dtype.h"
#include "logitserve/v1/logitserve.grpc.pb.h"
#include "nlohmann/json.hpp"

int main(int argc, char** argv) {
  CLI::App app{"logitserve hidden-mode end-to-end benchmark"};
  std::string target = "127.0.0.1:50051", head = "policy", json_path;
  int64_t rows = 2048;
  int iters = 5;
  app.add_option("--target", target, "server HOST:PORT");
  app.add_option("--head", head, "head name");
  app.add_option("--rows", rows, "token rows N");
  app.add_option("--iters", iters, "timed repetitions (best is reported)");
  app.add_option("--json", json_path, "also write results as JSON");
  CLI11_PARSE(app, argc, argv);

  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  auto stub = logitserve::v1::Scorer::NewStub(
      grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args));
  logitserve::v1::ListHeadsResponse heads;
  {
    grpc::ClientContext ctx;
    auto st = stub->ListHeads(&ctx, {}, &heads);
    if (!st.ok()) {
      std::fprintf(stderr, "ListHeads: %s\n", st.error_message().c_str());
      return 1;
    }
  }
  int64_t vocab = 0, hidden = 0;
  for (const auto& h : heads.heads()) {
    if (h.name() == head) {
      vocab = h.vocab_size();
      hidden = h.hidden_size();
    }
  }
  if (vocab == 0) {
    std::fprintf(stderr, "head %s not served\n", head.c_str());
    return 1;
  }
  logitserve::v1::ScoreRequest req;
  req.set_head(head);
  req.set_entropy(true);
  auto* h = req.mutable_hidden();
  h->set_dtype(logitserve::v1::DATA_TYPE_BFLOAT16);
  h->add_shape(rows);
  h->add_shape(hidden);
  std::vector<uint16_t> hb(static_cast<size_t>(rows * hidden));
  std::mt19937_64 rng(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& x : hb) x = logitserve::kernels::FloatToBFloat16(nd(rng));
  h->set_data(hb.data(), hb.size() * 2);
  auto* ids = req.mutable_target_ids();
  ids->set_dtype(logitserve::v1::DATA_TYPE_INT32);
  ids->add_shape(rows);
  std::vector<int32_t> iv(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i)
    iv[static_cast<size_t>(i)] = static_cast<int32_t>((i * 7919) % vocab);
  ids->set_data(iv.data(), iv.size() * 4);

  double best = 1e30, best_compute = 0;
  for (int i = 0; i < iters; ++i) {
    grpc::ClientContext ctx;
    logitserve::v1::ScoreResponse resp;
    const auto t0 = std::chrono::steady_clock::now();
    auto st = stub->Score(&ctx, req, &resp);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (!st.ok()) {
      std::fprintf(stderr, "Score: %s\n", st.error_message().c_str());
      return 1;
    }
    if (resp.entropy_size() != rows) {
      std::fprintf(stderr, "Score returned %d entropies for %ld rows\n", resp.entropy_size(),
                   static_cast<long>(rows));
      return 1;
    }
    if (ms < best) {
      best = ms;
      best_compute = resp.compute_us() / 1000.0;
    }
  }
  const double gflop = 2.0 * rows * hidden * vocab / 1e9;
  std::printf(
      "hidden e2e: N=%ld H=%ld V=%ld  best %.1f ms (server compute %.1f ms)  %.1f GFLOP/s\n",
      static_cast<long>(rows), static_cast<long>(hidden), static_cast<long>(vocab), best,
      best_compute, gflop / (best / 1e3));
  if (!json_path.empty()) {
    nlohmann::json out = {{"rows", rows}, {"hidden", hidden},           {"vocab", vocab},
                          {"ms", best},   {"compute_ms", best_compute}, {"gflop", gflop}};
    std::ofstream(json_path) << out.dump(2) << "\n";
  }
  return 0;
}
