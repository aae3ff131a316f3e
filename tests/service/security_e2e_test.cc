// End-to-end tests of the real `logitserve` binary for issue 4's limits, security and metrics:
// TLS and mutual TLS with certificates made by `openssl` at run time, bearer-token auth on every
// Scorer RPC (and none on grpc.health.v1), the Prometheus endpoint scraped over HTTP, the
// connection limits, and the start-up errors of those flags. Clients are the C++ client library
// (its TLS and token options are what is under test there) and raw stubs where the test needs
// exact control of the metadata or of the number of calls.
//
// Long file: the certificate fixture (openssl at run time) is shared by every case here; split,
// each part would regenerate it.
#include <arpa/inet.h>
#include <grpcpp/grpcpp.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "common/version/build_info.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "logitserve/v1/logitserve.grpc.pb.h"
#include "tests/service/prometheus_text.h"
#include "tests/support/server_process.h"
#include "tests/support/test_tensors.h"

namespace logitserve {
namespace {

using ::logitserve::testing::Exposition;
using ::logitserve::testing::FloatTensor;
using ::logitserve::testing::IdTensor;
using ::logitserve::testing::ScrapeMetrics;
using ::logitserve::testing::ScrapeUntil;
using ::logitserve::testing::ServerProcess;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::Optional;

constexpr int64_t kVocab = 100;
constexpr int64_t kHidden = 8;
const std::string kHeadFlag = "--synthetic-head=policy:vocab=100,hidden=8,seed=1";
constexpr char kUserToken[] = "user-token-5f2c";
constexpr char kAdminToken[] = "admin-token-9a41";

// ---------------------------------------------------------------------------------------------
// Files: a per-process temp dir holding the certificates and token files.

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream(path, std::ios::binary) << contents;
}

// A CA, a server certificate for 127.0.0.1 / localhost signed by it, one for another host name,
// a client certificate signed by it, and a second, unrelated CA with its own client certificate.
// P-256 keys: fast to make.
struct Pki {
  std::string dir;
  std::string ca_pem, server_pem, server_key, client_pem, client_key;
  std::string wrong_name_pem, wrong_name_key;  // signed by the CA, but for another host name
  std::string other_ca_pem, other_client_pem, other_client_key;
  // Removes the directory (token files included) when the test program exits.
  ~Pki() {
    std::error_code ignored;
    if (!dir.empty()) std::filesystem::remove_all(dir, ignored);
  }
};

const Pki& TestPki() {
  static const std::unique_ptr<Pki> pki = [] {
    auto p = std::make_unique<Pki>();
    char tmpl[4096];
    std::snprintf(tmpl, sizeof(tmpl), "%s/logitserve_tls_XXXXXX", ::testing::TempDir().c_str());
    const char* made = mkdtemp(tmpl);
    if (made == nullptr) return p;
    p->dir = made;
    const std::string d = p->dir;
    WriteFile(d + "/server.ext",
              "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
              "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:localhost\n");
    WriteFile(d + "/wrong_name.ext",
              "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
              "extendedKeyUsage=serverAuth\nsubjectAltName=DNS:wrong-name.invalid\n");
    WriteFile(d + "/client.ext",
              "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
              "extendedKeyUsage=clientAuth\n");
    const std::string key = "openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out ";
    const auto ca = [&](const std::string& name) {
      return key + name + ".key && openssl req -x509 -new -key " + name + ".key -out " + name +
             ".pem -days 2 -subj '/CN=logitserve test " + name +
             "' -addext 'basicConstraints=critical,CA:TRUE' "
             "-addext 'keyUsage=critical,keyCertSign,cRLSign'";
    };
    const auto leaf = [&](const std::string& name, const std::string& cn, const std::string& issuer,
                          const std::string& ext) {
      return key + name + ".key && openssl req -new -key " + name + ".key -out " + name +
             ".csr -subj '/CN=" + cn + "' && openssl x509 -req -in " + name + ".csr -CA " + issuer +
             ".pem -CAkey " + issuer + ".key -CAcreateserial -days 2 -extfile " + ext + " -out " +
             name + ".pem";
    };
    const std::string script = "set -e; cd '" + d + "'; " + ca("ca") + "; " + ca("other_ca") +
                               "; " + leaf("server", "localhost", "ca", "server.ext") + "; " +
                               leaf("wrong_name", "wrong-name.invalid", "ca", "wrong_name.ext") +
                               "; " + leaf("client", "test client", "ca", "client.ext") + "; " +
                               leaf("other_client", "other client", "other_ca", "client.ext");
    const std::string command = "sh -c \"" + script + "\" > '" + d + "/openssl.log' 2>&1";
    if (std::system(command.c_str()) != 0) {
      ADD_FAILURE() << "openssl failed: " << ReadFile(d + "/openssl.log");
      return p;
    }
    p->ca_pem = d + "/ca.pem";
    p->server_pem = d + "/server.pem";
    p->server_key = d + "/server.key";
    p->wrong_name_pem = d + "/wrong_name.pem";
    p->wrong_name_key = d + "/wrong_name.key";
    p->client_pem = d + "/client.pem";
    p->client_key = d + "/client.key";
    p->other_ca_pem = d + "/other_ca.pem";
    p->other_client_pem = d + "/other_client.pem";
    p->other_client_key = d + "/other_client.key";
    return p;
  }();
  return *pki;
}

// A token file in the PKI dir (which every test process creates anyway).
std::string TokenFile(const std::string& name, const std::string& contents) {
  const std::string path = TestPki().dir + "/" + name;
  WriteFile(path, contents);
  return path;
}

// ---------------------------------------------------------------------------------------------
// Requests and clients.

v1::ScoreRequest SmallRequest(int64_t rows, const std::string& head = "policy") {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> hidden(rows * kHidden);
  for (float& x : hidden) x = normal(rng);
  std::vector<int64_t> ids(rows);
  for (int64_t i = 0; i < rows; ++i) ids[i] = (i * 37) % kVocab;
  v1::ScoreRequest r;
  r.set_head(head);
  *r.mutable_hidden() = FloatTensor(v1::DATA_TYPE_FLOAT32, hidden, {rows, kHidden});
  *r.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT64, ids, {rows});
  r.set_entropy(true);
  return r;
}

