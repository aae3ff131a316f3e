// Soak (label `soak`, about 30 s): one real CPU server, 64 client threads mixing valid, invalid,
// cancelled and expired Score calls (and ScoreStream exchanges), while monitors poll health and
// the server's RSS. Asserts afterwards:
//   - every call ended with a status its kind allows (valid -> OK; bad shape / bad bytes / bad id
//     -> INVALID_ARGUMENT; unknown head -> NOT_FOUND; cancelled -> CANCELLED or OK when it won the
//     race; already expired -> DEADLINE_EXCEEDED; tiny deadline -> DEADLINE_EXCEEDED or OK), and
//     every kind happened, the races included;
//   - valid responses have the requested shapes and finite, in-range values;
//   - health answered SERVING to every poll;
//   - RSS after warm-up stays within kRssMarginBytes of its warm-up level;
//   - once the load stops, per-RPC call states created == released, and the server counted the
//     same number of INVALID_ARGUMENT and NOT_FOUND Score calls as the clients received.
// LOGITSERVE_SOAK_SECONDS overrides the length (warm-up is a third of it).
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "logitserve/v1/logitserve.grpc.pb.h"
#include "tests/service/prometheus_text.h"
#include "tests/support/server_process.h"
#include "tests/support/test_tensors.h"

namespace logitserve {
namespace {

using Clock = std::chrono::steady_clock;
using testing::ServerProcess;

constexpr int kClients = 64;
constexpr int64_t kVocab = 2048;
constexpr int64_t kHidden = 64;
constexpr int64_t kRefHidden = 32;
// RSS may rise after warm-up by at most this much. Why 32 MiB: the steady-state working set is the
// server's heads (< 1 MiB), gRPC's per-connection buffers and at most 64 requests of < 300 KiB in
// flight; what still moves after warm-up is allocator slack (glibc grows a per-thread arena by up
// to a few MiB when gRPC's thread pool places a burst on a new thread): 2-4 MiB measured on the
// 2-core dev box (RSS ~50 MiB at warm-up end). A leak of one 4 KiB request body per call would add
// ~40 MiB over the 20 s measured window at the ~500 calls/s this test reaches there; leaked call
// objects of any size are caught by the call-state balance below.
constexpr int64_t kRssMarginBytes = int64_t{32} << 20;

enum Kind {
  kValid,
  kBadShape,
  kBadBytes,
  kBadId,
  kUnknownHead,
  kCancelled,
  kExpired,
  kTinyDeadline,
  kStream,             // a ScoreStream with valid and invalid requests (codes in each response)
  kStreamUnknownHead,  // the invalid requests of those streams (tallied per response)
  kNumKinds
};
constexpr const char* kKindNames[kNumKinds] = {
    "valid",     "bad_shape", "bad_bytes",     "bad_id", "unknown_head",
    "cancelled", "expired",   "tiny_deadline", "stream", "stream_unknown_head"};
// Relative frequencies of what a client does next (stream_unknown_head happens inside streams).
constexpr int kWeights[kNumKinds] = {40, 6, 6, 6, 6, 14, 5, 12, 5, 0};

bool Allowed(Kind kind, grpc::StatusCode code) {
  using C = grpc::StatusCode;
  switch (kind) {
    case kValid:
    case kStream:
      return code == C::OK;
    case kBadShape:
    case kBadBytes:
    case kBadId:
      return code == C::INVALID_ARGUMENT;
    case kUnknownHead:
    case kStreamUnknownHead:
      return code == C::NOT_FOUND;
    case kCancelled:
      return code == C::CANCELLED || code == C::OK;
    case kExpired:
      return code == C::DEADLINE_EXCEEDED;
    case kTinyDeadline:
      return code == C::DEADLINE_EXCEEDED || code == C::OK;
    default:
      return false;
  }
}

int64_t SoakSeconds() {
  int64_t s = 30;
  if (const char* env = std::getenv("LOGITSERVE_SOAK_SECONDS")) {
    EXPECT_TRUE(absl::SimpleAtoi(env, &s) && s >= 3) << "LOGITSERVE_SOAK_SECONDS=" << env;
  }
  return s;
}

// VmRSS of `pid` in bytes, or -1.
int64_t ReadRss(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) {
      int64_t kb = 0;
      std::vector<std::string> parts = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (parts.size() >= 2 && absl::SimpleAtoi(parts[1], &kb)) return kb * 1024;
    }
  }
  return -1;
}

