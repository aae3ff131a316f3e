// End-to-end tests of issue 4's serving path against the real `logitserve` binary: co-batching is
// bitwise invisible (many concurrent clients on a batching server vs. each request alone on a
// server that never co-batches), and ScoreStream (many requests in flight matched by request_id,
// per-request errors that leave the stream open, more requests than the per-stream in-flight
// limit, half-close, client cancellation, authentication).
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/service/serving_e2e_common.h"

namespace logitserve::e2e::serving {
namespace {

using ::testing::HasSubstr;

// ---------------------------------------------------------------------------------------------
// Co-batching.

// Request `index` of client thread `thread`: mostly the common shape (policy head, bf16, ids [N],
// entropy, top-4) with N in {0, 1, ...} so they can share batches, some of them with sequence
// sums (per-request, computed after the split); mixed in, requests that must never share those
// batches: fp32 inputs, another temperature, a reference head with KL / JSD, another head with
// K = 2 ids per row, logits mode.
v1::ScoreRequest RandomRequest(int thread, int index) {
  const uint32_t seed = static_cast<uint32_t>(1000 * thread + index);
  std::mt19937 rng(seed);
  const int64_t sizes[] = {0, 1, 1, 2, 3, 5, 7, 8, 13, 31, 63, 64, 65, 100, 129};
  const int64_t n = sizes[rng() % std::size(sizes)];
  const std::string id = absl::StrCat("t", thread, "-", index);
  const int kind = static_cast<int>(rng() % 12);
  v1::ScoreRequest r = PolicyRequest(n, seed, id);
  switch (kind) {
    case 6: {  // sequence sums over 2 sequences
      r.add_sequence_lengths(n / 3);
      r.add_sequence_lengths(n - n / 3);
      break;
    }
    case 7:  // fp32 hidden states: another input dtype
      r = PolicyRequest(n, seed, id, v1::DATA_TYPE_FLOAT32);
      break;
    case 8:  // another temperature
      r.set_temperature(0.7f);
      break;
    case 9:  // a reference head and divergences
      r.set_reference_head(kReference.name);
      *r.mutable_reference_hidden() = FloatTensor(
          v1::DATA_TYPE_BFLOAT16, Normal(n * kReference.hidden, seed + 7), {n, kReference.hidden});
      r.set_forward_kl(true);
      r.set_jsd_beta(0.25f);
      break;
    case 10: {  // another head, K = 2, top-2
      r.Clear();
      r.set_request_id(id);
      r.set_head(kSmall.name);
      *r.mutable_hidden() =
          FloatTensor(v1::DATA_TYPE_BFLOAT16, Normal(n * kSmall.hidden, seed), {n, kSmall.hidden});
      *r.mutable_target_ids() =
          IdTensor(v1::DATA_TYPE_INT64, RandomIds(2 * n, kSmall.vocab, seed), {n, 2});
      r.set_top_k(2);
      r.set_entropy(true);
      break;
    }
    case 11: {  // logits mode, V = 1000
      constexpr int64_t v = 1000;
      r.Clear();
      r.set_request_id(id);
      *r.mutable_logits() = FloatTensor(v1::DATA_TYPE_FLOAT32, Normal(n * v, seed, 3.0f), {n, v});
      *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT32, RandomIds(n, v, seed), {n});
      r.set_entropy(true);
      r.set_top_k(4);
      break;
    }
    default:
      break;
  }
  return r;
}

TEST(CoBatchingE2eTest, ResultsAreBitwiseTheSameAsEachRequestAlone) {
  // Batching server: up to 4096 rows per batch, and the oldest request waits up to 20 ms for
  // company, so concurrent clients really share batches. Baseline: never co-batches.
  std::unique_ptr<ServerProcess> batching = StartServer(
      {"--max-batch-tokens", "4096", "--max-queue-delay-us", "20000", "--workers", "1"});
  std::unique_ptr<ServerProcess> alone = StartServer({"--max-batch-tokens", "0"});
  ASSERT_NE(batching, nullptr);
  ASSERT_NE(alone, nullptr);

  constexpr int kThreads = 16;
  constexpr int kPerThread = 10;
  std::vector<std::vector<v1::ScoreRequest>> requests(kThreads);
  std::vector<std::vector<v1::ScoreResponse>> batched(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kPerThread; ++i) requests[t].push_back(RandomRequest(t, i));
    batched[t].resize(kPerThread);
  }
  {
    std::shared_ptr<grpc::Channel> channel = Connect(batching->address());
    std::vector<std::thread> threads;
    absl::Mutex mu;
    std::vector<std::string> failures;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        auto stub = v1::Scorer::NewStub(channel);
        for (int i = 0; i < kPerThread; ++i) {
          const grpc::Status s = CallScore(*stub, requests[t][i], &batched[t][i]);
          if (!s.ok()) {
            absl::MutexLock lock(&mu);
            failures.push_back(absl::StrCat(requests[t][i].request_id(), ": ", s.error_code(), " ",
                                            s.error_message()));
          }
        }
      });
    }
    for (std::thread& th : threads) th.join();
    EXPECT_THAT(failures, ::testing::IsEmpty());
  }

  // Batches really formed: some batch held more than one request.
  const Exposition e = ScrapeUntil(batching->metrics_address(), [](const Exposition& x) {
    return Value(x, "logitserve_requests_total", {{"method", "Score"}, {"code", "OK"}}) ==
           kThreads * kPerThread;
  });
  const double batches = BatchesLaunched(e);
  const double single = Value(e, "logitserve_batch_requests_bucket", {{"le", "1"}});
  EXPECT_GT(batches - single, 0) << "no batch held more than one request: the test proved nothing";
  EXPECT_LT(batches, kThreads * kPerThread);

  // Each request alone on the baseline server: the same bits. Every third baseline answer is
  // also checked against the fp64 reference, so two identical wrong answers cannot pass.
  auto stub = v1::Scorer::NewStub(Connect(alone->address()));
  int checked = 0;
  for (int t = 0; t < kThreads; ++t) {
    for (int i = 0; i < kPerThread; ++i) {
      const v1::ScoreRequest& r = requests[t][i];
      SCOPED_TRACE(r.request_id());
      v1::ScoreResponse want;
      const grpc::Status s = CallScore(*stub, r, &want);
      ASSERT_TRUE(s.ok()) << s.error_message();
      ExpectBitwiseEqual(batched[t][i], want);
      if ((t * kPerThread + i) % 3 == 0) {
        ExpectMatchesReference(r, want, ReferenceHeads());
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 0);
  const Exposition base = ScrapeUntil(alone->metrics_address(),
                                      [](const Exposition& x) { return BatchesLaunched(x) > 0; });
  // The baseline never co-batched (or its comparison would prove nothing).
  EXPECT_EQ(Value(base, "logitserve_batch_requests_bucket", {{"le", "1"}}), BatchesLaunched(base));
  ExpectCallStatesBalanced(batching->metrics_address(), kThreads * kPerThread);
}

// ---------------------------------------------------------------------------------------------
// ScoreStream.

// A stream whose responses are read on their own thread while the test writes.
class StreamClient {
 public:
  StreamClient(v1::Scorer::Stub& stub, const std::string& token = "") {
    context_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    if (!token.empty()) context_.AddMetadata("authorization", "Bearer " + token);
    stream_ = stub.ScoreStream(&context_);
    reader_ = std::thread([this] {
      v1::ScoreStreamResponse response;
      while (stream_->Read(&response)) {
        absl::MutexLock lock(&mu_);
        responses_.push_back(response);
      }
    });
  }
  ~StreamClient() {
    if (reader_.joinable()) {
      context_.TryCancel();
      reader_.join();
      stream_->Finish();
    }
  }
  bool Write(const v1::ScoreRequest& request) {
    v1::ScoreStreamRequest message;
    *message.mutable_request() = request;
    return stream_->Write(message);
  }
  void Cancel() { context_.TryCancel(); }
  // Half-closes (unless cancelled), waits for the last response and returns the final status.
  grpc::Status Finish(bool half_close = true) {
    if (half_close) stream_->WritesDone();
    reader_.join();
    return stream_->Finish();
  }
  std::vector<v1::ScoreStreamResponse> responses() const {
    absl::MutexLock lock(&mu_);
    return responses_;
  }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::ScoreStreamRequest, v1::ScoreStreamResponse>>
      stream_;
  std::thread reader_;
  mutable absl::Mutex mu_;
  std::vector<v1::ScoreStreamResponse> responses_ ABSL_GUARDED_BY(mu_);
};

TEST(ScoreStreamE2eTest, ManyInFlightMatchedByIdBadOnesFailAloneAndHalfCloseIsOk) {
  // slow-tile:40 and one worker: the first request (25 tiles, >= 1 s) holds the worker while the
  // others arrive, so the stream reaches its limit of 64 requests in flight and must pause
  // reading, then resume as requests complete.
  std::unique_ptr<ServerProcess> server =
      StartServer({"--test-fault", "slow-tile:40", "--workers", "1"});
  ASSERT_NE(server, nullptr);
  std::shared_ptr<grpc::Channel> channel = Connect(server->address());
  auto stub = v1::Scorer::NewStub(channel);

  constexpr int kRequests = 100;
  std::vector<v1::ScoreRequest> requests;
  for (int i = 0; i < kRequests; ++i) {
    const int64_t n = i == 0 ? 25 * kRowTile : (i * 7) % 41;
    requests.push_back(PolicyRequest(n, 100 + i, absl::StrCat("r", i)));
  }
  // Bad in validation: an id at the vocabulary size.
  {
    std::vector<int64_t> ids = RandomIds(4, kPolicy.vocab, 9);
    ids[2] = kPolicy.vocab;
    *requests[50].mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT32, ids, {4});
    *requests[50].mutable_hidden() =
        FloatTensor(v1::DATA_TYPE_BFLOAT16, Normal(4 * kPolicy.hidden, 9), {4, kPolicy.hidden});
  }
  // Bad in the backend's pass: logits mode with a NaN, next to valid logits-mode requests it may
  // share a batch with (the batch is retried member by member, so only it fails).
  for (int i : {70, 71, 72}) {
    constexpr int64_t n = 6, v = 500;
    std::vector<float> z = Normal(n * v, 200 + i);
    if (i == 71) z[4 * v + 17] = std::numeric_limits<float>::quiet_NaN();
    requests[i].Clear();
    requests[i].set_request_id(absl::StrCat("r", i));
    *requests[i].mutable_logits() = FloatTensor(v1::DATA_TYPE_FLOAT32, z, {n, v});
    requests[i].set_entropy(true);
  }

  double max_in_flight = 0;
  {
    StreamClient stream(*stub);
    for (const v1::ScoreRequest& r : requests) ASSERT_TRUE(stream.Write(r));
    // While the first request computes, the stream fills up to its limit and no further.
    const Exposition e = ScrapeUntil(server->metrics_address(),
                                     [](const Exposition& x) { return InFlight(x) >= 64; });
    max_in_flight = InFlight(e);
    const grpc::Status status = stream.Finish();
    EXPECT_TRUE(status.ok()) << status.error_code() << ": " << status.error_message();

    std::map<std::string, v1::ScoreStreamResponse> by_id;
    for (const v1::ScoreStreamResponse& response : stream.responses()) {
      EXPECT_TRUE(by_id.emplace(response.request_id(), response).second)
          << "two responses for " << response.request_id();
    }
    ASSERT_EQ(by_id.size(), static_cast<size_t>(kRequests));
    for (int i = 0; i < kRequests; ++i) {
      const v1::ScoreRequest& r = requests[i];
      SCOPED_TRACE(r.request_id());
      ASSERT_EQ(by_id.count(r.request_id()), 1u);
      const v1::ScoreStreamResponse& got = by_id[r.request_id()];
      if (i == 50) {
        EXPECT_EQ(got.status_code(), 3);  // INVALID_ARGUMENT
        EXPECT_THAT(got.status_message(), HasSubstr("target_ids"));
        EXPECT_THAT(got.status_message(), HasSubstr("row 2"));
        EXPECT_FALSE(got.has_response());
        continue;
      }
      if (i == 71) {
        EXPECT_EQ(got.status_code(), 3);
        EXPECT_THAT(got.status_message(), HasSubstr("logits"));
        EXPECT_THAT(got.status_message(), HasSubstr("row 4"));
        continue;
      }
      EXPECT_EQ(got.status_code(), 0) << got.status_message();
      EXPECT_EQ(got.response().request_id(), r.request_id());
      ExpectMatchesReference(r, got.response(), ReferenceHeads());
    }
    // Unary Score of the same requests gives the same bits (a sample: slow-tile makes each call
    // cost at least one tile).
    for (int i = 0; i < kRequests; i += 9) {
      if (i == 0) continue;
      v1::ScoreResponse unary;
      ASSERT_TRUE(CallScore(*stub, requests[i], &unary).ok());
      SCOPED_TRACE(requests[i].request_id());
      ExpectBitwiseEqual(by_id[requests[i].request_id()].response(), unary);
    }
  }
  EXPECT_EQ(max_in_flight, 64) << "one stream must hold at most 64 requests in flight, and 100 "
                                  "written while the first computes must reach that limit";

  // A stream with no requests: half-close finishes it OK with no responses.
  {
    StreamClient empty(*stub);
    EXPECT_TRUE(empty.Finish().ok());
    EXPECT_TRUE(empty.responses().empty());
  }
  const Exposition e = ScrapeUntil(server->metrics_address(), [](const Exposition& x) {
    return Value(x, "logitserve_requests_total", {{"method", "ScoreStream"}, {"code", "OK"}}) >=
           kRequests - 2;
  });
  EXPECT_EQ(Value(e, "logitserve_requests_total", {{"method", "ScoreStream"}, {"code", "OK"}}),
            kRequests - 2);
  EXPECT_EQ(Value(e, "logitserve_requests_total",
                  {{"method", "ScoreStream"}, {"code", "INVALID_ARGUMENT"}}),
            2);
  ExpectCallStatesBalanced(server->metrics_address(), 2);
}