client::ClientOptions QuickOptions() {
  client::ClientOptions o;
  o.rpc_timeout = absl::Seconds(20);
  o.max_attempts = 1;  // a refused handshake is UNAVAILABLE: fail at once, do not retry
  o.split_requests = false;
  return o;
}

std::unique_ptr<client::Client> MakeClient(const std::string& target, client::ClientOptions o) {
  absl::StatusOr<std::unique_ptr<client::Client>> c = client::Client::Create(target, o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

std::unique_ptr<ServerProcess> StartServer(std::vector<std::string> args) {
  args.insert(args.begin(), kHeadFlag);
  absl::StatusOr<std::unique_ptr<ServerProcess>> s = ServerProcess::Start(std::move(args));
  EXPECT_TRUE(s.ok()) << s.status();
  return s.ok() ? *std::move(s) : nullptr;
}

// Plaintext raw stub; `token` "" sends no authorization metadata.
struct RawClient {
  explicit RawClient(const std::string& address)
      : channel(grpc::CreateChannel(address, grpc::InsecureChannelCredentials())),
        scorer(v1::Scorer::NewStub(channel)),
        health(grpc::health::v1::Health::NewStub(channel)) {}

  static void Prepare(grpc::ClientContext& context, const std::string& header) {
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    if (!header.empty()) context.AddMetadata("authorization", header);
  }
  grpc::Status Score(const std::string& header, const v1::ScoreRequest& request,
                     v1::ScoreResponse* response = nullptr) {
    grpc::ClientContext context;
    Prepare(context, header);
    v1::ScoreResponse ignored;
    return scorer->Score(&context, request, response != nullptr ? response : &ignored);
  }
  grpc::Status ListHeads(const std::string& header) {
    grpc::ClientContext context;
    Prepare(context, header);
    v1::ListHeadsResponse response;
    return scorer->ListHeads(&context, v1::ListHeadsRequest(), &response);
  }
  // One ScoreStream carrying `request`: the stream's final status (and the response, if any).
  grpc::Status ScoreStream(const std::string& header, const v1::ScoreRequest& request,
                           int* responses) {
    grpc::ClientContext context;
    Prepare(context, header);
    auto stream = scorer->ScoreStream(&context);
    v1::ScoreStreamRequest message;
    *message.mutable_request() = request;
    stream->Write(message);
    stream->WritesDone();
    v1::ScoreStreamResponse response;
    *responses = 0;
    while (stream->Read(&response)) ++*responses;
    return stream->Finish();
  }
  // LoadHead of a [vocab, hidden] fp32 head named `name` (zeros), in one chunk.
  grpc::Status LoadHead(const std::string& header, const std::string& name, int64_t vocab,
                        int64_t hidden, v1::LoadHeadResponse* info) {
    grpc::ClientContext context;
    Prepare(context, header);
    auto writer = scorer->LoadHead(&context, info);
    v1::LoadHeadRequest chunk;
    chunk.mutable_spec()->set_name(name);
    chunk.mutable_spec()->set_vocab_size(vocab);
    chunk.mutable_spec()->set_hidden_size(hidden);
    chunk.mutable_spec()->set_dtype(v1::DATA_TYPE_FLOAT32);
    chunk.set_weight_data(std::string(vocab * hidden * sizeof(float), '\0'));
    writer->Write(chunk);  // may fail once the server has answered; Finish has the status
    writer->WritesDone();
    return writer->Finish();
  }
  grpc::health::v1::HealthCheckResponse::ServingStatus Health(grpc::Status* status) {
    grpc::ClientContext context;
    Prepare(context, "");
    grpc::health::v1::HealthCheckResponse response;
    *status = health->Check(&context, grpc::health::v1::HealthCheckRequest(), &response);
    return response.status();
  }

  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Scorer::Stub> scorer;
  std::unique_ptr<grpc::health::v1::Health::Stub> health;
};

// ---------------------------------------------------------------------------------------------
// Metrics scraping.

// A sample value, 0 when the series does not exist yet (a counter never incremented).
double ValueOr0(const Exposition& e, const std::string& name, const testing::Labels& labels = {}) {
  return testing::SampleValue(e, name, labels).value_or(0.0);
}

double Requests(const Exposition& e, const std::string& method, const std::string& code) {
  return ValueOr0(e, "logitserve_requests_total", {{"method", method}, {"code", code}});
}

// ---------------------------------------------------------------------------------------------
// TLS.

TEST(TlsE2eTest, TlsServerServesTlsClientsThatTrustItsCa) {
  const Pki& pki = TestPki();
  ASSERT_FALSE(pki.ca_pem.empty());
  std::unique_ptr<ServerProcess> server =
      StartServer({"--tls-cert", pki.server_pem, "--tls-key", pki.server_key});
  ASSERT_NE(server, nullptr);
  const std::string port = server->address().substr(server->address().rfind(':') + 1);

  client::ClientOptions tls = QuickOptions();
  tls.use_tls = true;
  tls.tls_root_certs = ReadFile(pki.ca_pem);
  // Both names in the certificate's subjectAltName: the IP and the DNS name.
  for (const std::string& target : {"127.0.0.1:" + port, "localhost:" + port}) {
    std::unique_ptr<client::Client> c = MakeClient(target, tls);
    ASSERT_NE(c, nullptr);
    absl::StatusOr<client::ListHeadsOutput> heads = c->ListHeads();
    ASSERT_TRUE(heads.ok()) << target << ": " << heads.status();
    ASSERT_EQ(heads->heads.size(), 1u);
    EXPECT_EQ(heads->heads[0].name, "policy");
    absl::StatusOr<client::ScoreOutput> out = c->Score(SmallRequest(5));
    ASSERT_TRUE(out.ok()) << target << ": " << out.status();
    EXPECT_EQ(out->rows, 5);
    EXPECT_EQ(out->entropy.size(), 5u);
    absl::StatusOr<client::ServingStatus> health = c->Health();
    ASSERT_TRUE(health.ok()) << health.status();
    EXPECT_EQ(*health, client::ServingStatus::kServing);
  }

  // Plaintext against TLS: the connection never becomes ready.
  std::unique_ptr<client::Client> plain = MakeClient(server->address(), QuickOptions());
  absl::StatusOr<client::ListHeadsOutput> refused = plain->ListHeads();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();

  // TLS trusting another CA: the server certificate does not verify.
  client::ClientOptions wrong_ca = tls;
  wrong_ca.tls_root_certs = ReadFile(pki.other_ca_pem);
  std::unique_ptr<client::Client> untrusting = MakeClient(server->address(), wrong_ca);
  refused = untrusting->ListHeads();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
}

TEST(TlsE2eTest, CertificateForAnotherHostNameIsRejected) {
  const Pki& pki = TestPki();
  ASSERT_FALSE(pki.ca_pem.empty());
  // Signed by the trusted CA, but names neither 127.0.0.1 nor localhost.
  std::unique_ptr<ServerProcess> server =
      StartServer({"--tls-cert", pki.wrong_name_pem, "--tls-key", pki.wrong_name_key});
  ASSERT_NE(server, nullptr);
  client::ClientOptions tls = QuickOptions();
  tls.use_tls = true;
  tls.tls_root_certs = ReadFile(pki.ca_pem);
  absl::StatusOr<client::ListHeadsOutput> refused = MakeClient(server->address(), tls)->ListHeads();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
}

TEST(TlsE2eTest, MutualTlsRequiresAClientCertificateFromTheClientCa) {
  const Pki& pki = TestPki();
  ASSERT_FALSE(pki.ca_pem.empty());
  std::unique_ptr<ServerProcess> server = StartServer(
      {"--tls-cert", pki.server_pem, "--tls-key", pki.server_key, "--tls-client-ca", pki.ca_pem});
  ASSERT_NE(server, nullptr);
  client::ClientOptions tls = QuickOptions();
  tls.use_tls = true;
  tls.tls_root_certs = ReadFile(pki.ca_pem);

  // No client certificate: the handshake fails.
  std::unique_ptr<client::Client> anonymous = MakeClient(server->address(), tls);
  absl::StatusOr<client::ListHeadsOutput> heads = anonymous->ListHeads();
  EXPECT_EQ(heads.status().code(), absl::StatusCode::kUnavailable) << heads.status();

  // A client certificate from another CA: rejected too.
  client::ClientOptions foreign = tls;
  foreign.tls_client_cert = ReadFile(pki.other_client_pem);
  foreign.tls_client_key = ReadFile(pki.other_client_key);
  heads = MakeClient(server->address(), foreign)->ListHeads();
  EXPECT_EQ(heads.status().code(), absl::StatusCode::kUnavailable) << heads.status();

  // The client CA's certificate: served.
  client::ClientOptions mutual = tls;
  mutual.tls_client_cert = ReadFile(pki.client_pem);
  mutual.tls_client_key = ReadFile(pki.client_key);
  std::unique_ptr<client::Client> trusted = MakeClient(server->address(), mutual);
  heads = trusted->ListHeads();
  ASSERT_TRUE(heads.ok()) << heads.status();
  absl::StatusOr<client::ScoreOutput> out = trusted->Score(SmallRequest(3));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->rows, 3);
}

TEST(TlsE2eTest, ClientRejectsHalfAClientCertificate) {
  client::ClientOptions o = QuickOptions();
  o.use_tls = true;
  o.tls_client_cert = "PEM";
  EXPECT_EQ(client::Client::Create("127.0.0.1:1", o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// Bearer tokens.

class AuthE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(TestPki().dir.empty());
    server_ = StartServer({"--auth-token-file", TokenFile("user.token", "  user-token-5f2c\n"),
                           "--admin-token-file", TokenFile("admin.token", "admin-token-9a41\n"),
                           "--metrics-listen", "127.0.0.1:0"});
    ASSERT_NE(server_, nullptr);
    ASSERT_FALSE(server_->metrics_address().empty());
    raw_ = std::make_unique<RawClient>(server_->address());
  }
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<RawClient> raw_;
};

TEST_F(AuthE2eTest, RejectedCallsAreUnauthenticatedAndComputeNothing) {
  const std::string kWrong = "Bearer user-token-5f2d";
  const v1::ScoreRequest request = SmallRequest(4);
  int rejected_scores = 0;
  for (const std::string& header : {std::string(), kWrong, std::string("user-token-5f2c"),
                                    std::string("Basic user-token-5f2c")}) {
    grpc::Status s = raw_->Score(header, request);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << "'" << header << "'";
    ++rejected_scores;
    s = raw_->ListHeads(header);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << "'" << header << "'";
    int responses = -1;
    s = raw_->ScoreStream(header, request, &responses);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << "'" << header << "'";
    EXPECT_EQ(responses, 0);
    v1::LoadHeadResponse info;
    s = raw_->LoadHead(header, "uploaded", 4, kHidden, &info);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAUTHENTICATED) << "'" << header << "'";
  }
  // The C++ client's bearer_token option with a wrong token.
  client::ClientOptions o = QuickOptions();
  o.bearer_token = "not-the-token";
  absl::StatusOr<client::ScoreOutput> out = MakeClient(server_->address(), o)->Score(request);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kUnauthenticated) << out.status();
  ++rejected_scores;

  // Health (probes) needs no token.
  grpc::Status health_status;
  EXPECT_EQ(raw_->Health(&health_status), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_TRUE(health_status.ok()) << health_status.error_message();

  // No compute happened: nothing scored, no batch ran.
  const Exposition e = ScrapeUntil(server_->metrics_address(), [&](const Exposition& x) {
    return Requests(x, "Score", "UNAUTHENTICATED") >= rejected_scores;
  });
  EXPECT_EQ(Requests(e, "Score", "UNAUTHENTICATED"), rejected_scores);
  EXPECT_EQ(Requests(e, "ListHeads", "UNAUTHENTICATED"), 4);
  EXPECT_EQ(Requests(e, "Score", "OK"), 0);
  EXPECT_THAT(testing::SampleValue(e, "logitserve_tokens_scored_total"), Optional(0.0));
  EXPECT_THAT(testing::SampleValue(e, "logitserve_compute_latency_seconds_count"), Optional(0.0));
  EXPECT_THAT(testing::SampleValue(e, "logitserve_batch_tokens_count"), Optional(0.0));
}

TEST_F(AuthE2eTest, UserTokenScoresButCannotUpload) {
  const v1::ScoreRequest request = SmallRequest(6);
  v1::ScoreResponse response;
  grpc::Status s = raw_->Score("Bearer user-token-5f2c", request, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(response.entropy_size(), 6);
  EXPECT_TRUE(raw_->ListHeads("Bearer user-token-5f2c").ok());
  // The admin token is accepted on user RPCs too.
  EXPECT_TRUE(raw_->ListHeads("Bearer admin-token-9a41").ok());

  v1::LoadHeadResponse info;
  s = raw_->LoadHead("Bearer user-token-5f2c", "uploaded", 4, kHidden, &info);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();

  // Through the C++ client's bearer_token option.
  client::ClientOptions o = QuickOptions();
  o.bearer_token = kUserToken;
  std::unique_ptr<client::Client> c = MakeClient(server_->address(), o);
  absl::StatusOr<client::ScoreOutput> out = c->Score(SmallRequest(3));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->rows, 3);

  const Exposition e = ScrapeUntil(server_->metrics_address(), [](const Exposition& x) {
    return Requests(x, "Score", "OK") >= 2;
  });
  EXPECT_EQ(Requests(e, "Score", "OK"), 2);
  EXPECT_EQ(Requests(e, "LoadHead", "PERMISSION_DENIED"), 1);
  EXPECT_THAT(testing::SampleValue(e, "logitserve_tokens_scored_total"), Optional(9.0));
}

TEST_F(AuthE2eTest, AdminTokenUploadsAHead) {
  v1::LoadHeadResponse info;
  const grpc::Status s = raw_->LoadHead("Bearer admin-token-9a41", "uploaded", 4, kHidden, &info);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(info.head().name(), "uploaded");
  EXPECT_EQ(info.head().vocab_size(), 4);
  EXPECT_EQ(info.head().hidden_size(), kHidden);
  // All-zero weights: every logit is 0, so log p = -log(4) for every target.
  v1::ScoreRequest request = SmallRequest(2, "uploaded");
  std::vector<int64_t> ids = {0, 3};
  *request.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT64, ids, {2});
  v1::ScoreResponse response;
  const grpc::Status scored = raw_->Score("Bearer user-token-5f2c", request, &response);
  ASSERT_TRUE(scored.ok()) << scored.error_message();
  ASSERT_EQ(response.target_logprobs_size(), 2);
  // fp32 rounding of log(4) = 1.386...: a few ulp.
  constexpr double kTol = 1e-6;
  for (const float lp : response.target_logprobs()) EXPECT_NEAR(lp, -std::log(4.0), kTol);
  for (const float h : response.entropy()) EXPECT_NEAR(h, std::log(4.0), kTol);
}

