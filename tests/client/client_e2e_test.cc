// End-to-end tests of the client library against the real logitserve binary (ServerProcess):
// health, heads, scores checked against fp64 computed here from the inputs, automatic request
// splitting, retries on UNAVAILABLE, and error mapping.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "client/tensor.h"
#include "common/safetensors/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "logitserve/kernels/dtype.h"
#include "server/heads/head_weights.h"
#include "tests/client/output_expect.h"
#include "tests/support/server_process.h"

extern char** environ;

namespace logitserve::client {
namespace {

using ::logitserve::testing::ServerProcess;
using testing::Bits;
using testing::ExpectMatchesReference;
using ::testing::HasSubstr;

// Head file for hidden mode. The weights are multiples of 1/64 in [-1/4, 1/4] and the hidden
// states integers in [-2, 2], so every partial sum of a dot product over kHidden = 48 terms is a
// multiple of 1/64 below 2^5: exact in fp32 whatever the summation order or GEMM kernel, and both
// exact in bf16. The logits the server computes therefore equal the fp64 ones exactly; many are
// exactly equal to each other, so top-k's tie rule (smaller id first) is exercised too.
constexpr int64_t kVocab = 2500;  // more than one 2048-id vocabulary block
constexpr int64_t kHidden = 48;

std::vector<uint16_t> HeadWeightBits(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint16_t> w(kVocab * kHidden);
  for (uint16_t& b : w) {
    const float v = static_cast<float>(static_cast<int>(rng() % 33) - 16) / 64.0f;
    b = kernels::FloatToBFloat16(v);
  }
  return w;
}

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "/logitserve_client_" + std::to_string(getpid()) + "_" + name;
}

absl::Status WriteHeadFile(const std::string& path) {
  const std::vector<uint16_t> policy = HeadWeightBits(11), reference = HeadWeightBits(12);
  auto bytes = [](const std::vector<uint16_t>& v) {
    return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(v.data()), v.size() * 2);
  };
  const std::vector<SafetensorsTensorToWrite> tensors = {
      {"policy", SafetensorsDType::kBFloat16, {kVocab, kHidden}, bytes(policy)},
      {"reference", SafetensorsDType::kBFloat16, {kVocab, kHidden}, bytes(reference)}};
  return WriteSafetensors(path, tensors);
}

// The head the server loads from the file's tensor `name` (the weights of `seed`), as the fp64
// reference reads it.
std::shared_ptr<const PreparedHead> FileHead(const std::string& name, uint64_t seed) {
  auto w = std::make_shared<::logitserve::HeadWeights>();
  const std::vector<uint16_t> bits = HeadWeightBits(seed);
  w->name = name;
  w->vocab_size = kVocab;
  w->hidden_size = kHidden;
  w->dtype = kernels::FloatType::kBFloat16;
  w->weight.resize(bits.size() * 2);
  std::memcpy(w->weight.data(), bits.data(), w->weight.size());
  return std::make_shared<PreparedHead>(std::move(w));
}

const e2e::HeadMap& FileHeads() {
  static const auto* heads = new e2e::HeadMap{{"policy", FileHead("policy", 11)},
                                              {"reference", FileHead("reference", 12)}};
  return *heads;
}

// Normal(0, sd^2) fp32 logits [rows, vocab] from a fixed seed.
std::vector<float> RandomLogits(int64_t rows, int64_t vocab, double sd, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, sd);
  std::vector<float> v(rows * vocab);
  for (float& x : v) x = static_cast<float>(normal(rng));
  return v;
}

