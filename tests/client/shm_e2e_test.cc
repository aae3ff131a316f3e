// Shared-memory inputs end to end (issue 12 target 3): the C++ client writes tensors into a POSIX
// shared-memory object, registers it with the real server (auth on) and sends requests naming
// region + offset. Results must be bitwise those of the same values sent as bytes (and match the
// fp64 reference); every bad range, dtype, size, name and token is refused before a byte is read;
// unregistering waits for the request reading the region. These calls take the client's default
// path, the shared-memory call channels (shm_channel_e2e_test.cc tests them on their own). With
// channels off, shared-memory calls go over the client's long-lived session streams
// (client/session_stream.h): the same bits as unary calls, each concurrent caller its own answer,
// the request's own errors, a deadline per call.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "client/shm.h"
#include "client/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "logitserve/kernels/dtype.h"
#include "tests/client/output_expect.h"
#include "tests/client/shm_support.h"
#include "tests/service/e2e_support.h"
#include "tests/service/prometheus_text.h"
#include "tests/support/server_process.h"

namespace logitserve::client {
namespace {

using ::logitserve::testing::ServerProcess;
using namespace shm_test;  // NOLINT(build/namespaces): the suite's own helpers
using testing::Bits;
using ::testing::HasSubstr;

class SharedMemoryE2ETest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    token_file_ = TokenFile();
    server_ = e2e::StartServerProcess({"--backend", "cpu", "--threads", "2", "--synthetic-head",
                                       kHead.Flag(), "--auth-token-file", token_file_});
  }
  static void TearDownTestSuite() {
    server_.reset();
    std::remove(token_file_.c_str());
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    auto client = Client::Create(server_->address(), WithToken(kToken));
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }
  std::unique_ptr<SharedMemoryBuffer> Registered(const std::string& what, uint64_t bytes,
                                                 std::string* name) {
    return RegisteredObject(*client_, what, bytes, name);
  }

  static inline std::unique_ptr<ServerProcess> server_;
  static inline std::string token_file_;
  std::unique_ptr<Client> client_;
};

TEST_F(SharedMemoryE2ETest, MatchesBytesBitwiseAndFp64) {
  constexpr int64_t kRows = 37;
  const Inputs in = MakeInputs(kRows, 1);
  std::string name;
  std::unique_ptr<SharedMemoryBuffer> shm = Registered("happy", BytesOf(kRows), &name);
  ASSERT_NE(shm, nullptr);
  WriteInputs(in, *shm);

  const v1::ScoreRequest by_bytes = BytesRequest(in, kRows);
  absl::StatusOr<ScoreOutput> want = client_->Score(by_bytes);
  ASSERT_TRUE(want.ok()) << want.status();
  testing::ExpectMatchesReference(by_bytes, *want, {{kHead.name, e2e::ReferenceHead(kHead)}});

  absl::StatusOr<ScoreOutput> got = client_->Score(ShmRequest(name, kRows));
  ASSERT_TRUE(got.ok()) << got.status();
  ExpectBitwiseEqual(*got, *want);

  // Split by the client into 8-row chunks: each chunk names its rows' offsets in the region.
  ClientOptions split = WithToken(kToken);
  split.max_rows_per_request = 8;
  auto chunked = Client::Create(server_->address(), split);
  ASSERT_TRUE(chunked.ok());
  absl::StatusOr<ScoreOutput> pieces = (*chunked)->Score(ShmRequest(name, kRows));
  ASSERT_TRUE(pieces.ok()) << pieces.status();
  EXPECT_EQ(pieces->chunks, 5);
  ExpectBitwiseEqual(*pieces, *want);
  EXPECT_TRUE(client_->UnregisterSharedMemory(name).ok());
}

