// End-to-end tests of the real `logitserve` binary over loopback: health, reflection, ListHeads,
// valid Score requests checked output by output against the fp64 reference, every invalid input
// (status code, message naming the field, and the server still serving afterwards), the size
// limits and the bounded queue.
//
// Long file: the invalid-request table (one case per validation rule) and the output checks share
// one server fixture and its request builders.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/version/build_info.h"
#include "gmock/gmock.h"
#include "google/protobuf/descriptor.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "grpc/reflection/v1alpha/reflection.grpc.pb.h"
#include "gtest/gtest.h"
#include "logitserve/v1/logitserve.grpc.pb.h"
#include "tests/service/e2e_support.h"
#include "tests/support/server_process.h"
#include "tests/support/test_tensors.h"

namespace logitserve::e2e {
namespace {

using ::logitserve::testing::FloatTensor;
using ::logitserve::testing::IdTensor;
using ::logitserve::testing::Normal;
using ::logitserve::testing::RandomIds;
using ::logitserve::testing::RoundedTo;
using ::logitserve::testing::ServerProcess;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// A server with the three synthetic heads, two uneven vocabulary shards, default limits.
class ServerFixture {
 public:
  explicit ServerFixture(std::vector<std::string> extra_args = {}) {
    std::vector<std::string> args = {"--synthetic-head", kPolicy.Flag(),
                                     "--synthetic-head", kReference.Flag(),
                                     "--synthetic-head", kSmall.Flag(),
                                     "--threads",        "2",
                                     "--shards",         "2"};
    args.insert(args.end(), extra_args.begin(), extra_args.end());
    server_ = StartServerProcess(std::move(args));
    if (server_ == nullptr) return;
    channel_ = Connect(server_->address());
    stub_ = v1::Scorer::NewStub(channel_);
  }
  bool ok() const { return stub_ != nullptr; }
  // SIGTERM, after closing this fixture's connection (an idle connection would hold the
  // server's graceful shutdown until its --drain-seconds deadline); returns the exit status.
  int Stop() {
    stub_.reset();
    channel_.reset();
    return server_->Stop(SIGTERM);
  }
  v1::Scorer::Stub& stub() { return *stub_; }
  std::shared_ptr<grpc::Channel> channel() { return channel_; }
  ServerProcess& process() { return *server_; }

 private:
  std::unique_ptr<ServerProcess> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Scorer::Stub> stub_;
};

const std::map<std::string, std::shared_ptr<const PreparedHead>>& ReferenceHeads() {
  static const auto* heads = new std::map<std::string, std::shared_ptr<const PreparedHead>>{
      {kPolicy.name, ReferenceHead(kPolicy)},
      {kReference.name, ReferenceHead(kReference)},
      {kSmall.name, ReferenceHead(kSmall)}};
  return *heads;
}

// A valid hidden-mode request: n rows of bf16 hidden states for "policy", ids [n], entropy.
v1::ScoreRequest SmallValidRequest(int64_t n = 4) {
  v1::ScoreRequest r;
  r.set_request_id("valid");
  r.set_head(kPolicy.name);
  *r.mutable_hidden() =
      FloatTensor(v1::DATA_TYPE_BFLOAT16, Normal(n * kPolicy.hidden, 1), {n, kPolicy.hidden});
  *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT32, RandomIds(n, kPolicy.vocab, 2), {n});
  r.set_entropy(true);
  return r;
}

class ScorerE2eTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { server_ = new ServerFixture(); }
  static void TearDownTestSuite() {
    if (server_->ok()) {
      EXPECT_EQ(server_->Stop(), 0);
    }
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override { ASSERT_TRUE(server_->ok()); }

  v1::Scorer::Stub& stub() { return server_->stub(); }

  // Scores `request` and checks it against the reference.
  void ScoreAndCheck(const v1::ScoreRequest& request) {
    v1::ScoreResponse response;
    const grpc::Status status = CallScore(stub(), request, &response);
    ASSERT_TRUE(status.ok()) << status.error_code() << ": " << status.error_message();
    ExpectMatchesReference(request, response, ReferenceHeads());
  }

  static ServerFixture* server_;
};
ServerFixture* ScorerE2eTest::server_ = nullptr;

TEST_F(ScorerE2eTest, HealthIsServing) {
  auto health = grpc::health::v1::Health::NewStub(server_->channel());
  for (const std::string service : {"", "logitserve.v1.Scorer"}) {
    grpc::ClientContext context;
    grpc::health::v1::HealthCheckRequest request;
    request.set_service(service);
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status status = health->Check(&context, request, &response);
    ASSERT_TRUE(status.ok()) << service << ": " << status.error_message();
    EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING) << service;
  }
  grpc::ClientContext context;
  grpc::health::v1::HealthCheckRequest request;
  request.set_service("no.such.Service");
  grpc::health::v1::HealthCheckResponse response;
  EXPECT_EQ(health->Check(&context, request, &response).error_code(), grpc::StatusCode::NOT_FOUND);
}

