#include "bench/load/load_generator.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <condition_variable>
#include <fstream>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>
#include <unordered_map>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/tensor.h"
#include "common/base/read_file.h"
#include "common/base/status_macros.h"
#include "logitserve/v1/logitserve.grpc.pb.h"

namespace logitserve::bench {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------------------------
// LatencyHistogram

int LatencyHistogram::BucketOf(int64_t nanos) {
  if (nanos < 0) nanos = 0;
  const uint64_t v =
      std::min<uint64_t>(static_cast<uint64_t>(nanos), (uint64_t{1} << kMaxExponent) - 1);
  if (v < 1024) return static_cast<int>(v);
  const int e = std::bit_width(v) - 1;  // 10 .. kMaxExponent - 1
  const int shift = e - 9;
  return 1024 + (e - 10) * 512 + static_cast<int>((v >> shift) - 512);
}

int64_t LatencyHistogram::BucketLow(int bucket) {
  if (bucket < 1024) return bucket;
  const int k = bucket - 1024;
  const int e = 10 + k / 512;
  const int64_t mantissa = 512 + k % 512;
  return mantissa << (e - 9);
}

int64_t LatencyHistogram::BucketHigh(int bucket) {
  if (bucket < 1024) return bucket;
  const int e = 10 + (bucket - 1024) / 512;
  return BucketLow(bucket) + (int64_t{1} << (e - 9)) - 1;
}

void LatencyHistogram::Record(int64_t nanos) {
  counts_[static_cast<size_t>(BucketOf(nanos))].fetch_add(1, std::memory_order_relaxed);
  sum_nanos_.fetch_add(std::max<int64_t>(nanos, 0), std::memory_order_relaxed);
}

LatencyHistogram::Snapshot LatencyHistogram::Read() const {
  Snapshot s;
  s.counts.resize(kBuckets);
  for (int i = 0; i < kBuckets; ++i) {
    s.counts[static_cast<size_t>(i)] =
        counts_[static_cast<size_t>(i)].load(std::memory_order_relaxed);
    s.count += s.counts[static_cast<size_t>(i)];
  }
  s.sum_nanos = static_cast<double>(sum_nanos_.load(std::memory_order_relaxed));
  return s;
}

double LatencyHistogram::Snapshot::QuantileNanos(double q) const {
  if (count == 0) return 0;
  q = std::clamp(q, 0.0, 1.0);
  const uint64_t rank =
      std::max<uint64_t>(1, static_cast<uint64_t>(std::ceil(q * static_cast<double>(count))));
  uint64_t seen = 0;
  for (int i = 0; i < kBuckets; ++i) {
    seen += counts[static_cast<size_t>(i)];
    if (seen >= rank) {
      return 0.5 * static_cast<double>(BucketLow(i) + BucketHigh(i));
    }
  }
  return static_cast<double>(BucketHigh(kBuckets - 1));
}

// ---------------------------------------------------------------------------------------------
// Small helpers

std::string StatusCodeName(int code) {
  // gRPC codes are google.rpc.Code, whose names absl::StatusCodeToString holds.
  if (code >= 0 && code <= 16) return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
  return absl::StrCat("CODE_", code);
}

absl::StatusOr<std::chrono::nanoseconds> ParseDuration(const std::string& text) {
  std::string t(absl::StripAsciiWhitespace(text));
  double scale = 1e9;
  auto strip = [&](absl::string_view suffix, double s) {
    if (t.size() > suffix.size() && absl::EndsWith(t, suffix)) {
      t.resize(t.size() - suffix.size());
      scale = s;
      return true;
    }
    return false;
  };
  strip("ms", 1e6) || strip("us", 1e3) || strip("s", 1e9) || strip("m", 60e9) || strip("h", 3600e9);
  double value = 0;
  if (!absl::SimpleAtod(t, &value) || !std::isfinite(value) || value < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "' is not a duration (e.g. 20s, 500ms, 2m, 1.5)"));
  }
  return std::chrono::nanoseconds(static_cast<int64_t>(std::llround(value * scale)));
}

namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path, absl::string_view what) {
  absl::StatusOr<std::string> contents = ReadFileToString(path);
  if (!contents.ok()) return absl::NotFoundError(absl::StrCat(what, ": cannot read '", path, "'"));
  return contents;
}

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// gRPC deadlines take system_clock time points; the run keeps time on steady_clock.
void SetDeadline(grpc::ClientContext& ctx, Clock::time_point deadline) {
  ctx.set_deadline(
      std::chrono::system_clock::now() +
      std::chrono::duration_cast<std::chrono::system_clock::duration>(deadline - Clock::now()));
}

