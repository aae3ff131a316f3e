// logitserve: the gRPC logit-scoring server. This file parses flags into ServerOptions and owns
// the process (signals, logging, exit codes); server.h composes and runs the server.
//
// Start-up: parse flags, create the backend, load and prepare every head, listen; only then
// report SERVING and print `logitserve listening on HOST:PORT` (one line on stdout, flushed) so
// scripts and tests learn the port. Any start-up error is logged and exits non-zero before the
// server listens. SIGTERM / SIGINT: NOT_SERVING, refuse new work, drain in-flight calls within
// --drain-timeout, exit 0 (exit 4 when the deadline cut in-flight work off, or a second signal
// ended the drain); while heads load, a signal exits 0 at once (shutdown_signals.h). A fatal
// device error (Backend::Health): NOT_SERVING, in-flight work fails with UNAVAILABLE, exit 3 so
// the orchestrator restarts the process. Logs go to stderr; stdout carries only the
// `logitserve metrics on` and `logitserve listening on` lines.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/base/fast_mutexes.h"
#include "common/base/large_allocations.h"
#include "common/version/build_info.h"
#include "server/server.h"
#include "server/service/shutdown_signals.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace logitserve {
namespace {

// A [16384, 8192] bf16 hidden tensor is 256 MiB; model and reference together 512 MiB; the rest
// leaves room for target ids [16384, K] and message framing.
constexpr int64_t kDefaultMaxReceiveBytes = int64_t{576} << 20;
// In-flight work was abandoned: the drain deadline passed, or a second signal ended the drain.
constexpr int kExitWorkAbandoned = ShutdownSignals::kExitForced;

struct Flags {
  std::string listen = "127.0.0.1:50051";
  std::string backend = "auto";
  std::vector<std::string> heads;
  std::vector<std::string> synthetic_heads;
  std::vector<int> devices;
  int threads = 0;
  int shards = 1;
  int workers = 0;  // by backend: DefaultSchedulerWorkers
  int queue_size = 256;
  int64_t max_batch_tokens = 8192;
  int64_t max_queue_delay_us = 0;
  int64_t worker_idle_spin_us = -1;  // by backend: DefaultWorkerIdleSpin
  int64_t memory_budget_bytes = int64_t{4} << 30;
  int64_t max_head_bytes = int64_t{16} << 30;
  int64_t stream_window_bytes = int64_t{64} << 20;
  std::string test_fault;
  double collective_timeout_s = 60.0;
  int max_top_k = 64;
  int64_t max_tokens_per_request = 65536;
  int max_target_ids_per_row = 1024;
  int64_t max_receive_message_bytes = kDefaultMaxReceiveBytes;
  double drain_seconds = 10.0;
  std::string log_level = "info";
  int max_shared_memory_regions = 64;
  int max_shared_memory_channels = 64;
  int shared_memory_channel_spin_us = 200;
};

void AddFlags(CLI::App& app, Flags& f) {
  app.add_option("--listen", f.listen,
                 "Address to serve on, HOST:PORT; port 0 picks a free port (printed on stdout)")
      ->capture_default_str();
  app.add_option("--backend", f.backend,
                 "Compute backend: auto (CUDA when usable, else CPU), cpu, cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--head", f.heads,
                 "Serve a head: NAME=DIR (a Hugging Face model folder: config.json + "
                 "model.safetensors or its sharded index; lm_head.weight, or the input "
                 "embedding when tied; lm_head.bias; softcap / scale from the config) or "
                 "NAME=FILE.safetensors:TENSOR (repeatable)");
  app.add_option("--synthetic-head", f.synthetic_heads,
                 "Serve a deterministic random head: "
                 "NAME:vocab=V,hidden=H,seed=S[,dtype=bf16|fp16|fp32] (repeatable)");
  app.add_option("--devices", f.devices,
                 "CUDA devices to drive, comma-separated ordinals (default: every visible GPU)")
      ->delimiter(',')
      ->check(CLI::NonNegativeNumber);
  app.add_option("--threads", f.threads, "CPU backend compute threads (0 = all cores)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--shards", f.shards, "Vocabulary shards of the CPU backend")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--workers", f.workers,
                 "Batches computed concurrently; 0 = by backend: 2 for cuda (the GPU runs one "
                 "batch at a time; the second worker merges and stages the next batch on the "
                 "host meanwhile), 1 for cpu (one batch uses every core). Results are bitwise "
                 "the same for any value")
      ->check(CLI::Range(0, 256))
      ->capture_default_str();
  app.add_option("--queue-size", f.queue_size,
                 "Score requests waiting for compute before RESOURCE_EXHAUSTED")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--max-batch-tokens", f.max_batch_tokens,
                 "Most token rows co-batched into one backend job from compatible queued requests "
                 "(same heads, versions and options); 0 = no co-batching. Results are bitwise "
                 "the same either way")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40))
      ->capture_default_str();
  app.add_option("--max-queue-delay-us", f.max_queue_delay_us,
                 "How long the oldest queued request may wait for others to fill its batch "
                 "(0 = batch what is queued when a worker is free)")
      ->check(CLI::Range(int64_t{0}, int64_t{10'000'000}))
      ->capture_default_str();
  app.add_option("--worker-idle-spin-us", f.worker_idle_spin_us,
                 "After a batch, how long a scheduler worker looks for the next request before it "
                 "sleeps, microseconds; -1 = by backend: 200 for cuda (saves the wake-up of a "
                 "small call that follows), 0 for cpu (its cores compute)")
      ->check(CLI::Range(int64_t{-1}, int64_t{1'000'000}))
      ->capture_default_str();
  app.add_option("--memory-budget-bytes", f.memory_budget_bytes,
                 "Host bytes admitted at once: every byte a request makes the server hold (its "
                 "message, inputs, per-token and per-sequence outputs) plus ScoreStream "
                 "responses not yet sent; a request over the remaining budget is "
                 "RESOURCE_EXHAUSTED at admission (0 = unlimited)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 50))
      ->capture_default_str();
  app.add_option("--stream-window-bytes", f.stream_window_bytes,
                 "ScoreStream: bytes one stream may hold in requests in flight plus responses "
                 "its client has not received yet; past it the stream stops reading (and so "
                 "computing) until the client catches up")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 50))
      ->capture_default_str();
  app.add_option("--max-head-bytes", f.max_head_bytes,
                 "Largest LoadHead upload (weight + bias bytes); more is RESOURCE_EXHAUSTED")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 50))
      ->capture_default_str();
  app.add_option("--test-fault", f.test_fault,
                 "TESTS ONLY: inject a fault: fatal-after:N (the backend fails fatally after N "
                 "jobs), slow-tile:MS (sleep before every row tile), slow-load:MS (sleep before "
                 "loading each head); CUDA only: "
                 "skip-collective:RANK, stall:RANK, sticky-error:RANK (a real device fault)");
  app.add_option("--collective-timeout-s", f.collective_timeout_s,
                 "CUDA: a GPU wait or NCCL collective taking longer than this is a fatal device "
                 "error (watchdog: the communicators are aborted, the server exits non-zero)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-top-k", f.max_top_k, "Largest top_k a request may ask for (<= 1024)")
      ->check(CLI::Range(0, 1024))
      ->capture_default_str();
  app.add_option("--max-tokens-per-request", f.max_tokens_per_request,
                 "Largest N (token rows) of one request, and largest number of sequence_lengths "
                 "entries; more is RESOURCE_EXHAUSTED")
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40))
      ->capture_default_str();
  app.add_option("--max-target-ids-per-row", f.max_target_ids_per_row,
                 "Largest K of [N, K] target_ids (ids scored per token); more is INVALID_ARGUMENT")
      ->check(CLI::Range(1, 1 << 16))
      ->capture_default_str();
  app.add_option("--max-receive-message-bytes", f.max_receive_message_bytes,
                 "Largest request message in bytes; more is RESOURCE_EXHAUSTED")
      ->check(CLI::Range(int64_t{1}, int64_t{INT32_MAX}))
      ->capture_default_str();
  app.add_option("--max-shared-memory-regions", f.max_shared_memory_regions,
                 "POSIX shared-memory regions clients may register for in-place inputs at once "
                 "(0 = shared-memory inputs off)")
      ->check(CLI::Range(0, 1 << 16))
      ->capture_default_str();
  app.add_option(
         "--max-shared-memory-channels", f.max_shared_memory_channels,
         "Shared-memory call channels (Score without a gRPC round trip, for clients on this "
         "host) open at once; each has a thread (0 = none)")
      ->check(CLI::Range(0, 4096))
      ->capture_default_str();
  app.add_option("--shared-memory-channel-spin-us", f.shared_memory_channel_spin_us,
                 "How long a channel's thread spins for the client's next request after answering "
                 "one, microseconds, before it sleeps (0 = sleep at once)")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  app.add_option("--drain-timeout,--drain-seconds", f.drain_seconds,
                 "On SIGTERM/SIGINT, how long in-flight requests may take to finish")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--log-level", f.log_level, "trace, debug, info, warn, error, critical, off")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}))
      ->capture_default_str();
}

