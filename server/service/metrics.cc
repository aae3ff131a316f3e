#include "server/service/metrics.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/service/process_stats.h"

namespace logitserve {
namespace {

constexpr absl::string_view kPrefix = "logitserve_";

// Latency buckets: 100 us .. 60 s, roughly x2.5 apart (a scoring call spans sub-millisecond
// tiny CPU requests to multi-second 16k-token ones).
std::vector<double> LatencyBuckets() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
          0.1,    0.25,    0.5,    1,     2.5,    5,     10,   30,    60};
}
// Requests per batch: 1 .. 1024, powers of two.
std::vector<double> BatchRequestBuckets() {
  std::vector<double> b;
  for (double v = 1; v <= 1024; v *= 2) b.push_back(v);
  return b;
}
// Token rows per batch: 1 .. 1 Mi, powers of four.
std::vector<double> BatchTokenBuckets() {
  std::vector<double> b;
  for (double v = 1; v <= (1 << 20); v *= 4) b.push_back(v);
  return b;
}

// A sample value or bucket bound: integers exactly, everything else in the fewest digits that
// round-trip.
std::string FormatValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 9007199254740992.0) {
    return absl::StrFormat("%.0f", v);
  }
  // The shortest %g text that reads back as exactly v (0.0025, not 0.0025000000000000001).
  for (int precision = 1; precision < 17; ++precision) {
    const std::string text = absl::StrFormat("%.*g", precision, v);
    if (std::strtod(text.c_str(), nullptr) == v) return text;
  }
  return absl::StrFormat("%.17g", v);
}