// Per-thread tallies, merged at the end.
struct Tally {
  std::array<std::map<grpc::StatusCode, int64_t>, kNumKinds> codes;
  std::vector<std::string> unexpected;  // first few, for the failure message
  int64_t bad_responses = 0;
  std::string first_bad_response;
  void Add(Kind kind, const grpc::Status& s) {
    ++codes[kind][s.error_code()];
    if (!Allowed(kind, s.error_code()) && unexpected.size() < 5) {
      unexpected.push_back(
          absl::StrCat(kKindNames[kind], ": ", s.error_code(), " ", s.error_message()));
    }
  }
};

// A valid response has N (x K) finite values of each requested output.
bool CheckResponse(const v1::ScoreRequest& req, const v1::ScoreResponse& resp, std::string* why) {
  const int64_t n = req.hidden().shape(0);
  if (resp.target_logprobs_size() != n || resp.entropy_size() != n) {
    *why = absl::StrCat("sizes ", resp.target_logprobs_size(), ", ", resp.entropy_size(),
                        " for N = ", n);
    return false;
  }
  for (float lp : resp.target_logprobs()) {
    if (!(lp <= 0.0f) || !std::isfinite(lp)) {
      *why = absl::StrCat("target logprob ", lp);
      return false;
    }
  }
  for (float h : resp.entropy()) {
    if (!(h >= 0.0f) || h > std::log(static_cast<float>(kVocab)) + 1e-3f) {
      *why = absl::StrCat("entropy ", h);
      return false;
    }
  }
  if (req.forward_kl()) {
    if (resp.forward_kl_size() != n) {
      *why = "forward_kl size";
      return false;
    }
    for (float kl : resp.forward_kl()) {
      if (!(kl >= -1e-4f) || !std::isfinite(kl)) {
        *why = absl::StrCat("forward_kl ", kl);
        return false;
      }
    }
  }
  return true;
}

class Client {
 public:
  Client(int index, const std::string& address) : rng_(1000 + index) {
    grpc::ChannelArguments args;
    args.SetInt("logitserve.soak.client", index % 8);  // 8 connections, 8 clients each
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    stub_ = v1::Scorer::NewStub(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
    std::discrete_distribution<int> kinds(std::begin(kWeights), std::end(kWeights));
    kinds_ = kinds;
  }

  void Run(const std::atomic<bool>& stop, Tally& tally) {
    while (!stop.load()) {
      const Kind kind = static_cast<Kind>(kinds_(rng_));
      if (kind == kStream) {
        RunStream(tally);
        continue;
      }
      if (kind == kCancelled) {
        RunCancelled(tally);
        continue;
      }
      v1::ScoreRequest req = Valid(1 + rng_() % 64, rng_() % 4 == 0);
      switch (kind) {
        case kBadShape:  // width H - 1 with matching bytes
          *req.mutable_hidden() = testing::FloatTensor(
              v1::DATA_TYPE_BFLOAT16, Values(req.hidden().shape(0) * (kHidden - 1)),
              {req.hidden().shape(0), kHidden - 1});
          break;
        case kBadBytes:  // one byte short
          req.mutable_hidden()->mutable_data()->pop_back();
          break;
        case kBadId: {
          std::vector<int64_t> ids(static_cast<size_t>(req.hidden().shape(0)), 1);
          ids[rng_() % ids.size()] = kVocab;  // one past the end
          *req.mutable_target_ids() =
              testing::IdTensor(v1::DATA_TYPE_INT64, ids, {req.hidden().shape(0)});
          break;
        }
        case kUnknownHead:
          req.set_head("no-such-head");
          break;
        default:
          break;
      }
      grpc::ClientContext ctx;
      const auto now = std::chrono::system_clock::now();
      if (kind == kExpired) {
        ctx.set_deadline(now - std::chrono::milliseconds(1));
      } else if (kind == kTinyDeadline) {
        ctx.set_deadline(now + std::chrono::microseconds(50 + rng_() % 2000));
      } else {
        ctx.set_deadline(now + std::chrono::seconds(30));
      }
      v1::ScoreResponse resp;
      const grpc::Status s = stub_->Score(&ctx, req, &resp);
      tally.Add(kind, s);
      if (s.ok()) Verify(req, resp, tally);
    }
  }

 private:
  std::vector<float> Values(int64_t n) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = normal(rng_);
    return v;
  }