// Sizes every OK response must have (the benchmark is also a correctness check).
struct ExpectedSizes {
  int64_t target_logprobs = 0;  // N * K
  int64_t top_k = 0;            // N * k (ids and log-probs)
  int64_t entropy = 0;          // N or 0
  int64_t forward_kl = 0, reverse_kl = 0;

  explicit ExpectedSizes(const LoadOptions& o)
      : target_logprobs(o.tokens * o.target_ids),
        top_k(o.tokens * o.top_k),
        entropy(o.entropy ? o.tokens : 0),
        forward_kl(o.kl == "forward" || o.kl == "both" ? o.tokens : 0),
        reverse_kl(o.kl == "reverse" || o.kl == "both" ? o.tokens : 0) {}
  bool Match(const v1::ScoreResponse& r) const {
    return r.target_logprobs_size() == target_logprobs && r.top_k_ids_size() == top_k &&
           r.top_k_logprobs_size() == top_k && r.entropy_size() == entropy &&
           r.forward_kl_size() == forward_kl && r.reverse_kl_size() == reverse_kl;
  }
};

// Counts and latencies of the calls that finished inside the measured window.
class Stats {
 public:
  Stats(Clock::time_point measure_start, ExpectedSizes expected)
      : measure_start_(measure_start), expected_(expected) {}

  // `begin`: when the call was sent (closed loop) or scheduled to arrive (open loop).
  void Record(Clock::time_point begin, Clock::time_point end, int code,
              const v1::ScoreResponse* ok_response) {
    if (end < measure_start_) return;
    histogram_.Record(std::chrono::duration_cast<std::chrono::nanoseconds>(end - begin).count());
    codes_[static_cast<size_t>(code >= 0 && code <= 16 ? code : 17)].fetch_add(
        1, std::memory_order_relaxed);
    if (code != 0) return;
    if (ok_response != nullptr) {
      compute_us_.fetch_add(ok_response->compute_us(), std::memory_order_relaxed);
      queue_us_.fetch_add(ok_response->queue_us(), std::memory_order_relaxed);
      if (!expected_.Match(*ok_response)) wrong_.fetch_add(1, std::memory_order_relaxed);
    }
  }

  uint64_t Code(int code) const { return codes_[static_cast<size_t>(code)].load(); }
  uint64_t Other() const { return codes_[17].load(); }
  const LatencyHistogram& histogram() const { return histogram_; }
  Clock::time_point measure_start() const { return measure_start_; }
  int64_t compute_us() const { return compute_us_.load(); }
  int64_t queue_us() const { return queue_us_.load(); }
  uint64_t wrong() const { return wrong_.load(); }

 private:
  const Clock::time_point measure_start_;
  LatencyHistogram histogram_;
  std::array<std::atomic<uint64_t>, 18> codes_{};
  const ExpectedSizes expected_;
  std::atomic<int64_t> compute_us_{0}, queue_us_{0};
  std::atomic<uint64_t> wrong_{0};
};

struct HeadShape {
  int64_t vocab = 0;
  int64_t hidden = 0;
};

absl::StatusOr<std::vector<v1::ScoreRequest>> BuildRequests(const LoadOptions& o,
                                                            const HeadShape& model,
                                                            const HeadShape& reference) {
  std::vector<v1::ScoreRequest> pool;
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  auto hidden_tensor = [&](int64_t h) {
    std::vector<float> values(static_cast<size_t>(o.tokens * h));
    for (float& v : values) v = normal(rng);
    return o.hidden_dtype == "fp32" ? client::TensorOf(values, {o.tokens, h})
                                    : client::BFloat16TensorOf(values, {o.tokens, h});
  };
  for (int r = 0; r < std::max(1, o.distinct_requests); ++r) {
    v1::ScoreRequest req;
    req.set_head(o.head);
    *req.mutable_hidden() = hidden_tensor(model.hidden);
    if (o.target_ids > 0) {
      std::uniform_int_distribution<int32_t> id(0, static_cast<int32_t>(model.vocab - 1));
      std::vector<int32_t> ids(static_cast<size_t>(o.tokens * o.target_ids));
      for (int32_t& x : ids) x = id(rng);
      *req.mutable_target_ids() = o.target_ids == 1
                                      ? client::TensorOf(ids, {o.tokens})
                                      : client::TensorOf(ids, {o.tokens, int64_t{o.target_ids}});
    }
    req.set_top_k(static_cast<uint32_t>(o.top_k));
    req.set_entropy(o.entropy);
    if (!o.reference_head.empty()) {
      req.set_reference_head(o.reference_head);
      *req.mutable_reference_hidden() = hidden_tensor(reference.hidden);
      req.set_forward_kl(o.kl == "forward" || o.kl == "both");
      req.set_reverse_kl(o.kl == "reverse" || o.kl == "both");
    }
    pool.push_back(std::move(req));
  }
  return pool;
}