// Both reflection versions (grpcurl and grpc-js ask for v1, older tools for v1alpha) list every
// served service, describe each of them (grpc.health.v1 included), and answer unknown names
// with NOT_FOUND on the same stream.
template <typename Reflection>
void CheckReflection(const std::shared_ptr<grpc::Channel>& channel) {
  using Request = typename Reflection::Request;
  using Response = typename Reflection::Response;
  auto stub = Reflection::Service::NewStub(channel);
  grpc::ClientContext context;
  auto stream = stub->ServerReflectionInfo(&context);
  Request request;
  request.set_list_services("");
  ASSERT_TRUE(stream->Write(request));
  Response response;
  ASSERT_TRUE(stream->Read(&response));
  std::vector<std::string> services;
  for (const auto& s : response.list_services_response().service()) services.push_back(s.name());
  EXPECT_THAT(services, UnorderedElementsAre("logitserve.v1.Scorer", "grpc.health.v1.Health",
                                             "grpc.reflection.v1.ServerReflection",
                                             "grpc.reflection.v1alpha.ServerReflection"));

  for (const std::string& service : services) {
    request.set_file_containing_symbol(service);
    ASSERT_TRUE(stream->Write(request));
    ASSERT_TRUE(stream->Read(&response));
    ASSERT_FALSE(response.has_error_response())
        << service << ": " << response.error_response().error_message();
    ASSERT_GE(response.file_descriptor_response().file_descriptor_proto_size(), 1) << service;
    // The first file declares the service.
    google::protobuf::FileDescriptorProto file;
    ASSERT_TRUE(file.ParseFromString(response.file_descriptor_response().file_descriptor_proto(0)));
    const std::string short_name = service.substr(service.rfind('.') + 1);
    EXPECT_EQ(file.package() + "." + short_name, service);
    std::vector<std::string> methods;
    for (const auto& s : file.service()) {
      if (s.name() != short_name) continue;
      for (const auto& m : s.method()) methods.push_back(m.name());
    }
    if (service == "logitserve.v1.Scorer") {
      EXPECT_THAT(methods,
                  ::testing::IsSupersetOf({"Score", "ScoreStream", "ListHeads", "LoadHead"}));
    } else if (service == "grpc.health.v1.Health") {
      EXPECT_THAT(methods, ::testing::IsSupersetOf({"Check", "Watch"}));
    } else {
      EXPECT_THAT(methods, ::testing::ElementsAre("ServerReflectionInfo"));
    }
  }

  // A method name is a symbol too; a file by its name comes with its dependencies.
  request.set_file_containing_symbol("logitserve.v1.Scorer.Score");
  ASSERT_TRUE(stream->Write(request));
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_FALSE(response.has_error_response()) << response.error_response().error_message();
  request.set_file_by_filename("logitserve/v1/logitserve.proto");
  ASSERT_TRUE(stream->Write(request));
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_GE(response.file_descriptor_response().file_descriptor_proto_size(), 1);

  request.set_file_containing_symbol("no.such.Symbol");
  ASSERT_TRUE(stream->Write(request));
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.error_response().error_code(), static_cast<int>(grpc::StatusCode::NOT_FOUND));
  EXPECT_THAT(response.error_response().error_message(), HasSubstr("no.such.Symbol"));
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
}

struct ReflectionV1 {
  using Service = grpc::reflection::v1::ServerReflection;
  using Request = grpc::reflection::v1::ServerReflectionRequest;
  using Response = grpc::reflection::v1::ServerReflectionResponse;
};
struct ReflectionV1Alpha {
  using Service = grpc::reflection::v1alpha::ServerReflection;
  using Request = grpc::reflection::v1alpha::ServerReflectionRequest;
  using Response = grpc::reflection::v1alpha::ServerReflectionResponse;
};

TEST_F(ScorerE2eTest, ReflectionV1DescribesEveryService) {
  CheckReflection<ReflectionV1>(server_->channel());
}

TEST_F(ScorerE2eTest, ReflectionV1AlphaDescribesEveryService) {
  CheckReflection<ReflectionV1Alpha>(server_->channel());
}

