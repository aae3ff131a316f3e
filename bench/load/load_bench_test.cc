// logitserve-bench: its latency histogram and duration parser, then the binary end to end against
// a real server (closed loop, open loop, a run where every call fails).
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "bench/load/load_generator.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/support/server_process.h"

namespace logitserve::bench {
namespace {

using testing::ServerProcess;

TEST(LatencyHistogramTest, BucketsTileTheRangeAndHoldTheirValues) {
  for (int b = 0; b + 1 < LatencyHistogram::kBuckets; ++b) {
    ASSERT_LE(LatencyHistogram::BucketLow(b), LatencyHistogram::BucketHigh(b)) << b;
    ASSERT_EQ(LatencyHistogram::BucketHigh(b) + 1, LatencyHistogram::BucketLow(b + 1)) << b;
  }
  std::mt19937_64 rng(3);
  for (int i = 0; i < 100000; ++i) {
    const int64_t v = static_cast<int64_t>(rng() >> (18 + rng() % 46));  // all magnitudes
    const int b = LatencyHistogram::BucketOf(v);
    ASSERT_LE(LatencyHistogram::BucketLow(b), v);
    ASSERT_GE(LatencyHistogram::BucketHigh(b), v);
    // Relative width <= 2^-9: the precision the header promises.
    ASSERT_LE(LatencyHistogram::BucketHigh(b) - LatencyHistogram::BucketLow(b),
              LatencyHistogram::BucketLow(b) / 512)
        << v;
  }
}

TEST(LatencyHistogramTest, QuantilesMatchTheSortedSampleWithinBucketPrecision) {
  std::mt19937_64 rng(5);
  std::lognormal_distribution<double> dist(13.0, 1.5);  // ~0.4 ms median, long tail
  LatencyHistogram h;
  std::vector<int64_t> samples;
  for (int i = 0; i < 20001; ++i) {
    samples.push_back(static_cast<int64_t>(dist(rng)));
    h.Record(samples.back());
  }
  std::sort(samples.begin(), samples.end());
  const LatencyHistogram::Snapshot s = h.Read();
  ASSERT_EQ(s.count, samples.size());
  for (double q : {0.0, 0.5, 0.9, 0.99, 1.0}) {
    const size_t rank = std::max<size_t>(1, static_cast<size_t>(std::ceil(q * samples.size())));
    const double exact = static_cast<double>(samples[rank - 1]);
    EXPECT_NEAR(s.QuantileNanos(q), exact, exact / 512 + 1) << "q " << q;
  }
  double sum = 0;
  for (int64_t v : samples) sum += static_cast<double>(v);
  EXPECT_DOUBLE_EQ(s.MeanNanos(), sum / static_cast<double>(samples.size()));
}

TEST(ParseDurationTest, UnitsAndErrors) {
  EXPECT_EQ(*ParseDuration("20s"), std::chrono::seconds(20));
  EXPECT_EQ(*ParseDuration("500ms"), std::chrono::milliseconds(500));
  EXPECT_EQ(*ParseDuration("250us"), std::chrono::microseconds(250));
  EXPECT_EQ(*ParseDuration("2m"), std::chrono::minutes(2));
  EXPECT_EQ(*ParseDuration("1.5"), std::chrono::milliseconds(1500));
  EXPECT_FALSE(ParseDuration("soon").ok());
  EXPECT_FALSE(ParseDuration("-1s").ok());
  EXPECT_FALSE(ParseDuration("").ok());
}

TEST(StatusCodeNameTest, CanonicalNames) {
  EXPECT_EQ(StatusCodeName(0), "OK");
  EXPECT_EQ(StatusCodeName(3), "INVALID_ARGUMENT");
  EXPECT_EQ(StatusCodeName(8), "RESOURCE_EXHAUSTED");
  EXPECT_EQ(StatusCodeName(16), "UNAUTHENTICATED");
  EXPECT_EQ(StatusCodeName(42), "CODE_42");
}

// The binary against a real CPU server with a small synthetic head (V = 512, H = 64).
class LoadBenchE2eTest : public ::testing::Test {
 protected:
  static constexpr int64_t kTokens = 16;

