// The load generator behind `logitserve-bench`: drives one logitserve server with Score (or
// ScoreStream) calls through the generated gRPC stub (no retries, no splitting: every status is
// counted as the server returned it) and reports throughput, latency percentiles and status counts.
//
// Two loops:
//   closed (rate == 0): `concurrency` workers, each sending its next request as soon as the
//     previous one finished (latency = one round trip);
//   open (rate > 0): requests arrive at `rate` per second (Poisson or fixed interval) whatever the
//     server does, each on its own callback-API call (ScoreStream: written on one stream per
//     connection, matched back by request_id), and latency runs from the scheduled arrival, so
//     time spent queued anywhere is counted.
//
// Thread safety: RunLoad is self-contained; LatencyHistogram::Record and the readers may be called
// from any thread concurrently.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace logitserve::bench {

// Latencies in nanoseconds in log-linear buckets: exact below 1024 ns, then 512 buckets per power
// of two, so a reported quantile is within 2^-9 (0.2 %) of the true sample. Lock-free.
class LatencyHistogram {
 public:
  static constexpr int kMaxExponent = 46;  // values clamp at 2^46 ns (about 19.5 hours)
  static constexpr int kBuckets = 1024 + (kMaxExponent - 10) * 512;

  void Record(int64_t nanos);

  // A consistent copy: quantiles of one snapshot are ordered (p50 <= p90 <= p99).
  struct Snapshot {
    std::vector<uint64_t> counts;  // kBuckets
    uint64_t count = 0;
    double sum_nanos = 0;
    // The sample of rank ceil(q * count) (q in [0, 1]), as its bucket's midpoint; 0 when empty.
    double QuantileNanos(double q) const;
    double MeanNanos() const { return count == 0 ? 0 : sum_nanos / static_cast<double>(count); }
  };
  Snapshot Read() const;

  static int BucketOf(int64_t nanos);
  // [low, high] of a bucket's values.
  static int64_t BucketLow(int bucket);
  static int64_t BucketHigh(int bucket);

 private:
  std::array<std::atomic<uint64_t>, kBuckets> counts_{};
  std::atomic<int64_t> sum_nanos_{0};
};

// "OK", "INVALID_ARGUMENT", ... for a gRPC status code 0..16; "CODE_N" otherwise.
std::string StatusCodeName(int code);

// Parses "20s", "500ms", "2m", "1.5" (seconds). Errors: INVALID_ARGUMENT.
absl::StatusOr<std::chrono::nanoseconds> ParseDuration(const std::string& text);

struct LoadOptions {
  std::string target = "127.0.0.1:50051";
  std::string head;
  // Closed loop: workers sending back to back. Ignored in open loop (rate > 0).
  int concurrency = 1;
  double rate = 0;      // requests per second; 0 = closed loop
  bool poisson = true;  // open loop: exponential inter-arrival times, else fixed interval
  std::chrono::nanoseconds duration = std::chrono::seconds(20);
  std::chrono::nanoseconds warmup{0};  // calls finishing before this are not counted
  std::chrono::nanoseconds timeout = std::chrono::seconds(60);  // per-call deadline (unary)
  int connections = 1;  // separate HTTP/2 connections, workers spread round-robin

  // Request shape.
  int64_t tokens = 128;               // N rows
  std::string hidden_dtype = "bf16";  // bf16 | fp32
  int target_ids = 1;                 // K: 0 = none, 1 = shape [N], > 1 = [N, K]
  int top_k = 0;
  bool entropy = false;
  std::string reference_head;  // empty = no reference
  std::string kl = "none";     // none | forward | reverse | both (needs reference_head)
  int distinct_requests = 4;   // request bodies cycled through (random contents)
  uint64_t seed = 1;

  bool stream = false;  // ScoreStream instead of Score

  // Transport security and auth.
  std::string tls_ca_file, tls_cert_file, tls_key_file, tls_server_name;
  std::string token_file;

  // Called about once per second with a one-line summary (progress display); may be empty.
  std::function<void(const std::string&)> progress;
};

struct LoadReport {
  uint64_t count = 0;  // calls finished inside the measured window, any status
  double elapsed_s = 0;
  double rps = 0;
  double tokens_per_s = 0;  // OK calls x tokens / elapsed
  double latency_p50_ms = 0, latency_p90_ms = 0, latency_p99_ms = 0, latency_max_ms = 0,
         latency_mean_ms = 0;
  std::map<std::string, uint64_t> status_counts;
  double server_compute_us_mean = 0;  // ScoreResponse.compute_us over OK calls
  double server_queue_us_mean = 0;
  // OK responses whose output sizes do not match the request (must be 0).
  uint64_t wrong = 0;
  nlohmann::json options;  // what was run
  nlohmann::json ToJson() const;
};

// Runs the load. Fails before sending any Score (INVALID_ARGUMENT / NOT_FOUND / the ListHeads
// error) when the options or the head are wrong; afterwards every outcome is in the report.
absl::StatusOr<LoadReport> RunLoad(const LoadOptions& options);

}  // namespace logitserve::bench