// Everything one run shares.
struct Run {
  const LoadOptions& o;
  std::vector<std::unique_ptr<v1::Scorer::Stub>> stubs;
  std::vector<v1::ScoreRequest> pool;
  std::string bearer;  // "Bearer TOKEN" or empty
  Clock::time_point start, end;
  Stats stats;

  void Prepare(grpc::ClientContext& ctx) const {
    if (!bearer.empty()) ctx.AddMetadata("authorization", bearer);
  }
  v1::Scorer::Stub& stub(size_t i) const { return *stubs[i % stubs.size()]; }
};

void ClosedUnaryWorker(Run& run, int worker) {
  size_t next = static_cast<size_t>(worker);
  while (Clock::now() < run.end) {
    grpc::ClientContext ctx;
    run.Prepare(ctx);
    const Clock::time_point t0 = Clock::now();
    SetDeadline(ctx, t0 + run.o.timeout);
    v1::ScoreResponse response;
    const grpc::Status s = run.stub(static_cast<size_t>(worker))
                               .Score(&ctx, run.pool[next++ % run.pool.size()], &response);
    run.stats.Record(t0, Clock::now(), s.error_code(), s.ok() ? &response : nullptr);
  }
}

// Writes `request` as one ScoreStreamRequest without copying its (possibly large) tensors: the
// wrapper borrows the message for the write and hands it back.
bool WriteStreamRequest(
    grpc::ClientReaderWriter<v1::ScoreStreamRequest, v1::ScoreStreamResponse>& stream,
    v1::ScoreRequest& request) {
  v1::ScoreStreamRequest wrapper;
  wrapper.set_allocated_request(&request);
  const bool ok = stream.Write(wrapper);
  (void)wrapper.release_request();
  return ok;
}

// One stream per worker, one request in flight on it; a broken stream counts its pending request
// under the stream's final status and is reopened.
void ClosedStreamWorker(Run& run, int worker) {
  size_t next = static_cast<size_t>(worker);
  while (Clock::now() < run.end) {
    grpc::ClientContext ctx;
    run.Prepare(ctx);
    SetDeadline(ctx, run.end + run.o.timeout);
    auto rw = run.stub(static_cast<size_t>(worker)).ScoreStream(&ctx);
    bool pending = false;
    Clock::time_point t0;
    while (Clock::now() < run.end) {
      t0 = Clock::now();
      pending = true;
      if (!WriteStreamRequest(*rw, run.pool[next++ % run.pool.size()])) break;
      v1::ScoreStreamResponse response;
      if (!rw->Read(&response)) break;
      pending = false;
      run.stats.Record(t0, Clock::now(), response.status_code(),
                       response.status_code() == 0 ? &response.response() : nullptr);
    }
    rw->WritesDone();
    v1::ScoreStreamResponse extra;
    while (rw->Read(&extra)) {
    }
    const grpc::Status s = rw->Finish();
    if (pending) {
      run.stats.Record(t0, Clock::now(), s.ok() ? grpc::StatusCode::UNKNOWN : s.error_code(),
                       nullptr);
    }
  }
}

// Arrival times of one open-loop source: Poisson (exponential gaps) or fixed interval.
class Arrivals {
 public:
  Arrivals(double rate, bool poisson, uint64_t seed, Clock::time_point start)
      : rate_(rate), poisson_(poisson), rng_(seed), exp_(rate), next_(start) {}
  Clock::time_point Next() {
    const Clock::time_point t = next_;
    const double gap = poisson_ ? exp_(rng_) : 1.0 / rate_;
    next_ += std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(gap));
    return t;
  }

 private:
  double rate_;
  bool poisson_;
  std::mt19937_64 rng_;
  std::exponential_distribution<double> exp_;
  Clock::time_point next_;
};

