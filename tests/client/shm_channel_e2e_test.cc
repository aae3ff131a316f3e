// Shared-memory call channels end to end (issue 12 target 3; common/wire/shm_channel.h): Score
// requests posted into a control region the real server maps, answered without a gRPC round trip.
// Through the C++ client: the bits of unary calls, each concurrent caller its own answer, a
// request's own error, a deadline per call, the server's channel limit. By hand (the region
// written as the protocol says): what opening checks (token, object, header, claim), requests the
// server must refuse without harm (a length past the area, bytes that do not parse, an answer too
// large for its area), and a region shrunk under the server.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "client/shm.h"
#include "common/wire/shm_channel.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/client/shm_support.h"
#include "tests/service/e2e_support.h"
#include "tests/service/prometheus_text.h"
#include "tests/support/server_process.h"

namespace logitserve::client {
namespace {

using ::logitserve::testing::ServerProcess;
using namespace shm_test;  // NOLINT(build/namespaces): the suite's own helpers
using ::testing::HasSubstr;
using wire::ShmChannelLayout;

// Counts of logitserve_requests_total{method, code} on `server`'s metrics endpoint.
double Count(const ServerProcess& server, const char* method, const char* code) {
  absl::StatusOr<::logitserve::testing::Exposition> m =
      ::logitserve::testing::ScrapeMetrics(server.metrics_address());
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return -1;
  return ::logitserve::testing::SampleValue(*m, "logitserve_requests_total",
                                            {{"method", method}, {"code", code}})
      .value_or(0.0);
}

std::unique_ptr<Client> MakeClient(const ServerProcess& server, int shm_channels,
                                   const char* token = kToken) {
  ClientOptions o = WithToken(token);
  o.shm_channels = shm_channels;
  o.session_streams = 0;  // what is not a channel call is a unary call
  auto client = Client::Create(server.address(), o);
  EXPECT_TRUE(client.ok()) << client.status();
  return client.ok() ? *std::move(client) : nullptr;
}

// A control region written by hand, and its OpenSharedMemoryChannel call (blocking API).
class RawChannel {
 public:
  // `object_bytes` 0: exactly what the capacities need.
  RawChannel(uint64_t request_capacity, uint64_t response_capacity, uint64_t object_bytes = 0)
      : request_capacity_(request_capacity) {
    const uint64_t bytes = object_bytes != 0
                               ? object_bytes
                               : ShmChannelLayout::TotalBytes(request_capacity, response_capacity);
    static std::atomic<int> next{0};
    auto shm =
        SharedMemoryBuffer::Create("/" + Unique("raw-channel-" + std::to_string(next++)), bytes);
    EXPECT_TRUE(shm.ok()) << shm.status();
    if (!shm.ok()) return;
    region_ = *std::move(shm);
    wire::Word32(base(), ShmChannelLayout::kMagic).store(wire::kShmChannelMagic);
    wire::Word32(base(), ShmChannelLayout::kVersion).store(wire::kShmChannelVersion);
    wire::Word64(base(), ShmChannelLayout::kRequestCapacity).store(request_capacity);
    wire::Word64(base(), ShmChannelLayout::kResponseCapacity).store(response_capacity);
  }
  ~RawChannel() { Close(); }

  void* base() { return region_->data(); }
  const std::string& key() const { return region_->key(); }

  // Opens the call naming `key` (this region's by default): OK once the server serves it, else
  // the status the call ended with.
  absl::Status Open(const std::string& address, const char* token, std::string key = "") {
    stub_ = v1::Scorer::NewStub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    if (token != nullptr) context_.AddMetadata("authorization", std::string("Bearer ") + token);
    v1::OpenSharedMemoryChannelRequest request;
    request.set_key(key.empty() ? region_->key() : key);
    reader_ = stub_->OpenSharedMemoryChannel(&context_, request);
    v1::OpenSharedMemoryChannelResponse opened;
    if (reader_->Read(&opened)) {
      EXPECT_EQ(opened.request_capacity(), request_capacity_);
      return absl::OkStatus();
    }
    return Finish();
  }