  void SetUp() override {
    absl::StatusOr<std::unique_ptr<ServerProcess>> server = ServerProcess::Start(
        {"--backend", "cpu", "--threads", "1", "--max-top-k", "1024", "--synthetic-head",
         "policy:vocab=512,hidden=64,seed=1", "--synthetic-head",
         "teacher:vocab=512,hidden=32,seed=2", "--log-level", "warn"});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  // Runs logitserve-bench with `args`; returns its JSON report.
  nlohmann::json RunBench(const std::vector<std::string>& args) {
    const std::string json_path =
        absl::StrCat(::testing::TempDir(), "/load_bench_", getpid(), "_", runs_++, ".json");
    const std::string command =
        absl::StrCat(LOGITSERVE_BENCH_BINARY, " --quiet --target ", server_->address(), " --json ",
                     json_path, " ", absl::StrJoin(args, " "));
    const int rc = std::system(command.c_str());
    EXPECT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 0) << command << " -> " << rc;
    std::ifstream in(json_path);
    EXPECT_TRUE(in.good()) << "no report at " << json_path;
    if (!in.good()) return {};
    return nlohmann::json::parse(in);
  }

  // The checks every successful run's report must pass.
  static void ExpectAllOkAndOrdered(const nlohmann::json& j) {
    const uint64_t count = j.at("count").get<uint64_t>();
    EXPECT_GT(count, 0u);
    EXPECT_EQ(j.at("status_counts"), nlohmann::json({{"OK", count}}));
    const double p50 = j.at("latency_p50_ms"), p90 = j.at("latency_p90_ms"),
                 p99 = j.at("latency_p99_ms");
    EXPECT_GT(p50, 0.0);
    EXPECT_LE(p50, p90);
    EXPECT_LE(p90, p99);
    EXPECT_LE(p99, j.at("latency_max_ms").get<double>());
    const double elapsed = j.at("elapsed_s");
    EXPECT_NEAR(j.at("rps").get<double>(), static_cast<double>(count) / elapsed, 1e-6 * count);
    EXPECT_NEAR(j.at("tokens_per_s").get<double>(), static_cast<double>(count * kTokens) / elapsed,
                1e-6 * count * kTokens);
    EXPECT_GT(j.at("server_compute_us_mean").get<double>(), 0.0);
    EXPECT_EQ(j.at("wrong"), 0);
  }