// Open loop, unary: every arrival is its own callback-API call.
void OpenUnary(Run& run) {
  struct Call {
    grpc::ClientContext ctx;
    v1::ScoreResponse response;
    Clock::time_point scheduled;
  };
  std::mutex mu;
  std::condition_variable done;
  int64_t outstanding = 0;
  Arrivals arrivals(run.o.rate, run.o.poisson, run.o.seed * 7919 + 1, run.start);
  for (size_t i = 0;; ++i) {
    const Clock::time_point at = arrivals.Next();
    if (at >= run.end) break;
    std::this_thread::sleep_until(at);
    auto* call = new Call;
    call->scheduled = at;
    run.Prepare(call->ctx);
    SetDeadline(call->ctx, at + run.o.timeout);
    {
      std::lock_guard<std::mutex> lock(mu);
      ++outstanding;
    }
    run.stub(i).async()->Score(&call->ctx, &run.pool[i % run.pool.size()], &call->response,
                               [&run, &mu, &done, &outstanding, call](grpc::Status s) {
                                 run.stats.Record(call->scheduled, Clock::now(), s.error_code(),
                                                  s.ok() ? &call->response : nullptr);
                                 delete call;
                                 std::lock_guard<std::mutex> lock(mu);
                                 if (--outstanding == 0) done.notify_all();
                               });
  }
  std::unique_lock<std::mutex> lock(mu);
  done.wait(lock, [&] { return outstanding == 0; });
}

// Open loop, ScoreStream: one stream per connection, a writer issuing its share of the arrivals
// (tagged with request_id) and a reader matching the responses.
void OpenStream(Run& run, int stream_index, int streams) {
  grpc::ClientContext ctx;
  run.Prepare(ctx);
  SetDeadline(ctx, run.end + run.o.timeout);
  auto rw = run.stub(static_cast<size_t>(stream_index)).ScoreStream(&ctx);
  std::mutex mu;
  std::unordered_map<std::string, Clock::time_point> pending;
  std::thread reader([&] {
    v1::ScoreStreamResponse response;
    while (rw->Read(&response)) {
      const Clock::time_point now = Clock::now();
      Clock::time_point scheduled;
      {
        std::lock_guard<std::mutex> lock(mu);
        auto it = pending.find(response.request_id());
        if (it == pending.end()) continue;  // not ours: ignored
        scheduled = it->second;
        pending.erase(it);
      }
      run.stats.Record(scheduled, now, response.status_code(),
                       response.status_code() == 0 ? &response.response() : nullptr);
    }
  });
  std::vector<v1::ScoreRequest> pool = run.pool;  // this writer's copies (request_id varies)
  Arrivals arrivals(run.o.rate / streams, run.o.poisson,
                    run.o.seed * 7919 + 17 * static_cast<uint64_t>(stream_index) + 2, run.start);
  for (size_t i = 0;; ++i) {
    const Clock::time_point at = arrivals.Next();
    if (at >= run.end) break;
    std::this_thread::sleep_until(at);
    v1::ScoreRequest& req = pool[i % pool.size()];
    req.set_request_id(absl::StrCat(stream_index, "-", i));
    {
      std::lock_guard<std::mutex> lock(mu);
      pending.emplace(req.request_id(), at);
    }
    if (!WriteStreamRequest(*rw, req)) break;  // the stream ended; Finish tells why
  }
  rw->WritesDone();
  reader.join();
  const grpc::Status s = rw->Finish();
  const int code = s.ok() ? grpc::StatusCode::UNKNOWN : s.error_code();
  const Clock::time_point now = Clock::now();
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& [id, scheduled] : pending) run.stats.Record(scheduled, now, code, nullptr);
}

std::string ProgressLine(const Run& run, Clock::time_point now) {
  const LatencyHistogram::Snapshot snap = run.stats.histogram().Read();
  const uint64_t ok = run.stats.Code(0);
  const double window = std::max(1e-9, Seconds(now - run.stats.measure_start()));
  const bool measuring = now >= run.stats.measure_start();
  return absl::StrFormat(
      "[%6.1fs]%s count %llu  %.1f req/s  %.0f tok/s  p50 %.2f ms  p99 %.2f ms  errors %llu",
      Seconds(now - run.start), measuring ? "" : " (warm-up)",
      static_cast<unsigned long long>(snap.count),
      measuring ? static_cast<double>(snap.count) / window : 0.0,
      measuring ? static_cast<double>(ok * static_cast<uint64_t>(run.o.tokens)) / window : 0.0,
      snap.QuantileNanos(0.50) / 1e6, snap.QuantileNanos(0.99) / 1e6,
      static_cast<unsigned long long>(snap.count - ok));
}

}  // namespace

