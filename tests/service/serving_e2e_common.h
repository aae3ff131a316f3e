// Helpers of the serving end-to-end tests (serving_e2e_test.cc, serving_faults_e2e_test.cc):
// starting the real `logitserve` binary with the suite's small synthetic heads, request builders,
// a bit-for-bit comparison of two ScoreResponses, Prometheus scrapes of --metrics-listen, and the
// grpc.health.v1 Watch stream. Expected values never come from the server's code: results are
// compared with the fp64 reference (e2e_support.h) or with the same request computed alone.
//
// Thread safety: free functions; a HealthWatch belongs to one thread.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "logitserve/v1/logitserve.grpc.pb.h"
#include "tests/service/e2e_support.h"
#include "tests/service/prometheus_text.h"
#include "tests/support/server_process.h"
#include "tests/support/test_tensors.h"

namespace logitserve::e2e::serving {

using ::logitserve::testing::Exposition;
using ::logitserve::testing::FloatTensor;
using ::logitserve::testing::IdTensor;
using ::logitserve::testing::Normal;
using ::logitserve::testing::RandomIds;
using ::logitserve::testing::ScrapeMetrics;
using ::logitserve::testing::ScrapeUntil;
using ::logitserve::testing::ServerProcess;
using Clock = std::chrono::steady_clock;

// The row unit of --test-fault slow-tile:MS, which sleeps MS per 64 rows before every row tile
// (server/backend/fault_injection.h), on every backend: a request of `t * kRowTile` rows cannot
// finish in less than t * MS milliseconds. Stops are checked before every backend row tile (512
// rows on the CPU, 256 for its hidden-mode JSD; 512 in CUDA hidden mode), so a stop lands within
// one tile's sleep.
inline constexpr int64_t kRowTile = 64;

inline const HeadMap& ReferenceHeads() {
  static const auto* heads = new HeadMap{{kPolicy.name, ReferenceHead(kPolicy)},
                                         {kReference.name, ReferenceHead(kReference)},
                                         {kSmall.name, ReferenceHead(kSmall)}};
  return *heads;
}

// The real server with the three e2e heads (small: V 3000 / 500, H 64 / 32), two compute threads
// and a metrics endpoint, plus `extra` flags. Null (with a test failure) when it cannot start.
inline std::unique_ptr<ServerProcess> StartServer(const std::vector<std::string>& extra) {
  std::vector<std::string> args = {
      "--synthetic-head", kPolicy.Flag(), "--synthetic-head", kReference.Flag(),
      "--synthetic-head", kSmall.Flag(),  "--threads",        "2",
      "--metrics-listen", "127.0.0.1:0"};
  args.insert(args.end(), extra.begin(), extra.end());
  std::unique_ptr<ServerProcess> server = StartServerProcess(std::move(args));
  if (server == nullptr) return nullptr;
  EXPECT_FALSE(server->metrics_address().empty());
  return server;
}

// `n` rows of hidden states for "policy" in `dtype`, ids [n], entropy and top-4: the common
// shape many tests share (requests of this shape may share a batch).
inline v1::ScoreRequest PolicyRequest(int64_t n, uint32_t seed, const std::string& id = "",
                                      v1::DataType dtype = v1::DATA_TYPE_BFLOAT16) {
  v1::ScoreRequest r;
  r.set_request_id(id);
  r.set_head(kPolicy.name);
  *r.mutable_hidden() = FloatTensor(dtype, Normal(n * kPolicy.hidden, seed), {n, kPolicy.hidden});
  *r.mutable_target_ids() =
      IdTensor(v1::DATA_TYPE_INT32, RandomIds(n, kPolicy.vocab, seed + 1), {n});
  r.set_entropy(true);
  r.set_top_k(4);
  return r;
}

inline grpc::Status ScoreWithin(v1::Scorer::Stub& stub, const v1::ScoreRequest& request,
                                v1::ScoreResponse* response, std::chrono::milliseconds timeout) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + timeout);
  return stub.Score(&context, request, response);
}

inline double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// ---------------------------------------------------------------------------------------------
// Bitwise comparison.

// Bitwise equality of two float / int arrays (NaN payloads and signed zeros included).
template <typename Field>
void ExpectSameBits(const Field& got, const Field& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  if (got.size() == 0) return;
  if (std::memcmp(got.data(), want.data(), sizeof(got.Get(0)) * got.size()) == 0) return;
  for (int i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got.Get(i), &want.Get(i), sizeof(got.Get(i))) != 0) {
      ADD_FAILURE() << what << "[" << i << "]: " << got.Get(i) << " vs " << want.Get(i);
      return;
    }
  }
}