TEST_F(ScorerE2eTest, ListHeads) {
  grpc::ClientContext context;
  v1::ListHeadsResponse response;
  ASSERT_TRUE(stub().ListHeads(&context, v1::ListHeadsRequest(), &response).ok());
  // LOGITSERVE_EXPECT_GPU: the suite runs against a CUDA server on the GPU machine.
  EXPECT_EQ(response.backend(), std::getenv("LOGITSERVE_EXPECT_GPU") != nullptr ? "cuda" : "cpu");
  EXPECT_EQ(response.max_top_k(), 64u);
  EXPECT_EQ(response.max_tokens_per_request(), 65536);
  EXPECT_GT(response.max_receive_message_bytes(), int64_t{256} << 20);
  // The server's build: the values this test was built with (one build tree).
  const BuildInfo& build = GetBuildInfo();
  EXPECT_EQ(response.server_info().version(), build.version);
  EXPECT_EQ(response.server_info().git_commit(), build.git_commit);
  EXPECT_NE(response.server_info().git_commit(), "");
  EXPECT_EQ(response.server_info().build_type(), build.build_type);
  EXPECT_EQ(response.server_info().backends(), build.backends());
  EXPECT_EQ(response.server_info().cuda_version(), build.cuda_version);
  EXPECT_EQ(response.server_info().nccl_version(), build.nccl_version);
  ASSERT_EQ(response.heads_size(), 3);
  std::vector<std::string> names;
  for (const v1::HeadInfo& h : response.heads()) {
    names.push_back(h.name());
    const SyntheticHead& spec = h.name() == kPolicy.name      ? kPolicy
                                : h.name() == kReference.name ? kReference
                                                              : kSmall;
    EXPECT_EQ(h.vocab_size(), spec.vocab) << h.name();
    EXPECT_EQ(h.hidden_size(), spec.hidden) << h.name();
    EXPECT_EQ(h.dtype(), v1::DATA_TYPE_BFLOAT16) << h.name();
    EXPECT_EQ(h.version(), 1u) << h.name();
    EXPECT_FALSE(h.has_bias());
    EXPECT_EQ(h.logit_scale(), 1.0f);
    EXPECT_EQ(h.logits_scaling(), 1.0f);
    EXPECT_EQ(h.final_logit_softcapping(), 0.0f);
    EXPECT_THAT(h.source(), HasSubstr("synthetic"));
    // The shards (two CPU shards: --shards 2; one per GPU on the CUDA backend) cover [0, V)
    // contiguously, in order.
    if (std::getenv("LOGITSERVE_EXPECT_GPU") == nullptr) {
      EXPECT_EQ(h.shards_size(), 2) << h.name();
    }
    ASSERT_GE(h.shards_size(), 1) << h.name();
    int64_t next = 0;
    for (int i = 0; i < h.shards_size(); ++i) {
      EXPECT_EQ(h.shards(i).shard(), i) << h.name();
      EXPECT_EQ(h.shards(i).vocab_begin(), next) << h.name() << " shard " << i;
      EXPECT_GE(h.shards(i).vocab_end(), h.shards(i).vocab_begin()) << h.name();
      next = h.shards(i).vocab_end();
    }
    EXPECT_EQ(next, spec.vocab) << h.name();
  }
  EXPECT_THAT(names, UnorderedElementsAre("policy", "ref", "small"));
}

TEST_F(ScorerE2eTest, HiddenModeEveryOutput) {
  constexpr int64_t n = 10;
  v1::ScoreRequest r;
  r.set_request_id("hidden-every-output");
  r.set_head(kPolicy.name);
  *r.mutable_hidden() =
      FloatTensor(v1::DATA_TYPE_BFLOAT16, Normal(n * kPolicy.hidden, 10), {n, kPolicy.hidden});
  r.set_reference_head(kReference.name);
  *r.mutable_reference_hidden() = FloatTensor(
      v1::DATA_TYPE_BFLOAT16, Normal(n * kReference.hidden, 11), {n, kReference.hidden});
  std::vector<int64_t> ids = RandomIds(n * 3, kPolicy.vocab, 12);
  ids[1] = -100;                    // one ignored id in row 0
  ids[6] = ids[7] = ids[8] = -100;  // row 2 entirely ignored: out of the sums
  ids[12] = ids[13];                // duplicate ids in row 4
  *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT64, ids, {n, 3});
  r.set_top_k(8);
  r.set_entropy(true);
  r.set_reference_entropy(true);
  r.set_forward_kl(true);
  r.set_reverse_kl(true);
  r.set_jsd_beta(0.3f);
  for (int64_t len : {3, 0, 5, 2}) r.add_sequence_lengths(len);
  r.set_head_version(1);
  ScoreAndCheck(r);

  v1::ScoreResponse response;
  ASSERT_TRUE(CallScore(stub(), r, &response).ok());
  EXPECT_EQ(response.head_version(), 1u);
  EXPECT_EQ(response.reference_head_version(), 1u);
  EXPECT_EQ(response.sequence_sums().token_count(0), 2);  // row 2 excluded
}

TEST_F(ScorerE2eTest, HiddenModeInEveryDtype) {
  for (v1::DataType dtype :
       {v1::DATA_TYPE_FLOAT32, v1::DATA_TYPE_BFLOAT16, v1::DATA_TYPE_FLOAT16}) {
    SCOPED_TRACE(v1::DataType_Name(dtype));
    constexpr int64_t n = 7;
    v1::ScoreRequest r;
    r.set_head(kSmall.name);
    *r.mutable_hidden() = FloatTensor(dtype, Normal(n * kSmall.hidden, 20), {n, kSmall.hidden});
    *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT32, RandomIds(n, kSmall.vocab, 21), {n});
    r.set_top_k(5);
    r.set_entropy(true);
    ScoreAndCheck(r);
  }
}

TEST_F(ScorerE2eTest, LogitsModeEveryOutputWithMasksAndTemperatures) {
  constexpr int64_t n = 6;
  constexpr int64_t v = 1000;
  std::vector<float> z = Normal(n * v, 30, 3.0f);
  std::vector<float> zr = Normal(n * v, 31, 3.0f);
  for (int64_t j = 0; j < v; j += 3) z[1 * v + j] = -kInf;                // row 1 partially masked
  for (int64_t j = 0; j < v; ++j) z[3 * v + j] = j == 17 ? 0.0f : -kInf;  // row 3 one-hot
  zr[2 * v + 5] = -kInf;                                 // support mismatch in row 2
  for (int64_t j = 0; j < v; ++j) z[4 * v + j] = -kInf;  // row 4 entirely masked: NaN
  v1::ScoreRequest r;
  r.set_request_id("logits-every-output");
  *r.mutable_logits() = FloatTensor(v1::DATA_TYPE_FLOAT32, z, {n, v});
  *r.mutable_reference_logits() = FloatTensor(v1::DATA_TYPE_FLOAT16, zr, {n, v});
  std::vector<int64_t> ids = RandomIds(n, v, 32);
  ids[3] = 17;
  ids[4] = -100;
  ids[5] = -100;
  *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT32, ids, {n});
  r.set_temperature(0.7f);
  r.set_reference_temperature(1.3f);
  r.set_top_k(4);
  r.set_entropy(true);
  r.set_reference_entropy(true);
  r.set_forward_kl(true);
  r.set_reverse_kl(true);
  r.set_jsd_beta(0.5f);
  r.add_sequence_lengths(4);
  r.add_sequence_lengths(2);
  ScoreAndCheck(r);
}