TEST_F(SharedMemoryE2ETest, LogitsFromSharedMemoryMatchBytes) {
  constexpr int64_t kRows = 3, kVocab = 257;
  std::mt19937_64 rng(2);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> logits(kRows * kVocab), ref(kRows * kVocab);
  for (float& v : logits) v = normal(rng);
  for (float& v : ref) v = normal(rng);
  std::string name;
  std::unique_ptr<SharedMemoryBuffer> shm = Registered("logits", 4096 + logits.size() * 4, &name);
  ASSERT_NE(shm, nullptr);
  std::memcpy(static_cast<char*>(shm->data()) + 4096, logits.data(), logits.size() * 4);

  v1::ScoreRequest by_bytes;
  *by_bytes.mutable_logits() = TensorOf(logits, {kRows, kVocab});
  *by_bytes.mutable_reference_logits() = TensorOf(ref, {kRows, kVocab});
  by_bytes.set_forward_kl(true);
  by_bytes.set_entropy(true);
  v1::ScoreRequest by_shm = by_bytes;
  *by_shm.mutable_logits() = SharedMemoryTensor(name, 4096, v1::DATA_TYPE_FLOAT32, {kRows, kVocab});
  by_shm.mutable_logits()->mutable_shared_memory()->set_byte_size(logits.size() * 4);

  absl::StatusOr<ScoreOutput> want = client_->Score(by_bytes);
  absl::StatusOr<ScoreOutput> got = client_->Score(by_shm);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_TRUE(got.ok()) << got.status();
  testing::ExpectMatchesReference(by_bytes, *want);
  EXPECT_EQ(Bits(got->entropy), Bits(want->entropy));
  EXPECT_EQ(Bits(got->forward_kl), Bits(want->forward_kl));
  EXPECT_TRUE(client_->UnregisterSharedMemory(name).ok());
}

TEST_F(SharedMemoryE2ETest, RangesOutsideTheRegionAreRefused) {
  constexpr int64_t kRows = 16;
  std::string name;
  // One byte short of what the request needs.
  std::unique_ptr<SharedMemoryBuffer> shm = Registered("small", BytesOf(kRows) - 1, &name);
  ASSERT_NE(shm, nullptr);

  absl::Status s = client_->Score(ShmRequest(name, kRows)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("target_ids.shared_memory"));
  EXPECT_THAT(s.message(), HasSubstr("not inside region"));

  v1::ScoreRequest past_end = ShmRequest(name, kRows);
  past_end.mutable_hidden()->mutable_shared_memory()->set_offset(BytesOf(kRows) + 8);
  s = client_->Score(past_end).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("hidden.shared_memory"));

  // An offset that would wrap around when added to the size.
  v1::ScoreRequest wrap = ShmRequest(name, kRows);
  wrap.mutable_hidden()->mutable_shared_memory()->set_offset(std::numeric_limits<uint64_t>::max() -
                                                             16);
  s = client_->Score(wrap).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;

  // A region past the object's end cannot be registered.
  s = client_->RegisterSharedMemory(Unique("too-big"), shm->key(), 0, shm->size() + 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  s = client_->RegisterSharedMemory(Unique("too-far"), shm->key(), shm->size(), 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(client_->UnregisterSharedMemory(name).ok());
}

TEST_F(SharedMemoryE2ETest, WrongDtypeOrSizeIsRefused) {
  constexpr int64_t kRows = 4;
  std::string name;
  std::unique_ptr<SharedMemoryBuffer> shm = Registered("dtype", 4 * BytesOf(kRows), &name);
  ASSERT_NE(shm, nullptr);

  v1::ScoreRequest float_ids = ShmRequest(name, kRows);
  float_ids.mutable_target_ids()->set_dtype(v1::DATA_TYPE_FLOAT32);
  absl::Status s = client_->Score(float_ids).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("target_ids: dtype"));

  // byte_size declared for fp32 hidden states, dtype bf16.
  v1::ScoreRequest mismatch = ShmRequest(name, kRows);
  mismatch.mutable_hidden()->mutable_shared_memory()->set_byte_size(kRows * kHead.hidden * 4);
  s = client_->Score(mismatch).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("hidden.shared_memory.byte_size"));

  // Bytes and a shared-memory reference at once (a raw stub: the client refuses it itself).
  v1::ScoreRequest both = ShmRequest(name, kRows);
  both.mutable_hidden()->set_data(std::string(kRows * kHead.hidden * 2, '\0'));
  auto stub = v1::Scorer::NewStub(e2e::Connect(server_->address()));
  grpc::ClientContext ctx;
  ctx.AddMetadata("authorization", std::string("Bearer ") + kToken);
  v1::ScoreResponse resp;
  const grpc::Status gs = stub->Score(&ctx, both, &resp);
  EXPECT_EQ(gs.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << gs.error_message();
  EXPECT_THAT(gs.error_message(), HasSubstr("must be empty when shared_memory is set"));
  EXPECT_TRUE(client_->UnregisterSharedMemory(name).ok());
}

