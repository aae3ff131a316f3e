// Metrics: the server's Prometheus metrics, and MetricsHttpServer, which serves them over HTTP.
//
// Every metric name starts with `logitserve_`. Rendered in the Prometheus text exposition format
// 0.0.4 (one `# HELP` and one `# TYPE` line per family):
//   logitserve_requests_total{method,code}        counter    finished RPCs by method and gRPC code
//   logitserve_tokens_scored_total                counter    token rows computed successfully
//   logitserve_queue_latency_seconds              histogram  admission -> start of compute
//   logitserve_compute_latency_seconds            histogram  one batch on the backend
//   logitserve_batch_requests / _batch_tokens     histogram  requests / token rows per batch
//   logitserve_requests_in_flight                 gauge      RPCs accepted and not yet finished
//   logitserve_queue_depth                        gauge      requests waiting for compute
//   logitserve_call_states_created_total /        counter    per-RPC state objects; equal when
//     _released_total                                         nothing leaked and nothing is live
//   plus gauges computed at scrape time (AddGaugeSource): device memory, head versions, build
//   info, ...; and the standard process_* families (process_stats.h: CPU seconds, resident and
//   virtual memory, open and max fds, start time), unprefixed as every Prometheus client names
//   them.
//
// Thread safety: every method may be called from any thread at any time. Counters and gauges are
// atomics; each histogram and the requests_total table have their own mutex (held for a few
// instructions), so one histogram renders as a consistent snapshot (_count equals the +Inf
// bucket and the sum matches the observations counted). Gauge sources run on the scraping thread
// while a reader lock on the source list is held: a source must be thread-safe and must not call
// back into this Metrics object.
#pragma once

#include <grpcpp/support/status.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace logitserve {

// A cumulative Prometheus histogram over fixed upper bounds (ascending, finite; +Inf implied).
class Histogram {
 public:
  explicit Histogram(std::vector<double> upper_bounds);
  void Observe(double value);  // NaN is ignored

  struct Snapshot {
    std::vector<double> upper_bounds;
    std::vector<uint64_t> cumulative;  // one per upper bound, then +Inf (== count)
    uint64_t count = 0;
    double sum = 0;
  };
  Snapshot Read() const;

 private:
  const std::vector<double> upper_bounds_;
  mutable absl::Mutex mu_;
  std::vector<uint64_t> counts_ ABSL_GUARDED_BY(mu_);  // per bucket, not cumulative; last = +Inf
  double sum_ ABSL_GUARDED_BY(mu_) = 0;
};

class Metrics {
 public:
  Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // One finished RPC: logitserve_requests_total{method="Score",code="OK"}. `code` is rendered by
  // its canonical name (OK, INVALID_ARGUMENT, UNAUTHENTICATED, ...).
  void RecordRequest(std::string_view method, grpc::StatusCode code);
  // Token rows computed for successful responses: logitserve_tokens_scored_total.
  void AddTokensScored(int64_t tokens);
  // Seconds from admission to the start of compute: logitserve_queue_latency_seconds.
  void ObserveQueueLatency(double seconds);
  // Seconds one backend batch took: logitserve_compute_latency_seconds.
  void ObserveComputeLatency(double seconds);
  // One batch of `requests` requests holding `tokens` token rows: logitserve_batch_requests,
  // logitserve_batch_tokens.
  void ObserveBatch(int64_t requests, int64_t tokens);
  // logitserve_requests_in_flight += delta.
  void AddInFlight(int64_t delta);
  // logitserve_queue_depth = depth.
  void SetQueueDepth(int64_t depth);
  // logitserve_call_states_created_total / logitserve_call_states_released_total.
  void CallStateCreated();
  void CallStateReleased();
  int64_t call_states_created() const;
  int64_t call_states_released() const;

  // Accessors for tests and the soak harness.
  int64_t tokens_scored() const;
  int64_t requests(std::string_view method, grpc::StatusCode code) const;

