// logitserve-wire-bench: the user's view of the service (issue 12, SPEC §9 "Service"), through
// the project's own C++ client (client/client.h), against a running server.
//
// For each --rows N it builds one hidden-mode request (bf16 [N, H] hidden states of --head,
// int32 target ids [N], entropy: the shape of the issue) and measures:
//   compute     the server's compute_us of the request sent alone and unsplit (median): the
//               compute-only rate is N / compute;
//   e2e         closed-loop tokens/s with C client threads (--concurrency, default by size),
//               pipelining on (the client's defaults): the end-to-end rate; ratio e2e / compute
//               (>= 0.90 meets target 1);
//   single      wall time of one pipelined Score of the N rows, against max(compute, transfer),
//               where transfer is the same request's serialized bytes as one raw gRPC call to an
//               in-process echo peer (bench/rpc/echo_service.h; this process runs under the
//               server's malloc policy, common/base/large_allocations.h, so the peer receives
//               as the server does rather than re-faulting every message's pages); ratio
//               <= 1.15 meets target 2;
//   unpiped     wall time of one unsplit Score (pipelining off), for comparison;
//   shm         wall time of one Score reading the same bytes from POSIX shared memory (the
//               server must run on this host; --no-shm skips it), through the client's
//               shared-memory call channels by default (--shm-channels 0: over gRPC, a session
//               stream or, with --session-streams 0, unary calls); shm / compute <= 1.1 meets
//               target 3. shm_cmp: the server's compute_us of those calls; shm_fixed: the
//               rest of each call's wall time (wall - queue_us - compute_us, median), i.e. what
//               the call costs beyond the server's compute. rtt_ms: a grpc.health.v1 Check to
//               the same server (median), the unary round trip no Score can beat; shm_fixed -
//               rtt_ms is what the service and the client add.
// CPU time (noise-robust beside wall times on a shared machine): with --server-pid (the server
// on this host), the server's CPU ms per request (user + system, /proc/PID/stat) of the single
// pipelined, the unsplit and the shared-memory request; the bytes' cost on the server is
// srv_piped - srv_shm (same compute, no tensor bytes). cli_shm: this process's CPU ms per
// shared-memory request. cli_piped: this process's CPU ms per
// pipelined request (getrusage). Also with --server-pid, a line after each size's row: the
// server's busiest threads by name during the end-to-end run, in % of one core
// (/proc/PID/task; its own threads are named ls-*), to find a serial bound on the receive path.
// Correctness: every response must hold N log-probs and N entropies, and the pipelined and
// shared-memory results must equal the unsplit one bit for bit; mismatches count as `wrong`
// (exit 1 when any).
//
//   logitserve-wire-bench --target 127.0.0.1:50051 --head policy --rows 64,1024,8192 [--json F]
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <iterator>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/rpc/echo_service.h"
#include "client/client.h"
#include "client/shm.h"
#include "client/tensor.h"
#include "common/base/fast_mutexes.h"
#include "common/base/large_allocations.h"
#include "logitserve/kernels/dtype.h"
#include "nlohmann/json.hpp"

namespace {

namespace v1 = logitserve::v1;
namespace lc = logitserve::client;
using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  if (v.empty()) return 0;
  const size_t m = v.size() / 2;
  return v.size() % 2 == 1 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

double MsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The request's per-row bytes, as the client would send them.
struct Inputs {
  std::vector<uint16_t> hidden;  // bf16 bits [N, H]
  std::vector<int32_t> ids;      // [N]
};

Inputs MakeInputs(int64_t rows, int64_t hidden, int64_t vocab) {
  Inputs in;
  in.hidden.resize(static_cast<size_t>(rows * hidden));
  std::mt19937_64 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (uint16_t& b : in.hidden) b = logitserve::kernels::FloatToBFloat16(normal(rng));
  in.ids.resize(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) in.ids[i] = static_cast<int32_t>((i * 7919) % vocab);
  return in;
}

// A /proc stat file's command name (in parentheses; it may hold spaces) and CPU clock ticks
// (utime + stime, fields 14 and 15); ticks -1 when the file is unreadable.
std::pair<std::string, long long> StatTicks(const std::string& path) {
  std::ifstream in(path);
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t open = stat.find('('), close = stat.rfind(')');
  if (open == std::string::npos || close == std::string::npos || close < open) return {"", -1};
  std::istringstream fields(stat.substr(close + 2));
  std::string f;
  long long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && fields >> f; ++i) {
    if (i == 14) utime = std::stoll(f);
    if (i == 15) stime = std::stoll(f);
  }
  return {stat.substr(open + 1, close - open - 1), utime + stime};
}