class ClientE2ETest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    head_file_ = TempPath("heads.safetensors");
    if (absl::Status s = WriteHeadFile(head_file_); !s.ok()) {
      start_error_ = s.ToString();
      return;
    }
    auto server = ServerProcess::Start({"--backend", "cpu", "--threads", "2", "--max-top-k", "16",
                                        "--head", "policy=" + head_file_ + ":policy", "--head",
                                        "reference=" + head_file_ + ":reference",
                                        "--synthetic-head", "synth:vocab=100,hidden=8,seed=3"});
    if (!server.ok()) {
      start_error_ = server.status().ToString();
      return;
    }
    server_ = *std::move(server);
  }
  static void TearDownTestSuite() {
    server_.reset();
    std::remove(head_file_.c_str());
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr) << "server did not start: " << start_error_;
    auto client = Client::Create(server_->address());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }

  static inline std::unique_ptr<ServerProcess> server_;
  static inline std::string head_file_;
  static inline std::string start_error_;
  std::unique_ptr<Client> client_;
};

TEST_F(ClientE2ETest, HealthIsServing) {
  absl::StatusOr<ServingStatus> status = client_->Health();
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(*status, ServingStatus::kServing);
  status = client_->Health("logitserve.v1.Scorer");
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(*status, ServingStatus::kServing);
  // The standard protocol answers NOT_FOUND for a service it does not know.
  EXPECT_EQ(client_->Health("no.such.Service").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ClientE2ETest, ListHeadsDescribesEveryHead) {
  absl::StatusOr<ListHeadsOutput> heads = client_->ListHeads();
  ASSERT_TRUE(heads.ok()) << heads.status();
  EXPECT_EQ(heads->backend, "cpu");
  EXPECT_EQ(heads->max_top_k, 16u);
  EXPECT_GT(heads->max_tokens_per_request, 0);
  std::map<std::string, HeadInfo> by_name;
  for (const HeadInfo& h : heads->heads) by_name[h.name] = h;
  ASSERT_EQ(by_name.size(), 3u);
  EXPECT_EQ(by_name["policy"].vocab_size, kVocab);
  EXPECT_EQ(by_name["policy"].hidden_size, kHidden);
  EXPECT_EQ(by_name["policy"].dtype, v1::DATA_TYPE_BFLOAT16);
  EXPECT_GE(by_name["policy"].version, 1u);
  EXPECT_THAT(by_name["reference"].source, HasSubstr(head_file_));
  EXPECT_EQ(by_name["synth"].vocab_size, 100);
  EXPECT_EQ(by_name["synth"].hidden_size, 8);
  EXPECT_EQ(by_name["synth"].logit_scale, 1.0f);
}

TEST_F(ClientE2ETest, HiddenModeMatchesFp64) {
  constexpr int64_t kRows = 6;
  std::mt19937_64 rng(5);
  std::vector<float> h(kRows * kHidden), h_ref(kRows * kHidden);
  for (float& v : h) v = static_cast<float>(static_cast<int>(rng() % 5) - 2);
  for (float& v : h_ref) v = static_cast<float>(static_cast<int>(rng() % 5) - 2);
  const std::vector<int32_t> ids = {0, 2499, 17, -100, 1234, 17};

  v1::ScoreRequest req;
  req.set_request_id("hidden-1");
  req.set_head("policy");
  req.set_reference_head("reference");
  *req.mutable_hidden() = BFloat16TensorOf(h, {kRows, kHidden});
  *req.mutable_reference_hidden() = BFloat16TensorOf(h_ref, {kRows, kHidden});
  *req.mutable_target_ids() = TensorOf(ids, {kRows});
  req.set_top_k(4);
  req.set_entropy(true);
  req.set_reference_entropy(true);
  req.set_forward_kl(true);
  req.set_reverse_kl(true);
  req.set_jsd_beta(0.5f);
  req.set_temperature(0.75f);

  absl::StatusOr<ScoreOutput> out = client_->Score(req);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->request_id, "hidden-1");
  EXPECT_EQ(out->chunks, 1);
  EXPECT_GE(out->head_version, 1u);
  EXPECT_GE(out->reference_head_version, 1u);

  ExpectMatchesReference(req, *out, FileHeads());
}