  v1::ScoreRequest Valid(int64_t n, bool with_reference) {
    v1::ScoreRequest req;
    req.set_head("policy");
    *req.mutable_hidden() =
        testing::FloatTensor(v1::DATA_TYPE_BFLOAT16, Values(n * kHidden), {n, kHidden});
    std::vector<int64_t> ids(static_cast<size_t>(n));
    for (int64_t& id : ids) id = static_cast<int64_t>(rng_() % kVocab);
    *req.mutable_target_ids() = testing::IdTensor(v1::DATA_TYPE_INT32, ids, {n});
    req.set_entropy(true);
    if (with_reference) {
      req.set_reference_head("teacher");
      *req.mutable_reference_hidden() =
          testing::FloatTensor(v1::DATA_TYPE_FLOAT32, Values(n * kRefHidden), {n, kRefHidden});
      req.set_forward_kl(true);
    }
    return req;
  }

  void Verify(const v1::ScoreRequest& req, const v1::ScoreResponse& resp, Tally& tally) {
    std::string why;
    if (!CheckResponse(req, resp, &why)) {
      if (tally.bad_responses++ == 0) tally.first_bad_response = why;
    }
  }

  // A larger call, cancelled 0-3 ms after it was sent (in the queue, computing, or finished).
  void RunCancelled(Tally& tally) {
    const v1::ScoreRequest req = Valid(256 + rng_() % 256, rng_() % 2 == 0);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::ScoreResponse resp;
    std::promise<grpc::Status> done;
    stub_->async()->Score(&ctx, &req, &resp, [&done](grpc::Status s) { done.set_value(s); });
    std::this_thread::sleep_for(std::chrono::microseconds(rng_() % 3000));
    ctx.TryCancel();
    const grpc::Status s = done.get_future().get();
    tally.Add(kCancelled, s);
    if (s.ok()) Verify(req, resp, tally);
  }

  // One stream, a few requests (every third invalid) written back to back, then read: each
  // response must carry its own request's expected code; the stream itself must end OK.
  void RunStream(Tally& tally) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    auto rw = stub_->ScoreStream(&ctx);
    std::map<std::string, std::pair<v1::ScoreRequest, Kind>> sent;
    const int count = 2 + static_cast<int>(rng_() % 5);
    for (int i = 0; i < count; ++i) {
      v1::ScoreRequest req = Valid(1 + rng_() % 32, false);
      Kind kind = kStream;
      if (i % 3 == 2) {
        req.set_head("no-such-head");
        kind = kStreamUnknownHead;
      }
      const std::string id = absl::StrCat("s", i);
      req.set_request_id(id);
      v1::ScoreStreamRequest message;
      *message.mutable_request() = req;
      if (!rw->Write(message)) break;
      sent.emplace(id, std::make_pair(std::move(req), kind));
    }
    rw->WritesDone();
    v1::ScoreStreamResponse resp;
    while (rw->Read(&resp)) {
      auto it = sent.find(resp.request_id());
      if (it == sent.end()) {
        tally.Add(kStream, grpc::Status(grpc::StatusCode::INTERNAL,
                                        "response for unknown request_id " + resp.request_id()));
        continue;
      }
      const auto code = static_cast<grpc::StatusCode>(resp.status_code());
      tally.Add(it->second.second, grpc::Status(code, resp.status_message()));
      if (code == grpc::StatusCode::OK) Verify(it->second.first, resp.response(), tally);
      sent.erase(it);
    }
    const grpc::Status s = rw->Finish();
    if (!s.ok() || !sent.empty()) {
      tally.Add(kStream, s.ok() ? grpc::Status(grpc::StatusCode::INTERNAL,
                                               absl::StrCat(sent.size(), " requests unanswered"))
                                : s);
    }
  }

  std::unique_ptr<v1::Scorer::Stub> stub_;
  std::mt19937_64 rng_;
  std::discrete_distribution<int> kinds_;
};