TEST_F(SharedMemoryE2ETest, TokensAreRequired) {
  std::string name;
  std::unique_ptr<SharedMemoryBuffer> shm = Registered("auth", BytesOf(2), &name);
  ASSERT_NE(shm, nullptr);
  for (const char* token : {static_cast<const char*>(nullptr), "wrong-token"}) {
    auto anonymous = Client::Create(server_->address(), WithToken(token));
    ASSERT_TRUE(anonymous.ok());
    const absl::Status reg =
        (*anonymous)->RegisterSharedMemory(Unique("anon"), shm->key(), 0, shm->size());
    EXPECT_EQ(reg.code(), absl::StatusCode::kUnauthenticated) << reg;
    const absl::Status unreg = (*anonymous)->UnregisterSharedMemory(name);
    EXPECT_EQ(unreg.code(), absl::StatusCode::kUnauthenticated) << unreg;
    const absl::Status score = (*anonymous)->Score(ShmRequest(name, 2)).status();
    EXPECT_EQ(score.code(), absl::StatusCode::kUnauthenticated) << score;
  }
  // The region survived the anonymous attempts.
  EXPECT_TRUE(client_->Score(ShmRequest(name, 2)).ok());
  EXPECT_TRUE(client_->UnregisterSharedMemory(name).ok());
}