  struct LabeledValue {
    std::vector<std::pair<std::string, std::string>> labels;  // name -> value
    double value = 0;
  };
  // A gauge family computed at scrape time, e.g. logitserve_device_memory_bytes{device="cuda:0",
  // kind="used"} from Backend::MemoryUsage(), logitserve_head_version{head="policy"}. `name` gets
  // the `logitserve_` prefix when it lacks it. Label names must match [a-zA-Z_][a-zA-Z0-9_]*;
  // label values are escaped. Typically registered at start-up, before serving.
  void AddGaugeSource(std::string name, std::string help,
                      std::function<std::vector<LabeledValue>()> source);

  // Every metric in the Prometheus text exposition format 0.0.4.
  std::string RenderPrometheus() const;

  // What the HTTP probes report (MetricsHttpServer): /healthz answers 200 unless kFailed (a fatal
  // device error: restart me), /readyz 200 only while kServing (heads loaded, not draining).
  enum class Readiness { kStarting, kServing, kDraining, kFailed };
  void SetReadiness(Readiness readiness) { readiness_.store(readiness); }
  Readiness readiness() const { return readiness_.load(); }

 private:
  std::atomic<Readiness> readiness_{Readiness::kStarting};
  std::atomic<int64_t> tokens_scored_{0};
  std::atomic<int64_t> in_flight_{0};
  std::atomic<int64_t> queue_depth_{0};
  std::atomic<int64_t> call_states_created_{0};
  std::atomic<int64_t> call_states_released_{0};
  Histogram queue_latency_;
  Histogram compute_latency_;
  Histogram batch_requests_;
  Histogram batch_tokens_;

  mutable absl::Mutex requests_mu_;
  // method -> gRPC code number -> count; ordered so the rendering is stable.
  using CodeCounts = std::map<int, int64_t>;
  std::map<std::string, CodeCounts, std::less<>> requests_ ABSL_GUARDED_BY(requests_mu_);

  struct GaugeSource {
    std::string name;
    std::string help;
    std::function<std::vector<LabeledValue>()> source;
  };
  mutable absl::Mutex sources_mu_;
  std::vector<GaugeSource> sources_ ABSL_GUARDED_BY(sources_mu_);
};

// The canonical name of a gRPC status code ("OK", "INVALID_ARGUMENT", ...; "UNKNOWN" for a value
// outside google.rpc.Code), from absl::StatusCodeToString: the one table of code names.
std::string GrpcCodeName(grpc::StatusCode code);

// Serves GET /metrics (Content-Type text/plain; version=0.0.4) from `metrics`, and the probes
// GET /healthz (200 "ok" unless the device failed: 503) and /readyz (200 "ok" only while serving,
// else 503 with the state), from Metrics::readiness(), for load balancers and non-gRPC
// orchestrators; any other path is 404. One thread of its own multiplexes every connection
// (metrics_http.cc: slow or idle clients never block a scrape or a probe). Thread safety: Start
// and the destructor from one thread; port() from any thread.
class MetricsHttpServer {
 public:
  // Binds `host_port` ("HOST:PORT", "[::1]:PORT"; port 0 picks a free port) and starts serving.
  // Fails (INVALID_ARGUMENT naming --metrics-listen for a malformed address, UNAVAILABLE when the
  // address cannot be bound, e.g. in use) before returning. `metrics` must outlive the server.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& host_port,
                                                                  const Metrics* metrics);
  int port() const { return port_; }
  ~MetricsHttpServer();  // stops accepting, finishes the scrape in progress, joins
  MetricsHttpServer(const MetricsHttpServer&) = delete;
  MetricsHttpServer& operator=(const MetricsHttpServer&) = delete;

 private:
  struct Impl;
  MetricsHttpServer(std::unique_ptr<Impl> impl, int port);
  std::unique_ptr<Impl> impl_;
  int port_ = 0;
};

}  // namespace logitserve
