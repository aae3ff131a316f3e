// Client-side chunk pipelining (issue 12 target 2) against the real server: a large Score sent
// as chunks over one ScoreStream gives bitwise the outputs of one unsplit request (and of the fp64
// reference) however it is cut, with or without per-sequence sums; an error in a chunk names the
// row of the whole request; the deadline covers every chunk, and a failed or expired request
// stops the chunks still to come.
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "client/client.h"
#include "client/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/client/output_expect.h"
#include "tests/service/e2e_support.h"
#include "tests/service/prometheus_text.h"
#include "tests/support/server_process.h"

namespace logitserve::client {
namespace {

using ::logitserve::testing::ServerProcess;
using testing::Bits;
using ::testing::HasSubstr;

const e2e::SyntheticHead& kHead = e2e::kPolicy;  // V = 3000, H = 64
constexpr int64_t kRows = 100;
// fp32 hidden states: 256 bytes per row, + 8 bytes of [N, 2] int32 ids.
constexpr int64_t kRowBytes = kHead.hidden * 4 + 8;

v1::ScoreRequest Request(int64_t rows, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> h(rows * kHead.hidden);
  for (float& v : h) v = normal(rng);
  std::vector<int32_t> ids(rows * 2);
  for (int32_t& id : ids) id = static_cast<int32_t>(rng() % kHead.vocab);
  v1::ScoreRequest req;
  req.set_request_id("big");
  req.set_head(kHead.name);
  *req.mutable_hidden() = TensorOf(h, {rows, kHead.hidden});
  *req.mutable_target_ids() = TensorOf(ids, {rows, 2});
  req.set_entropy(true);
  req.set_top_k(3);
  return req;
}

ClientOptions Pipelined(int64_t chunk_rows, int depth, int streams = 2) {
  ClientOptions o;
  o.max_attempts = 1;
  o.pipeline_chunk_bytes = chunk_rows * kRowBytes;
  o.pipeline_depth = depth;
  o.pipeline_streams = streams;
  return o;
}

void ExpectSameBits(const ScoreOutput& a, const ScoreOutput& b) {
  EXPECT_EQ(a.rows, b.rows);
  EXPECT_EQ(Bits(a.target_logprobs), Bits(b.target_logprobs));
  EXPECT_EQ(Bits(a.entropy), Bits(b.entropy));
  EXPECT_EQ(a.top_k_ids, b.top_k_ids);
  EXPECT_EQ(Bits(a.top_k_logprobs), Bits(b.top_k_logprobs));
}

class PipelineE2ETest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = e2e::StartServerProcess({"--backend", "cpu", "--threads", "2", "--synthetic-head",
                                       kHead.Flag(), "--metrics-listen", "127.0.0.1:0"});
  }
  static void TearDownTestSuite() { server_.reset(); }
  void SetUp() override { ASSERT_NE(server_, nullptr); }
  std::unique_ptr<Client> MakeClient(ClientOptions o) {
    auto c = Client::Create(server_->address(), o);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *std::move(c) : nullptr;
  }
  static inline std::unique_ptr<ServerProcess> server_;
};

TEST_F(PipelineE2ETest, ChunkedResultIsBitwiseTheUnsplitOne) {
  const v1::ScoreRequest req = Request(kRows, 1);
  ClientOptions off;
  off.pipeline_chunk_bytes = 0;
  std::unique_ptr<Client> whole_client = MakeClient(off);
  absl::StatusOr<ScoreOutput> whole = whole_client->Score(req);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->chunks, 1);
  testing::ExpectMatchesReference(req, *whole, {{kHead.name, e2e::ReferenceHead(kHead)}});

  // 100 rows as 7-row chunks (15 chunks, the last one short), 1 to 8 in flight on 1 to 3
  // streams; and 33-row ones.
  for (const auto& [chunk_rows, depth, streams] : std::vector<std::tuple<int64_t, int, int>>{
           {7, 1, 1}, {7, 3, 2}, {7, 8, 3}, {33, 2, 2}, {33, 1, 4}}) {
    SCOPED_TRACE(::testing::Message() << chunk_rows << " rows per chunk, depth " << depth << ", "
                                      << streams << " streams");
    std::unique_ptr<Client> client = MakeClient(Pipelined(chunk_rows, depth, streams));
    absl::StatusOr<ScoreOutput> out = client->Score(req);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->chunks, (kRows + chunk_rows - 1) / chunk_rows);
    EXPECT_EQ(out->request_id, "big");
    EXPECT_EQ(out->head_version, whole->head_version);
    ExpectSameBits(*out, *whole);
  }
}

