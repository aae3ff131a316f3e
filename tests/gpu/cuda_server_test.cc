// The real server on the CUDA backend with its default scheduler (two workers: the second merges
// and stages the next batch on the host while the GPU computes the first, server.h
// DefaultSchedulerWorkers). Requests of kinds that cannot share a batch (different outputs) sent
// from many threads at once run as concurrent batches; every response must equal, bit for bit,
// the response of the same request sent alone while the server is otherwise idle. Label gpu:
// skipped without a device.
#include <grpcpp/grpcpp.h>

#include <cstdint>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "logitserve/v1/logitserve.grpc.pb.h"
#include "tests/service/e2e_support.h"
#include "tests/service/prometheus_text.h"
#include "tests/support/server_process.h"
#include "tests/support/test_tensors.h"

namespace logitserve {
namespace {

// Large enough for several 512-row tiles per job, so concurrent batches overlap in time.
constexpr int64_t kRows[] = {1100, 700, 1500, 300};
constexpr int kThreads = 8;
constexpr int kRoundsPerThread = 3;

// Request `kind`: its own rows, values and outputs (kinds 0..3 differ in options, so the
// scheduler never merges two kinds into one batch; the same kind may co-batch, also bitwise).
v1::ScoreRequest MakeRequest(int kind) {
  const int64_t rows = kRows[kind];
  const int64_t h = e2e::kPolicy.hidden;
  std::mt19937 rng(100 + kind);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> hidden(static_cast<size_t>(rows * h));
  for (float& v : hidden) v = normal(rng);
  v1::ScoreRequest r;
  r.set_request_id("kind-" + std::to_string(kind));
  r.set_head(e2e::kPolicy.name);
  *r.mutable_hidden() = testing::FloatTensor(v1::DATA_TYPE_BFLOAT16, hidden, {rows, h});
  std::vector<int64_t> ids(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) ids[i] = (i * 7919 + kind) % e2e::kPolicy.vocab;
  *r.mutable_target_ids() = testing::IdTensor(v1::DATA_TYPE_INT32, ids, {rows});
  r.set_entropy(kind != 1);
  if (kind == 1 || kind == 3) r.set_top_k(kind == 1 ? 8 : 64);
  if (kind == 2) r.set_temperature(0.7f);
  return r;
}

// The response without its timings (which differ run to run).
std::string Outputs(v1::ScoreResponse response) {
  response.clear_queue_us();
  response.clear_compute_us();
  return response.SerializeAsString();
}

TEST(CudaServerTest, ConcurrentBatchesOnTwoWorkersAreBitIdenticalToSequentialRuns) {
  std::unique_ptr<testing::ServerProcess> server =
      e2e::StartServerProcess({"--backend", "cuda", "--synthetic-head", e2e::kPolicy.Flag(),
                               "--metrics-listen", "127.0.0.1:0", "--log-level", "warn"});
  ASSERT_NE(server, nullptr);
  absl::StatusOr<testing::Exposition> metrics = testing::ScrapeMetrics(server->metrics_address());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ(testing::SampleValue(*metrics, "logitserve_scheduler_workers"), 2.0)
      << "the CUDA backend's default";

  std::vector<v1::ScoreRequest> requests;
  for (int kind = 0; kind < 4; ++kind) requests.push_back(MakeRequest(kind));
  auto stub = v1::Scorer::NewStub(e2e::Connect(server->address()));
  // Sequential: one request at a time, each batch alone on an idle server.
  std::vector<std::string> expected;
  for (const v1::ScoreRequest& r : requests) {
    v1::ScoreResponse response;
    const grpc::Status s = e2e::CallScore(*stub, r, &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(response.target_logprobs_size(), r.hidden().shape(0));
    expected.push_back(Outputs(response));
  }
  // Concurrent: every thread cycles through the kinds from its own offset, so kinds that cannot
  // share a batch are queued together and the two workers run them at once.
  std::vector<std::vector<std::string>> got(kThreads);
  std::vector<std::vector<int>> kinds(kThreads);
  std::vector<std::string> errors(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto own = v1::Scorer::NewStub(e2e::Connect(server->address()));
      for (int i = 0; i < kRoundsPerThread * 4; ++i) {
        const int kind = (t + i) % 4;
        v1::ScoreResponse response;
        const grpc::Status s = e2e::CallScore(*own, requests[kind], &response);
        if (!s.ok()) {
          errors[t] = s.error_message();
          return;
        }
        got[t].push_back(Outputs(response));
        kinds[t].push_back(kind);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    ASSERT_TRUE(errors[t].empty()) << "thread " << t << ": " << errors[t];
    for (size_t i = 0; i < got[t].size(); ++i) {
      EXPECT_EQ(got[t][i], expected[kinds[t][i]])
          << "thread " << t << ", call " << i << " (kind " << kinds[t][i] << ")";
    }
  }
  // Batches really ran (requests and tokens counted by the server).
  metrics = testing::ScrapeMetrics(server->metrics_address());
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  int64_t tokens = 0;
  for (int64_t rows : kRows) tokens += rows;
  EXPECT_EQ(testing::SampleValue(*metrics, "logitserve_tokens_scored_total"),
            static_cast<double>(tokens * (1 + kThreads * kRoundsPerThread)));
}

}  // namespace
}  // namespace logitserve