TEST(ScoreStreamE2eTest, ClientCancelMidStreamStopsItsWorkAndTheServerKeepsServing) {
  // No co-batching and one worker: the stream's first request (200 tiles of 50 ms: >= 10 s) is
  // computing, the other 19 wait in the queue. After the cancel the first stops at its next tile
  // and the queued ones are never launched.
  std::unique_ptr<ServerProcess> server =
      StartServer({"--test-fault", "slow-tile:50", "--workers", "1", "--max-batch-tokens", "0"});
  ASSERT_NE(server, nullptr);
  std::shared_ptr<grpc::Channel> channel = Connect(server->address());
  auto stub = v1::Scorer::NewStub(channel);
  constexpr int kRequests = 20;
  constexpr int64_t kLongRows = 200 * kRowTile;

  const Clock::time_point start = Clock::now();
  {
    StreamClient stream(*stub);
    for (int i = 0; i < kRequests; ++i) {
      ASSERT_TRUE(stream.Write(
          PolicyRequest(i == 0 ? kLongRows : kRowTile, 300 + i, absl::StrCat("c", i))));
    }
    const Exposition e = ScrapeUntil(server->metrics_address(),
                                     [](const Exposition& x) { return InFlight(x) == kRequests; });
    ASSERT_EQ(InFlight(e), kRequests);
    stream.Cancel();
    const grpc::Status status = stream.Finish(/*half_close=*/false);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::CANCELLED) << status.error_message();
    for (const v1::ScoreStreamResponse& r : stream.responses()) {
      EXPECT_NE(r.status_code(), 0) << r.request_id() << " completed on a cancelled stream";
    }
  }
  // The next request is served long before the cancelled work could have finished: had the first
  // request not stopped, this one would wait for its 200 tiles of >= 50 ms each, >= 10 s after
  // `start`. Stopped, it finishes within about two tiles; 5 s leaves 4+ s of slack.
  v1::ScoreResponse response;
  const v1::ScoreRequest next = PolicyRequest(3, 999, "after-cancel");
  const grpc::Status s = CallScore(*stub, next, &response);
  const double elapsed = Seconds(Clock::now() - start);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ExpectMatchesReference(next, response, ReferenceHeads());
  EXPECT_LT(elapsed, 5.0) << "the cancelled stream's work was not stopped";

  grpc::Status health_status;
  EXPECT_EQ(CheckHealth(channel, &health_status), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_TRUE(health_status.ok()) << health_status.error_message();

  ExpectCallStatesBalanced(server->metrics_address(), 2);
  absl::StatusOr<Exposition> scraped = ScrapeMetrics(server->metrics_address());
  ASSERT_TRUE(scraped.ok()) << scraped.status();
  const Exposition& e = *scraped;
  // Launched: the first stream request (then stopped) and `next`; the 19 queued ones never were.
  EXPECT_EQ(BatchesLaunched(e), 2);
  EXPECT_EQ(RowsLaunched(e), kLongRows + 3);
  EXPECT_EQ(TokensScored(e), 3);
  EXPECT_EQ(Value(e, "logitserve_requests_total", {{"method", "ScoreStream"}, {"code", "OK"}}), 0);
}