  // Waits for the call's end (after the server ended it, or after Close cancelled it).
  absl::Status Finish() {
    if (reader_ == nullptr) return absl::OkStatus();
    const grpc::Status s = reader_->Finish();
    reader_.reset();
    return FromGrpcStatus(s);
  }

  void Close() {
    if (reader_ != nullptr) {
      context_.TryCancel();
      Finish().IgnoreError();
    }
  }

  // Posts `bytes` as request `seq` claiming `claimed` bytes (-1: their size); waits up to 10 s.
  struct Answer {
    bool answered = false;
    int code = -1;
    std::string bytes;
  };
  Answer Post(const std::string& bytes, int64_t claimed = -1) {
    if (bytes.size() <= request_capacity_) {
      std::memcpy(static_cast<char*>(base()) + ShmChannelLayout::RequestArea(), bytes.data(),
                  bytes.size());
    }
    return Bump(claimed >= 0 ? static_cast<uint64_t>(claimed) : bytes.size());
  }
  Answer Bump(uint64_t claimed) {
    wire::Word64(base(), ShmChannelLayout::kRequestBytes).store(claimed);
    const uint32_t seq = ++seq_;
    wire::Word32(base(), ShmChannelLayout::kRequestSeq).store(seq);
    wire::FutexWakeAll(wire::Addr32(base(), ShmChannelLayout::kRequestSeq));
    Answer a;
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (std::chrono::steady_clock::now() < until) {
      if (wire::Word32(base(), ShmChannelLayout::kResponseSeq).load() == seq) {
        a.answered = true;
        a.code = static_cast<int>(wire::Word32(base(), ShmChannelLayout::kStatusCode).load());
        const uint64_t n = wire::Word64(base(), ShmChannelLayout::kResponseBytes).load();
        a.bytes.assign(
            static_cast<const char*>(base()) + ShmChannelLayout::ResponseArea(request_capacity_),
            n);
        break;
      }
      if (wire::Word32(base(), ShmChannelLayout::kClosed).load() != 0) break;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return a;
  }
  bool closed() { return wire::Word32(base(), ShmChannelLayout::kClosed).load() != 0; }

 private:
  const uint64_t request_capacity_;
  std::unique_ptr<SharedMemoryBuffer> region_;
  std::unique_ptr<v1::Scorer::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<v1::OpenSharedMemoryChannelResponse>> reader_;
  uint32_t seq_ = 0;
};

class ShmChannelE2ETest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    token_file_ = TokenFile();
    server_ = e2e::StartServerProcess({"--backend", "cpu", "--threads", "2", "--synthetic-head",
                                       kHead.Flag(), "--auth-token-file", token_file_,
                                       "--metrics-listen", "127.0.0.1:0"});
  }
  static void TearDownTestSuite() {
    server_.reset();
    std::remove(token_file_.c_str());
  }
  void SetUp() override { ASSERT_NE(server_, nullptr); }