TEST(SoakTest, MixedTrafficKeepsStatusesMemoryHealthAndCallStatesInCheck) {
  absl::StatusOr<std::unique_ptr<ServerProcess>> started = ServerProcess::Start(
      {"--backend", "cpu", "--threads", "1", "--workers", "2", "--queue-size", "1024",
       "--synthetic-head", absl::StrCat("policy:vocab=", kVocab, ",hidden=", kHidden, ",seed=1"),
       "--synthetic-head",
       absl::StrCat("teacher:vocab=", kVocab, ",hidden=", kRefHidden, ",seed=2"),
       "--metrics-listen", "127.0.0.1:0", "--log-level", "error"});
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<ServerProcess> server = *std::move(started);
  ASSERT_FALSE(server->metrics_address().empty()) << "no `logitserve metrics on` line";

  const int64_t seconds = SoakSeconds();
  const auto warmup = std::chrono::milliseconds(seconds * 1000 / 3);
  const Clock::time_point start = Clock::now();
  std::atomic<bool> stop{false};

  // Health: one poll every 100 ms, alternating the overall and the Scorer service.
  std::atomic<int64_t> health_polls{0}, health_failures{0};
  std::string first_health_failure;
  std::thread health([&] {
    auto stub = grpc::health::v1::Health::NewStub(
        grpc::CreateChannel(server->address(), grpc::InsecureChannelCredentials()));
    for (int i = 0; !stop.load(); ++i) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      grpc::health::v1::HealthCheckRequest req;
      req.set_service(i % 2 == 0 ? "" : "logitserve.v1.Scorer");
      grpc::health::v1::HealthCheckResponse resp;
      const grpc::Status s = stub->Check(&ctx, req, &resp);
      ++health_polls;
      if (!s.ok() || resp.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
        if (health_failures++ == 0) {
          first_health_failure =
              absl::StrCat(s.error_code(), " ", s.error_message(), " status ", resp.status());
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });

  // RSS every 200 ms: (seconds since start, bytes).
  std::vector<std::pair<double, int64_t>> rss;
  std::thread rss_sampler([&] {
    while (!stop.load()) {
      rss.emplace_back(std::chrono::duration<double>(Clock::now() - start).count(),
                       ReadRss(server->pid()));
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  });

  std::vector<Tally> tallies(kClients);
  std::vector<std::thread> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.emplace_back([&, i] {
      Client client(i, server->address());
      client.Run(stop, tallies[static_cast<size_t>(i)]);
    });
  }
  std::this_thread::sleep_until(start + std::chrono::seconds(seconds));
  stop = true;
  for (std::thread& t : clients) t.join();
  health.join();
  rss_sampler.join();

  // Statuses.
  Tally all;
  int64_t calls = 0;
  for (const Tally& t : tallies) {
    for (int k = 0; k < kNumKinds; ++k) {
      for (const auto& [code, n] : t.codes[k]) {
        all.codes[k][code] += n;
        calls += n;
      }
    }
    all.unexpected.insert(all.unexpected.end(), t.unexpected.begin(), t.unexpected.end());
    all.bad_responses += t.bad_responses;
    if (all.first_bad_response.empty()) all.first_bad_response = t.first_bad_response;
  }
  std::string summary;
  for (int k = 0; k < kNumKinds; ++k) {
    absl::StrAppend(&summary, "\n  ", kKindNames[k], ":");
    for (const auto& [code, n] : all.codes[k]) absl::StrAppend(&summary, " code ", code, " x", n);
  }
  std::printf("soak: %lld calls in %lld s%s\n", static_cast<long long>(calls),
              static_cast<long long>(seconds), summary.c_str());
  for (int k = 0; k < kNumKinds; ++k) {
    for (const auto& [code, n] : all.codes[k]) {
      EXPECT_TRUE(Allowed(static_cast<Kind>(k), code))
          << kKindNames[k] << " ended " << n << " times with code " << code;
    }
    EXPECT_FALSE(all.codes[k].empty()) << "no " << kKindNames[k] << " call was made";
  }
  EXPECT_TRUE(all.unexpected.empty()) << "first unexpected: " << all.unexpected.front();
  EXPECT_EQ(all.bad_responses, 0) << "first: " << all.first_bad_response;
  // The races were exercised, not only their benign outcome.
  EXPECT_GT(all.codes[kCancelled][grpc::StatusCode::CANCELLED], 0);
  EXPECT_GT(all.codes[kTinyDeadline][grpc::StatusCode::DEADLINE_EXCEEDED], 0);
  EXPECT_GT(all.codes[kValid][grpc::StatusCode::OK], 100);

  // Health.
  EXPECT_GT(health_polls.load(), seconds * 2) << "health was polled too rarely (< 2 per second)";
  EXPECT_EQ(health_failures.load(), 0) << "first: " << first_health_failure;

  // RSS: baseline = the largest sample of the last second of warm-up.
  const double warm_s = std::chrono::duration<double>(warmup).count();
  int64_t baseline = 0, peak_after = 0, last = 0;
  for (const auto& [t, bytes] : rss) {
    ASSERT_GT(bytes, 0) << "cannot read /proc/" << server->pid() << "/status";
    if (t >= warm_s - 1.0 && t < warm_s) baseline = std::max(baseline, bytes);
    if (t >= warm_s) peak_after = std::max(peak_after, bytes);
    last = bytes;
  }
  std::printf(
      "soak: RSS at warm-up end %.1f MiB, peak after %.1f MiB, last %.1f MiB (margin %.0f "
      "MiB)\n",
      baseline / 1048576.0, peak_after / 1048576.0, last / 1048576.0, kRssMarginBytes / 1048576.0);
  ASSERT_GT(baseline, 0) << "no RSS sample in the last second of warm-up";
  EXPECT_LE(peak_after, baseline + kRssMarginBytes);

  // Call states and server-side counts, once everything in flight has finished.
  absl::StatusOr<testing::Exposition> metrics;
  std::optional<double> created, released;
  for (int attempt = 0; attempt < 100; ++attempt) {
    metrics = testing::ScrapeMetrics(server->metrics_address());
    ASSERT_TRUE(metrics.ok()) << metrics.status();
    created = testing::SampleValue(*metrics, "logitserve_call_states_created_total");
    released = testing::SampleValue(*metrics, "logitserve_call_states_released_total");
    ASSERT_TRUE(created.has_value() && released.has_value()) << "call-state metrics missing";
    if (*created == *released) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::printf("soak: call states created %.0f, released %.0f\n", *created, *released);
  EXPECT_EQ(*created, *released) << "call states leaked (or still live 10 s after the load)";
  EXPECT_GT(*created, static_cast<double>(all.codes[kValid][grpc::StatusCode::OK]));

  // Every invalid call reaches the server (generous deadlines) and is counted there once: unary
  // calls under Score, stream messages under ScoreStream.
  int64_t invalid = 0;
  for (Kind k : {kBadShape, kBadBytes, kBadId}) invalid += all.codes[k][grpc::INVALID_ARGUMENT];
  auto server_count = [&](const char* method, const char* code) {
    return testing::SampleValue(*metrics, "logitserve_requests_total",
                                {{"method", method}, {"code", code}})
        .value_or(0.0);
  };
  EXPECT_EQ(server_count("Score", "INVALID_ARGUMENT"), static_cast<double>(invalid));
  EXPECT_EQ(server_count("Score", "NOT_FOUND"),
            static_cast<double>(all.codes[kUnknownHead][grpc::StatusCode::NOT_FOUND]));
  EXPECT_EQ(server_count("ScoreStream", "NOT_FOUND"),
            static_cast<double>(all.codes[kStreamUnknownHead][grpc::StatusCode::NOT_FOUND]));
}

}  // namespace
}  // namespace logitserve