TEST_F(PipelineE2ETest, SequencesStayWholeAndSumsMatch) {
  v1::ScoreRequest req = Request(kRows, 2);
  for (int64_t len : {10, 25, 5, 0, 30, 30}) req.add_sequence_lengths(len);
  ClientOptions off;
  off.pipeline_chunk_bytes = 0;
  absl::StatusOr<ScoreOutput> whole = MakeClient(off)->Score(req);
  ASSERT_TRUE(whole.ok()) << whole.status();
  absl::StatusOr<ScoreOutput> out = MakeClient(Pipelined(40, 3))->Score(req);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->chunks, 3);  // {10, 25, 5, 0}, {30}, {30}
  ExpectSameBits(*out, *whole);
  ASSERT_TRUE(out->sequence_sums.has_value() && whole->sequence_sums.has_value());
  EXPECT_EQ(Bits(out->sequence_sums->entropy), Bits(whole->sequence_sums->entropy));
  EXPECT_EQ(Bits(out->sequence_sums->target_logprobs), Bits(whole->sequence_sums->target_logprobs));
  EXPECT_EQ(out->sequence_sums->token_count, whole->sequence_sums->token_count);

  // A sequence longer than a pipeline chunk: the request is not pipelined, and still succeeds.
  absl::StatusOr<ScoreOutput> unpiped = MakeClient(Pipelined(20, 3))->Score(req);
  ASSERT_TRUE(unpiped.ok()) << unpiped.status();
  EXPECT_EQ(unpiped->chunks, 1);
  ExpectSameBits(*unpiped, *whole);
}

TEST_F(PipelineE2ETest, ErrorNamesTheRowOfTheWholeRequest) {
  v1::ScoreRequest req = Request(kRows, 3);
  float nan = std::numeric_limits<float>::quiet_NaN();
  std::string* data = req.mutable_hidden()->mutable_data();
  std::memcpy(data->data() + (63 * kHead.hidden + 5) * 4, &nan, 4);  // row 63, column 5
  absl::Status s = MakeClient(Pipelined(10, 4))->Score(req).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("rows [60, 70) of 100"));
  EXPECT_THAT(s.message(), HasSubstr("hidden: row 63 contains NaN (column 5)"));
}

// A server that sleeps 1 s per 64 rows (156 ms per 10-row chunk): 20 chunks need >= 3 s, the
// deadline is 0.5 s. The request must fail with DEADLINE_EXCEEDED at about the deadline, and the
// server must not compute the chunks still to come.
TEST(PipelineDeadlineE2ETest, DeadlineCoversEveryChunk) {
  std::unique_ptr<ServerProcess> server = e2e::StartServerProcess(
      {"--backend", "cpu", "--threads", "2", "--synthetic-head", kHead.Flag(), "--test-fault",
       "slow-tile:1000", "--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(server, nullptr);
  ClientOptions o = Pipelined(10, 2);
  o.rpc_timeout = absl::Milliseconds(500);
  auto client = Client::Create(server->address(), o);
  ASSERT_TRUE(client.ok());
  const auto start = std::chrono::steady_clock::now();
  const absl::Status s = (*client)->Score(Request(200, 4)).status();
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_LT(elapsed, std::chrono::milliseconds(1500));
  // Give the server time to finish what it had started, then count what it scored.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  absl::StatusOr<::logitserve::testing::Exposition> m =
      ::logitserve::testing::ScrapeMetrics(server->metrics_address());
  ASSERT_TRUE(m.ok()) << m.status();
  const std::optional<double> scored =
      ::logitserve::testing::SampleValue(*m, "logitserve_tokens_scored_total");
  ASSERT_TRUE(scored.has_value());
  EXPECT_LT(*scored, 100) << "the server kept computing chunks of an expired request";
}

}  // namespace
}  // namespace logitserve::client
