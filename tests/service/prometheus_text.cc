#include "tests/service/prometheus_text.h"

#include <cmath>
#include <cstdlib>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gtest/gtest.h"
#include "httplib.h"

namespace logitserve::testing {
namespace {

bool IsNameChar(char c, bool first) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
         (!first && c >= '0' && c <= '9');
}

// Reads a metric / label name at the front of `s`; "" when there is none.
std::string TakeName(absl::string_view& s) {
  size_t n = 0;
  while (n < s.size() && IsNameChar(s[n], n == 0)) ++n;
  std::string name(s.substr(0, n));
  s.remove_prefix(n);
  return name;
}

absl::StatusOr<double> ParseValue(absl::string_view v) {
  if (v == "+Inf" || v == "Inf") return HUGE_VAL;
  if (v == "-Inf") return -HUGE_VAL;
  if (v == "NaN") return std::nan("");
  const std::string copy(v);
  char* end = nullptr;
  const double d = std::strtod(copy.c_str(), &end);
  if (copy.empty() || end != copy.c_str() + copy.size()) {
    return absl::InvalidArgumentError(absl::StrCat("bad sample value '", v, "'"));
  }
  return d;
}

// `{a="x",b="y"}` at the front of `s` (consumed).
absl::StatusOr<Labels> TakeLabels(absl::string_view& s) {
  Labels labels;
  if (!absl::ConsumePrefix(&s, "{")) return labels;
  while (true) {
    if (absl::ConsumePrefix(&s, "}")) return labels;
    const std::string name = TakeName(s);
    if (name.empty() || name.find(':') != std::string::npos) {
      return absl::InvalidArgumentError("bad label name");
    }
    if (!absl::ConsumePrefix(&s, "=\"")) return absl::InvalidArgumentError("expected =\"");
    std::string value;
    while (true) {
      if (s.empty()) return absl::InvalidArgumentError("unterminated label value");
      const char c = s[0];
      s.remove_prefix(1);
      if (c == '"') break;
      if (c == '\n') return absl::InvalidArgumentError("raw newline in label value");
      if (c == '\\') {
        if (s.empty()) return absl::InvalidArgumentError("dangling escape");
        const char e = s[0];
        s.remove_prefix(1);
        if (e == 'n') {
          value += '\n';
        } else if (e == '\\' || e == '"') {
          value += e;
        } else {
          return absl::InvalidArgumentError("bad escape in label value");
        }
      } else {
        value += c;
      }
    }
    if (!labels.emplace(name, value).second) {
      return absl::InvalidArgumentError(absl::StrCat("label '", name, "' repeated"));
    }
    if (!absl::ConsumePrefix(&s, ",") && !absl::StartsWith(s, "}")) {
      return absl::InvalidArgumentError("expected , or } after a label");
    }
  }
}

// Whether sample `sample` may belong to family `family` of `type`.
bool BelongsTo(const std::string& sample, const std::string& family, const std::string& type) {
  if (type == "histogram") {
    return sample == family + "_bucket" || sample == family + "_sum" || sample == family + "_count";
  }
  if (type == "summary") {
    return sample == family || sample == family + "_sum" || sample == family + "_count";
  }
  return sample == family;
}

}  // namespace

absl::StatusOr<Exposition> ParsePrometheusText(absl::string_view text) {
  Exposition out;
  std::string current;  // family of the latest TYPE line
  std::set<std::string> series_seen;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_number;
    const auto fail = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line_number, " '", line, "': ", why));
    };
    if (line.empty()) continue;
    if (absl::ConsumePrefix(&line, "# ")) {
      absl::string_view rest = line;
      const bool help = absl::ConsumePrefix(&rest, "HELP ");
      const bool type = !help && absl::ConsumePrefix(&rest, "TYPE ");
      if (!help && !type) continue;  // a plain comment
      const std::string name = TakeName(rest);
      if (name.empty() || !absl::ConsumePrefix(&rest, " ")) return fail("bad HELP/TYPE line");
      PromFamily& family = out[name];
      family.name = name;
      if (help) {
        if (!family.help.empty()) return fail("second HELP");
        family.help = std::string(rest);
      } else {
        if (!family.type.empty()) return fail("second TYPE");
        if (!family.samples.empty()) return fail("TYPE after samples");
        static const std::set<std::string> kTypes = {"counter", "gauge", "histogram", "summary",
                                                     "untyped"};
        if (kTypes.count(std::string(rest)) == 0) return fail("unknown type");
        family.type = std::string(rest);
        current = name;
      }
      continue;
    }
    if (line[0] == '#') continue;
    absl::string_view rest = line;
    PromSample sample;
    sample.name = TakeName(rest);
    if (sample.name.empty()) return fail("no metric name");
    absl::StatusOr<Labels> labels = TakeLabels(rest);
    if (!labels.ok()) return fail(labels.status().message());
    sample.labels = *std::move(labels);
    if (!absl::ConsumePrefix(&rest, " ")) return fail("expected a space before the value");
    std::vector<absl::string_view> fields = absl::StrSplit(rest, ' ');
    if (fields.empty() || fields.size() > 2) return fail("expected VALUE [TIMESTAMP]");
    absl::StatusOr<double> value = ParseValue(fields[0]);
    if (!value.ok()) return fail(value.status().message());
    sample.value = *value;
    if (current.empty() || !BelongsTo(sample.name, current, out[current].type)) {
      return fail(
          absl::StrCat("sample outside its TYPE'd family (current family '", current, "')"));
    }
    std::string key = sample.name;
    for (const auto& [k, v] : sample.labels) absl::StrAppend(&key, "\x1f", k, "=", v);
    if (!series_seen.insert(key).second) return fail("duplicate series");
    out[current].samples.push_back(std::move(sample));
  }
  if (!text.empty() && text.back() != '\n') {
    return absl::InvalidArgumentError("exposition does not end with a newline");
  }
  return out;
}