  static inline std::unique_ptr<ServerProcess> server_;
  static inline std::string token_file_;
};

TEST_F(ShmChannelE2ETest, CallsHaveTheBitsOfUnaryCalls) {
  constexpr int64_t kRows = 9;
  constexpr int kCalls = 20;
  std::unique_ptr<Client> channeled = MakeClient(*server_, 2), unary = MakeClient(*server_, 0);
  ASSERT_NE(channeled, nullptr);
  ASSERT_NE(unary, nullptr);
  std::string name;
  std::unique_ptr<SharedMemoryBuffer> shm = RegisteredInputs(*channeled, "calls", kRows, 7, &name);
  ASSERT_NE(shm, nullptr);

  const double channel_before = Count(*server_, "OpenSharedMemoryChannel", "OK");
  const double unary_before = Count(*server_, "Score", "OK");
  absl::StatusOr<ScoreOutput> want = unary->Score(ShmRequest(name, kRows));
  ASSERT_TRUE(want.ok()) << want.status();
  const Inputs in = MakeInputs(kRows, 7);
  testing::ExpectMatchesReference(BytesRequest(in, kRows), *want,
                                  {{kHead.name, e2e::ReferenceHead(kHead)}});
  for (int i = 0; i < kCalls; ++i) {
    absl::StatusOr<ScoreOutput> got = channeled->Score(ShmRequest(name, kRows));
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectBitwiseEqual(*got, *want);
  }
  // A request with tensor bytes stays on gRPC.
  absl::StatusOr<ScoreOutput> by_bytes = channeled->Score(BytesRequest(in, kRows));
  ASSERT_TRUE(by_bytes.ok()) << by_bytes.status();
  ExpectBitwiseEqual(*by_bytes, *want);
  EXPECT_EQ(Count(*server_, "OpenSharedMemoryChannel", "OK") - channel_before, kCalls);
  EXPECT_EQ(Count(*server_, "Score", "OK") - unary_before, 2);
  EXPECT_TRUE(channeled->UnregisterSharedMemory(name).ok());
}

TEST_F(ShmChannelE2ETest, ConcurrentCallersEachGetTheirOwnAnswer) {
  constexpr int kThreads = 6, kCalls = 10;
  constexpr int64_t kRows = kThreads;  // thread t asks for the first t + 1 rows
  std::unique_ptr<Client> channeled = MakeClient(*server_, 2), unary = MakeClient(*server_, 0);
  ASSERT_NE(channeled, nullptr);
  ASSERT_NE(unary, nullptr);
  std::string name;
  std::unique_ptr<SharedMemoryBuffer> shm =
      RegisteredInputs(*channeled, "concurrent-channels", kRows, 8, &name);
  ASSERT_NE(shm, nullptr);
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
  const double channel_before = Count(*server_, "OpenSharedMemoryChannel", "OK");
  ExpectConcurrentCallersGetTheirOwnAnswers(*channeled, want, request, kThreads, kCalls);
  EXPECT_EQ(Count(*server_, "OpenSharedMemoryChannel", "OK") - channel_before, kThreads * kCalls);
  EXPECT_TRUE(channeled->UnregisterSharedMemory(name).ok());
}

TEST_F(ShmChannelE2ETest, ARequestsOwnErrorLeavesTheChannelInUse) {
  std::unique_ptr<Client> channeled = MakeClient(*server_, 1), unary = MakeClient(*server_, 0);
  ASSERT_NE(channeled, nullptr);
  ASSERT_NE(unary, nullptr);
  const v1::ScoreRequest missing = ShmRequest(Unique("never-registered"), 2);
  const double errors_before = Count(*server_, "OpenSharedMemoryChannel", "NOT_FOUND");
  const absl::Status want = unary->Score(missing).status();
  const absl::Status got = channeled->Score(missing).status();
  EXPECT_EQ(want.code(), absl::StatusCode::kNotFound) << want;
  EXPECT_EQ(got.code(), want.code()) << got;
  EXPECT_EQ(got.message(), want.message());
  EXPECT_THAT(got.message(), HasSubstr("hidden.shared_memory.region"));
  EXPECT_EQ(Count(*server_, "OpenSharedMemoryChannel", "NOT_FOUND") - errors_before, 1)
      << "the error must come from the channel, not from a gRPC retry";
  constexpr int64_t kRows = 3;
  std::string name;
  std::unique_ptr<SharedMemoryBuffer> shm =
      RegisteredInputs(*channeled, "channel-after-error", kRows, 9, &name);
  ASSERT_NE(shm, nullptr);
  const double ok_before = Count(*server_, "OpenSharedMemoryChannel", "OK");
  EXPECT_TRUE(channeled->Score(ShmRequest(name, kRows)).ok());
  EXPECT_EQ(Count(*server_, "OpenSharedMemoryChannel", "OK") - ok_before, 1);
  EXPECT_TRUE(channeled->UnregisterSharedMemory(name).ok());
}

TEST_F(ShmChannelE2ETest, OpeningChecksTokenObjectHeaderAndClaim) {
  {
    RawChannel raw(4096, 4096);
    const absl::Status s = raw.Open(server_->address(), nullptr);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
  }
  {
    RawChannel raw(4096, 4096);
    const absl::Status s = raw.Open(server_->address(), kToken, "/" + Unique("no-such-object"));
    EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
    EXPECT_THAT(s.message(), HasSubstr("key"));
  }
  {
    RawChannel raw(4096, 4096);
    const absl::Status s = raw.Open(server_->address(), kToken, "/a/b");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("key"));
  }
  {
    RawChannel raw(4096, 4096);
    wire::Word32(raw.base(), ShmChannelLayout::kMagic).store(0x12345678u);
    const absl::Status s = raw.Open(server_->address(), kToken);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("is not a version 1 channel region"));
  }
  {
    // Capacities that need more bytes than the object holds.
    RawChannel raw(4096, 1 << 20, ShmChannelLayout::TotalBytes(4096, 4096));
    const absl::Status s = raw.Open(server_->address(), kToken);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("its capacities need"));
  }
  {
    RawChannel raw(0, 4096, ShmChannelLayout::TotalBytes(4096, 4096));
    const absl::Status s = raw.Open(server_->address(), kToken);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("request capacity 0"));
  }
  {
    RawChannel first(4096, 4096);
    ASSERT_TRUE(first.Open(server_->address(), kToken).ok());
    RawChannel second(4096, 4096);
    const absl::Status s = second.Open(server_->address(), kToken, first.key());
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_THAT(s.message(), HasSubstr("already served by another channel"));
  }
}