TEST_F(ScorerE2eTest, JsdEndpointsAreTheKls) {
  constexpr int64_t n = 3;
  constexpr int64_t v = 300;
  for (float beta : {0.0f, 1.0f}) {
    v1::ScoreRequest r;
    *r.mutable_logits() = FloatTensor(v1::DATA_TYPE_BFLOAT16, Normal(n * v, 40, 2.0f), {n, v});
    *r.mutable_reference_logits() =
        FloatTensor(v1::DATA_TYPE_FLOAT32, Normal(n * v, 41, 2.0f), {n, v});
    r.set_jsd_beta(beta);
    r.set_forward_kl(true);
    r.set_reverse_kl(true);
    ScoreAndCheck(r);
    v1::ScoreResponse response;
    ASSERT_TRUE(CallScore(stub(), r, &response).ok());
    for (int64_t i = 0; i < n; ++i) {
      EXPECT_EQ(response.jsd(i), beta == 0.0f ? response.forward_kl(i) : response.reverse_kl(i));
    }
  }
}

TEST_F(ScorerE2eTest, IgnoreIndexInsideTheVocabulary) {
  // ignore_index = 5 is a real id: every id 5 gives exactly 0.0 (and a row of only 5s leaves the
  // sequence sums), every other id its ordinary log-probability.
  constexpr int64_t n = 5;
  constexpr int64_t v = 40;
  v1::ScoreRequest r;
  r.set_request_id("ignore-inside");
  *r.mutable_logits() = FloatTensor(v1::DATA_TYPE_FLOAT32, Normal(n * v, 80, 3.0f), {n, v});
  const std::vector<int64_t> ids = {5, 0, 39, 5, 5, 5, 7, -100, 5, 6, 5, 4, 5, 5, 3};
  *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT64, ids, {n, 3});
  r.set_ignore_index(5);
  r.set_entropy(true);
  r.set_top_k(6);  // id 5 is still ranked like any other token
  r.add_sequence_lengths(2);
  r.add_sequence_lengths(3);
  // -100 is an ordinary (invalid) id now.
  v1::ScoreResponse response;
  grpc::Status status = CallScore(stub(), r, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("row 2"));
  std::vector<int64_t> fixed = ids;
  fixed[7] = 8;
  *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT64, fixed, {n, 3});
  ScoreAndCheck(r);

  status = CallScore(stub(), r, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  for (size_t i = 0; i < fixed.size(); ++i) {
    if (fixed[i] == 5) {
      EXPECT_EQ(response.target_logprobs(static_cast<int>(i)), 0.0f) << i;
    } else {
      EXPECT_LT(response.target_logprobs(static_cast<int>(i)), 0.0f) << i;
    }
  }
  // Row 1 holds only 5s: sequence 0 counts one row.
  EXPECT_THAT(response.sequence_sums().token_count(), ::testing::ElementsAre(1, 3));
}

TEST_F(ScorerE2eTest, UnusedReferenceIsIgnored) {
  v1::ScoreRequest r = SmallValidRequest();
  r.set_reference_head(kReference.name);
  *r.mutable_reference_hidden() = r.hidden();
  ScoreAndCheck(r);
}

TEST_F(ScorerE2eTest, EmptyRequest) {
  v1::ScoreRequest r = SmallValidRequest(0);
  r.set_top_k(3);
  r.add_sequence_lengths(0);
  v1::ScoreResponse response;
  const grpc::Status status = CallScore(stub(), r, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(response.target_logprobs_size(), 0);
  EXPECT_EQ(response.entropy_size(), 0);
  EXPECT_EQ(response.top_k_ids_size(), 0);
  EXPECT_THAT(response.sequence_sums().token_count(), ::testing::ElementsAre(0));
  EXPECT_THAT(response.sequence_sums().entropy(), ::testing::ElementsAre(0.0f));
}

// The hidden-state scan runs where the request is received, before admission: a bad request on a
// stream is answered with its own row, and the requests before and after it on the same stream
// are computed as usual.
TEST_F(ScorerE2eTest, NonFiniteHiddenOnAStreamFailsOnlyThatRequest) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto stream = stub().ScoreStream(&context);
  std::map<std::string, v1::ScoreRequest> sent;
  for (const char* id : {"before", "bad", "after"}) {
    v1::ScoreRequest r = SmallValidRequest(6);
    r.set_request_id(id);
    if (std::string(id) == "bad") {
      std::vector<float> h = Normal(6 * kPolicy.hidden, 7);
      h[3 * kPolicy.hidden + 2] = kNaN;
      *r.mutable_hidden() = FloatTensor(v1::DATA_TYPE_BFLOAT16, h, {6, kPolicy.hidden});
    }
    v1::ScoreStreamRequest message;
    *message.mutable_request() = r;
    ASSERT_TRUE(stream->Write(message));
    sent[id] = r;
  }
  stream->WritesDone();
  std::map<std::string, v1::ScoreStreamResponse> got;
  v1::ScoreStreamResponse response;
  while (stream->Read(&response)) got[response.request_id()] = response;
  ASSERT_TRUE(stream->Finish().ok());
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got["bad"].status_code(), static_cast<int>(grpc::StatusCode::INVALID_ARGUMENT));
  EXPECT_THAT(got["bad"].status_message(), AllOf(HasSubstr("hidden"), HasSubstr("row 3")));
  for (const char* id : {"before", "after"}) {
    SCOPED_TRACE(id);
    ASSERT_EQ(got[id].status_code(), 0) << got[id].status_message();
    ExpectMatchesReference(sent[id], got[id].response(), ReferenceHeads());
  }
}