nlohmann::json LoadReport::ToJson() const {
  nlohmann::json j;
  j["count"] = count;
  j["elapsed_s"] = elapsed_s;
  j["rps"] = rps;
  j["tokens_per_s"] = tokens_per_s;
  j["latency_p50_ms"] = latency_p50_ms;
  j["latency_p90_ms"] = latency_p90_ms;
  j["latency_p99_ms"] = latency_p99_ms;
  j["latency_max_ms"] = latency_max_ms;
  j["latency_mean_ms"] = latency_mean_ms;
  j["status_counts"] = status_counts;
  j["server_compute_us_mean"] = server_compute_us_mean;
  j["server_queue_us_mean"] = server_queue_us_mean;
  j["wrong"] = wrong;
  j["options"] = options;
  return j;
}

absl::StatusOr<LoadReport> RunLoad(const LoadOptions& o) {
  if (o.head.empty()) return absl::InvalidArgumentError("--head is required");
  if (o.tokens < 1) return absl::InvalidArgumentError("--tokens must be >= 1");
  if (o.concurrency < 1) return absl::InvalidArgumentError("--concurrency must be >= 1");
  if (o.connections < 1) return absl::InvalidArgumentError("--connections must be >= 1");
  if (o.rate < 0 || !std::isfinite(o.rate)) {
    return absl::InvalidArgumentError("--rate must be a finite number >= 0");
  }
  if (o.hidden_dtype != "bf16" && o.hidden_dtype != "fp32") {
    return absl::InvalidArgumentError("--hidden-dtype must be bf16 or fp32");
  }
  if (o.kl != "none" && o.reference_head.empty()) {
    return absl::InvalidArgumentError("--kl needs --reference-head");
  }
  if (o.tls_ca_file.empty() && (!o.tls_cert_file.empty() || !o.tls_key_file.empty())) {
    return absl::InvalidArgumentError("--tls-cert / --tls-key need --tls-ca");
  }
  if (o.tls_cert_file.empty() != o.tls_key_file.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }

  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
  if (!o.tls_ca_file.empty()) {
    grpc::SslCredentialsOptions ssl;
    LOGITSERVE_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadFile(o.tls_ca_file, "--tls-ca"));
    if (!o.tls_cert_file.empty()) {
      LOGITSERVE_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadFile(o.tls_cert_file, "--tls-cert"));
      LOGITSERVE_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadFile(o.tls_key_file, "--tls-key"));
    }
    creds = grpc::SslCredentials(ssl);
  }
  std::string bearer;
  if (!o.token_file.empty()) {
    LOGITSERVE_ASSIGN_OR_RETURN(std::string token, ReadFile(o.token_file, "--token-file"));
    bearer = absl::StrCat("Bearer ", absl::StripAsciiWhitespace(token));
  }

  std::vector<std::unique_ptr<v1::Scorer::Stub>> stubs;
  for (int c = 0; c < o.connections; ++c) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    // Distinct arguments and a private subchannel pool: one TCP connection per channel.
    args.SetInt("logitserve.bench.connection", c);
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    if (!o.tls_server_name.empty()) args.SetSslTargetNameOverride(o.tls_server_name);
    stubs.push_back(v1::Scorer::NewStub(grpc::CreateCustomChannel(o.target, creds, args)));
  }

  // Head shapes from ListHeads.
  v1::ListHeadsResponse heads;
  {
    grpc::ClientContext ctx;
    if (!bearer.empty()) ctx.AddMetadata("authorization", bearer);
    SetDeadline(ctx, Clock::now() + std::chrono::seconds(10));
    const grpc::Status s = stubs[0]->ListHeads(&ctx, {}, &heads);
    if (!s.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                          absl::StrCat("ListHeads on ", o.target, ": ", s.error_message()));
    }
  }
  auto find = [&](const std::string& name) -> absl::StatusOr<HeadShape> {
    for (const v1::HeadInfo& h : heads.heads()) {
      if (h.name() == name) return HeadShape{h.vocab_size(), h.hidden_size()};
    }
    return absl::NotFoundError(absl::StrCat("head '", name, "' is not served by ", o.target));
  };
  LOGITSERVE_ASSIGN_OR_RETURN(HeadShape model, find(o.head));
  HeadShape reference;
  if (!o.reference_head.empty()) {
    LOGITSERVE_ASSIGN_OR_RETURN(reference, find(o.reference_head));
  }
  LOGITSERVE_ASSIGN_OR_RETURN(std::vector<v1::ScoreRequest> pool,
                              BuildRequests(o, model, reference));

  const Clock::time_point start = Clock::now();
  Run run{o,
          std::move(stubs),
          std::move(pool),
          bearer,
          start,
          start + std::chrono::duration_cast<Clock::duration>(o.duration),
          Stats(start + std::chrono::duration_cast<Clock::duration>(o.warmup), ExpectedSizes(o))};

  std::atomic<bool> finished{false};
  std::mutex progress_mu;
  std::condition_variable progress_cv;
  std::thread progress;
  if (o.progress) {
    progress = std::thread([&] {
      std::unique_lock<std::mutex> lock(progress_mu);
      Clock::time_point next = run.start + std::chrono::seconds(1);
      while (!progress_cv.wait_until(lock, next, [&] { return finished.load(); })) {
        o.progress(ProgressLine(run, Clock::now()));
        next += std::chrono::seconds(1);
      }
    });
  }

  std::vector<std::thread> threads;
  if (o.rate == 0) {
    for (int w = 0; w < o.concurrency; ++w) {
      threads.emplace_back(o.stream ? ClosedStreamWorker : ClosedUnaryWorker, std::ref(run), w);
    }
  } else if (o.stream) {
    for (int s = 0; s < o.connections; ++s) {
      threads.emplace_back(OpenStream, std::ref(run), s, o.connections);
    }
  } else {
    threads.emplace_back(OpenUnary, std::ref(run));
  }
  for (std::thread& t : threads) t.join();
  const Clock::time_point stop = Clock::now();
  {
    std::lock_guard<std::mutex> lock(progress_mu);
    finished = true;
  }
  progress_cv.notify_all();
  if (progress.joinable()) progress.join();
  if (o.progress) o.progress(ProgressLine(run, stop));

  LoadReport report;
  const LatencyHistogram::Snapshot snap = run.stats.histogram().Read();
  report.count = snap.count;
  report.elapsed_s = std::max(1e-9, Seconds(stop - run.stats.measure_start()));
  report.rps = static_cast<double>(snap.count) / report.elapsed_s;
  const uint64_t ok = run.stats.Code(0);
  report.tokens_per_s = static_cast<double>(ok) * static_cast<double>(o.tokens) / report.elapsed_s;
  report.latency_p50_ms = snap.QuantileNanos(0.50) / 1e6;
  report.latency_p90_ms = snap.QuantileNanos(0.90) / 1e6;
  report.latency_p99_ms = snap.QuantileNanos(0.99) / 1e6;
  report.latency_max_ms = snap.QuantileNanos(1.0) / 1e6;
  report.latency_mean_ms = snap.MeanNanos() / 1e6;
  for (int code = 0; code <= 16; ++code) {
    if (run.stats.Code(code) > 0) report.status_counts[StatusCodeName(code)] = run.stats.Code(code);
  }
  if (run.stats.Other() > 0) report.status_counts["OTHER"] = run.stats.Other();
  report.wrong = run.stats.wrong();
  if (ok > 0) {
    report.server_compute_us_mean =
        static_cast<double>(run.stats.compute_us()) / static_cast<double>(ok);
    report.server_queue_us_mean =
        static_cast<double>(run.stats.queue_us()) / static_cast<double>(ok);
  }
  report.options = {{"target", o.target},
                    {"head", o.head},
                    {"mode", o.rate > 0 ? "open" : "closed"},
                    {"concurrency", o.concurrency},
                    {"rate", o.rate},
                    {"arrivals", o.poisson ? "poisson" : "fixed"},
                    {"duration_s", Seconds(o.duration)},
                    {"warmup_s", Seconds(o.warmup)},
                    {"connections", o.connections},
                    {"tokens", o.tokens},
                    {"hidden_size", model.hidden},
                    {"vocab_size", model.vocab},
                    {"hidden_dtype", o.hidden_dtype},
                    {"target_ids", o.target_ids},
                    {"top_k", o.top_k},
                    {"entropy", o.entropy},
                    {"reference_head", o.reference_head},
                    {"kl", o.kl},
                    {"stream", o.stream},
                    {"tls", !o.tls_ca_file.empty()},
                    {"token", !o.token_file.empty()}};
  return report;
}

}  // namespace logitserve::bench
