// A strict reader of the Prometheus text exposition format 0.0.4 for the metrics tests: parses a
// scrape into families and samples and rejects what a Prometheus server would reject (samples
// outside their TYPE'd family, bad label syntax, duplicate series, unparsable values), so the
// tests check logitserve's output against the format rather than against its own renderer.
// ScrapeMetrics / ScrapeUntil fetch and parse a live server's --metrics-listen endpoint.
//
// Thread safety: plain values and free functions.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace logitserve::testing {

using Labels = std::map<std::string, std::string>;

struct PromSample {
  std::string name;  // full sample name (e.g. x_bucket for a histogram x)
  Labels labels;
  double value = 0;
};

struct PromFamily {
  std::string name;
  std::string help;
  std::string type;  // counter, gauge, histogram, summary, untyped
  std::vector<PromSample> samples;
};

// Family name -> family, for one scrape.
using Exposition = std::map<std::string, PromFamily>;

absl::StatusOr<Exposition> ParsePrometheusText(absl::string_view text);

// The value of the sample `name` with exactly `labels` (searched in every family), or nullopt.
std::optional<double> SampleValue(const Exposition& e, const std::string& name,
                                  const Labels& labels = {});

// Histogram invariants per series (labels other than `le`): buckets with increasing `le`
// ending at +Inf, non-decreasing cumulative counts, +Inf bucket == _count, _sum present, and
// _sum == 0 when _count == 0. The error names the family and what is wrong.
absl::Status CheckHistogram(const PromFamily& family);

// GET http://`host_port`/metrics (10 s connect and read timeouts), requires HTTP 200 and the
// Content-Type `text/plain; version=0.0.4`, and parses the body with ParsePrometheusText.
absl::StatusOr<Exposition> ScrapeMetrics(const std::string& host_port);

// Scrapes until `done` holds (metrics of a call may be recorded just after its response left)
// or `limit` passed; returns the last scrape. A failed scrape is a gtest failure (EXPECT) and
// returns the previous scrape. The limit only stops a hang (the caller asserts the condition
// afterwards); it is not a timing assertion.
Exposition ScrapeUntil(const std::string& host_port,
                       const std::function<bool(const Exposition&)>& done,
                       std::chrono::milliseconds limit = std::chrono::seconds(20));

}  // namespace logitserve::testing