// Transport, security, connection-limit and metrics flags (kept apart from Flags: they configure
// the listening port and the side endpoints, not the scoring).
struct ServingFlags {
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;
  std::string auth_token_file;
  std::string admin_token_file;
  std::string metrics_listen;
  // HTTP/2 streams one client connection may have open at once; more wait on the client side.
  int max_concurrent_streams = 1024;
  int keepalive_time_ms = 60000;
  int keepalive_timeout_ms = 20000;
  int keepalive_min_ping_interval_ms = 10000;
  int handshake_timeout_ms = 20000;
  // gRPC's own memory (connections, frames, messages being received): 0 = twice the largest
  // request message plus 256 MiB.
  int64_t grpc_memory_quota_bytes = 0;
};

void AddServingFlags(CLI::App& app, ServingFlags& f) {
  app.add_option("--tls-cert", f.tls_cert,
                 "TLS: PEM certificate chain of this server (with --tls-key; neither = plaintext)");
  app.add_option("--tls-key", f.tls_key, "TLS: PEM private key of --tls-cert (unencrypted)");
  app.add_option("--tls-client-ca", f.tls_client_ca,
                 "Mutual TLS: PEM CA certificate(s); every client must present a certificate "
                 "signed by them (needs --tls-cert/--tls-key)");
  app.add_option("--auth-token-file", f.auth_token_file,
                 "File holding the bearer token for Score/ScoreStream/ListHeads (clients send "
                 "'authorization: Bearer <token>'); unset = no user token. Health checks and "
                 "reflection stay open for probes");
  app.add_option("--admin-token-file", f.admin_token_file,
                 "File holding the bearer token for LoadHead (also accepted on every user RPC); "
                 "with only --auth-token-file, LoadHead is refused (PERMISSION_DENIED)");
  app.add_option("--metrics-listen", f.metrics_listen,
                 "Serve Prometheus metrics at http://HOST:PORT/metrics; port 0 picks a free "
                 "port (printed on stdout); empty = off")
      ->capture_default_str();
  app.add_option("--max-concurrent-streams", f.max_concurrent_streams,
                 "Concurrent RPCs (HTTP/2 streams) per client connection; more wait client-side")
      ->check(CLI::Range(1, INT32_MAX))
      ->capture_default_str();
  app.add_option("--keepalive-time-ms", f.keepalive_time_ms,
                 "Ping a client connection idle this long, to detect dead peers")
      ->check(CLI::Range(1000, INT32_MAX))
      ->capture_default_str();
  app.add_option("--keepalive-timeout-ms", f.keepalive_timeout_ms,
                 "Close a connection whose keepalive ping is unanswered this long")
      ->check(CLI::Range(1, INT32_MAX))
      ->capture_default_str();
  app.add_option("--keepalive-min-ping-interval-ms", f.keepalive_min_ping_interval_ms,
                 "Shortest interval between client keepalive pings allowed (also without calls); "
                 "clients pinging more often are disconnected (GOAWAY too_many_pings)")
      ->check(CLI::Range(1, INT32_MAX))
      ->capture_default_str();
  app.add_option("--grpc-memory-quota-bytes", f.grpc_memory_quota_bytes,
                 "Memory gRPC may use for connections and messages being received, before any "
                 "authentication (grpc::ResourceQuota; past it gRPC shrinks windows and cancels "
                 "streams); 0 = 2 x --max-receive-message-bytes + 256 MiB")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 50))
      ->capture_default_str();
  app.add_option("--handshake-timeout-ms", f.handshake_timeout_ms,
                 "Close a connection that has not finished its HTTP/2 (and TLS) handshake by then")
      ->check(CLI::Range(1, INT32_MAX))
      ->capture_default_str();
}

