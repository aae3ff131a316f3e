// Metrics: the rendering is read back with a strict exposition-format parser
// (tests/service/prometheus_text.h) and compared with values computed here from the recorded
// observations and the format's definitions (cumulative `le` buckets, inclusive upper bounds);
// MetricsHttpServer is scraped over a real socket with cpp-httplib's client.
#include "server/service/metrics.h"

#include <cmath>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "httplib.h"
#include "tests/service/prometheus_text.h"

namespace logitserve {
namespace {

using ::logitserve::testing::CheckHistogram;
using ::logitserve::testing::Exposition;
using ::logitserve::testing::ParsePrometheusText;
using ::logitserve::testing::SampleValue;
using ::testing::HasSubstr;
using ::testing::Optional;

Exposition Parse(const Metrics& metrics) {
  const std::string text = metrics.RenderPrometheus();
  absl::StatusOr<Exposition> e = ParsePrometheusText(text);
  EXPECT_TRUE(e.ok()) << e.status() << "\n" << text;
  return e.ok() ? *e : Exposition{};
}

TEST(MetricsTest, EveryFamilyIsPrefixedTypedAndDocumented) {
  Metrics metrics;
  const Exposition e = Parse(metrics);
  const std::map<std::string, std::string> expected = {
      {"logitserve_requests_total", "counter"},
      {"logitserve_tokens_scored_total", "counter"},
      {"logitserve_queue_latency_seconds", "histogram"},
      {"logitserve_compute_latency_seconds", "histogram"},
      {"logitserve_batch_requests", "histogram"},
      {"logitserve_batch_tokens", "histogram"},
      {"logitserve_requests_in_flight", "gauge"},
      {"logitserve_queue_depth", "gauge"},
      {"logitserve_call_states_created_total", "counter"},
      {"logitserve_call_states_released_total", "counter"}};
  for (const auto& [name, type] : expected) {
    ASSERT_EQ(e.count(name), 1u) << name;
    EXPECT_EQ(e.at(name).type, type) << name;
  }
  for (const auto& [name, family] : e) {
    // The standard process_* families keep the names every Prometheus client library uses.
    EXPECT_TRUE(absl::StartsWith(name, "logitserve_") || absl::StartsWith(name, "process_"))
        << name;
    EXPECT_FALSE(family.help.empty()) << name;
    EXPECT_FALSE(family.type.empty()) << name;
    if (family.type == "histogram") {
      EXPECT_TRUE(CheckHistogram(family).ok()) << CheckHistogram(family);
    }
  }
  // Nothing recorded: zeros, and no requests_total series yet.
  EXPECT_THAT(SampleValue(e, "logitserve_tokens_scored_total"), Optional(0.0));
  EXPECT_THAT(SampleValue(e, "logitserve_queue_latency_seconds_count"), Optional(0.0));
  EXPECT_TRUE(e.at("logitserve_requests_total").samples.empty());
}

TEST(MetricsTest, RequestsByMethodAndCode) {
  Metrics metrics;
  for (int i = 0; i < 3; ++i) metrics.RecordRequest("Score", grpc::StatusCode::OK);
  metrics.RecordRequest("Score", grpc::StatusCode::INVALID_ARGUMENT);
  metrics.RecordRequest("ListHeads", grpc::StatusCode::OK);
  metrics.RecordRequest("LoadHead", grpc::StatusCode::PERMISSION_DENIED);
  metrics.RecordRequest("ScoreStream", grpc::StatusCode::UNAUTHENTICATED);
  const Exposition e = Parse(metrics);
  const std::string name = "logitserve_requests_total";
  EXPECT_THAT(SampleValue(e, name, {{"method", "Score"}, {"code", "OK"}}), Optional(3.0));
  EXPECT_THAT(SampleValue(e, name, {{"method", "Score"}, {"code", "INVALID_ARGUMENT"}}),
              Optional(1.0));
  EXPECT_THAT(SampleValue(e, name, {{"method", "ListHeads"}, {"code", "OK"}}), Optional(1.0));
  EXPECT_THAT(SampleValue(e, name, {{"method", "LoadHead"}, {"code", "PERMISSION_DENIED"}}),
              Optional(1.0));
  EXPECT_THAT(SampleValue(e, name, {{"method", "ScoreStream"}, {"code", "UNAUTHENTICATED"}}),
              Optional(1.0));
  EXPECT_EQ(e.at(name).samples.size(), 5u);
  EXPECT_EQ(metrics.requests("Score", grpc::StatusCode::OK), 3);
  EXPECT_EQ(metrics.requests("Score", grpc::StatusCode::NOT_FOUND), 0);
}

TEST(MetricsTest, CountersAndGauges) {
  Metrics metrics;
  metrics.AddTokensScored(100);
  metrics.AddTokensScored(23);
  metrics.AddInFlight(3);
  metrics.AddInFlight(-1);
  metrics.SetQueueDepth(9);
  metrics.SetQueueDepth(7);
  for (int i = 0; i < 5; ++i) metrics.CallStateCreated();
  for (int i = 0; i < 4; ++i) metrics.CallStateReleased();
  EXPECT_EQ(metrics.call_states_created(), 5);
  EXPECT_EQ(metrics.call_states_released(), 4);
  const Exposition e = Parse(metrics);
  EXPECT_THAT(SampleValue(e, "logitserve_tokens_scored_total"), Optional(123.0));
  EXPECT_THAT(SampleValue(e, "logitserve_requests_in_flight"), Optional(2.0));
  EXPECT_THAT(SampleValue(e, "logitserve_queue_depth"), Optional(7.0));
  EXPECT_THAT(SampleValue(e, "logitserve_call_states_created_total"), Optional(5.0));
  EXPECT_THAT(SampleValue(e, "logitserve_call_states_released_total"), Optional(4.0));
}

// Cumulative count of the bucket le=`le` of histogram `name`.
std::optional<double> Bucket(const Exposition& e, const std::string& name, const std::string& le) {
  return SampleValue(e, name + "_bucket", {{"le", le}});
}

TEST(MetricsTest, LatencyHistogramFollowsLeSemantics) {
  Metrics metrics;
  const std::vector<double> observed = {0.00005, 0.001, 0.003, 0.5, 100.0};
  double sum = 0;
  for (const double v : observed) {
    metrics.ObserveQueueLatency(v);
    sum += v;
  }
  metrics.ObserveQueueLatency(std::nan(""));  // ignored
  const Exposition e = Parse(metrics);
  const std::string name = "logitserve_queue_latency_seconds";
  ASSERT_TRUE(CheckHistogram(e.at(name)).ok()) << CheckHistogram(e.at(name));
  // le is an inclusive upper bound: 0.001 falls in le="0.001".
  EXPECT_THAT(Bucket(e, name, "0.0001"), Optional(1.0));
  EXPECT_THAT(Bucket(e, name, "0.001"), Optional(2.0));
  EXPECT_THAT(Bucket(e, name, "0.0025"), Optional(2.0));
  EXPECT_THAT(Bucket(e, name, "0.005"), Optional(3.0));
  EXPECT_THAT(Bucket(e, name, "0.5"), Optional(4.0));
  EXPECT_THAT(Bucket(e, name, "60"), Optional(4.0));
  EXPECT_THAT(Bucket(e, name, "+Inf"), Optional(5.0));
  EXPECT_THAT(SampleValue(e, name + "_count"), Optional(5.0));
  const std::optional<double> got_sum = SampleValue(e, name + "_sum");
  ASSERT_TRUE(got_sum.has_value());
  EXPECT_DOUBLE_EQ(*got_sum, sum);
  // The other latency histogram is independent.
  EXPECT_THAT(SampleValue(e, "logitserve_compute_latency_seconds_count"), Optional(0.0));
}

TEST(MetricsTest, BatchHistograms) {
  Metrics metrics;
  metrics.ObserveBatch(3, 700);
  metrics.ObserveBatch(1, 1);
  metrics.ObserveComputeLatency(0.02);
  const Exposition e = Parse(metrics);
  for (const std::string name : {"logitserve_batch_requests", "logitserve_batch_tokens",
                                 "logitserve_compute_latency_seconds"}) {
    EXPECT_TRUE(CheckHistogram(e.at(name)).ok()) << CheckHistogram(e.at(name));
  }
  EXPECT_THAT(Bucket(e, "logitserve_batch_requests", "1"), Optional(1.0));
  EXPECT_THAT(Bucket(e, "logitserve_batch_requests", "2"), Optional(1.0));
  EXPECT_THAT(Bucket(e, "logitserve_batch_requests", "4"), Optional(2.0));
  EXPECT_THAT(SampleValue(e, "logitserve_batch_requests_sum"), Optional(4.0));
  EXPECT_THAT(Bucket(e, "logitserve_batch_tokens", "1"), Optional(1.0));
  EXPECT_THAT(Bucket(e, "logitserve_batch_tokens", "256"), Optional(1.0));
  EXPECT_THAT(Bucket(e, "logitserve_batch_tokens", "1024"), Optional(2.0));
  EXPECT_THAT(SampleValue(e, "logitserve_batch_tokens_sum"), Optional(701.0));
  EXPECT_THAT(Bucket(e, "logitserve_compute_latency_seconds", "0.01"), Optional(0.0));
  EXPECT_THAT(Bucket(e, "logitserve_compute_latency_seconds", "0.025"), Optional(1.0));
}

TEST(MetricsTest, GaugeSourcesAreEvaluatedAtScrapeTimeAndEscaped) {
  Metrics metrics;
  int calls = 0;
  metrics.AddGaugeSource("head_version", "Version of each head.", [&calls] {
    ++calls;
    return std::vector<Metrics::LabeledValue>{{{{"head", "policy"}}, static_cast<double>(calls)},
                                              {{{"head", "odd \"name\" \\ with\nnewline"}}, 7}};
  });
  metrics.AddGaugeSource("logitserve_device_memory_bytes", "Device memory.", [] {
    return std::vector<Metrics::LabeledValue>{
        {{{"device", "cuda:0"}, {"kind", "used"}}, 1234567890123.0},
        {{{"device", "cuda:0"}, {"kind", "total"}}, 150e9}};
  });
  metrics.AddGaugeSource("empty_gauge", "No samples.",
                         [] { return std::vector<Metrics::LabeledValue>{}; });
  Exposition e = Parse(metrics);
  ASSERT_EQ(e.count("logitserve_head_version"), 1u);  // prefixed once
  EXPECT_EQ(e.count("logitserve_logitserve_device_memory_bytes"), 0u);
  EXPECT_EQ(e.at("logitserve_head_version").type, "gauge");
  EXPECT_THAT(SampleValue(e, "logitserve_head_version", {{"head", "policy"}}), Optional(1.0));
  EXPECT_THAT(
      SampleValue(e, "logitserve_head_version", {{"head", "odd \"name\" \\ with\nnewline"}}),
      Optional(7.0));
  EXPECT_THAT(
      SampleValue(e, "logitserve_device_memory_bytes", {{"device", "cuda:0"}, {"kind", "used"}}),
      Optional(1234567890123.0));
  EXPECT_THAT(
      SampleValue(e, "logitserve_device_memory_bytes", {{"device", "cuda:0"}, {"kind", "total"}}),
      Optional(150e9));
  EXPECT_EQ(e.at("logitserve_empty_gauge").type, "gauge");
  e = Parse(metrics);  // a second scrape calls the source again
  EXPECT_THAT(SampleValue(e, "logitserve_head_version", {{"head", "policy"}}), Optional(2.0));
}

TEST(MetricsTest, ConcurrentRecordingLosesNothing) {
  Metrics metrics;
  constexpr int kThreads = 4;
  constexpr int kPerThread = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&metrics, t] {
      for (int i = 0; i < kPerThread; ++i) {
        metrics.RecordRequest(t % 2 == 0 ? "Score" : "ListHeads", grpc::StatusCode::OK);
        metrics.AddTokensScored(2);
        metrics.ObserveComputeLatency(0.5);
        metrics.AddInFlight(1);
        metrics.AddInFlight(-1);
      }
    });
  }
  // Scrapes race with the writers; every one must be well-formed.
  for (int i = 0; i < 20; ++i) {
    const Exposition e = Parse(metrics);
    ASSERT_TRUE(CheckHistogram(e.at("logitserve_compute_latency_seconds")).ok());
  }
  for (std::thread& t : threads) t.join();
  const Exposition e = Parse(metrics);
  const double half = kThreads / 2 * kPerThread;
  EXPECT_THAT(SampleValue(e, "logitserve_requests_total", {{"method", "Score"}, {"code", "OK"}}),
              Optional(half));
  EXPECT_THAT(
      SampleValue(e, "logitserve_requests_total", {{"method", "ListHeads"}, {"code", "OK"}}),
      Optional(half));
  EXPECT_THAT(SampleValue(e, "logitserve_tokens_scored_total"),
              Optional(2.0 * kThreads * kPerThread));
  EXPECT_THAT(SampleValue(e, "logitserve_compute_latency_seconds_count"),
              Optional(1.0 * kThreads * kPerThread));
  // 0.5 is exact in binary, so the sum is exact too.
  EXPECT_THAT(SampleValue(e, "logitserve_compute_latency_seconds_sum"),
              Optional(0.5 * kThreads * kPerThread));
  EXPECT_THAT(SampleValue(e, "logitserve_requests_in_flight"), Optional(0.0));
}