  std::unique_ptr<ServerProcess> server_;
  int runs_ = 0;
};

TEST_F(LoadBenchE2eTest, ClosedLoopCountsEveryCallOk) {
  const nlohmann::json j =
      RunBench({"--head", "policy", "--concurrency", "4", "--duration", "2s", "--tokens", "16",
                "--entropy", "--top-k", "5", "--reference-head", "teacher", "--kl", "both"});
  ExpectAllOkAndOrdered(j);
  EXPECT_EQ(j.at("options").at("mode"), "closed");
  EXPECT_EQ(j.at("options").at("hidden_size"), 64);
  EXPECT_GE(j.at("elapsed_s").get<double>(), 2.0);
}

TEST_F(LoadBenchE2eTest, OpenLoopFixedArrivalsSendExactlyRateTimesDuration) {
  // Fixed 10 ms gaps over 2 s: arrivals at 0, 10, ..., 1990 ms -> exactly 200 calls, each
  // counted whatever its latency (the run waits for the last one).
  const nlohmann::json j =
      RunBench({"--head", "policy", "--rate", "100", "--arrivals", "fixed", "--duration", "2s",
                "--tokens", "16", "--hidden-dtype", "fp32", "--target-ids", "3"});
  ExpectAllOkAndOrdered(j);
  EXPECT_EQ(j.at("count"), 200);
  EXPECT_EQ(j.at("options").at("mode"), "open");
}

TEST_F(LoadBenchE2eTest, FailedCallsAreCountedUnderTheirCode) {
  // top_k 600 > V = 512: every call is INVALID_ARGUMENT (never retried, never counted as OK).
  const nlohmann::json j = RunBench({"--head", "policy", "--concurrency", "2", "--duration", "1s",
                                     "--tokens", "16", "--top-k", "600"});
  const uint64_t count = j.at("count").get<uint64_t>();
  EXPECT_GT(count, 0u);
  EXPECT_EQ(j.at("status_counts"), nlohmann::json({{"INVALID_ARGUMENT", count}}));
  EXPECT_EQ(j.at("tokens_per_s").get<double>(), 0.0);
}

TEST_F(LoadBenchE2eTest, StreamClosedAndOpenLoop) {
  ExpectAllOkAndOrdered(RunBench({"--head", "policy", "--stream", "--concurrency", "2",
                                  "--duration", "1s", "--tokens", "16", "--entropy"}));
  const nlohmann::json open =
      RunBench({"--head", "policy", "--stream", "--rate", "100", "--arrivals", "fixed",
                "--duration", "1s", "--tokens", "16", "--entropy"});
  ExpectAllOkAndOrdered(open);
  EXPECT_EQ(open.at("count"), 100);
}

// TLS (certificate made here with openssl) and a bearer token: with both every call is OK; without
// the token the run stops at ListHeads (UNAUTHENTICATED, exit 1).
TEST(LoadBenchSecurityTest, TlsAndBearerToken) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/load_bench_tls_", getpid());
  const std::string cert = dir + "/cert.pem", key = dir + "/key.pem", token = dir + "/token";
  ASSERT_EQ(
      std::system(
          absl::StrCat("mkdir -p ", dir,
                       " && openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj "
                       "/CN=localhost -addext subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout ",
                       key, " -out ", cert, " > /dev/null 2>&1 && echo s3cret-token > ", token)
              .c_str()),
      0);
  absl::StatusOr<std::unique_ptr<ServerProcess>> server =
      ServerProcess::Start({"--backend", "cpu", "--threads", "1", "--synthetic-head",
                            "policy:vocab=512,hidden=64,seed=1", "--tls-cert", cert, "--tls-key",
                            key, "--auth-token-file", token, "--log-level", "warn"});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string json_path = dir + "/report.json";
  const std::string base =
      absl::StrCat(LOGITSERVE_BENCH_BINARY, " --quiet --target ", (*server)->address(),
                   " --tls-ca ", cert, " --head policy --duration 1s --tokens 16 --entropy");
  int rc = std::system(absl::StrCat(base, " --token-file ", token, " --json ", json_path).c_str());
  ASSERT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 0) << rc;
  std::ifstream in(json_path);
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_GT(j.at("count").get<uint64_t>(), 0u);
  EXPECT_EQ(j.at("status_counts"), nlohmann::json({{"OK", j.at("count")}}));
  EXPECT_EQ(j.at("options").at("tls"), true);
  rc = std::system(absl::StrCat(base, " > ", dir, "/no_token.out 2>&1").c_str());
  EXPECT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 1) << rc;
  std::ifstream out(dir + "/no_token.out");
  const std::string text((std::istreambuf_iterator<char>(out)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("UNAUTHENTICATED"), std::string::npos) << text;
}

TEST_F(LoadBenchE2eTest, UnknownHeadFailsBeforeTheRun) {
  const std::string command =
      absl::StrCat(LOGITSERVE_BENCH_BINARY, " --quiet --target ", server_->address(),
                   " --head nosuch --duration 1s", " > /dev/null 2>&1");
  const int rc = std::system(command.c_str());
  EXPECT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 1) << rc;
}

}  // namespace
}  // namespace logitserve::bench