// CPU ms (user + system) of process `pid` so far (-1 when unreadable), or of this process when
// pid == 0.
double CpuMs(int pid) {
  if (pid == 0) {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return (u.ru_utime.tv_sec + u.ru_stime.tv_sec) * 1e3 +
           (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e3;
  }
  const long long ticks = StatTicks("/proc/" + std::to_string(pid) + "/stat").second;
  return ticks < 0 ? -1 : ticks * 1e3 / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// CPU clock ticks (user + system) of every thread of process `pid`: tid -> (name, ticks). The
// server names its own threads ls-* (common/base/thread_name.h). Empty when unreadable.
std::map<std::string, std::pair<std::string, long long>> ThreadTicks(int pid) {
  std::map<std::string, std::pair<std::string, long long>> ticks;
  std::error_code ec;
  for (const auto& entry :
       std::filesystem::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    auto stat = StatTicks((entry.path() / "stat").string());
    if (stat.second >= 0) ticks[entry.path().filename().string()] = std::move(stat);
  }
  return ticks;
}

// The server's busiest thread names over an interval of `ms`, at most `top` of them, as
// "name total% (max one thread%) xN": total over the threads of that name, in % of one core, and
// the busiest single one (near 100 %: a serial bound).
std::string BusiestThreads(const std::map<std::string, std::pair<std::string, long long>>& before,
                           const std::map<std::string, std::pair<std::string, long long>>& after,
                           double ms, size_t top) {
  struct Use {
    double total = 0, max = 0;
    int threads = 0;
  };
  std::map<std::string, Use> by_name;
  const double per_tick = 1e5 / static_cast<double>(sysconf(_SC_CLK_TCK)) / ms;  // % of a core
  for (const auto& [tid, now] : after) {
    const auto it = before.find(tid);
    const double pct = (now.second - (it == before.end() ? 0 : it->second.second)) * per_tick;
    Use& u = by_name[now.first];
    u.total += pct;
    u.max = std::max(u.max, pct);
    ++u.threads;
  }
  std::vector<std::pair<double, std::string>> order;
  for (const auto& [name, u] : by_name) order.emplace_back(u.total, name);
  std::sort(order.rbegin(), order.rend());
  std::string out;
  for (size_t i = 0; i < order.size() && i < top && order[i].first >= 1; ++i) {
    const Use& u = by_name[order[i].second];
    out += (i ? ", " : "") + order[i].second + " " + std::to_string(std::lround(u.total)) +
           "% (max " + std::to_string(std::lround(u.max)) + "%) x" + std::to_string(u.threads);
  }
  return out;
}

v1::ScoreRequest BaseRequest(const std::string& head) {
  v1::ScoreRequest req;
  req.set_head(head);
  req.set_entropy(true);
  return req;
}

}  // namespace

int main(int argc, char** argv) {
  logitserve::KeepLargeAllocations();
  logitserve::UseFastMutexes();  // as the server does: the client's locks cost what they would
  CLI::App app{"logitserve end to end: compute-only vs client rates, pipelining, shared memory"};
  std::string target = "127.0.0.1:50051", head = "policy", json_path, token;
  std::vector<int64_t> rows_list = {64, 256, 1024, 4096, 8192};
  int iters = 5, concurrency = 0;
  double rate_seconds = 2.0;
  bool no_shm = false;
  app.add_option("--target", target, "logitserve server HOST:PORT")->capture_default_str();
  app.add_option("--head", head, "Head to score with")->capture_default_str();
  app.add_option("--rows", rows_list, "Token rows N per request (comma-separated list)")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--iters", iters, "Timed repetitions of each single-request measurement")
      ->check(CLI::Range(1, 10000))
      ->capture_default_str();
  app.add_option("--concurrency", concurrency,
                 "Client threads of the end-to-end rate (0 = by size: clamp(4096 / N, 2, 32))")
      ->capture_default_str();
  app.add_option("--rate-seconds", rate_seconds, "Minimum duration of each end-to-end rate run")
      ->capture_default_str();
  lc::ClientOptions piped_options;
  app.add_option("--pipeline-chunk-bytes", piped_options.pipeline_chunk_bytes,
                 "Client pipelining: bytes per chunk (0 = off)")
      ->capture_default_str();
  app.add_option("--pipeline-depth", piped_options.pipeline_depth,
                 "Client pipelining: chunks unanswered per stream")
      ->capture_default_str();
  app.add_option("--pipeline-streams", piped_options.pipeline_streams,
                 "Client pipelining: streams (connections)")
      ->capture_default_str();
  app.add_option("--session-streams", piped_options.session_streams,
                 "ClientOptions::session_streams: shared-memory calls over long-lived ScoreStreams "
                 "(0 = unary calls)")
      ->capture_default_str();
  app.add_option("--shm-channels", piped_options.shm_channels,
                 "ClientOptions::shm_channels: shared-memory calls through shared-memory call "
                 "channels, no gRPC round trip (0 = over gRPC, as --session-streams says)")
      ->capture_default_str();
  int64_t channel_spin_us = absl::ToInt64Microseconds(piped_options.shm_channel.spin);
  app.add_option("--shm-channel-spin-us", channel_spin_us,
                 "ClientOptions::shm_channel.spin: how long a channel call spins for its answer "
                 "before it sleeps on the futex, microseconds")
      ->capture_default_str();
  app.add_option("--token", token, "Bearer token");
  int server_pid = 0;
  app.add_option("--server-pid", server_pid,
                 "The server's process id (same host): report its CPU ms per request");
  app.add_flag("--no-shm", no_shm, "Skip the shared-memory measurement (server on another host)");
  bool shm_only = false;
  app.add_flag("--shm-only", shm_only,
               "Measure only compute and the shared-memory path (skip pipelining, transfer and "
               "the end-to-end rate): the fixed per-call cost of target 3, with many --iters");
  app.add_option("--json", json_path, "Also write the results as JSON");
  CLI11_PARSE(app, argc, argv);
  if (shm_only && no_shm) {
    std::fprintf(stderr, "--shm-only and --no-shm exclude each other\n");
    return 1;
  }

  piped_options.bearer_token = token;
  piped_options.shm_channel.spin = absl::Microseconds(channel_spin_us);
  piped_options.rpc_timeout = absl::Seconds(600);
  lc::ClientOptions unpiped_options = piped_options;
  unpiped_options.pipeline_chunk_bytes = 0;
  auto piped = lc::Client::Create(target, piped_options);
  auto unpiped = lc::Client::Create(target, unpiped_options);
  if (!piped.ok() || !unpiped.ok()) {
    std::fprintf(stderr, "cannot create clients for %s\n", target.c_str());
    return 1;
  }
  absl::StatusOr<lc::ListHeadsOutput> heads = (*unpiped)->ListHeads();
  if (!heads.ok()) {
    std::fprintf(stderr, "ListHeads on %s: %s\n", target.c_str(),
                 heads.status().ToString().c_str());
    return 1;
  }
  int64_t vocab = 0, hidden = 0;
  for (const lc::HeadInfo& h : heads->heads) {
    if (h.name == head) {
      vocab = h.vocab_size;
      hidden = h.hidden_size;
    }
  }
  if (vocab == 0) {
    std::fprintf(stderr, "head '%s' is not served by %s\n", head.c_str(), target.c_str());
    return 1;
  }

  // The in-process raw-transfer peer. Not started with --shm-only: its polling threads would
  // share this process's gRPC event loop (and could be the thread that reads the client's
  // replies, adding a wake-up to every call), which a worker process has no reason to run.
  logitserve::bench::EchoService echo;
  std::unique_ptr<grpc::Server> echo_server;
  std::unique_ptr<grpc::GenericStub> raw;
  if (!shm_only) {
    int echo_port = 0;
    echo_server = logitserve::bench::StartEchoServer(&echo, &echo_port);
    if (echo_server == nullptr) {
      std::fprintf(stderr, "cannot start the echo server\n");
      return 1;
    }
    grpc::ChannelArguments unlimited;
    unlimited.SetMaxReceiveMessageSize(-1);
    unlimited.SetMaxSendMessageSize(-1);
    raw = std::make_unique<grpc::GenericStub>(grpc::CreateCustomChannel(
        "127.0.0.1:" + std::to_string(echo_port), grpc::InsecureChannelCredentials(), unlimited));
  }

  std::printf(
      "backend %s, head %s (V = %lld, H = %lld), C++ client, pipelining %lld-byte chunks "
      "x %d in flight x %d streams; %d iterations (medians), rates over >= %.1f s\n",
      heads->backend.c_str(), head.c_str(), static_cast<long long>(vocab),
      static_cast<long long>(hidden), static_cast<long long>(piped_options.pipeline_chunk_bytes),
      piped_options.pipeline_depth, piped_options.pipeline_streams, iters, rate_seconds);
  std::printf(
      "%6s %7s %10s %11s %11s %4s %7s %9s %10s %11s %7s %8s %7s %8s %9s %7s %6s %10s %9s %9s "
      "%9s %8s\n",
      "rows", "MiB", "compute_ms", "compute_t/s", "e2e_t/s", "C", "e2e/cmp", "single_ms",
      "unpiped_ms", "transfer_ms", "sgl/max", "shm_ms", "shm/cmp", "shm_cmp", "shm_fixed", "rtt_ms",
      "wrong", "srv_unpiped", "srv_piped", "srv_shm", "cli_piped", "cli_shm");
  nlohmann::json results = nlohmann::json::array();
  int64_t total_wrong = 0;
  for (int64_t rows : rows_list) {
    const Inputs in = MakeInputs(rows, hidden, vocab);
    v1::ScoreRequest req = BaseRequest(head);
    *req.mutable_hidden() = lc::BFloat16TensorFromBits(in.hidden, {rows, hidden});
    *req.mutable_target_ids() = lc::TensorOf(in.ids, {rows});
    const std::string request_bytes = req.SerializeAsString();
    std::atomic<int64_t> wrong{0};
    auto check = [&](const absl::StatusOr<lc::ScoreOutput>& out) {
      if (!out.ok()) {
        std::fprintf(stderr, "Score (%lld rows): %s\n", static_cast<long long>(rows),
                     out.status().ToString().c_str());
        ++wrong;
        return false;
      }
      if (out->rows != rows || static_cast<int64_t>(out->target_logprobs.size()) != rows ||
          static_cast<int64_t>(out->entropy.size()) != rows) {
        ++wrong;
        return false;
      }
      return true;
    };

    // Compute-only and the unsplit wall time; the unsplit result is the reference bits.
    absl::StatusOr<lc::ScoreOutput> reference = (*unpiped)->Score(req);  // also warms up
    check(reference);
    std::vector<double> compute_ms, unpiped_ms, single_ms, transfer_ms, shm_ms;
    // Per shared-memory call: the server's own compute_us, and the rest of the call's wall time
    // (wall - queue_us - compute_us: the RPC, parse, validation, hand-offs, response), the fixed
    // cost target 3 is about.
    std::vector<double> shm_compute_ms, shm_fixed_ms;
    // The floor no unary Score can beat: a grpc.health.v1 Check (tiny request and response) to
    // the same server over the same connection, through the same kind of blocking call.
    std::vector<double> rtt_ms;
    // CPU ms per request of the server (srv_*) and of this process (cli_piped); -1 = not measured.
    double srv_unpiped = -1, srv_piped = -1, srv_shm = -1, cli_piped = -1, cli_shm = -1;
    auto cpu_per_request = [&](int pid, double start) {
      return pid < 0 ? -1.0 : (CpuMs(pid) - start) / iters;
    };
    const int srv = server_pid > 0 ? server_pid : -1;
    double srv0 = srv > 0 ? CpuMs(srv) : 0;
    for (int i = 0; i < iters; ++i) {
      const Clock::time_point t0 = Clock::now();
      absl::StatusOr<lc::ScoreOutput> out = (*unpiped)->Score(req);
      unpiped_ms.push_back(MsSince(t0));
      if (check(out)) compute_ms.push_back(out->compute_us / 1e3);
    }
    srv_unpiped = cpu_per_request(srv, srv0);
    // One pipelined request.
    if (!shm_only) (void)(*piped)->Score(req);
    srv0 = srv > 0 ? CpuMs(srv) : 0;
    const double cli0 = CpuMs(0);
    for (int i = 0; i < (shm_only ? 0 : iters); ++i) {
      const Clock::time_point t0 = Clock::now();
      absl::StatusOr<lc::ScoreOutput> out = (*piped)->Score(req);
      single_ms.push_back(MsSince(t0));
      if (check(out) && reference.ok() &&
          (!SameBits(out->entropy, reference->entropy) ||
           !SameBits(out->target_logprobs, reference->target_logprobs))) {
        ++wrong;
      }
    }
    srv_piped = cpu_per_request(srv, srv0);
    cli_piped = cpu_per_request(0, cli0);
    // The raw transfer of the same request bytes (reply: a response-sized message).
    v1::ScoreResponse sample;
    if (reference.ok()) {
      for (float v : reference->target_logprobs) sample.add_target_logprobs(v);
      for (float v : reference->entropy) sample.add_entropy(v);
    }
    const std::string reply_bytes = sample.SerializeAsString();
    echo.Expect(request_bytes.size(), logitserve::bench::BufferOf(reply_bytes));
    const grpc::ByteBuffer request_buffer = logitserve::bench::BufferOf(request_bytes);
    for (int i = -1; i < (shm_only ? -1 : iters); ++i) {  // -1: warm-up
      grpc::ClientContext ctx;
      grpc::ByteBuffer reply;
      std::promise<grpc::Status> done;
      const Clock::time_point t0 = Clock::now();
      raw->UnaryCall(&ctx, logitserve::bench::kEchoMethod, grpc::StubOptions(), &request_buffer,
                     &reply, [&done](grpc::Status s) { done.set_value(std::move(s)); });
      const grpc::Status s = done.get_future().get();
      const double ms = MsSince(t0);
      if (!s.ok() || reply.Length() != reply_bytes.size()) ++wrong;
      if (i >= 0) transfer_ms.push_back(ms);
    }
    // Shared memory: the same bytes in a region, hidden then ids.
    if (!no_shm) {
      const uint64_t hidden_bytes = in.hidden.size() * 2;
      const uint64_t bytes = hidden_bytes + in.ids.size() * 4;
      const std::string name = "wire-bench-" + std::to_string(getpid());
      auto shm = lc::SharedMemoryBuffer::Create("/" + name, bytes);
      absl::Status reg =
          shm.ok() ? (*unpiped)->RegisterSharedMemory(name, (*shm)->key(), 0, bytes) : shm.status();
      if (!reg.ok()) {
        std::fprintf(stderr, "shared memory: %s\n", reg.ToString().c_str());
        ++wrong;
      } else {
        std::memcpy((*shm)->data(), in.hidden.data(), hidden_bytes);
        std::memcpy(static_cast<char*>((*shm)->data()) + hidden_bytes, in.ids.data(),
                    in.ids.size() * 4);
        v1::ScoreRequest by_shm = BaseRequest(head);
        *by_shm.mutable_hidden() =
            lc::SharedMemoryTensor(name, 0, v1::DATA_TYPE_BFLOAT16, {rows, hidden});
        *by_shm.mutable_target_ids() =
            lc::SharedMemoryTensor(name, hidden_bytes, v1::DATA_TYPE_INT32, {rows});
        (void)(*unpiped)->Score(by_shm);
        for (int i = -1; i < iters; ++i) {  // -1: warm-up
          const Clock::time_point t0 = Clock::now();
          absl::StatusOr<lc::ServingStatus> health = (*unpiped)->Health();
          if (!health.ok()) ++wrong;
          if (i >= 0) rtt_ms.push_back(MsSince(t0));
        }
        srv0 = srv > 0 ? CpuMs(srv) : 0;
        const double cli_shm0 = CpuMs(0);
        for (int i = 0; i < iters; ++i) {
          const Clock::time_point t0 = Clock::now();
          absl::StatusOr<lc::ScoreOutput> out = (*unpiped)->Score(by_shm);
          const double wall = MsSince(t0);
          shm_ms.push_back(wall);
          if (!check(out)) continue;
          shm_compute_ms.push_back(out->compute_us / 1e3);
          shm_fixed_ms.push_back(wall - (out->queue_us + out->compute_us) / 1e3);
          if (reference.ok() && !SameBits(out->entropy, reference->entropy)) ++wrong;
        }
        srv_shm = cpu_per_request(srv, srv0);
        cli_shm = cpu_per_request(0, cli_shm0);
        if (!(*unpiped)->UnregisterSharedMemory(name).ok()) ++wrong;
      }
    }
    // End-to-end rate: C threads, closed loop, pipelined client.
    const int threads =
        concurrency > 0 ? concurrency : static_cast<int>(std::clamp<int64_t>(4096 / rows, 2, 32));
    std::atomic<int64_t> scored{0};
    std::atomic<bool> stop{false};
    const auto threads0 = srv > 0 && !shm_only
                              ? ThreadTicks(srv)
                              : std::map<std::string, std::pair<std::string, long long>>();
    const Clock::time_point t0 = Clock::now();
    std::vector<std::thread> workers;
    for (int t = 0; t < (shm_only ? 0 : threads); ++t) {
      workers.emplace_back([&] {
        while (!stop.load()) {
          if (check((*piped)->Score(req))) scored += rows;
        }
      });
    }
    while (!shm_only && (MsSince(t0) < rate_seconds * 1e3 || scored.load() < 4 * rows * threads)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      if (wrong.load() > 100) break;
    }
    stop = true;
    for (std::thread& w : workers) w.join();
    const double rate_ms = MsSince(t0);
    const double e2e_rate = scored.load() / (rate_ms / 1e3);
    // The server's busiest threads during the end-to-end run (% of one core).
    const std::string busiest =
        threads0.empty() ? "" : BusiestThreads(threads0, ThreadTicks(srv), rate_ms, 6);

    const double c_ms = Median(compute_ms), s_ms = Median(single_ms), u_ms = Median(unpiped_ms),
                 x_ms = Median(transfer_ms), m_ms = Median(shm_ms), mc_ms = Median(shm_compute_ms),
                 mf_ms = Median(shm_fixed_ms), rtt = Median(rtt_ms);
    const double compute_rate = c_ms > 0 ? rows / (c_ms / 1e3) : 0;
    const double mib = static_cast<double>(request_bytes.size()) / (1 << 20);
    const double single_ratio = s_ms / std::max(c_ms, x_ms);
    std::printf(
        "%6lld %7.2f %10.3f %11.0f %11.0f %4d %7.3f %9.3f %10.3f %11.3f %7.3f %8.3f %7.3f %8.3f "
        "%9.3f %7.3f %6lld %11.1f %9.1f %9.1f %9.1f %8.3f\n",
        static_cast<long long>(rows), mib, c_ms, compute_rate, e2e_rate, threads,
        e2e_rate / compute_rate, s_ms, u_ms, x_ms, single_ratio, m_ms, no_shm ? 0.0 : m_ms / c_ms,
        mc_ms, mf_ms, rtt, static_cast<long long>(wrong.load()), srv_unpiped, srv_piped, srv_shm,
        cli_piped, cli_shm);
    if (!busiest.empty()) std::printf("       server threads during e2e: %s\n", busiest.c_str());
    std::fflush(stdout);
    results.push_back(
        {{"rows", rows},
         {"request_bytes", request_bytes.size()},
         {"compute_ms", c_ms},
         {"compute_tokens_per_s", compute_rate},
         {"e2e_tokens_per_s", e2e_rate},
         {"e2e_threads", threads},
         {"e2e_over_compute", e2e_rate / compute_rate},
         {"single_ms", s_ms},
         {"unpipelined_ms", u_ms},
         {"transfer_ms", x_ms},
         {"single_over_max_compute_transfer", single_ratio},
         {"shm_ms", no_shm ? nlohmann::json() : nlohmann::json(m_ms)},
         {"shm_over_compute", no_shm ? nlohmann::json() : nlohmann::json(m_ms / c_ms)},
         {"shm_server_compute_ms", no_shm ? nlohmann::json() : nlohmann::json(mc_ms)},
         {"shm_fixed_ms", no_shm ? nlohmann::json() : nlohmann::json(mf_ms)},
         {"health_rtt_ms", no_shm ? nlohmann::json() : nlohmann::json(rtt)},
         {"wrong", wrong.load()},
         {"server_cpu_ms_unpipelined", srv_unpiped},
         {"server_cpu_ms_pipelined", srv_piped},
         {"server_cpu_ms_shm", srv_shm},
         {"client_cpu_ms_pipelined", cli_piped},
         {"client_cpu_ms_shm", cli_shm},
         {"server_threads_e2e", busiest}});
    total_wrong += wrong.load();
  }
  std::printf("targets: e2e/cmp >= 0.90 (1), sgl/max <= 1.15 (2), shm/cmp <= 1.10 (3)\n");
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << nlohmann::json({{"client", "c++"},
                           {"backend", heads->backend},
                           {"head", head},
                           {"vocab_size", vocab},
                           {"hidden_size", hidden},
                           {"iters", iters},
                           {"pipeline_chunk_bytes", piped_options.pipeline_chunk_bytes},
                           {"pipeline_depth", piped_options.pipeline_depth},
                           {"pipeline_streams", piped_options.pipeline_streams},
                           {"results", results}})
               .dump(2)
        << "\n";
  }
  if (echo_server != nullptr) echo_server->Shutdown();
  return total_wrong == 0 ? 0 : 1;
}