TEST_F(ClientE2ETest, LogitsModeWithMasksMatchesFp64) {
  constexpr int64_t kRows = 7, kV = 777;
  std::vector<float> logits = RandomLogits(kRows, kV, 2.0, 21);
  std::vector<float> ref = RandomLogits(kRows, kV, 2.0, 22);
  for (int j = 0; j < 10; ++j) logits[2 * kV + j] = ref[2 * kV + j] = -INFINITY;  // both mask
  ref[4 * kV + 5] = -INFINITY;  // the reference masks a token the model supports
  std::vector<int32_t> ids(kRows * 2);
  for (int64_t r = 0; r < kRows; ++r) {
    ids[2 * r] = static_cast<int32_t>((r * 97) % kV);
    ids[2 * r + 1] = static_cast<int32_t>((r * 97) % kV);  // duplicate ids each get the value
  }
  ids[3] = -7;  // custom ignore index

  v1::ScoreRequest req;
  *req.mutable_logits() = TensorOf(logits, {kRows, kV});
  *req.mutable_reference_logits() = TensorOf(ref, {kRows, kV});
  *req.mutable_target_ids() = TensorOf(ids, {kRows, 2});
  req.set_ignore_index(-7);
  req.set_top_k(5);
  req.set_entropy(true);
  req.set_reference_entropy(true);
  req.set_forward_kl(true);
  req.set_reverse_kl(true);
  req.set_jsd_beta(0.3f);
  req.set_temperature(1.5f);
  req.set_reference_temperature(0.8f);
  absl::StatusOr<ScoreOutput> out = client_->Score(req);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->head_version, 0u);  // logits mode

  ExpectMatchesReference(req, *out);
  EXPECT_TRUE(std::isinf(out->reverse_kl[4]));  // KL(model || ref) with a ref-masked token
  EXPECT_TRUE(std::isfinite(out->jsd[4]));
}

TEST_F(ClientE2ETest, EmptyRequestGivesEmptyOutputs) {
  v1::ScoreRequest req;
  req.set_head("policy");
  *req.mutable_hidden() = BFloat16TensorOf(std::vector<float>{}, {0, kHidden});
  req.set_entropy(true);
  absl::StatusOr<ScoreOutput> out = client_->Score(req);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->rows, 0);
  EXPECT_TRUE(out->entropy.empty());
}

TEST_F(ClientE2ETest, ServerErrorsKeepTheirCodeAndMessage) {
  v1::ScoreRequest req;
  req.set_head("no-such-head");
  *req.mutable_hidden() = TensorOf(std::vector<float>(kHidden, 0.0f), {1, kHidden});
  absl::StatusOr<ScoreOutput> out = client_->Score(req);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(out.status().message(), HasSubstr("no-such-head"));

  req.set_head("policy");
  *req.mutable_target_ids() = TensorOf(std::vector<int32_t>{kVocab}, {1});
  out = client_->Score(req);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(out.status().message(), HasSubstr("target_ids"));
}

// --- Splitting: a server that accepts at most 5 rows per request. --------------------------

constexpr int64_t kSplitRows = 13, kSplitVocab = 300, kSplitLimit = 5;

class ClientSplitTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto server = ServerProcess::Start({"--backend", "cpu", "--threads", "2",
                                        "--max-tokens-per-request", std::to_string(kSplitLimit),
                                        "--synthetic-head", "synth:vocab=300,hidden=8,seed=3"});
    if (!server.ok()) {
      start_error_ = server.status().ToString();
      return;
    }
    server_ = *std::move(server);
  }
  static void TearDownTestSuite() { server_.reset(); }
  void SetUp() override {
    ASSERT_NE(server_, nullptr) << "server did not start: " << start_error_;
    auto client = Client::Create(server_->address());
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
    ClientOptions no_split;
    no_split.split_requests = false;
    auto raw = Client::Create(server_->address(), no_split);
    ASSERT_TRUE(raw.ok()) << raw.status();
    unsplit_client_ = *std::move(raw);

    logits_ = RandomLogits(kSplitRows, kSplitVocab, 3.0, 31);
    ref_ = RandomLogits(kSplitRows, kSplitVocab, 3.0, 32);
    ids_.resize(kSplitRows);
    for (int64_t r = 0; r < kSplitRows; ++r) ids_[r] = static_cast<int32_t>((r * 37) % 300);
    ids_[6] = -100;
  }

  // Rows [begin, end) of the test request (all of it by default).
  v1::ScoreRequest Request(int64_t begin = 0, int64_t end = kSplitRows) const {
    const int64_t n = end - begin;
    v1::ScoreRequest req;
    req.set_request_id("split");
    *req.mutable_logits() =
        TensorOf(std::span<const float>(logits_).subspan(begin * kSplitVocab, n * kSplitVocab),
                 {n, kSplitVocab});
    *req.mutable_reference_logits() =
        TensorOf(std::span<const float>(ref_).subspan(begin * kSplitVocab, n * kSplitVocab),
                 {n, kSplitVocab});
    *req.mutable_target_ids() = TensorOf(std::span<const int32_t>(ids_).subspan(begin, n), {n});
    req.set_top_k(3);
    req.set_entropy(true);
    req.set_forward_kl(true);
    req.set_reverse_kl(true);
    req.set_jsd_beta(0.5f);
    return req;
  }

  // Scores rows [begin, end) in one unsplit request and appends its outputs to `acc`.
  void ScoreUnsplit(int64_t begin, int64_t end, const std::vector<int64_t>& seq,
                    ScoreOutput& acc) const {
    v1::ScoreRequest req = Request(begin, end);
    for (int64_t len : seq) req.add_sequence_lengths(len);
    absl::StatusOr<ScoreOutput> out = unsplit_client_->Score(req);
    ASSERT_TRUE(out.ok()) << out.status();
    auto append = [](auto& dst, const auto& src) { dst.insert(dst.end(), src.begin(), src.end()); };
    append(acc.target_logprobs, out->target_logprobs);
    append(acc.top_k_ids, out->top_k_ids);
    append(acc.top_k_logprobs, out->top_k_logprobs);
    append(acc.entropy, out->entropy);
    append(acc.forward_kl, out->forward_kl);
    append(acc.reverse_kl, out->reverse_kl);
    append(acc.jsd, out->jsd);
    if (out->sequence_sums.has_value()) {
      if (!acc.sequence_sums.has_value()) acc.sequence_sums.emplace();
      SequenceStatsOutput& sums = *acc.sequence_sums;
      append(sums.target_logprobs, out->sequence_sums->target_logprobs);
      append(sums.entropy, out->sequence_sums->entropy);
      append(sums.reference_entropy, out->sequence_sums->reference_entropy);
      append(sums.forward_kl, out->sequence_sums->forward_kl);
      append(sums.reverse_kl, out->sequence_sums->reverse_kl);
      append(sums.jsd, out->sequence_sums->jsd);
      append(sums.token_count, out->sequence_sums->token_count);
    }
  }

  static void ExpectSameBits(const ScoreOutput& a, const ScoreOutput& b) {
    EXPECT_EQ(Bits(a.target_logprobs), Bits(b.target_logprobs));
    EXPECT_EQ(a.top_k_ids, b.top_k_ids);
    EXPECT_EQ(Bits(a.top_k_logprobs), Bits(b.top_k_logprobs));
    EXPECT_EQ(Bits(a.entropy), Bits(b.entropy));
    EXPECT_EQ(Bits(a.forward_kl), Bits(b.forward_kl));
    EXPECT_EQ(Bits(a.reverse_kl), Bits(b.reverse_kl));
    EXPECT_EQ(Bits(a.jsd), Bits(b.jsd));
  }

  static inline std::unique_ptr<ServerProcess> server_;
  static inline std::string start_error_;
  std::unique_ptr<Client> client_;
  std::unique_ptr<Client> unsplit_client_;
  std::vector<float> logits_, ref_;
  std::vector<int32_t> ids_;
};

TEST_F(ClientSplitTest, ServerRefusesTheWholeRequest) {
  absl::StatusOr<ScoreOutput> out = unsplit_client_->Score(Request());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kResourceExhausted) << out.status();
}