// The grouped options of server.h from the flags.
ServerOptions ToServerOptions(const Flags& flags, const ServingFlags& serving) {
  ServerOptions o;
  o.listen.address = flags.listen;
  o.listen.max_receive_message_bytes = flags.max_receive_message_bytes;
  o.listen.max_concurrent_streams = serving.max_concurrent_streams;
  o.listen.keepalive_time_ms = serving.keepalive_time_ms;
  o.listen.keepalive_timeout_ms = serving.keepalive_timeout_ms;
  o.listen.keepalive_min_ping_interval_ms = serving.keepalive_min_ping_interval_ms;
  o.listen.handshake_timeout_ms = serving.handshake_timeout_ms;
  o.listen.grpc_memory_quota_bytes = serving.grpc_memory_quota_bytes;
  o.backend.kind = flags.backend;
  o.backend.devices = flags.devices;
  o.backend.threads = flags.threads;
  o.backend.shards = flags.shards;
  o.backend.collective_timeout = absl::Seconds(flags.collective_timeout_s);
  o.test_fault = flags.test_fault;
  o.heads.files = flags.heads;
  o.heads.synthetic = flags.synthetic_heads;
  o.heads.max_upload_bytes = flags.max_head_bytes;
  o.scheduler.workers = flags.workers;
  o.scheduler.queue_size = static_cast<size_t>(flags.queue_size);
  o.scheduler.max_batch_tokens = flags.max_batch_tokens;
  o.scheduler.max_queue_delay = std::chrono::microseconds(flags.max_queue_delay_us);
  o.scheduler.idle_spin = std::chrono::microseconds(flags.worker_idle_spin_us);
  o.scheduler.memory_budget_bytes = flags.memory_budget_bytes;
  o.limits.max_top_k = flags.max_top_k;
  o.limits.max_tokens_per_request = flags.max_tokens_per_request;
  o.limits.max_target_ids_per_row = flags.max_target_ids_per_row;
  o.stream_window_bytes = flags.stream_window_bytes;
  o.max_shared_memory_regions = flags.max_shared_memory_regions;
  o.max_shared_memory_channels = flags.max_shared_memory_channels;
  o.shared_memory_channel_spin = std::chrono::microseconds(flags.shared_memory_channel_spin_us);
  o.security.tls_cert = serving.tls_cert;
  o.security.tls_key = serving.tls_key;
  o.security.tls_client_ca = serving.tls_client_ca;
  o.security.auth_token_file = serving.auth_token_file;
  o.security.admin_token_file = serving.admin_token_file;
  o.metrics.listen = serving.metrics_listen;
  return o;
}