TEST(MetricsHttpServerTest, ServesMetricsOverHttp) {
  Metrics metrics;
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
      MetricsHttpServer::Start("127.0.0.1:0", &metrics);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_GT((*server)->port(), 0);
  metrics.AddTokensScored(41);  // after Start: the scrape renders live values
  httplib::Client client("127.0.0.1", (*server)->port());
  client.set_connection_timeout(10);
  client.set_read_timeout(10);
  httplib::Result response = client.Get("/metrics");
  ASSERT_TRUE(response) << httplib::to_string(response.error());
  EXPECT_EQ(response->status, 200);
  EXPECT_THAT(response->get_header_value("Content-Type"), HasSubstr("text/plain; version=0.0.4"));
  absl::StatusOr<Exposition> e = ParsePrometheusText(response->body);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_THAT(SampleValue(*e, "logitserve_tokens_scored_total"), Optional(41.0));

  httplib::Result other = client.Get("/");
  ASSERT_TRUE(other);
  EXPECT_EQ(other->status, 404);
}

// The process_* values describe this test process: its start time lies between a few minutes ago
// and now, its descriptor count follows a descriptor the test opens, its CPU time grows with work.
TEST(MetricsTest, ProcessMetricsDescribeThisProcess) {
  Metrics metrics;
  const double now = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  Exposition e = Parse(metrics);
  ASSERT_EQ(e.count("process_cpu_seconds_total"), 1u);
  EXPECT_EQ(e.at("process_cpu_seconds_total").type, "counter");
  for (const char* gauge : {"process_resident_memory_bytes", "process_virtual_memory_bytes",
                            "process_open_fds", "process_max_fds", "process_start_time_seconds"}) {
    ASSERT_EQ(e.count(gauge), 1u) << gauge;
    EXPECT_EQ(e.at(gauge).type, "gauge") << gauge;
  }
  EXPECT_LE(*SampleValue(e, "process_start_time_seconds"), now + 1);
  EXPECT_GT(*SampleValue(e, "process_start_time_seconds"), now - 600);  // the test just started
  EXPECT_GT(*SampleValue(e, "process_resident_memory_bytes"), 1 << 20);

  const double fds = *SampleValue(e, "process_open_fds");
  FILE* extra = std::fopen("/proc/self/stat", "r");
  ASSERT_NE(extra, nullptr);
  e = Parse(metrics);
  EXPECT_EQ(*SampleValue(e, "process_open_fds"), fds + 1);
  std::fclose(extra);

  // CPU time grows with work done (spin ~50 ms of user time).
  const double cpu = *SampleValue(e, "process_cpu_seconds_total");
  volatile double sink = 0;
  const absl::Time until = absl::Now() + absl::Milliseconds(50);
  while (absl::Now() < until) sink = sink + 1;
  e = Parse(metrics);
  EXPECT_GT(*SampleValue(e, "process_cpu_seconds_total"), cpu);
}