TEST_F(ScorerE2eTest, NonFiniteLogitsNameFieldAndRow) {
  // Found by the backend during its pass (not by validation); the same contract.
  for (float bad : {kNaN, kInf}) {
    constexpr int64_t n = 5;
    constexpr int64_t v = 100;
    std::vector<float> z = Normal(n * v, 50);
    z[3 * v + 42] = bad;
    v1::ScoreRequest r;
    *r.mutable_logits() = FloatTensor(v1::DATA_TYPE_FLOAT32, z, {n, v});
    r.set_entropy(true);
    v1::ScoreResponse response;
    grpc::Status status = CallScore(stub(), r, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(), HasSubstr("logits"));
    EXPECT_THAT(status.error_message(), HasSubstr("row 3"));

    // In the reference logits, too.
    r.clear_logits();
    *r.mutable_logits() = FloatTensor(v1::DATA_TYPE_FLOAT32, Normal(n * v, 51), {n, v});
    *r.mutable_reference_logits() = FloatTensor(v1::DATA_TYPE_FLOAT32, z, {n, v});
    r.set_reverse_kl(true);
    status = CallScore(stub(), r, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(status.error_message(), HasSubstr("reference_logits"));
    EXPECT_THAT(status.error_message(), HasSubstr("row 3"));
  }
  ScoreAndCheck(SmallValidRequest());
}

// ---------------------------------------------------------------------------------------------
// Invalid requests: one case per rule. Each starts from SmallValidRequest (4 rows, hidden mode).

struct BadCase {
  std::string name;
  std::function<void(v1::ScoreRequest&)> mutate;
  grpc::StatusCode code;
  std::vector<std::string> message_has;
};

// gtest prints parameters in test names and failure messages; the case name says it all.
void PrintTo(const BadCase& c, std::ostream* os) { *os << c.name; }

std::vector<BadCase> BadCases() {
  constexpr int64_t n = 4;
  const int64_t h = kPolicy.hidden;
  const int64_t v = kPolicy.vocab;
  auto logits = [](int64_t rows, int64_t vocab) {
    return FloatTensor(v1::DATA_TYPE_FLOAT32, Normal(rows * vocab, 60), {rows, vocab});
  };
  auto use_logits = [=](v1::ScoreRequest& r) {
    r.clear_head();
    r.clear_hidden();
    *r.mutable_logits() = logits(n, 100);
    *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT32, RandomIds(n, 100, 61), {n});
  };
  auto with_reference = [=](v1::ScoreRequest& r) {
    r.set_forward_kl(true);
    r.set_reference_head(kReference.name);
    *r.mutable_reference_hidden() = r.hidden();
  };
  auto bad_hidden = [=](float value) {
    return [=](v1::ScoreRequest& r) {
      std::vector<float> x = Normal(n * h, 62);
      x[2 * h + 9] = value;
      *r.mutable_hidden() = FloatTensor(v1::DATA_TYPE_BFLOAT16, x, {n, h});
    };
  };
  using C = grpc::StatusCode;
  const C kInvalid = C::INVALID_ARGUMENT;
  return {
      {"ByteLength",
       [](v1::ScoreRequest& r) { r.mutable_hidden()->mutable_data()->append("xy"); },
       kInvalid,
       {"hidden", "bytes"}},
      {"NegativeDim",
       [](v1::ScoreRequest& r) {
         r.mutable_hidden()->set_shape(0, -4);
         r.mutable_hidden()->set_shape(1, -64);
       },
       kInvalid,
       {"hidden", "negative"}},
      {"OverflowingDims",
       [](v1::ScoreRequest& r) {
         r.mutable_hidden()->set_shape(0, int64_t{1} << 62);
         r.mutable_hidden()->set_shape(1, int64_t{1} << 62);
       },
       kInvalid,
       {"hidden", "[4611686018427387904, 4611686018427387904]"}},
      {"WrongRank",
       [](v1::ScoreRequest& r) { r.mutable_hidden()->add_shape(1); },
       kInvalid,
       {"hidden", "rank 3"}},
      {"Int32Logits",
       [=](v1::ScoreRequest& r) {
         use_logits(r);
         r.mutable_logits()->set_dtype(v1::DATA_TYPE_INT32);
       },
       kInvalid,
       {"logits", "INT32"}},
      {"Float32Ids",
       [](v1::ScoreRequest& r) { r.mutable_target_ids()->set_dtype(v1::DATA_TYPE_FLOAT32); },
       kInvalid,
       {"target_ids", "FLOAT32"}},
      {"UnspecifiedDtype",
       [](v1::ScoreRequest& r) { r.mutable_hidden()->set_dtype(v1::DATA_TYPE_UNSPECIFIED); },
       kInvalid,
       {"hidden", "UNSPECIFIED"}},
      {"HiddenAndLogits",
       [=](v1::ScoreRequest& r) { *r.mutable_logits() = logits(n, 100); },
       kInvalid,
       {"hidden", "logits", "both"}},
      {"NeitherHiddenNorLogits",
       [](v1::ScoreRequest& r) { r.clear_hidden(); },
       kInvalid,
       {"hidden", "logits", "neither"}},
      {"HeadWithLogits",
       [=](v1::ScoreRequest& r) {
         use_logits(r);
         r.set_head(kPolicy.name);
       },
       kInvalid,
       {"head", "logits"}},
      {"HiddenWithoutHead",
       [](v1::ScoreRequest& r) { r.clear_head(); },
       kInvalid,
       {"head", "required"}},
      {"UnknownHead",
       [](v1::ScoreRequest& r) { r.set_head("nope"); },
       C::NOT_FOUND,
       {"head", "nope"}},
      {"VersionPin",
       [](v1::ScoreRequest& r) { r.set_head_version(2); },
       C::FAILED_PRECONDITION,
       {"head_version", "2"}},
      {"ReferenceVersionPin",
       [=](v1::ScoreRequest& r) {
         with_reference(r);
         r.set_reference_head_version(9);
       },
       C::FAILED_PRECONDITION,
       {"reference_head_version", "9"}},
      {"ReferenceEntropyWithoutReference",
       [](v1::ScoreRequest& r) { r.set_reference_entropy(true); },
       kInvalid,
       {"reference_hidden", "reference_entropy"}},
      {"ForwardKlWithoutReference",
       [](v1::ScoreRequest& r) { r.set_forward_kl(true); },
       kInvalid,
       {"reference_hidden", "forward_kl"}},
      {"ReverseKlWithoutReference",
       [](v1::ScoreRequest& r) { r.set_reverse_kl(true); },
       kInvalid,
       {"reference_hidden", "reverse_kl"}},
      {"JsdWithoutReference",
       [](v1::ScoreRequest& r) { r.set_jsd_beta(0.5f); },
       kInvalid,
       {"reference_hidden", "jsd_beta"}},
      {"IdAtVocab",
       [=](v1::ScoreRequest& r) {
         std::vector<int64_t> ids = {1, 2, 3, 4, 5, 6, 7, v};
         *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT32, ids, {n, 2});
       },
       kInvalid,
       {"target_ids", "row 3", "column 1", "3000"}},
      {"NegativeId",
       [=](v1::ScoreRequest& r) {
         std::vector<int64_t> ids = {1, 2, -7, 4};
         *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT64, ids, {n});
       },
       kInvalid,
       {"target_ids", "row 2", "column 0", "-7"}},
      {"Int64IdBeyondInt32",
       [=](v1::ScoreRequest& r) {
         std::vector<int64_t> ids = {1, int64_t{1} << 31, 3, 4};
         *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT64, ids, {n});
       },
       kInvalid,
       {"target_ids", "row 1", "int32"}},
      {"IdRowsMismatch",
       [=](v1::ScoreRequest& r) {
         *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT32, RandomIds(n + 1, v, 63), {n + 1});
       },
       kInvalid,
       {"target_ids", "5 rows", "N = 4"}},
      {"HiddenWidthMismatch",
       [](v1::ScoreRequest& r) { r.set_head(kSmall.name); },
       kInvalid,
       {"hidden", "width 64", "hidden size 32"}},
      {"ReferenceVocabMismatch",
       [=](v1::ScoreRequest& r) {
         r.set_forward_kl(true);
         r.set_reference_head(kSmall.name);
         *r.mutable_reference_hidden() =
             FloatTensor(v1::DATA_TYPE_BFLOAT16, Normal(n * kSmall.hidden, 64), {n, kSmall.hidden});
       },
       kInvalid,
       {"reference_hidden", "vocabulary size 500", "3000"}},
      {"ReferenceRowsMismatch",
       [=](v1::ScoreRequest& r) {
         r.set_reverse_kl(true);
         *r.mutable_reference_logits() = logits(n + 2, v);
       },
       kInvalid,
       {"reference_logits", "6 rows", "4 rows"}},
      {"ZeroTemperature",
       [](v1::ScoreRequest& r) { r.set_temperature(0.0f); },
       kInvalid,
       {"temperature"}},
      {"NegativeTemperature",
       [](v1::ScoreRequest& r) { r.set_temperature(-1.0f); },
       kInvalid,
       {"temperature"}},
      {"NaNTemperature",
       [](v1::ScoreRequest& r) { r.set_temperature(kNaN); },
       kInvalid,
       {"temperature"}},
      {"InfTemperature",
       [](v1::ScoreRequest& r) { r.set_temperature(kInf); },
       kInvalid,
       {"temperature"}},
      {"BadReferenceTemperature",
       [=](v1::ScoreRequest& r) {
         with_reference(r);
         r.set_reference_temperature(0.0f);
       },
       kInvalid,
       {"reference_temperature"}},
      {"JsdBetaAboveOne",
       [=](v1::ScoreRequest& r) {
         with_reference(r);
         r.set_jsd_beta(1.5f);
       },
       kInvalid,
       {"jsd_beta", "1.5"}},
      {"JsdBetaNegative",
       [=](v1::ScoreRequest& r) {
         with_reference(r);
         r.set_jsd_beta(-0.25f);
       },
       kInvalid,
       {"jsd_beta"}},
      {"JsdBetaNaN",
       [=](v1::ScoreRequest& r) {
         with_reference(r);
         r.set_jsd_beta(kNaN);
       },
       kInvalid,
       {"jsd_beta"}},
      {"TopKOverServerCap",
       [](v1::ScoreRequest& r) { r.set_top_k(65); },
       kInvalid,
       {"top_k", "64"}},
      {"TopKOverVocab",
       [=](v1::ScoreRequest& r) {
         use_logits(r);
         *r.mutable_logits() = logits(n, 10);
         r.clear_target_ids();
         r.set_top_k(11);
       },
       kInvalid,
       {"top_k", "vocabulary size 10"}},
      {"NegativeSequenceLength",
       [](v1::ScoreRequest& r) {
         r.add_sequence_lengths(5);
         r.add_sequence_lengths(-1);
       },
       kInvalid,
       {"sequence_lengths", "negative"}},
      {"SequenceLengthsSum",
       [](v1::ScoreRequest& r) {
         r.add_sequence_lengths(1);
         r.add_sequence_lengths(2);
       },
       kInvalid,
       {"sequence_lengths", "sum 3", "N = 4"}},
      {"ReferenceLogitsVocabMismatch",
       [=](v1::ScoreRequest& r) {
         use_logits(r);  // 100 ids
         r.set_reverse_kl(true);
         *r.mutable_reference_logits() = logits(n, 101);
       },
       kInvalid,
       {"reference_logits", "vocabulary size 101", "model vocabulary size 100"}},
      {"IdsPerRowOverTheCap",
       [=](v1::ScoreRequest& r) {
         *r.mutable_target_ids() =
             IdTensor(v1::DATA_TYPE_INT32, RandomIds(n * 1025, v, 66), {n, 1025});
       },
       kInvalid,
       {"target_ids", "1025 ids per row", "1024", "--max-target-ids-per-row"}},
      {"HugeIdsPerRowWithNoRows",
       // [0, 2147483647] ids hold no bytes at all: K must still be bounded before anything is
       // sized by it (the per-sequence sums, the backend's per-tile buffers).
       [](v1::ScoreRequest& r) {
         r = SmallValidRequest(0);
         *r.mutable_target_ids() =
             IdTensor(v1::DATA_TYPE_INT32, {}, {0, std::numeric_limits<int32_t>::max()});
         r.add_sequence_lengths(0);
       },
       kInvalid,
       {"target_ids", "2147483647 ids per row", "--max-target-ids-per-row"}},
      {"MoreSequencesThanTheTokenLimit",
       // Zero-length sequences are allowed, but no more of them than --max-tokens-per-request.
       [](v1::ScoreRequest& r) {
         r.add_sequence_lengths(4);
         for (int i = 0; i < 65536; ++i) r.add_sequence_lengths(0);
       },
       C::RESOURCE_EXHAUSTED,
       {"sequence_lengths", "65537 sequences", "65536", "--max-tokens-per-request"}},
      {"NaNHidden", bad_hidden(kNaN), kInvalid, {"hidden", "row 2", "NaN"}},
      {"PosInfHidden", bad_hidden(kInf), kInvalid, {"hidden", "row 2", "+inf"}},
      {"NegInfHidden", bad_hidden(-kInf), kInvalid, {"hidden", "row 2", "-inf"}},
      {"NaNReferenceHidden",
       [=](v1::ScoreRequest& r) {
         with_reference(r);
         std::vector<float> x = Normal(n * h, 65);
         x[h + 3] = kNaN;
         *r.mutable_reference_hidden() = FloatTensor(v1::DATA_TYPE_FLOAT32, x, {n, h});
       },
       kInvalid,
       {"reference_hidden", "row 1"}},
      {"HiddenOverflowsTheLogits",
       // Finite hidden states (so validation accepts them) whose logits overflow fp32: row 2 is
       // 3e38 everywhere, so h . w_j = 3e38 * sum_i w_ji, with sum_i w_ji of spread
       // kSyntheticLogitStd = 3 nats, is beyond FLT_MAX (+inf or NaN) for most ids j. The backend
       // finds them during its pass.
       [=](v1::ScoreRequest& r) {
         std::vector<float> x = Normal(n * h, 67);
         for (int64_t i = 0; i < h; ++i) x[2 * h + i] = 3e38f;
         *r.mutable_hidden() = FloatTensor(v1::DATA_TYPE_FLOAT32, x, {n, h});
       },
       kInvalid,
       {"hidden", "row 2"}},
  };
}