TEST(AuthOnlyUserTokenE2eTest, UploadsAreDisabled) {
  ASSERT_FALSE(TestPki().dir.empty());
  std::unique_ptr<ServerProcess> server =
      StartServer({"--auth-token-file", TokenFile("only_user.token", kUserToken)});
  ASSERT_NE(server, nullptr);
  RawClient raw(server->address());
  EXPECT_TRUE(raw.ListHeads(std::string("Bearer ") + kUserToken).ok());
  v1::LoadHeadResponse info;
  const grpc::Status s = raw.LoadHead(std::string("Bearer ") + kUserToken, "x", 4, kHidden, &info);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("--admin-token-file"));
}

TEST(TlsAuthE2eTest, TokenOverMutualTls) {
  const Pki& pki = TestPki();
  ASSERT_FALSE(pki.ca_pem.empty());
  std::unique_ptr<ServerProcess> server =
      StartServer({"--tls-cert", pki.server_pem, "--tls-key", pki.server_key, "--tls-client-ca",
                   pki.ca_pem, "--auth-token-file", TokenFile("tls_user.token", kUserToken)});
  ASSERT_NE(server, nullptr);
  client::ClientOptions o = QuickOptions();
  o.use_tls = true;
  o.tls_root_certs = ReadFile(pki.ca_pem);
  o.tls_client_cert = ReadFile(pki.client_pem);
  o.tls_client_key = ReadFile(pki.client_key);
  absl::StatusOr<client::ListHeadsOutput> heads = MakeClient(server->address(), o)->ListHeads();
  EXPECT_EQ(heads.status().code(), absl::StatusCode::kUnauthenticated) << heads.status();
  o.bearer_token = kUserToken;
  heads = MakeClient(server->address(), o)->ListHeads();
  EXPECT_TRUE(heads.ok()) << heads.status();
}