// Every output of `got` equals `want` bit for bit; only the timings may differ.
inline void ExpectBitwiseEqual(const v1::ScoreResponse& got, const v1::ScoreResponse& want) {
  EXPECT_EQ(got.request_id(), want.request_id());
  ExpectSameBits(got.target_logprobs(), want.target_logprobs(), "target_logprobs");
  ExpectSameBits(got.top_k_ids(), want.top_k_ids(), "top_k_ids");
  ExpectSameBits(got.top_k_logprobs(), want.top_k_logprobs(), "top_k_logprobs");
  ExpectSameBits(got.entropy(), want.entropy(), "entropy");
  ExpectSameBits(got.reference_entropy(), want.reference_entropy(), "reference_entropy");
  ExpectSameBits(got.forward_kl(), want.forward_kl(), "forward_kl");
  ExpectSameBits(got.reverse_kl(), want.reverse_kl(), "reverse_kl");
  ExpectSameBits(got.jsd(), want.jsd(), "jsd");
  // Everything else (sequence sums, K, k, versions, status): the serialized messages without
  // their timings must be identical bytes (packed floats serialize as their bits).
  v1::ScoreResponse a = got;
  v1::ScoreResponse b = want;
  for (v1::ScoreResponse* m : {&a, &b}) {
    m->clear_queue_us();
    m->clear_compute_us();
  }
  std::string sa, sb;
  {
    google::protobuf::io::StringOutputStream oa(&sa), ob(&sb);
    google::protobuf::io::CodedOutputStream ca(&oa), cb(&ob);
    ca.SetSerializationDeterministic(true);
    cb.SetSerializationDeterministic(true);
    a.SerializeToCodedStream(&ca);
    b.SerializeToCodedStream(&cb);
  }
  EXPECT_TRUE(sa == sb) << "responses differ beyond the per-token outputs:\n"
                        << a.ShortDebugString().substr(0, 2000) << "\nvs\n"
                        << b.ShortDebugString().substr(0, 2000);
}

// ---------------------------------------------------------------------------------------------
// Metrics.

// A sample's value, 0 when the series does not exist yet (a counter never incremented).
inline double Value(const Exposition& e, const std::string& name,
                    const testing::Labels& labels = {}) {
  return testing::SampleValue(e, name, labels).value_or(0.0);
}

inline double InFlight(const Exposition& e) { return Value(e, "logitserve_requests_in_flight"); }
inline double QueueDepth(const Exposition& e) { return Value(e, "logitserve_queue_depth"); }
inline double CallsCreated(const Exposition& e) {
  return Value(e, "logitserve_call_states_created_total");
}
inline double CallsReleased(const Exposition& e) {
  return Value(e, "logitserve_call_states_released_total");
}
// Batches that reached the backend and the rows they held.
inline double BatchesLaunched(const Exposition& e) {
  return Value(e, "logitserve_batch_requests_count");
}
inline double RowsLaunched(const Exposition& e) { return Value(e, "logitserve_batch_tokens_sum"); }
inline double TokensScored(const Exposition& e) {
  return Value(e, "logitserve_tokens_scored_total");
}

// Waits until every per-call state object the server created has been released (nothing in
// flight, nothing leaked) and checks that at least `min_created` were created.
inline void ExpectCallStatesBalanced(const std::string& metrics_address, double min_created) {
  const Exposition e = ScrapeUntil(metrics_address, [](const Exposition& x) {
    return CallsCreated(x) == CallsReleased(x) && InFlight(x) == 0;
  });
  EXPECT_GE(CallsCreated(e), min_created);
  EXPECT_EQ(CallsCreated(e), CallsReleased(e)) << "per-RPC state objects leaked";
  EXPECT_EQ(InFlight(e), 0);
}

// ---------------------------------------------------------------------------------------------
// Health.

inline grpc::health::v1::HealthCheckResponse::ServingStatus CheckHealth(
    const std::shared_ptr<grpc::Channel>& channel, grpc::Status* status) {
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service("logitserve.v1.Scorer");
  grpc::health::v1::HealthCheckResponse response;
  *status = health->Check(&context, request, &response);
  return response.status();
}

// A grpc.health.v1 Watch of logitserve.v1.Scorer: sees every serving-status change, including
// the NOT_SERVING the server announces just before it stops accepting calls (a Check polled at
// that moment could already be refused). Cancelled on destruction, so it never holds a drain.
class HealthWatch {
 public:
  explicit HealthWatch(const std::string& address)
      : channel_(Connect(address)), stub_(grpc::health::v1::Health::NewStub(channel_)) {
    grpc::health::v1::HealthCheckRequest request;
    request.set_service("logitserve.v1.Scorer");
    context_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    reader_ = stub_->Watch(&context_, request);
  }
  ~HealthWatch() { Cancel(); }
  // The next status the server sends; UNKNOWN when the stream ended instead.
  grpc::health::v1::HealthCheckResponse::ServingStatus Next() {
    grpc::health::v1::HealthCheckResponse response;
    if (reader_ == nullptr || !reader_->Read(&response)) {
      return grpc::health::v1::HealthCheckResponse::UNKNOWN;
    }
    return response.status();
  }
  void Cancel() {
    if (reader_ == nullptr) return;
    context_.TryCancel();
    grpc::health::v1::HealthCheckResponse ignored;
    while (reader_->Read(&ignored)) {
    }
    reader_->Finish();
    reader_.reset();
  }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<grpc::health::v1::Health::Stub> stub_;
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<grpc::health::v1::HealthCheckResponse>> reader_;
};

}  // namespace logitserve::e2e::serving