TEST_F(ClientSplitTest, SplitResultIsBitIdenticalToChunkByChunkAndMatchesFp64) {
  absl::StatusOr<ScoreOutput> out = client_->Score(Request());
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->chunks, 3);
  EXPECT_EQ(out->rows, kSplitRows);
  EXPECT_EQ(out->request_id, "split");

  ScoreOutput by_chunk;
  for (int64_t begin = 0; begin < kSplitRows; begin += kSplitLimit) {
    ScoreUnsplit(begin, std::min(kSplitRows, begin + kSplitLimit), {}, by_chunk);
  }
  ExpectSameBits(*out, by_chunk);

  // Batch invariance: each row alone gives the same bits as well.
  ScoreOutput by_row;
  for (int64_t r = 0; r < kSplitRows; ++r) ScoreUnsplit(r, r + 1, {}, by_row);
  ExpectSameBits(*out, by_row);

  ExpectMatchesReference(Request(), *out);
}

TEST_F(ClientSplitTest, SplitsOnlyAtSequenceBoundaries) {
  const std::vector<int64_t> lengths = {3, 2, 4, 4};
  v1::ScoreRequest req = Request();
  for (int64_t len : lengths) req.add_sequence_lengths(len);
  absl::StatusOr<ScoreOutput> out = client_->Score(req);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->chunks, 3);  // {3, 2}, {4}, {4}
  ASSERT_TRUE(out->sequence_sums.has_value());
  EXPECT_EQ(out->sequence_sums->token_count, (std::vector<int64_t>{3, 2, 3, 4}));

  ScoreOutput by_chunk;
  ScoreUnsplit(0, 5, {3, 2}, by_chunk);
  ScoreUnsplit(5, 9, {4}, by_chunk);
  ScoreUnsplit(9, 13, {4}, by_chunk);
  ExpectSameBits(*out, by_chunk);
  const SequenceStatsOutput& split = *out->sequence_sums;
  const SequenceStatsOutput& chunked = *by_chunk.sequence_sums;
  EXPECT_EQ(Bits(split.target_logprobs), Bits(chunked.target_logprobs));
  EXPECT_EQ(Bits(split.entropy), Bits(chunked.entropy));
  EXPECT_EQ(Bits(split.reference_entropy), Bits(chunked.reference_entropy));
  EXPECT_EQ(Bits(split.forward_kl), Bits(chunked.forward_kl));
  EXPECT_EQ(Bits(split.reverse_kl), Bits(chunked.reverse_kl));
  EXPECT_EQ(Bits(split.jsd), Bits(chunked.jsd));
  EXPECT_EQ(split.token_count, chunked.token_count);

  ExpectMatchesReference(req, *out);
}

TEST_F(ClientSplitTest, SequenceLongerThanTheLimitIsRejectedByTheClient) {
  v1::ScoreRequest req = Request();
  for (int64_t len : {3, 6, 4}) req.add_sequence_lengths(len);
  absl::StatusOr<ScoreOutput> out = client_->Score(req);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(out.status().message(), HasSubstr("sequence 1 has 6 rows"));
}

TEST_F(ClientSplitTest, ChunkErrorsNameTheRowsOfTheWholeRequest) {
  v1::ScoreRequest req = Request();
  std::vector<int32_t> ids = ids_;
  ids[7] = kSplitVocab;  // out of range, in the second chunk
  *req.mutable_target_ids() = TensorOf(ids, {kSplitRows});
  absl::StatusOr<ScoreOutput> out = client_->Score(req);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(out.status().message(), HasSubstr("rows [5, 10) of 13"));
  EXPECT_THAT(out.status().message(), HasSubstr("target_ids: row 7, column 0"));
}

// --- Retries. ---------------------------------------------------------------------------------