class InvalidRequestTest : public ::testing::TestWithParam<BadCase> {
 protected:
  static void SetUpTestSuite() { server_ = new ServerFixture(); }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  static ServerFixture* server_;
};
ServerFixture* InvalidRequestTest::server_ = nullptr;

TEST_P(InvalidRequestTest, IsRejectedWithTheFieldNamedAndTheServerKeepsServing) {
  ASSERT_TRUE(server_->ok());
  const BadCase& c = GetParam();
  v1::ScoreRequest r = SmallValidRequest();
  c.mutate(r);
  v1::ScoreResponse response;
  const grpc::Status status = CallScore(server_->stub(), r, &response);
  EXPECT_EQ(status.error_code(), c.code) << status.error_message();
  for (const std::string& part : c.message_has) {
    EXPECT_THAT(status.error_message(), HasSubstr(part));
  }
  // Still serving.
  v1::ScoreResponse ok_response;
  const grpc::Status ok = CallScore(server_->stub(), SmallValidRequest(), &ok_response);
  EXPECT_TRUE(ok.ok()) << ok.error_message();
  EXPECT_EQ(ok_response.entropy_size(), 4);
}

INSTANTIATE_TEST_SUITE_P(AllRules, InvalidRequestTest, ::testing::ValuesIn(BadCases()),
                         [](const ::testing::TestParamInfo<BadCase>& info) {
                           return info.param.name;
                         });