TEST(ScoreStreamE2eTest, StreamWithoutTheTokenIsUnauthenticatedAndComputesNothing) {
  const std::string dir = ::testing::TempDir();
  const std::string token_file = dir + "/serving_e2e_user.token";
  {
    FILE* f = std::fopen(token_file.c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs("stream-token-3b7d\n", f);
    std::fclose(f);
  }
  std::unique_ptr<ServerProcess> server = StartServer({"--auth-token-file", token_file});
  ASSERT_NE(server, nullptr);
  auto stub = v1::Scorer::NewStub(Connect(server->address()));
  const v1::ScoreRequest request = PolicyRequest(5, 77, "auth");
  for (const std::string& token : {std::string(), std::string("stream-token-3b7e")}) {
    SCOPED_TRACE(token.empty() ? "no token" : "wrong token");
    StreamClient stream(*stub, token);
    stream.Write(request);  // may fail once the server has finished the call
    const grpc::Status status = stream.Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAUTHENTICATED) << status.error_message();
    EXPECT_TRUE(stream.responses().empty());
  }
  const Exposition before = ScrapeUntil(server->metrics_address(), [](const Exposition& x) {
    return Value(x, "logitserve_requests_total",
                 {{"method", "ScoreStream"}, {"code", "UNAUTHENTICATED"}}) >= 2;
  });
  EXPECT_EQ(Value(before, "logitserve_requests_total",
                  {{"method", "ScoreStream"}, {"code", "UNAUTHENTICATED"}}),
            2);
  EXPECT_EQ(BatchesLaunched(before), 0) << "an unauthenticated request reached the backend";

  // The right token: served.
  StreamClient stream(*stub, "stream-token-3b7d");
  ASSERT_TRUE(stream.Write(request));
  ASSERT_TRUE(stream.Finish().ok());
  ASSERT_EQ(stream.responses().size(), 1u);
  EXPECT_EQ(stream.responses()[0].status_code(), 0) << stream.responses()[0].status_message();
  ExpectMatchesReference(request, stream.responses()[0].response(), ReferenceHeads());
  ExpectCallStatesBalanced(server->metrics_address(), 3);
}

}  // namespace
}  // namespace logitserve::e2e::serving