// A loopback port nobody listens on: bound, then released. It is drawn from below the kernel's
// ephemeral range (32768 and up by default), because a client connecting to a free ephemeral port
// can be handed that same port as its source port and connect to itself (TCP simultaneous open),
// which turns "connection refused" into a hung handshake.
int FreePort() {
  std::mt19937 rng(static_cast<unsigned>(getpid()));
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int port = 20000 + static_cast<int>(rng() % 12000);
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    close(fd);
    if (free) return port;
  }
  return -1;
}

TEST(ClientRetryTest, UnreachableServerGivesUnavailableAfterBoundedRetries) {
  const int port = FreePort();
  ASSERT_GT(port, 0);
  ClientOptions options;
  options.max_attempts = 4;
  options.initial_backoff = absl::Milliseconds(100);
  options.backoff_multiplier = 2.0;
  options.max_backoff = absl::Seconds(1);
  options.backoff_jitter = 0.0;
  auto client = Client::Create("127.0.0.1:" + std::to_string(port), options);
  ASSERT_TRUE(client.ok()) << client.status();

  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<ServingStatus> status = (*client)->Health();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(status.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(status.status().message(), HasSubstr("4 attempts"));
  // Three backoffs of 100 + 200 + 400 ms separate the four attempts; a refused connection
  // fails at once, so the whole call is bounded well below the 60 s RPC deadline.
  EXPECT_GE(seconds, 0.7);
  EXPECT_LT(seconds, 5.0);

  v1::ScoreRequest req;
  *req.mutable_logits() = TensorOf(std::vector<float>{0.0f, 1.0f}, {1, 2});
  options.split_requests = false;
  options.max_attempts = 1;
  auto once = Client::Create("127.0.0.1:" + std::to_string(port), options);
  ASSERT_TRUE(once.ok());
  EXPECT_EQ((*once)->Score(req).status().code(), absl::StatusCode::kUnavailable);
}

TEST(ClientRetryTest, RetriesReachAServerThatStartsLate) {
  const int port = FreePort();
  ASSERT_GT(port, 0);
  const std::string address = "127.0.0.1:" + std::to_string(port);
  ClientOptions options;
  options.max_attempts = 40;
  options.initial_backoff = absl::Milliseconds(50);
  options.max_backoff = absl::Milliseconds(250);
  auto client = Client::Create(address, options);
  ASSERT_TRUE(client.ok()) << client.status();

  // The client asks first; the server is spawned 300 ms later on the same port.
  pid_t pid = -1;
  std::thread starter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const std::string binary = ServerProcess::DefaultBinary();
    std::vector<std::string> args = {binary,
                                     "--listen",
                                     address,
                                     "--backend",
                                     "cpu",
                                     "--synthetic-head",
                                     "synth:vocab=100,hidden=8,seed=3"};
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
    if (posix_spawn(&pid, binary.c_str(), &actions, nullptr, argv.data(), environ) != 0) pid = -1;
    posix_spawn_file_actions_destroy(&actions);
  });
  absl::StatusOr<ServingStatus> status = (*client)->Health();
  starter.join();
  ASSERT_GT(pid, 0) << "could not spawn " << ServerProcess::DefaultBinary();
  EXPECT_TRUE(status.ok()) << status.status();
  if (status.ok()) {
    EXPECT_EQ(*status, ServingStatus::kServing);
  }
  // Close the connection first: the test is about the client, and the server's drain is faster
  // without an idle client connection held open.
  client->reset();
  kill(pid, SIGTERM);
  int wstatus = 0;
  waitpid(pid, &wstatus, 0);
  EXPECT_TRUE(WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) << "server exit " << wstatus;
}

TEST(ClientOptionsTest, InvalidOptionsAreRejected) {
  EXPECT_EQ(Client::Create("").status().code(), absl::StatusCode::kInvalidArgument);
  ClientOptions o;
  o.max_attempts = 0;
  EXPECT_EQ(Client::Create("127.0.0.1:1", o).status().code(), absl::StatusCode::kInvalidArgument);
  o = ClientOptions();
  o.tls_client_cert = "cert";
  EXPECT_EQ(Client::Create("127.0.0.1:1", o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace logitserve::client