TEST_F(SharedMemoryE2ETest, NamesAndKeysAreChecked) {
  std::string name;
  std::unique_ptr<SharedMemoryBuffer> shm = Registered("names", BytesOf(2), &name);
  ASSERT_NE(shm, nullptr);
  EXPECT_EQ(client_->RegisterSharedMemory(name, shm->key(), 0, 8).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(client_->RegisterSharedMemory(Unique("x"), "/" + Unique("no-such-object"), 0, 8).code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->RegisterSharedMemory(Unique("x"), "/etc/passwd", 0, 8).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->RegisterSharedMemory("bad name!", shm->key(), 0, 8).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(client_->RegisterSharedMemory(Unique("x"), shm->key(), 0, 0).code(),
            absl::StatusCode::kInvalidArgument);

  EXPECT_TRUE(client_->UnregisterSharedMemory(name).ok());
  EXPECT_EQ(client_->UnregisterSharedMemory(name).code(), absl::StatusCode::kNotFound);
  const absl::Status s = client_->Score(ShmRequest(name, 2)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(s.message(), HasSubstr("hidden.shared_memory.region"));
}

TEST_F(SharedMemoryE2ETest, ShrunkObjectIsRefused) {
  std::string name;
  std::unique_ptr<SharedMemoryBuffer> shm = Registered("shrunk", 2 * BytesOf(2), &name);
  ASSERT_NE(shm, nullptr);
  ASSERT_TRUE(client_->Score(ShmRequest(name, 2)).ok());
  const int fd = shm_open(shm->key().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 16), 0);
  close(fd);
  const absl::Status s = client_->Score(ShmRequest(name, 2)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("no longer holds"));
  EXPECT_TRUE(client_->UnregisterSharedMemory(name).ok());
}

// A server that sleeps 150 ms per 64-row tile (--test-fault slow-tile), so a 256-row request is
// in flight for ~0.6 s: Unregister, sent while it computes, must answer only after it finished,
// and the request must still get the right answer.
TEST(SharedMemoryUnregisterE2ETest, WaitsForTheRequestReadingIt) {
  constexpr int64_t kRows = 256;
  std::unique_ptr<ServerProcess> server =
      e2e::StartServerProcess({"--backend", "cpu", "--threads", "2", "--synthetic-head",
                               kHead.Flag(), "--test-fault", "slow-tile:150"});
  ASSERT_NE(server, nullptr);
  auto client = Client::Create(server->address(), WithToken(nullptr));
  ASSERT_TRUE(client.ok());
  const Inputs in = MakeInputs(kRows, 3);
  auto shm = SharedMemoryBuffer::Create("/" + Unique("busy"), BytesOf(kRows));
  ASSERT_TRUE(shm.ok()) << shm.status();
  WriteInputs(in, **shm);
  const std::string name = Unique("busy");
  ASSERT_TRUE((*client)->RegisterSharedMemory(name, (*shm)->key(), 0, BytesOf(kRows)).ok());

  using Clock = std::chrono::steady_clock;
  Clock::time_point score_done;
  absl::StatusOr<ScoreOutput> got = absl::UnknownError("not run");
  std::thread scorer([&] {
    got = (*client)->Score(ShmRequest(name, kRows));
    score_done = Clock::now();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const absl::Status unregistered = (*client)->UnregisterSharedMemory(name);
  const Clock::time_point unregister_done = Clock::now();
  scorer.join();
  ASSERT_TRUE(unregistered.ok()) << unregistered;
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_LE(score_done - unregister_done, std::chrono::milliseconds(50))
      << "Unregister returned while the request was still reading the region";
  absl::StatusOr<ScoreOutput> want = (*client)->Score(BytesRequest(in, kRows));
  ASSERT_TRUE(want.ok()) << want.status();
  ExpectBitwiseEqual(*got, *want);
  EXPECT_EQ((*client)->Score(ShmRequest(name, kRows)).status().code(), absl::StatusCode::kNotFound);
}

// Session streams: the server counts every request a ScoreStream carried
// (logitserve_requests_total{method="ScoreStream"}) and every unary Score apart.
class SessionStreamE2ETest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    server_ = e2e::StartServerProcess({"--backend", "cpu", "--threads", "2", "--synthetic-head",
                                       kHead.Flag(), "--metrics-listen", "127.0.0.1:0"});
  }
  static void TearDownTestSuite() { server_.reset(); }
  static std::unique_ptr<Client> MakeClient(int session_streams) {
    ClientOptions o = WithToken(nullptr);
    o.session_streams = session_streams;
    o.shm_channels = 0;  // shm_channel_e2e_test.cc covers those
    auto client = Client::Create(server_->address(), o);
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }
  static double Count(const char* method, const char* code) {
    absl::StatusOr<::logitserve::testing::Exposition> m =
        ::logitserve::testing::ScrapeMetrics(server_->metrics_address());
    EXPECT_TRUE(m.ok()) << m.status();
    if (!m.ok()) return -1;
    return ::logitserve::testing::SampleValue(*m, "logitserve_requests_total",
                                              {{"method", method}, {"code", code}})
        .value_or(0.0);
  }
  static inline std::unique_ptr<ServerProcess> server_;
};

TEST_F(SessionStreamE2ETest, SharedMemoryCallsUseTheStreamWithTheBitsOfUnaryCalls) {
  ASSERT_NE(server_, nullptr);
  constexpr int64_t kRows = 9;
  constexpr int kCalls = 20;
  std::unique_ptr<Client> streamed = MakeClient(4), unary = MakeClient(0);
  ASSERT_NE(streamed, nullptr);
  ASSERT_NE(unary, nullptr);
  std::string name;
  std::unique_ptr<SharedMemoryBuffer> shm = RegisteredInputs(*streamed, "session", kRows, 7, &name);
  ASSERT_NE(shm, nullptr);

  const double stream_before = Count("ScoreStream", "OK"), unary_before = Count("Score", "OK");
  absl::StatusOr<ScoreOutput> want = unary->Score(ShmRequest(name, kRows));
  ASSERT_TRUE(want.ok()) << want.status();
  for (int i = 0; i < kCalls; ++i) {
    absl::StatusOr<ScoreOutput> got = streamed->Score(ShmRequest(name, kRows));
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectBitwiseEqual(*got, *want);
  }
  // A request with tensor bytes stays unary.
  absl::StatusOr<ScoreOutput> by_bytes = streamed->Score(BytesRequest(MakeInputs(kRows, 7), kRows));
  ASSERT_TRUE(by_bytes.ok()) << by_bytes.status();
  ExpectBitwiseEqual(*by_bytes, *want);
  EXPECT_EQ(Count("ScoreStream", "OK") - stream_before, kCalls);
  EXPECT_EQ(Count("Score", "OK") - unary_before, 2);
  EXPECT_TRUE(streamed->UnregisterSharedMemory(name).ok());
}

TEST_F(SessionStreamE2ETest, ConcurrentCallersEachGetTheirOwnAnswer) {
  ASSERT_NE(server_, nullptr);
  constexpr int kThreads = 6, kCalls = 10;
  constexpr int64_t kRows = kThreads;  // thread t asks for the first t + 1 rows
  std::unique_ptr<Client> streamed = MakeClient(2), unary = MakeClient(0);
  ASSERT_NE(streamed, nullptr);
  ASSERT_NE(unary, nullptr);
  std::string name;
  std::unique_ptr<SharedMemoryBuffer> shm =
      RegisteredInputs(*streamed, "concurrent", kRows, 8, &name);
  ASSERT_NE(shm, nullptr);
  // Rows [0, t + 1) of a region laid out for kRows rows: the ids start after all kRows rows.
  auto request = [&](int64_t rows) {
    v1::ScoreRequest req = ShmRequest(name, rows);
    *req.mutable_target_ids() =
        SharedMemoryTensor(name, kRows * kHead.hidden * 2, v1::DATA_TYPE_INT32, {rows});
    return req;
  };
  std::vector<ScoreOutput> want;
  for (int t = 0; t < kThreads; ++t) {
    absl::StatusOr<ScoreOutput> w = unary->Score(request(t + 1));
    ASSERT_TRUE(w.ok()) << w.status();
    want.push_back(*std::move(w));
  }
  ExpectConcurrentCallersGetTheirOwnAnswers(*streamed, want, request, kThreads, kCalls);
  EXPECT_TRUE(streamed->UnregisterSharedMemory(name).ok());
}

TEST_F(SessionStreamE2ETest, ARequestsOwnErrorLeavesTheStreamInUse) {
  ASSERT_NE(server_, nullptr);
  std::unique_ptr<Client> streamed = MakeClient(1), unary = MakeClient(0);
  ASSERT_NE(streamed, nullptr);
  ASSERT_NE(unary, nullptr);
  const v1::ScoreRequest missing = ShmRequest(Unique("never-registered"), 2);
  const double stream_before = Count("ScoreStream", "NOT_FOUND");
  const absl::Status want = unary->Score(missing).status();
  const absl::Status got = streamed->Score(missing).status();
  EXPECT_EQ(want.code(), absl::StatusCode::kNotFound) << want;
  EXPECT_EQ(got.code(), want.code()) << got;
  EXPECT_EQ(got.message(), want.message());
  EXPECT_THAT(got.message(), HasSubstr("hidden.shared_memory.region"));
  EXPECT_EQ(Count("ScoreStream", "NOT_FOUND") - stream_before, 1)
      << "the error must come from the stream, not from a unary retry";
  // The same stream carries the next request.
  constexpr int64_t kRows = 3;
  std::string name;
  std::unique_ptr<SharedMemoryBuffer> shm =
      RegisteredInputs(*streamed, "after-error", kRows, 9, &name);
  ASSERT_NE(shm, nullptr);
  const double ok_before = Count("ScoreStream", "OK");
  EXPECT_TRUE(streamed->Score(ShmRequest(name, kRows)).ok());
  EXPECT_EQ(Count("ScoreStream", "OK") - ok_before, 1);
  EXPECT_TRUE(streamed->UnregisterSharedMemory(name).ok());
}

// A server that sleeps 1 s per 64 rows: a call with a 300 ms deadline ends at about the deadline
// with DEADLINE_EXCEEDED, and the client's next call (a new stream) still works.
TEST(SessionStreamDeadlineE2ETest, ACallEndsAtItsDeadline) {
  std::unique_ptr<ServerProcess> server =
      e2e::StartServerProcess({"--backend", "cpu", "--threads", "2", "--synthetic-head",
                               kHead.Flag(), "--test-fault", "slow-tile:1000"});
  ASSERT_NE(server, nullptr);
  ClientOptions o = WithToken(nullptr);
  o.rpc_timeout = absl::Milliseconds(300);
  o.shm_channels = 0;
  auto client = Client::Create(server->address(), o);
  ASSERT_TRUE(client.ok()) << client.status();
  constexpr int64_t kRows = 64;
  std::string name;
  std::unique_ptr<SharedMemoryBuffer> shm =
      RegisteredInputs(**client, "deadline", kRows, 10, &name);
  ASSERT_NE(shm, nullptr);
  for (int i = 0; i < 2; ++i) {
    const auto start = std::chrono::steady_clock::now();
    const absl::Status s = (*client)->Score(ShmRequest(name, kRows)).status();
    const auto elapsed = std::chrono::steady_clock::now() - start;
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_LT(elapsed, std::chrono::milliseconds(900)) << "call " << i;
  }
  // Unregistering waits for the abandoned requests that still read the region (about 1 s each):
  // longer than this client's deadline, so another client's.
  auto patient = Client::Create(server->address(), WithToken(nullptr));
  ASSERT_TRUE(patient.ok()) << patient.status();
  const absl::Status unregistered = (*patient)->UnregisterSharedMemory(name);
  EXPECT_TRUE(unregistered.ok()) << unregistered;
}

}  // namespace
}  // namespace logitserve::client