// ---------------------------------------------------------------------------------------------
// Server limits.

TEST(ServerLimitsTest, OverLimitRequestsAreResourceExhausted) {
  ServerFixture server({"--max-tokens-per-request", "8", "--max-receive-message-bytes", "8192",
                        "--max-top-k", "4", "--max-target-ids-per-row", "2"});
  ASSERT_TRUE(server.ok());
  v1::ScoreResponse response;

  // N over --max-tokens-per-request (the message itself is small).
  grpc::Status status = CallScore(server.stub(), SmallValidRequest(9), &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("hidden"));
  EXPECT_THAT(status.error_message(), HasSubstr("max-tokens-per-request"));

  // A message over --max-receive-message-bytes: 8 rows of fp32 logits over 300 ids (~9.6 kB).
  v1::ScoreRequest big;
  *big.mutable_logits() = FloatTensor(v1::DATA_TYPE_FLOAT32, Normal(8 * 300, 70), {8, 300});
  big.set_entropy(true);
  status = CallScore(server.stub(), big, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();

  // top_k over the configured cap.
  v1::ScoreRequest top = SmallValidRequest(2);
  top.set_top_k(5);
  status = CallScore(server.stub(), top, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("top_k"));

  // K over --max-target-ids-per-row.
  v1::ScoreRequest wide = SmallValidRequest(2);
  *wide.mutable_target_ids() =
      IdTensor(v1::DATA_TYPE_INT32, RandomIds(6, kPolicy.vocab, 71), {2, 3});
  status = CallScore(server.stub(), wide, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("target_ids"));
  EXPECT_THAT(status.error_message(), HasSubstr("limit of 2"));

  // More sequences than --max-tokens-per-request (zero-length ones count).
  v1::ScoreRequest seqs = SmallValidRequest(2);
  for (int64_t len : {1, 0, 0, 0, 0, 0, 0, 0, 1}) seqs.add_sequence_lengths(len);
  status = CallScore(server.stub(), seqs, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr("sequence_lengths"));

  // Within every limit: served.
  *wide.mutable_target_ids() =
      IdTensor(v1::DATA_TYPE_INT32, RandomIds(4, kPolicy.vocab, 72), {2, 2});
  wide.set_top_k(4);
  for (int64_t len : {1, 0, 0, 0, 0, 0, 0, 1}) wide.add_sequence_lengths(len);
  status = CallScore(server.stub(), wide, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ExpectMatchesReference(wide, response, ReferenceHeads());
  top.set_top_k(4);
  status = CallScore(server.stub(), top, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ExpectMatchesReference(top, response, ReferenceHeads());
  EXPECT_TRUE(CallScore(server.stub(), SmallValidRequest(8), &response).ok());
}

TEST(ServerLimitsTest, FullQueueIsResourceExhaustedAndOthersComplete) {
  ServerFixture server({"--workers", "1", "--queue-size", "1"});
  ASSERT_TRUE(server.ok());
  // 12 concurrent requests of ~100 M multiply-adds each against one worker and one queue slot.
  constexpr int kCalls = 12;
  const v1::ScoreRequest request = SmallValidRequest(512);
  absl::Mutex mu;
  std::vector<grpc::Status> statuses;
  std::vector<std::thread> threads;
  for (int i = 0; i < kCalls; ++i) {
    threads.emplace_back([&] {
      v1::ScoreResponse response;
      const grpc::Status s = CallScore(server.stub(), request, &response);
      absl::MutexLock lock(&mu);
      statuses.push_back(s);
    });
  }
  for (std::thread& t : threads) t.join();
  int ok = 0;
  int exhausted = 0;
  for (const grpc::Status& s : statuses) {
    if (s.ok()) {
      ++ok;
    } else {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
      EXPECT_THAT(s.error_message(), HasSubstr("queue"));
      ++exhausted;
    }
  }
  EXPECT_GE(ok, 1);
  EXPECT_GE(exhausted, 1);
  v1::ScoreResponse response;
  EXPECT_TRUE(CallScore(server.stub(), SmallValidRequest(), &response).ok());
}

}  // namespace
}  // namespace logitserve::e2e
