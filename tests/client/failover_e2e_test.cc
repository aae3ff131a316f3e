// Client-side load balancing and failover across replicas, end to end: three real logitserve
// servers on loopback (ServerProcess), one C++ Client with a multi-address target and the
// round_robin policy (what a `dns:///` target over a headless Service resolves to), load from
// several threads, and one server SIGKILLed mid-run. Asserts that every request succeeds (the
// client retries UNAVAILABLE; round_robin skips the dead subchannel), that every response is
// bit-identical (same synthetic head everywhere, batch-invariant server), that all three servers
// served Score requests before the kill, and that the survivors served everything started after it.
// Traffic per server is read from each server's Prometheus endpoint (--metrics-listen):
// logitserve_requests_total{method="Score",code="OK"}; the victim is killed while its
// logitserve_requests_in_flight shows a request being computed (--test-fault slow-tile keeps each
// one in compute for a while), so the kill really interrupts calls that must be retried. A second
// test checks the `dns:///host:port` + round_robin form used against a headless Service.
#include <signal.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_join.h"
#include "client/client.h"
#include "client/tensor.h"
#include "common/base/status_macros.h"
#include "gtest/gtest.h"
#include "tests/service/prometheus_text.h"
#include "tests/support/server_process.h"

namespace logitserve::client {
namespace {

using ::logitserve::testing::ServerProcess;

constexpr int kServers = 3;
constexpr int kThreads = 4;
// Requests completed (all threads together) before the kill, and requests each thread starts
// after the kill has been reaped.
constexpr int kRequestsBeforeKill = 90;
constexpr int kRequestsPerThreadAfterKill = 25;
constexpr int kRows = 4;
constexpr int kHidden = 32;
constexpr int kVocab = 700;
constexpr const char* kHead = "synth:vocab=700,hidden=32,seed=7";
constexpr int kSlowTileMs = 20;

// The value of the first sample `name{...}` whose labels include every one of `labels` (e.g.
// code="OK"), scraped from the metrics endpoint `host_port`: an error when the scrape fails,
// nullopt when the scrape holds no such sample.
absl::StatusOr<std::optional<double>> ScrapeSample(const std::string& host_port,
                                                   const std::string& name,
                                                   const testing::Labels& labels = {}) {
  LOGITSERVE_ASSIGN_OR_RETURN(testing::Exposition e, testing::ScrapeMetrics(host_port));
  for (const auto& [family_name, family] : e) {
    for (const testing::PromSample& sample : family.samples) {
      if (sample.name != name) continue;
      bool all = true;
      for (const auto& [key, value] : labels) {
        const auto found = sample.labels.find(key);
        all = all && found != sample.labels.end() && found->second == value;
      }
      if (all) return std::optional<double>(sample.value);
    }
  }
  return std::optional<double>();
}

// logitserve_requests_total{method="Score",code="OK"}: Score requests the server completed (a
// series appears with its first request, so an absent one is 0).
absl::StatusOr<double> ScoreOkCount(const std::string& host_port) {
  LOGITSERVE_ASSIGN_OR_RETURN(
      std::optional<double> value,
      ScrapeSample(host_port, "logitserve_requests_total", {{"method", "Score"}, {"code", "OK"}}));
  return value.value_or(0.0);
}

v1::ScoreRequest MakeRequest() {
  std::vector<float> hidden(kRows * kHidden);
  for (size_t i = 0; i < hidden.size(); ++i) {
    hidden[i] = static_cast<float>(static_cast<int>(i % 9) - 4) / 4.0f;  // exact in bf16
  }
  std::vector<int32_t> targets = {0, 1, kVocab / 2, kVocab - 1};
  v1::ScoreRequest request;
  request.set_head("synth");
  *request.mutable_hidden() = BFloat16TensorOf(hidden, {kRows, kHidden});
  *request.mutable_target_ids() = TensorOf(std::span<const int32_t>(targets), {kRows});
  request.set_entropy(true);
  return request;
}

TEST(FailoverE2eTest, RoundRobinSpreadsLoadAndSurvivesAKilledReplica) {
  std::vector<std::unique_ptr<ServerProcess>> servers;
  std::vector<std::string> addresses;
  for (int i = 0; i < kServers; ++i) {
    // slow-tile: every request spends >= kSlowTileMs in compute, so the victim is killed with
    // requests in flight (their retries are what this test is about).
    auto server = ServerProcess::Start(
        {"--backend", "cpu", "--threads", "1", "--metrics-listen", "127.0.0.1:0", "--test-fault",
         "slow-tile:" + std::to_string(kSlowTileMs), "--synthetic-head", kHead});
    ASSERT_TRUE(server.ok()) << server.status();
    ASSERT_FALSE((*server)->metrics_address().empty()) << "no `logitserve metrics on` line";
    addresses.push_back((*server)->address());
    servers.push_back(*std::move(server));
  }
  // gRPC's static multi-address form: ipv4:HOST:PORT,HOST:PORT,... (one scheme for all).
  const std::string target = "ipv4:" + absl::StrJoin(addresses, ",");

  ClientOptions options;
  options.load_balancing_policy = "round_robin";
  options.split_requests = false;  // Score RPCs only; no ListHeads in the counts
  options.rpc_timeout = absl::Seconds(30);
  // The defaults (5 attempts, 100 ms .. 2 s backoff) are what is under test.
  auto client = Client::Create(target, options);
  ASSERT_TRUE(client.ok()) << client.status();

  const v1::ScoreRequest request = MakeRequest();
  std::atomic<int> completed{0};
  std::atomic<bool> killed{false};
  std::atomic<bool> stop{false};  // set when the test gives up early (a failed ASSERT)
  std::atomic<int> started_after_kill{0};
  std::mutex mu;
  std::vector<std::string> failures;  // guarded by mu
  std::optional<ScoreOutput> first;   // guarded by mu
  int mismatches = 0;                 // guarded by mu

  auto worker = [&] {
    int after_kill = 0;
    while (!stop.load() && after_kill < kRequestsPerThreadAfterKill) {
      const bool post_kill = killed.load();
      absl::StatusOr<ScoreOutput> out = (*client)->Score(request);
      std::lock_guard<std::mutex> lock(mu);
      if (!out.ok()) {
        failures.push_back(out.status().ToString());
      } else if (!first.has_value()) {
        first = *out;
      } else if (out->target_logprobs != first->target_logprobs || out->entropy != first->entropy) {
        ++mismatches;
      }
      completed.fetch_add(1);
      if (post_kill) {
        ++after_kill;
        started_after_kill.fetch_add(1);
      }
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker);
  // Joins the threads on every exit path (an ASSERT returning early included).
  struct Joiner {
    std::vector<std::thread>& threads;
    std::atomic<bool>& stop;
    ~Joiner() {
      stop.store(true);
      for (std::thread& t : threads) {
        if (t.joinable()) t.join();
      }
    }
  } joiner{threads, stop};

  // Phase 1: all three replicas serve. Wait until kRequestsBeforeKill requests have completed
  // (each is bounded by its own deadline and attempts, so this ends).
  while (completed.load() < kRequestsBeforeKill) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::vector<double> before(kServers, 0);
  for (int i = 0; i < kServers; ++i) {
    const absl::StatusOr<double> count = ScoreOkCount(servers[i]->metrics_address());
    ASSERT_TRUE(count.ok()) << count.status();
    before[i] = *count;
  }

  // Phase 2: SIGKILL one replica while it is computing a request and the threads keep sending.
  constexpr int kVictim = 1;
  bool victim_busy = false;
  for (int scrape = 0; scrape < 1000 && !victim_busy; ++scrape) {
    const absl::StatusOr<std::optional<double>> in_flight =
        ScrapeSample(servers[kVictim]->metrics_address(), "logitserve_requests_in_flight");
    ASSERT_TRUE(in_flight.ok()) << in_flight.status();
    ASSERT_TRUE(in_flight->has_value()) << "no logitserve_requests_in_flight on the victim";
    victim_busy = **in_flight >= 1;
  }
  EXPECT_TRUE(victim_busy) << "the victim never had a request in flight";
  EXPECT_EQ(servers[kVictim]->Stop(SIGKILL), 128 + SIGKILL);
  killed.store(true);
  for (std::thread& t : threads) t.join();  // each runs kRequestsPerThreadAfterKill more

  // The server counts a call as it finishes it, so the counts may trail the responses by a moment:
  // re-scrape (a bounded number of times) until they cover what the client saw.
  std::vector<double> after(kServers, 0);
  double survivors_gain = 0;
  for (int scrape = 0; scrape < 50; ++scrape) {
    survivors_gain = 0;
    for (int i = 0; i < kServers; ++i) {
      if (i == kVictim) continue;
      const absl::StatusOr<double> count = ScoreOkCount(servers[i]->metrics_address());
      ASSERT_TRUE(count.ok()) << count.status();
      after[i] = *count;
      survivors_gain += after[i] - before[i];
    }
    if (survivors_gain >= kThreads * kRequestsPerThreadAfterKill) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }

  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_TRUE(failures.empty()) << failures.size()
                                  << " requests failed; first: " << failures.front();
    EXPECT_EQ(mismatches, 0) << "responses differ between replicas";
    ASSERT_TRUE(first.has_value());
    EXPECT_EQ(first->rows, kRows);
    ASSERT_EQ(first->target_logprobs.size(), static_cast<size_t>(kRows));
    for (float lp : first->target_logprobs) EXPECT_TRUE(std::isfinite(lp) && lp <= 0.0f) << lp;
  }
  EXPECT_EQ(started_after_kill.load(), kThreads * kRequestsPerThreadAfterKill);
  for (int i = 0; i < kServers; ++i) {
    EXPECT_GT(before[i], 0) << "server " << i << " (" << addresses[i]
                            << ") received no Score request before the kill; counts: "
                            << absl::StrJoin(before, ", ");
  }
  // Everything started after the victim was reaped was served by the survivors.
  EXPECT_GE(survivors_gain, kThreads * kRequestsPerThreadAfterKill);
  std::cout << "Score OK per server before the kill: " << absl::StrJoin(before, ", ")
            << "; survivors served " << survivors_gain << " more after it\n";
  for (int i = 0; i < kServers; ++i) {
    if (i != kVictim) {
      EXPECT_GT(after[i], before[i]) << "survivor " << i << " got no traffic";
    }
  }
}

// The form clients use against a headless Service: a dns:/// target with round_robin. "localhost"
// resolves through the same DNS resolver path (to 127.0.0.1, and ::1 where the host has it, which
// round_robin skips as unreachable: the server listens on 127.0.0.1 only).
TEST(FailoverE2eTest, DnsTargetWithRoundRobinServes) {
  auto server =
      ServerProcess::Start({"--backend", "cpu", "--threads", "1", "--synthetic-head", kHead});
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = (*server)->address();
  const std::string port = address.substr(address.rfind(':') + 1);
  ClientOptions options;
  options.load_balancing_policy = "round_robin";
  options.split_requests = false;
  auto client = Client::Create("dns:///localhost:" + port, options);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<ScoreOutput> out = (*client)->Score(MakeRequest());
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->rows, kRows);
  absl::StatusOr<ServingStatus> health = (*client)->Health("logitserve.v1.Scorer");
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, ServingStatus::kServing);
}

}  // namespace
}  // namespace logitserve::client