std::optional<double> SampleValue(const Exposition& e, const std::string& name,
                                  const Labels& labels) {
  for (const auto& [family_name, family] : e) {
    for (const PromSample& s : family.samples) {
      if (s.name == name && s.labels == labels) return s.value;
    }
  }
  return std::nullopt;
}

absl::Status CheckHistogram(const PromFamily& family) {
  const auto fail = [&](absl::string_view why) {
    return absl::FailedPreconditionError(absl::StrCat("histogram ", family.name, ": ", why));
  };
  if (family.type != "histogram") return fail("TYPE is not histogram");
  struct Series {
    std::vector<std::pair<double, double>> buckets;  // (le, cumulative count) in text order
    std::optional<double> sum;
    std::optional<double> count;
  };
  std::map<Labels, Series> series;
  for (const PromSample& s : family.samples) {
    Labels key = s.labels;
    key.erase("le");
    Series& out = series[key];
    if (s.name == family.name + "_bucket") {
      const auto le = s.labels.find("le");
      if (le == s.labels.end()) return fail("bucket without le");
      absl::StatusOr<double> bound = ParseValue(le->second);
      if (!bound.ok()) return fail(absl::StrCat("bad le '", le->second, "'"));
      out.buckets.emplace_back(*bound, s.value);
    } else if (s.name == family.name + "_sum") {
      out.sum = s.value;
    } else {
      out.count = s.value;
    }
  }
  if (series.empty()) return fail("no samples");
  for (const auto& [labels, s] : series) {
    if (s.buckets.empty() || !s.sum.has_value() || !s.count.has_value()) {
      return fail("a series lacks buckets, _sum or _count");
    }
    for (size_t i = 1; i < s.buckets.size(); ++i) {
      if (!(s.buckets[i].first > s.buckets[i - 1].first)) return fail("le not increasing");
      if (s.buckets[i].second < s.buckets[i - 1].second) return fail("counts decrease");
    }
    if (!std::isinf(s.buckets.back().first)) return fail("last bucket is not +Inf");
    if (s.buckets.back().second != *s.count) return fail("+Inf bucket != _count");
    if (*s.count == 0 && *s.sum != 0) return fail("_sum != 0 with no observations");
  }
  return absl::OkStatus();
}

absl::StatusOr<Exposition> ScrapeMetrics(const std::string& host_port) {
  const size_t colon = host_port.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(host_port.substr(colon + 1), &port)) {
    return absl::InvalidArgumentError(absl::StrCat("bad metrics address '", host_port, "'"));
  }
  httplib::Client http(host_port.substr(0, colon), port);
  http.set_connection_timeout(10);
  http.set_read_timeout(10);
  httplib::Result r = http.Get("/metrics");
  if (!r) {
    return absl::UnavailableError(
        absl::StrCat("GET http://", host_port, "/metrics failed: ", httplib::to_string(r.error())));
  }
  if (r->status != 200) {
    return absl::InternalError(
        absl::StrCat("GET http://", host_port, "/metrics: HTTP ", r->status));
  }
  const std::string content_type = r->get_header_value("Content-Type");
  if (content_type.find("text/plain; version=0.0.4") == std::string::npos) {
    return absl::InternalError(
        absl::StrCat("GET http://", host_port, "/metrics: Content-Type '", content_type, "'"));
  }
  return ParsePrometheusText(r->body);
}

Exposition ScrapeUntil(const std::string& host_port,
                       const std::function<bool(const Exposition&)>& done,
                       std::chrono::milliseconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  Exposition last;
  while (true) {
    absl::StatusOr<Exposition> e = ScrapeMetrics(host_port);
    EXPECT_TRUE(e.ok()) << e.status();
    if (!e.ok()) return last;
    last = *std::move(e);
    if (done(last) || std::chrono::steady_clock::now() > deadline) return last;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace logitserve::testing