// ---------------------------------------------------------------------------------------------
// Metrics.

TEST(MetricsE2eTest, CountsRequestsByMethodAndCodeAndTokensScored) {
  std::unique_ptr<ServerProcess> server = StartServer({"--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(server, nullptr);
  ASSERT_THAT(server->metrics_address(), HasSubstr("127.0.0.1:"));
  absl::StatusOr<Exposition> before = ScrapeMetrics(server->metrics_address());
  ASSERT_TRUE(before.ok()) << before.status();
  for (const auto& [name, family] : *before) {
    // Ours are prefixed; the standard process_* families keep their universal names.
    EXPECT_TRUE(name.rfind("logitserve_", 0) == 0 || name.rfind("process_", 0) == 0) << name;
    if (family.type == "histogram") {
      EXPECT_TRUE(testing::CheckHistogram(family).ok()) << testing::CheckHistogram(family);
    }
  }
  EXPECT_EQ(Requests(*before, "Score", "OK"), 0);

  RawClient raw(server->address());
  constexpr int64_t kRows = 13;
  ASSERT_TRUE(raw.Score("", SmallRequest(kRows)).ok());
  Exposition e = ScrapeUntil(server->metrics_address(),
                             [](const Exposition& x) { return Requests(x, "Score", "OK") >= 1; });
  EXPECT_EQ(Requests(e, "Score", "OK"), 1);
  EXPECT_THAT(testing::SampleValue(e, "logitserve_tokens_scored_total"), Optional(13.0));
  EXPECT_GE(ValueOr0(e, "logitserve_compute_latency_seconds_count"), 1);
  EXPECT_GE(ValueOr0(e, "logitserve_queue_latency_seconds_count"), 1);
  EXPECT_THAT(testing::SampleValue(e, "logitserve_batch_tokens_sum"), Optional(13.0));

  // A bad request: counted under its code, nothing more scored.
  EXPECT_EQ(raw.Score("", SmallRequest(3, "no_such_head")).error_code(),
            grpc::StatusCode::NOT_FOUND);
  v1::ScoreRequest bad_ids = SmallRequest(2);
  std::vector<int64_t> out_of_range = {0, kVocab};
  *bad_ids.mutable_target_ids() = IdTensor(v1::DATA_TYPE_INT64, out_of_range, {2});
  EXPECT_EQ(raw.Score("", bad_ids).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_TRUE(raw.ListHeads("").ok());
  e = ScrapeUntil(server->metrics_address(), [](const Exposition& x) {
    return Requests(x, "Score", "NOT_FOUND") >= 1 &&
           Requests(x, "Score", "INVALID_ARGUMENT") >= 1 && Requests(x, "ListHeads", "OK") >= 1;
  });
  EXPECT_EQ(Requests(e, "Score", "NOT_FOUND"), 1);
  EXPECT_EQ(Requests(e, "Score", "INVALID_ARGUMENT"), 1);
  EXPECT_EQ(Requests(e, "Score", "OK"), 1);
  EXPECT_EQ(Requests(e, "ListHeads", "OK"), 1);
  EXPECT_THAT(testing::SampleValue(e, "logitserve_tokens_scored_total"), Optional(13.0));

  // Scrape-time gauges: the head's version as ListHeads reports it.
  v1::ListHeadsResponse heads;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(raw.scorer->ListHeads(&context, v1::ListHeadsRequest(), &heads).ok());
  }
  ASSERT_EQ(heads.heads_size(), 1);
  EXPECT_THAT(testing::SampleValue(e, "logitserve_head_version", {{"head", "policy"}}),
              Optional(static_cast<double>(heads.heads(0).version())));
  ASSERT_EQ(e.count("logitserve_device_memory_bytes"), 1u);
  EXPECT_EQ(e.at("logitserve_device_memory_bytes").type, "gauge");

  // Nothing in flight and every per-call state released once the calls are done.
  e = ScrapeUntil(server->metrics_address(), [](const Exposition& x) {
    return ValueOr0(x, "logitserve_requests_in_flight") == 0 &&
           ValueOr0(x, "logitserve_call_states_created_total") ==
               ValueOr0(x, "logitserve_call_states_released_total");
  });
  EXPECT_EQ(ValueOr0(e, "logitserve_requests_in_flight"), 0);
  EXPECT_GE(ValueOr0(e, "logitserve_call_states_created_total"), 3);
  EXPECT_EQ(ValueOr0(e, "logitserve_call_states_created_total"),
            ValueOr0(e, "logitserve_call_states_released_total"));
}

// Once every call has finished, nothing is queued: the gauge must say 0, whatever order the
// scheduler's enqueue and dequeue updates raced in.
TEST(MetricsE2eTest, QueueDepthReturnsToZero) {
  std::unique_ptr<ServerProcess> server = StartServer({"--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(server, nullptr);
  RawClient raw(server->address());
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(raw.Score("", SmallRequest(2)).ok());
  const Exposition e = ScrapeUntil(server->metrics_address(), [](const Exposition& x) {
    return ValueOr0(x, "logitserve_requests_in_flight") == 0;
  });
  EXPECT_EQ(ValueOr0(e, "logitserve_requests_in_flight"), 0);
  EXPECT_THAT(testing::SampleValue(e, "logitserve_queue_depth"), Optional(0.0));
}

// --workers 0 (the default) takes the backend's default, 1 on the CPU backend; an explicit value
// is used as given. Both are exported, so an operator sees what runs.
TEST(MetricsE2eTest, SchedulerWorkersByBackendUnlessGiven) {
  for (const auto& [flags, expected] : std::vector<std::pair<std::vector<std::string>, double>>{
           {{"--metrics-listen", "127.0.0.1:0"}, 1.0},
           {{"--metrics-listen", "127.0.0.1:0", "--workers", "0"}, 1.0},
           {{"--metrics-listen", "127.0.0.1:0", "--workers", "3"}, 3.0}}) {
    std::unique_ptr<ServerProcess> server = StartServer(flags);
    ASSERT_NE(server, nullptr);
    absl::StatusOr<Exposition> e = ScrapeMetrics(server->metrics_address());
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_THAT(testing::SampleValue(*e, "logitserve_scheduler_workers"), Optional(expected))
        << flags.back();
    RawClient raw(server->address());
    EXPECT_TRUE(raw.Score("", SmallRequest(2)).ok());
  }
}

// What every Prometheus target exports: logitserve_build_info (the build ListHeads reports) and
// the standard process_* families, with values that describe this very process.
TEST(MetricsE2eTest, BuildInfoAndProcessMetrics) {
  std::unique_ptr<ServerProcess> server = StartServer({"--metrics-listen", "127.0.0.1:0"});
  ASSERT_NE(server, nullptr);
  absl::StatusOr<Exposition> e = ScrapeMetrics(server->metrics_address());
  ASSERT_TRUE(e.ok()) << e.status();
  const BuildInfo& build = GetBuildInfo();
  ASSERT_EQ(e->count("logitserve_build_info"), 1u);
  EXPECT_EQ(e->at("logitserve_build_info").type, "gauge");
  EXPECT_THAT(testing::SampleValue(*e, "logitserve_build_info",
                                   {{"version", std::string(build.version)},
                                    {"git_commit", std::string(build.git_commit)},
                                    {"backend", "cpu"},
                                    {"cuda_version", std::string(build.cuda_version)},
                                    {"nccl_version", std::string(build.nccl_version)}}),
              Optional(1.0));

  const std::map<std::string, std::string> process_types = {
      {"process_cpu_seconds_total", "counter"},
      {"process_resident_memory_bytes", "gauge"},
      {"process_virtual_memory_bytes", "gauge"},
      {"process_open_fds", "gauge"},
      {"process_max_fds", "gauge"},
      {"process_start_time_seconds", "gauge"}};
  for (const auto& [name, type] : process_types) {
    ASSERT_EQ(e->count(name), 1u) << name;
    EXPECT_EQ(e->at(name).type, type) << name;
  }
  // The server holds a synthetic head and gRPC's threads: some MiB resident, more virtual; a few
  // descriptors (stdio, sockets) below the limit; started before this scrape, and not before this
  // test began (a generous minute of slack for clock granularity: start time has tick precision).
  const double now = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  EXPECT_GT(ValueOr0(*e, "process_resident_memory_bytes"), 1 << 20);
  EXPECT_GE(ValueOr0(*e, "process_virtual_memory_bytes"),
            ValueOr0(*e, "process_resident_memory_bytes"));
  EXPECT_GE(ValueOr0(*e, "process_open_fds"), 3);
  EXPECT_LT(ValueOr0(*e, "process_open_fds"), ValueOr0(*e, "process_max_fds"));
  EXPECT_LE(ValueOr0(*e, "process_start_time_seconds"), now + 1);
  EXPECT_GT(ValueOr0(*e, "process_start_time_seconds"), now - 60);
  EXPECT_GE(ValueOr0(*e, "process_cpu_seconds_total"), 0);

  // CPU seconds count up as the server works.
  RawClient raw(server->address());
  for (int i = 0; i < 20; ++i) ASSERT_TRUE(raw.Score("", SmallRequest(64)).ok());
  absl::StatusOr<Exposition> later = ScrapeMetrics(server->metrics_address());
  ASSERT_TRUE(later.ok()) << later.status();
  EXPECT_GT(ValueOr0(*later, "process_cpu_seconds_total"),
            ValueOr0(*e, "process_cpu_seconds_total"));
}

// /healthz and /readyz on the metrics port: both 200 while serving; on SIGTERM readiness drops
// (503 "draining") while liveness stays 200 until the process exits.
TEST(MetricsE2eTest, HealthAndReadinessProbes) {
  std::unique_ptr<ServerProcess> server =
      StartServer({"--metrics-listen", "127.0.0.1:0", "--test-fault", "slow-tile:1500"});
  ASSERT_NE(server, nullptr);
  const std::string metrics = server->metrics_address();
  httplib::Client http("http://" + metrics);
  http.set_connection_timeout(10);
  http.set_read_timeout(10);
  for (const char* path : {"/healthz", "/readyz"}) {
    httplib::Result r = http.Get(path);
    ASSERT_TRUE(r) << path;
    EXPECT_EQ(r->status, 200) << path;
    EXPECT_EQ(r->body, "ok\n") << path;
  }
  // Keep one slow request in flight so the drain lasts long enough to be observed.
  RawClient raw(server->address());
  std::thread slow([&raw] { (void)raw.Score("", SmallRequest(2)); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ASSERT_EQ(kill(server->pid(), SIGTERM), 0);
  int ready_status = 0;
  std::string ready_body;
  for (int i = 0; i < 200; ++i) {  // the main loop polls for signals every 100 ms
    httplib::Result ready = http.Get("/readyz");
    ASSERT_TRUE(ready);
    ready_status = ready->status;
    ready_body = ready->body;
    if (ready_status != 200) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(ready_status, 503);
  EXPECT_EQ(ready_body, "draining\n");
  httplib::Result live = http.Get("/healthz");
  ASSERT_TRUE(live);
  EXPECT_EQ(live->status, 200);
  slow.join();
  // The drain ends by itself (signal 0: no second SIGTERM, which would end it with exit 4).
  EXPECT_EQ(server->Stop(0), 0);
}

TEST(MetricsE2eTest, NoMetricsLineWithoutTheFlag) {
  std::unique_ptr<ServerProcess> server = StartServer({});
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(server->metrics_address(), "");
}

// ---------------------------------------------------------------------------------------------
// Connection limits.

// A TCP connection that never sends the HTTP/2 preface is closed once --handshake-timeout-ms
// passes. The 300 ms limit is far below the 10 s the test waits (and the 20 s default), so the
// test distinguishes the flag from the default without timing anything tightly.
TEST(LimitsE2eTest, SilentConnectionIsClosedAfterTheHandshakeTimeout) {
  std::unique_ptr<ServerProcess> server = StartServer({"--handshake-timeout-ms", "300"});
  ASSERT_NE(server, nullptr);
  const std::string& address = server->address();
  const int port = std::stoi(address.substr(address.rfind(':') + 1));
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  // The server writes its SETTINGS (and maybe a GOAWAY) first; read until EOF or a reset, which
  // must come within 10 s.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  bool closed = false;
  while (!closed) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    pollfd p{fd, POLLIN, 0};
    if (left.count() <= 0 || poll(&p, 1, static_cast<int>(left.count())) == 0) break;
    char buf[256];
    closed = read(fd, buf, sizeof(buf)) <= 0;
  }
  close(fd);
  EXPECT_TRUE(closed) << "the server kept a silent connection open for 10 s";
}

// With --max-concurrent-streams 1, an open ScoreStream occupies the connection's only stream: a
// Score on the same channel waits client-side (until its deadline) and runs once the stream
// closes. (The default, 1024, would run it at once.)
TEST(LimitsE2eTest, MaxConcurrentStreamsQueuesCallsOnAConnection) {
  std::unique_ptr<ServerProcess> server = StartServer({"--max-concurrent-streams", "1"});
  ASSERT_NE(server, nullptr);
  RawClient raw(server->address());
  grpc::ClientContext stream_context;
  stream_context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto stream = raw.scorer->ScoreStream(&stream_context);
  // One round trip on the stream: it is open and the server's SETTINGS have arrived.
  v1::ScoreStreamRequest message;
  *message.mutable_request() = SmallRequest(2);
  ASSERT_TRUE(stream->Write(message));
  v1::ScoreStreamResponse response;
  ASSERT_TRUE(stream->Read(&response));
  EXPECT_EQ(response.status_code(), 0) << response.status_message();

  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(1500));
    v1::ListHeadsResponse heads;
    const grpc::Status blocked = raw.scorer->ListHeads(&context, v1::ListHeadsRequest(), &heads);
    EXPECT_EQ(blocked.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << blocked.error_message();
  }
  ASSERT_TRUE(stream->WritesDone());
  while (stream->Read(&response)) {
  }
  const grpc::Status closed = stream->Finish();
  EXPECT_TRUE(closed.ok()) << closed.error_message();
  EXPECT_TRUE(raw.ListHeads("").ok());
}

TEST(LimitsE2eTest, ServesWithExplicitLimits) {
  std::unique_ptr<ServerProcess> server = StartServer(
      {"--max-concurrent-streams", "2", "--keepalive-time-ms", "10000", "--keepalive-timeout-ms",
       "5000", "--keepalive-min-ping-interval-ms", "5000", "--handshake-timeout-ms", "5000"});
  ASSERT_NE(server, nullptr);
  // More concurrent calls than streams allowed: the extra ones wait client-side, none fails.
  RawClient raw(server->address());
  std::vector<std::thread> threads;
  std::vector<grpc::Status> results(6);
  for (size_t i = 0; i < results.size(); ++i) {
    threads.emplace_back([&, i] { results[i] = raw.Score("", SmallRequest(4)); });
  }
  for (std::thread& t : threads) t.join();
  for (const grpc::Status& s : results) EXPECT_TRUE(s.ok()) << s.error_message();
}

// ---------------------------------------------------------------------------------------------
// Start-up errors: non-zero exit, a message naming the flag (and file), never a listening line.

ServerProcess::ExitResult RunServer(std::vector<std::string> args) {
  args.insert(args.begin(), kHeadFlag);
  absl::StatusOr<ServerProcess::ExitResult> r = ServerProcess::RunToExit(std::move(args));
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : ServerProcess::ExitResult{-1, ""};
}

void ExpectStartupError(const std::vector<std::string>& args,
                        const std::vector<std::string>& message_parts) {
  const ServerProcess::ExitResult r = RunServer(args);
  std::string joined;
  for (const std::string& a : args) joined += a + " ";
  EXPECT_NE(r.exit_code, 0) << joined << "\n" << r.output;
  EXPECT_THAT(r.output, Not(HasSubstr("listening on"))) << joined;
  for (const std::string& part : message_parts) {
    EXPECT_THAT(r.output, HasSubstr(part)) << joined;
  }
}

TEST(SecurityStartupTest, TlsFlagErrors) {
  const Pki& pki = TestPki();
  ASSERT_FALSE(pki.ca_pem.empty());
  const std::string missing = pki.dir + "/missing.pem";
  const std::string garbage = TokenFile("garbage.pem", "not a certificate\n");
  ExpectStartupError({"--tls-cert", pki.server_pem}, {"--tls-cert", "--tls-key", "together"});
  ExpectStartupError({"--tls-key", pki.server_key}, {"--tls-cert", "--tls-key", "together"});
  ExpectStartupError({"--tls-client-ca", pki.ca_pem}, {"--tls-client-ca", "--tls-cert"});
  ExpectStartupError({"--tls-cert", missing, "--tls-key", pki.server_key},
                     {"--tls-cert", missing, "cannot read"});
  ExpectStartupError({"--tls-cert", garbage, "--tls-key", pki.server_key},
                     {"--tls-cert", garbage, "no PEM certificate"});
  ExpectStartupError({"--tls-cert", pki.server_pem, "--tls-key", garbage},
                     {"--tls-key", garbage, "private key"});
  ExpectStartupError({"--tls-cert", pki.server_pem, "--tls-key", pki.client_key},
                     {"--tls-key", pki.client_key, "does not match"});
  ExpectStartupError(
      {"--tls-cert", pki.server_pem, "--tls-key", pki.server_key, "--tls-client-ca", garbage},
      {"--tls-client-ca", garbage});
}

TEST(SecurityStartupTest, TokenFileErrors) {
  ASSERT_FALSE(TestPki().dir.empty());
  const std::string missing = TestPki().dir + "/missing.token";
  ExpectStartupError({"--auth-token-file", missing}, {"--auth-token-file", missing});
  ExpectStartupError({"--admin-token-file", missing}, {"--admin-token-file", missing});
  const std::string empty = TokenFile("empty.token", "\n\n");
  ExpectStartupError({"--auth-token-file", empty}, {"--auth-token-file", empty, "no token"});
}

TEST(SecurityStartupTest, MetricsListenErrors) {
  // A port some other socket listens on (no SO_REUSEPORT: a plain listener).
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  const std::string taken = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  ExpectStartupError({"--metrics-listen", taken}, {"--metrics-listen", taken});
  close(fd);
  ExpectStartupError({"--metrics-listen", "127.0.0.1"}, {"--metrics-listen", "HOST:PORT"});
  ExpectStartupError({"--metrics-listen", "127.0.0.1:99999"}, {"--metrics-listen"});
}

TEST(SecurityStartupTest, BadLimitValuesFail) {
  for (const std::vector<std::string>& args :
       std::vector<std::vector<std::string>>{{"--max-concurrent-streams", "0"},
                                             {"--keepalive-time-ms", "10"},
                                             {"--keepalive-timeout-ms", "0"},
                                             {"--keepalive-min-ping-interval-ms", "-5"},
                                             {"--handshake-timeout-ms", "0"}}) {
    ExpectStartupError(args, {args[0]});
  }
}

TEST(SecurityStartupTest, HelpListsTheFlags) {
  const ServerProcess::ExitResult r = RunServer({"--help"});
  EXPECT_EQ(r.exit_code, 0);
  for (const char* flag :
       {"--tls-cert", "--tls-key", "--tls-client-ca", "--auth-token-file", "--admin-token-file",
        "--metrics-listen", "--max-concurrent-streams", "--keepalive-time-ms",
        "--keepalive-timeout-ms", "--keepalive-min-ping-interval-ms", "--handshake-timeout-ms"}) {
    EXPECT_THAT(r.output, HasSubstr(flag));
  }
}

}  // namespace
}  // namespace logitserve