// Label values escape backslash, double quote and newline; HELP text backslash and newline.
std::string EscapeLabelValue(absl::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (const char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}
std::string EscapeHelp(absl::string_view s) {
  std::string out;
  for (const char c : s) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

bool IsValidName(absl::string_view s, bool allow_colon) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool alpha =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (allow_colon && c == ':');
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

void AppendHeader(std::string& out, absl::string_view name, absl::string_view help,
                  absl::string_view type) {
  absl::StrAppend(&out, "# HELP ", name, " ", EscapeHelp(help), "\n# TYPE ", name, " ", type, "\n");
}

void AppendHistogram(std::string& out, absl::string_view name, absl::string_view help,
                     const Histogram& histogram) {
  const Histogram::Snapshot s = histogram.Read();
  AppendHeader(out, name, help, "histogram");
  for (size_t i = 0; i < s.upper_bounds.size(); ++i) {
    absl::StrAppend(&out, name, "_bucket{le=\"", FormatValue(s.upper_bounds[i]), "\"} ",
                    s.cumulative[i], "\n");
  }
  absl::StrAppend(&out, name, "_bucket{le=\"+Inf\"} ", s.count, "\n");
  absl::StrAppend(&out, name, "_sum ", FormatValue(s.sum), "\n");
  absl::StrAppend(&out, name, "_count ", s.count, "\n");
}

void AppendScalar(std::string& out, absl::string_view name, absl::string_view help,
                  absl::string_view type, int64_t value) {
  AppendHeader(out, name, help, type);
  absl::StrAppend(&out, name, " ", value, "\n");
}

void AppendOptional(std::string& out, absl::string_view name, absl::string_view help,
                    std::optional<double> value) {
  if (!value.has_value()) return;
  AppendHeader(out, name, help, "gauge");
  absl::StrAppend(&out, name, " ", FormatValue(*value), "\n");
}

// The standard process_* families (unprefixed: dashboards and alerts written for any service use
// these names).
void AppendProcessMetrics(std::string& out) {
  const ProcessStats stats = ReadProcessStats();
  AppendHeader(out, "process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
               "counter");
  absl::StrAppend(&out, "process_cpu_seconds_total ", FormatValue(stats.cpu_seconds), "\n");
  AppendOptional(out, "process_resident_memory_bytes", "Resident memory size in bytes.",
                 stats.resident_memory_bytes);
  AppendOptional(out, "process_virtual_memory_bytes", "Virtual memory size in bytes.",
                 stats.virtual_memory_bytes);
  AppendOptional(out, "process_open_fds", "Number of open file descriptors.", stats.open_fds);
  AppendOptional(out, "process_max_fds", "Maximum number of open file descriptors.", stats.max_fds);
  AppendOptional(out, "process_start_time_seconds",
                 "Start time of the process since unix epoch in seconds.",
                 stats.start_time_seconds);
}

}  // namespace

std::string GrpcCodeName(grpc::StatusCode code) {
  // grpc::StatusCode and absl::StatusCode are both google.rpc.Code: absl's table names both.
  std::string name = absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
  return name.empty() ? "UNKNOWN" : name;
}

Histogram::Histogram(std::vector<double> upper_bounds)
    : upper_bounds_(std::move(upper_bounds)), counts_(upper_bounds_.size() + 1, 0) {}

void Histogram::Observe(double value) {
  if (std::isnan(value)) return;
  // First bucket whose upper bound is >= value (Prometheus buckets are inclusive: le).
  const size_t bucket = static_cast<size_t>(
      std::lower_bound(upper_bounds_.begin(), upper_bounds_.end(), value) - upper_bounds_.begin());
  absl::MutexLock lock(&mu_);
  ++counts_[bucket];
  sum_ += value;
}

Histogram::Snapshot Histogram::Read() const {
  Snapshot s;
  s.upper_bounds = upper_bounds_;
  s.cumulative.resize(counts_.size());
  absl::MutexLock lock(&mu_);
  uint64_t running = 0;
  for (size_t i = 0; i < counts_.size(); ++i) {
    running += counts_[i];
    s.cumulative[i] = running;
  }
  s.count = running;
  s.sum = sum_;
  return s;
}

Metrics::Metrics()
    : queue_latency_(LatencyBuckets()),
      compute_latency_(LatencyBuckets()),
      batch_requests_(BatchRequestBuckets()),
      batch_tokens_(BatchTokenBuckets()) {}

void Metrics::RecordRequest(std::string_view method, grpc::StatusCode code) {
  absl::MutexLock lock(&requests_mu_);
  auto it = requests_.find(method);  // heterogeneous: no allocation once the method is known
  if (it == requests_.end()) it = requests_.emplace(std::string(method), CodeCounts()).first;
  ++it->second[static_cast<int>(code)];
}

void Metrics::AddTokensScored(int64_t tokens) {
  tokens_scored_.fetch_add(tokens, std::memory_order_relaxed);
}
void Metrics::ObserveQueueLatency(double seconds) { queue_latency_.Observe(seconds); }
void Metrics::ObserveComputeLatency(double seconds) { compute_latency_.Observe(seconds); }
void Metrics::ObserveBatch(int64_t requests, int64_t tokens) {
  batch_requests_.Observe(static_cast<double>(requests));
  batch_tokens_.Observe(static_cast<double>(tokens));
}
void Metrics::AddInFlight(int64_t delta) { in_flight_.fetch_add(delta, std::memory_order_relaxed); }
void Metrics::SetQueueDepth(int64_t depth) { queue_depth_.store(depth, std::memory_order_relaxed); }
void Metrics::CallStateCreated() { call_states_created_.fetch_add(1, std::memory_order_relaxed); }
void Metrics::CallStateReleased() { call_states_released_.fetch_add(1, std::memory_order_relaxed); }
int64_t Metrics::call_states_created() const {
  return call_states_created_.load(std::memory_order_relaxed);
}
int64_t Metrics::call_states_released() const {
  return call_states_released_.load(std::memory_order_relaxed);
}
int64_t Metrics::tokens_scored() const { return tokens_scored_.load(std::memory_order_relaxed); }

int64_t Metrics::requests(std::string_view method, grpc::StatusCode code) const {
  absl::MutexLock lock(&requests_mu_);
  const auto it = requests_.find(method);
  if (it == requests_.end()) return 0;
  const auto code_it = it->second.find(static_cast<int>(code));
  return code_it == it->second.end() ? 0 : code_it->second;
}

void Metrics::AddGaugeSource(std::string name, std::string help,
                             std::function<std::vector<LabeledValue>()> source) {
  if (!absl::StartsWith(name, kPrefix)) name = absl::StrCat(kPrefix, name);
  absl::MutexLock lock(&sources_mu_);
  sources_.push_back({std::move(name), std::move(help), std::move(source)});
}

std::string Metrics::RenderPrometheus() const {
  std::string out;
  {
    absl::MutexLock lock(&requests_mu_);
    AppendHeader(out, "logitserve_requests_total", "Finished RPCs by method and gRPC status code.",
                 "counter");
    for (const auto& [method, counts] : requests_) {
      for (const auto& [code, count] : counts) {
        absl::StrAppend(&out, "logitserve_requests_total{method=\"",
                        EscapeLabelValue(absl::string_view(method.data(), method.size())),
                        "\",code=\"", GrpcCodeName(static_cast<grpc::StatusCode>(code)), "\"} ",
                        count, "\n");
      }
    }
  }
  AppendScalar(out, "logitserve_tokens_scored_total", "Token rows scored for successful responses.",
               "counter", tokens_scored());
  AppendHistogram(out, "logitserve_queue_latency_seconds",
                  "Seconds a request waited between admission and the start of its compute.",
                  queue_latency_);
  AppendHistogram(out, "logitserve_compute_latency_seconds",
                  "Seconds one batch spent on the backend.", compute_latency_);
  AppendHistogram(out, "logitserve_batch_requests", "Requests per computed batch.",
                  batch_requests_);
  AppendHistogram(out, "logitserve_batch_tokens", "Token rows per computed batch.", batch_tokens_);
  AppendScalar(out, "logitserve_requests_in_flight", "RPCs accepted and not yet finished.", "gauge",
               in_flight_.load(std::memory_order_relaxed));
  AppendScalar(out, "logitserve_queue_depth", "Requests waiting for compute.", "gauge",
               queue_depth_.load(std::memory_order_relaxed));
  AppendScalar(out, "logitserve_call_states_created_total", "Per-RPC state objects created.",
               "counter", call_states_created());
  AppendScalar(out, "logitserve_call_states_released_total", "Per-RPC state objects released.",
               "counter", call_states_released());

  AppendProcessMetrics(out);

  absl::ReaderMutexLock lock(&sources_mu_);
  for (const GaugeSource& g : sources_) {
    if (!IsValidName(g.name, /*allow_colon=*/true)) continue;
    AppendHeader(out, g.name, g.help, "gauge");
    for (const LabeledValue& v : g.source()) {
      out += g.name;
      bool first = true;
      for (const auto& [label, value] : v.labels) {
        if (!IsValidName(label, /*allow_colon=*/false)) continue;  // never emit a broken line
        absl::StrAppend(&out, first ? "{" : ",", label, "=\"", EscapeLabelValue(value), "\"");
        first = false;
      }
      if (!first) out += "}";
      absl::StrAppend(&out, " ", FormatValue(v.value), "\n");
    }
  }
  return out;
}

}  // namespace logitserve