// "HOST" of "HOST:PORT" ("[::1]" stays bracketed).
std::string HostOf(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  return colon == std::string::npos ? listen : listen.substr(0, colon);
}

int Run(int argc, char** argv) {
  // Block the shutdown signals before any thread exists, so every thread inherits the mask and
  // only the watcher's sigwait ever sees them (no work in a signal handler).
  ShutdownSignals::Block();

  CLI::App app{
      "logitserve: exact full-vocabulary log-probabilities, entropy, KL and JSD over "
      "gRPC (logitserve.v1.Scorer)"};
  Flags flags;
  AddFlags(app, flags);
  ServingFlags serving;
  AddServingFlags(app, serving);
  app.set_version_flag("--version", VersionText("logitserve"),
                       "Print the version, commit and compiled-in backends (CUDA / NCCL versions) "
                       "and exit");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  auto logger = spdlog::stderr_color_mt("logitserve");
  spdlog::set_default_logger(logger);
  spdlog::set_level(spdlog::level::from_str(flags.log_level));
  ShutdownSignals signals;  // from here on, a signal ends the start-up at once
  signals.Start();
  const BuildInfo& build = GetBuildInfo();
  spdlog::info("logitserve {} (commit {}, {}); backends built: {}{}", std::string(build.version),
               std::string(build.git_commit), std::string(build.build_type),
               std::string(build.backends()),
               build.cuda_version.empty()
                   ? ""
                   : absl::StrCat(" (CUDA ", build.cuda_version, ", NCCL ", build.nccl_version,
                                  ", sm ", build.cuda_architectures, ")"));

  absl::StatusOr<std::unique_ptr<Server>> created = Server::Create(ToServerOptions(flags, serving));
  if (!created.ok()) {
    spdlog::error("{}", std::string(created.status().message()));
    return StartupExitCode(created.status());
  }
  Server& server = **created;
  if (server.metrics_port() != 0) {
    // Before the listening line, so whoever waits for that line knows both ports.
    std::printf("logitserve metrics on %s:%d\n", HostOf(serving.metrics_listen).c_str(),
                server.metrics_port());
  }
  signals.MarkServing();  // from here on, the first signal drains
  // A second signal abandons in-flight work (exit 4) only if there is some; forgotten before the
  // server goes away.
  signals.SetWorkInFlight([&server] { return server.in_flight(); });
  absl::Cleanup forget_server = [&signals] { signals.SetWorkInFlight(nullptr); };
  std::printf("logitserve listening on %s\n", server.address().c_str());
  std::fflush(stdout);

  // Wait for SIGTERM / SIGINT (drain, exit 0) or a fatal device error (exit kExitDeviceFault).
  int signal_number = 0;
  const absl::Duration poll_interval = absl::Milliseconds(100);
  while (true) {
    signal_number = signals.Wait(poll_interval);
    if (signal_number > 0) break;
    if (!server.fatal_error().ok()) break;
  }
  if (signal_number == 0) {
    server.ShutdownAfterFatalError();
    server.Wait();
    return kExitDeviceFault;
  }
  server.StopServing();
  spdlog::info("received {}; draining (up to {} s)",
               signal_number == SIGTERM ? "SIGTERM" : "SIGINT", flags.drain_seconds);
  const int64_t abandoned =
      server.Shutdown(absl::Milliseconds(static_cast<int64_t>(flags.drain_seconds * 1000)));
  server.Wait();
  spdlog::info("stopped");
  return abandoned > 0 ? kExitWorkAbandoned : 0;
}

}  // namespace
}  // namespace logitserve

int main(int argc, char** argv) {
  // Request buffers of many MiB (hidden states) would otherwise be mmapped (or trimmed) and
  // faulted in again on every call (common/base/large_allocations.h).
  logitserve::KeepLargeAllocations();
  // No debug lock-order check on every absl::Mutex operation (common/base/fast_mutexes.h).
  logitserve::UseFastMutexes();
  return logitserve::Run(argc, argv);
}