TEST_F(ShmChannelE2ETest, BadRequestsAreAnsweredAndTheChannelGoesOn) {
  constexpr int64_t kRows = 4;
  std::unique_ptr<Client> client = MakeClient(*server_, 0);
  ASSERT_NE(client, nullptr);
  std::string name;
  std::unique_ptr<SharedMemoryBuffer> shm =
      RegisteredInputs(*client, "raw-inputs", kRows, 5, &name);
  ASSERT_NE(shm, nullptr);
  RawChannel raw(4096, 100);
  ASSERT_TRUE(raw.Open(server_->address(), kToken).ok());

  RawChannel::Answer a = raw.Post("x", 4097);  // past the request area
  ASSERT_TRUE(a.answered);
  EXPECT_EQ(a.code, static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(a.bytes, HasSubstr("request_bytes: 4097 bytes exceed"));

  a = raw.Post(std::string("\xff\xff\xff\xff\x0f garbage", 14));
  ASSERT_TRUE(a.answered);
  EXPECT_EQ(a.code, static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(a.bytes, HasSubstr("request: the request area does not hold"));

  // Top-k 5 of 4 rows is more than a 100-byte response area holds.
  a = raw.Post(ShmRequest(name, kRows).SerializeAsString());
  ASSERT_TRUE(a.answered);
  EXPECT_EQ(a.code, static_cast<int>(absl::StatusCode::kResourceExhausted));
  EXPECT_THAT(a.bytes, HasSubstr("response: "));

  v1::ScoreRequest small = ShmRequest(name, kRows);
  small.set_top_k(0);
  a = raw.Post(small.SerializeAsString());
  ASSERT_TRUE(a.answered);
  ASSERT_EQ(a.code, 0) << a.bytes;
  v1::ScoreResponse response;
  ASSERT_TRUE(response.ParseFromString(a.bytes));
  EXPECT_EQ(response.entropy_size(), kRows);
  absl::StatusOr<ScoreOutput> want = client->Score(small);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_EQ(static_cast<size_t>(response.entropy_size()), want->entropy.size());
  EXPECT_EQ(std::memcmp(response.entropy().data(), want->entropy.data(), kRows * 4), 0);
  EXPECT_TRUE(client->UnregisterSharedMemory(name).ok());
}

TEST_F(ShmChannelE2ETest, AShrunkRegionClosesTheChannel) {
  std::unique_ptr<Client> client = MakeClient(*server_, 0);
  ASSERT_NE(client, nullptr);
  std::string name;
  std::unique_ptr<SharedMemoryBuffer> shm = RegisteredInputs(*client, "shrink-inputs", 2, 6, &name);
  ASSERT_NE(shm, nullptr);
  RawChannel raw(4096, 4096);
  ASSERT_TRUE(raw.Open(server_->address(), kToken).ok());
  const std::string request = ShmRequest(name, 2).SerializeAsString();
  std::memcpy(static_cast<char*>(raw.base()) + ShmChannelLayout::RequestArea(), request.data(),
              request.size());
  const int fd = shm_open(raw.key().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, ShmChannelLayout::kHeaderBytes), 0);  // the header page stays
  close(fd);
  const RawChannel::Answer a = raw.Bump(request.size());
  EXPECT_FALSE(a.answered);
  EXPECT_TRUE(raw.closed());
  const absl::Status end = raw.Finish();
  EXPECT_EQ(end.code(), absl::StatusCode::kFailedPrecondition) << end;
  EXPECT_THAT(end.message(), HasSubstr("no longer holds the channel's region"));
  // The server goes on serving.
  EXPECT_TRUE(client->Score(ShmRequest(name, 2)).ok());
  EXPECT_TRUE(client->UnregisterSharedMemory(name).ok());
}

// --max-shared-memory-channels 1: a second channel is refused while the first is open; the
// client then scores over gRPC; once the first closes, a new one opens.
TEST(ShmChannelLimitE2ETest, TheServersLimitHolds) {
  std::unique_ptr<ServerProcess> server = e2e::StartServerProcess(
      {"--backend", "cpu", "--threads", "2", "--synthetic-head", kHead.Flag(),
       "--max-shared-memory-channels", "1", "--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(server, nullptr);
  auto first = std::make_unique<RawChannel>(4096, 4096);
  ASSERT_TRUE(first->Open(server->address(), nullptr).ok());
  RawChannel refused(4096, 4096);
  const absl::Status s = refused.Open(server->address(), nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("--max-shared-memory-channels"));

  std::unique_ptr<Client> client = MakeClient(*server, 4, nullptr);
  ASSERT_NE(client, nullptr);
  std::string name;
  std::unique_ptr<SharedMemoryBuffer> shm = RegisteredInputs(*client, "limit", 3, 4, &name);
  ASSERT_NE(shm, nullptr);
  const double unary_before = Count(*server, "Score", "OK");
  EXPECT_TRUE(client->Score(ShmRequest(name, 3)).ok());
  EXPECT_EQ(Count(*server, "Score", "OK") - unary_before, 1);

  first.reset();  // cancels its call; the server closes the channel
  bool reopened = false;
  for (int i = 0; i < 100 && !reopened; ++i) {
    RawChannel again(4096, 4096);
    reopened = again.Open(server->address(), nullptr).ok();
    if (!reopened) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(reopened);
  EXPECT_TRUE(client->UnregisterSharedMemory(name).ok());
}

// A server that sleeps 1 s per 64 rows: a channel call with a 300 ms deadline ends at about the
// deadline with DEADLINE_EXCEEDED (the server is told to stop it), and the next call works too.
TEST(ShmChannelDeadlineE2ETest, ACallEndsAtItsDeadline) {
  std::unique_ptr<ServerProcess> server = e2e::StartServerProcess(
      {"--backend", "cpu", "--threads", "2", "--synthetic-head", kHead.Flag(), "--test-fault",
       "slow-tile:1000", "--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(server, nullptr);
  ClientOptions o = WithToken(nullptr);
  o.rpc_timeout = absl::Milliseconds(300);
  o.session_streams = 0;
  auto client = Client::Create(server->address(), o);
  ASSERT_TRUE(client.ok()) << client.status();
  constexpr int64_t kRows = 64;
  std::string name;
  std::unique_ptr<SharedMemoryBuffer> shm =
      RegisteredInputs(**client, "channel-deadline", kRows, 10, &name);
  ASSERT_NE(shm, nullptr);
  for (int i = 0; i < 2; ++i) {
    const auto start = std::chrono::steady_clock::now();
    const absl::Status s = (*client)->Score(ShmRequest(name, kRows)).status();
    const auto elapsed = std::chrono::steady_clock::now() - start;
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
    EXPECT_LT(elapsed, std::chrono::milliseconds(900)) << "call " << i;
  }
  // Both requests reached the server through a channel and were stopped there.
  auto patient = Client::Create(server->address(), WithToken(nullptr));
  ASSERT_TRUE(patient.ok()) << patient.status();
  EXPECT_TRUE((*patient)->UnregisterSharedMemory(name).ok());  // waits for them to end
  const double stopped = Count(*server, "OpenSharedMemoryChannel", "DEADLINE_EXCEEDED") +
                         Count(*server, "OpenSharedMemoryChannel", "CANCELLED");
  EXPECT_EQ(stopped, 2);
}

}  // namespace
}  // namespace logitserve::client