TEST(MetricsHttpServerTest, HealthzAndReadyzFollowTheReadiness) {
  Metrics metrics;
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> server =
      MetricsHttpServer::Start("127.0.0.1:0", &metrics);
  ASSERT_TRUE(server.ok()) << server.status();
  httplib::Client client("127.0.0.1", (*server)->port());
  client.set_connection_timeout(10);
  client.set_read_timeout(10);
  struct Case {
    Metrics::Readiness readiness;
    int healthz;
    int readyz;
    std::string readyz_body;
  };
  for (const Case& c :
       {Case{Metrics::Readiness::kStarting, 200, 503, "starting\n"},
        Case{Metrics::Readiness::kServing, 200, 200, "ok\n"},
        Case{Metrics::Readiness::kDraining, 200, 503, "draining\n"},
        Case{Metrics::Readiness::kFailed, 503, 503, "failed: fatal device error\n"}}) {
    metrics.SetReadiness(c.readiness);
    httplib::Result live = client.Get("/healthz");
    ASSERT_TRUE(live);
    EXPECT_EQ(live->status, c.healthz) << c.readyz_body;
    httplib::Result ready = client.Get("/readyz");
    ASSERT_TRUE(ready);
    EXPECT_EQ(ready->status, c.readyz) << c.readyz_body;
    EXPECT_EQ(ready->body, c.readyz_body);
  }
}

TEST(MetricsHttpServerTest, PortInUseFailsClearly) {
  Metrics metrics;
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> first =
      MetricsHttpServer::Start("127.0.0.1:0", &metrics);
  ASSERT_TRUE(first.ok()) << first.status();
  const std::string taken = "127.0.0.1:" + std::to_string((*first)->port());
  absl::StatusOr<std::unique_ptr<MetricsHttpServer>> second =
      MetricsHttpServer::Start(taken, &metrics);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
  EXPECT_THAT(second.status().message(), HasSubstr("--metrics-listen"));
  EXPECT_THAT(second.status().message(), HasSubstr(taken));
}

TEST(MetricsHttpServerTest, MalformedAddressIsInvalidArgument) {
  Metrics metrics;
  for (const std::string address : {"", "127.0.0.1", "127.0.0.1:", "127.0.0.1:http",
                                    "127.0.0.1:65536", "127.0.0.1:-1", ":9090"}) {
    absl::StatusOr<std::unique_ptr<MetricsHttpServer>> s =
        MetricsHttpServer::Start(address, &metrics);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << "'" << address << "'";
    EXPECT_THAT(s.status().message(), HasSubstr("--metrics-listen")) << address;
  }
}

}  // namespace
}  // namespace logitserve
