// logitserve: the gRPC logit-scoring server.
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
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <malloc.h>
#include <pthread.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/version/build_info.h"
#include "server/backend/backend.h"
#include "server/backend/cpu/cpu_backend.h"
#include "server/backend/fault_injection.h"
#if LOGITSERVE_HAVE_CUDA
#include "server/backend/cuda/cuda_backend.h"
#endif
#include "server/heads/head_loader.h"
#include "server/heads/head_store.h"
#include "server/service/auth.h"
#include "server/service/metrics.h"
#include "server/service/reflection.h"
#include "server/service/service.h"
#include "server/service/shm_registry.h"
#include "server/service/shutdown_signals.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace logitserve {
namespace {

// A [16384, 8192] bf16 hidden tensor is 256 MiB; model and reference together 512 MiB; the rest
// leaves room for target ids [16384, K] and message framing.
constexpr int64_t kDefaultMaxReceiveBytes = int64_t{576} << 20;
constexpr int kExitStartupError = 1;
constexpr int kExitNoCuda = 2;
constexpr int kExitDeviceFault = 3;
// In-flight work was abandoned: the drain deadline passed, or a second signal ended the drain.
constexpr int kExitWorkAbandoned = ShutdownSignals::kExitForced;
constexpr const char* kServiceName = "logitserve.v1.Scorer";
constexpr const char* kHealthServiceName = "grpc.health.v1.Health";

struct Flags {
  std::string listen = "127.0.0.1:50051";
  std::string backend = "auto";
  std::vector<std::string> heads;
  std::vector<std::string> synthetic_heads;
  std::vector<int> devices;
  int threads = 0;
  int shards = 1;
  int workers = 1;
  int queue_size = 256;
  int64_t max_batch_tokens = 8192;
  int64_t max_queue_delay_us = 0;
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
                 "Batches computed concurrently (1 keeps the cores or GPUs for one batch at a "
                 "time; batching fills it)")
      ->check(CLI::Range(1, 256))
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

// The connection limits and keepalive policy of ServingFlags as server channel arguments.
void ApplyConnectionLimits(const ServingFlags& f, grpc::ServerBuilder& builder) {
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, f.max_concurrent_streams);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, f.keepalive_time_ms);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, f.keepalive_timeout_ms);
  // Client pings are welcome as often as the minimum interval, with or without calls in flight
  // (rollout workers hold idle channels between batches); faster ones count as ping strikes.
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                             f.keepalive_min_ping_interval_ms);
  builder.AddChannelArgument(GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS, f.handshake_timeout_ms);
}

// Scrape-time gauges: device memory of the backend and the version of every served head.
// `backend` and `heads` must outlive every scrape (the metrics HTTP server is stopped first).
void AddGaugeSources(const Backend* backend, const HeadStore* heads, Metrics& metrics) {
  metrics.AddGaugeSource(
      "logitserve_device_memory_bytes",
      "Device memory in bytes: kind=used (held by this server), kind=total (device size).",
      [backend] {
        std::vector<Metrics::LabeledValue> values;
        for (const Backend::MemoryInfo& m : backend->MemoryUsage()) {
          values.push_back(
              {{{"device", m.device}, {"kind", "used"}}, static_cast<double>(m.used_bytes)});
          if (m.total_bytes > 0) {
            values.push_back(
                {{{"device", m.device}, {"kind", "total"}}, static_cast<double>(m.total_bytes)});
          }
        }
        return values;
      });
  metrics.AddGaugeSource(
      "logitserve_build_info",
      "Always 1; the labels say what is running (version, commit, serving backend, CUDA / NCCL "
      "versions built against, empty without CUDA).",
      [backend] {
        const BuildInfo& build = GetBuildInfo();
        return std::vector<Metrics::LabeledValue>{
            {{{"version", std::string(build.version)},
              {"git_commit", std::string(build.git_commit)},
              {"backend", backend->name()},
              {"cuda_version", std::string(build.cuda_version)},
              {"nccl_version", std::string(build.nccl_version)}},
             1.0}};
      });
  metrics.AddGaugeSource("logitserve_head_version", "Version of each served head.", [heads] {
    std::vector<Metrics::LabeledValue> values;
    for (const std::shared_ptr<const PreparedHead>& head : heads->List()) {
      values.push_back(
          {{{"head", head->weights().name}}, static_cast<double>(head->weights().version)});
    }
    return values;
  });
}

// --test-fault slow-load:MS: the start-up delay before each head, for the tests of signals during
// start-up; zero otherwise.
constexpr char kSlowLoadFault[] = "slow-load:";
std::chrono::milliseconds SlowLoadDelay(const std::string& test_fault) {
  int ms = 0;
  if (test_fault.rfind(kSlowLoadFault, 0) != 0) return std::chrono::milliseconds(0);
  if (!absl::SimpleAtoi(test_fault.substr(sizeof(kSlowLoadFault) - 1), &ms) || ms < 0) ms = 0;
  return std::chrono::milliseconds(ms);
}

// Loads every head named by the flags, prepares it on the backend and adds it to the store.
absl::Status LoadHeads(const Flags& flags, Backend& backend, HeadStore& store) {
  std::vector<std::shared_ptr<HeadWeights>> loaded;
  const std::chrono::milliseconds delay = SlowLoadDelay(flags.test_fault);
  for (const std::string& spec : flags.synthetic_heads) {
    std::this_thread::sleep_for(delay);
    // The loader's messages already quote the flag and name the problem.
    absl::StatusOr<SyntheticHeadSpec> parsed = ParseSyntheticHeadSpec(spec);
    if (!parsed.ok()) return parsed.status();
    absl::StatusOr<std::shared_ptr<HeadWeights>> head = MakeSyntheticHead(*parsed);
    if (!head.ok()) return head.status();
    loaded.push_back(*std::move(head));
  }
  for (const std::string& spec : flags.heads) {
    absl::StatusOr<std::shared_ptr<HeadWeights>> head = ParseHeadFlag(spec);
    if (!head.ok()) return head.status();
    loaded.push_back(*std::move(head));
  }
  for (std::shared_ptr<HeadWeights>& weights : loaded) {
    const std::string name = weights->name;
    if (store.Find(name) != nullptr) {  // before the expensive PrepareHead
      return absl::InvalidArgumentError("head '" + name + "' is given more than once");
    }
    spdlog::info("head '{}': vocab {}, hidden {}, {}, version {}, from {}", name,
                 weights->vocab_size, weights->hidden_size,
                 std::string(FloatTypeName(weights->dtype)), weights->version, weights->source);
    absl::StatusOr<std::shared_ptr<const PreparedHead>> prepared =
        backend.PrepareHead(std::move(weights));
    if (!prepared.ok()) {
      return absl::Status(prepared.status().code(),
                          "head '" + name + "': " + std::string(prepared.status().message()));
    }
    if (absl::Status s = store.Add(*std::move(prepared)); !s.ok()) {
      return absl::Status(s.code(), "head '" + name + "': " + std::string(s.message()));
    }
  }
  return absl::OkStatus();
}

// The --test-fault kinds the CUDA backend injects itself (a real stalled kernel, skipped
// collective or illegal address); the others wrap any backend (server/backend/fault_injection.h).
bool IsCudaTestFault(const std::string& spec) {
  for (const char* kind : {"skip-collective:", "stall:", "sticky-error:"}) {
    if (spec.rfind(kind, 0) == 0) return true;
  }
  return false;
}

// The backend --backend asks for. `cuda` fails with kExitNoCuda when this build has no CUDA or no
// usable GPU (compute capability checked against the built architectures: never a kernel launch
// failure at request time); `auto` falls back to the CPU backend with a warning.
struct BackendChoice {
  absl::StatusOr<std::unique_ptr<Backend>> backend;
  int exit_code = kExitStartupError;  // when backend is not ok
};

BackendChoice CreateBackend(const Flags& flags) {
#if LOGITSERVE_HAVE_CUDA
  if (flags.backend != "cpu") {
    const absl::Status usable = CheckCudaDevices(flags.devices);
    if (usable.ok()) {
      CudaBackendOptions options;
      options.devices = flags.devices;
      options.collective_timeout = absl::Seconds(flags.collective_timeout_s);
      if (IsCudaTestFault(flags.test_fault)) options.test_fault = flags.test_fault;
      return {CreateCudaBackend(options)};
    }
    if (flags.backend == "cuda") {
      return {absl::FailedPreconditionError(
                  absl::StrCat("--backend cuda: no usable GPU: ", usable.message())),
              kExitNoCuda};
    }
    spdlog::warn("--backend auto: {}; using the CPU backend", std::string(usable.message()));
  }
#else
  if (flags.backend == "cuda") {
    return {absl::FailedPreconditionError(
                "--backend cuda: this logitserve was built without CUDA; use --backend cpu"),
            kExitNoCuda};
  }
  if (flags.backend == "auto") spdlog::info("--backend auto: no CUDA in this build, using cpu");
#endif
  CpuBackendOptions options;
  options.threads = flags.threads;
  options.shards = flags.shards;
  return {CreateCpuBackend(options)};
}

// Raised (once) by the scheduler on a fatal device error; polled by the main loop.
class FatalSignal {
 public:
  void Raise(const absl::Status& status) {
    absl::MutexLock lock(&mu_);
    if (status_.ok()) status_ = status;
  }
  absl::Status status() const {
    absl::MutexLock lock(&mu_);
    return status_;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

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

  // TLS and token files first: a bad file fails in milliseconds, before heads are loaded.
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      ServerCredentialsFromFiles(serving.tls_cert, serving.tls_key, serving.tls_client_ca);
  if (!credentials.ok()) {
    spdlog::error("{}", std::string(credentials.status().message()));
    return kExitStartupError;
  }
  absl::StatusOr<std::unique_ptr<Authorizer>> authorizer =
      Authorizer::FromFiles(serving.auth_token_file, serving.admin_token_file);
  if (!authorizer.ok()) {
    spdlog::error("{}", std::string(authorizer.status().message()));
    return kExitStartupError;
  }
  if (!(*authorizer)->enabled()) spdlog::warn("no --auth-token-file: every RPC is open");
  if ((*authorizer)->enabled() && !serving.tls_cert.empty()) {
    // Tokens are checked on the initial metadata, before gRPC reads a request (TLS only: gRPC
    // has no such hook for plaintext ports, where the handlers' check after the read remains).
    (*credentials)->SetAuthMetadataProcessor(MakeTokenAuthProcessor(authorizer->get()));
  }
  Metrics metrics;  // outlives the service and the metrics HTTP server (declared before both)

  if (flags.heads.empty() && flags.synthetic_heads.empty()) {
    spdlog::error("no heads to serve: give at least one --head or --synthetic-head");
    return kExitStartupError;
  }
  BackendChoice choice = CreateBackend(flags);
  absl::StatusOr<std::unique_ptr<Backend>>& backend = choice.backend;
  if (!backend.ok()) {
    spdlog::error("cannot create the {} backend: {}", flags.backend,
                  std::string(backend.status().message()));
    return choice.exit_code;
  }
  spdlog::info("backend {}: --threads {} (0 = all cores), --shards {}", (*backend)->name(),
               flags.threads, flags.shards);
  if (IsCudaTestFault(flags.test_fault) && (*backend)->name() != "cuda") {
    spdlog::error("--test-fault {} needs the CUDA backend", flags.test_fault);
    return kExitStartupError;
  }
  if (!flags.test_fault.empty() && !IsCudaTestFault(flags.test_fault) &&
      SlowLoadDelay(flags.test_fault).count() == 0) {
    spdlog::warn("--test-fault {}: injecting faults (tests only)", flags.test_fault);
    backend = WrapWithTestFault(*std::move(backend), flags.test_fault);
    if (!backend.ok()) {
      spdlog::error("{}", std::string(backend.status().message()));
      return kExitStartupError;
    }
  }

  HeadStore heads;
  if (absl::Status s = LoadHeads(flags, **backend, heads); !s.ok()) {
    spdlog::error("cannot load heads: {}", std::string(s.message()));
    return kExitStartupError;
  }

  ServiceOptions options;
  options.limits.max_top_k = flags.max_top_k;
  options.limits.max_tokens_per_request = flags.max_tokens_per_request;
  options.limits.max_target_ids_per_row = flags.max_target_ids_per_row;
  options.max_receive_message_bytes = flags.max_receive_message_bytes;
  options.max_head_bytes = flags.max_head_bytes;
  options.stream_window_bytes = flags.stream_window_bytes;
  options.scheduler.workers = flags.workers;
  options.scheduler.queue_size = static_cast<size_t>(flags.queue_size);
  options.scheduler.max_batch_tokens = flags.max_batch_tokens;
  options.scheduler.max_queue_delay = std::chrono::microseconds(flags.max_queue_delay_us);
  options.scheduler.memory_budget_bytes = flags.memory_budget_bytes;
  // A fatal device error: NOT_SERVING, fail what is in flight, exit non-zero (the main loop).
  FatalSignal fatal;
  options.on_fatal = [&fatal](const absl::Status& s) { fatal.Raise(s); };
  options.authorizer = authorizer->get();
  options.metrics = &metrics;
  SharedMemoryRegistry shared_memory(flags.max_shared_memory_regions);  // outlives the service
  options.shared_memory = &shared_memory;
  AddGaugeSources(backend->get(), &heads, metrics);
  // Before the metrics endpoint, so scrapes (which read it) stop before the service goes away.
  ScorerService service(backend->get(), &heads, options);
  metrics.AddGaugeSource(
      "logitserve_memory_admitted_bytes",
      "Bytes counted against --memory-budget-bytes: requests in flight and unsent stream "
      "responses.",
      [&service] {
        return std::vector<Metrics::LabeledValue>{
            {{}, static_cast<double>(service.admitted_bytes())}};
      });
  std::unique_ptr<MetricsHttpServer> metrics_http;  // stopped before heads / backend go away
  if (!serving.metrics_listen.empty()) {
    absl::StatusOr<std::unique_ptr<MetricsHttpServer>> started =
        MetricsHttpServer::Start(serving.metrics_listen, &metrics);
    if (!started.ok()) {
      spdlog::error("{}", std::string(started.status().message()));
      return kExitStartupError;
    }
    metrics_http = *std::move(started);
  }

  grpc::EnableDefaultHealthCheckService(true);
  ReflectionServices reflection({kServiceName, kHealthServiceName});
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(flags.listen, *credentials, &port);
  // gRPC sets SO_REUSEPORT by default: a second server on a busy port would start and take a
  // share of the new connections (clients silently scored by other weights). One server per port.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  ApplyConnectionLimits(serving, builder);
  builder.SetMaxReceiveMessageSize(static_cast<int>(flags.max_receive_message_bytes));
  // What gRPC itself may hold (before any token is checked: unary messages arrive whole first).
  const int64_t quota_bytes = serving.grpc_memory_quota_bytes > 0
                                  ? serving.grpc_memory_quota_bytes
                                  : 2 * flags.max_receive_message_bytes + (int64_t{256} << 20);
  grpc::ResourceQuota quota("logitserve");
  quota.Resize(static_cast<size_t>(quota_bytes));
  builder.SetResourceQuota(quota);
  builder.RegisterService(&service);
  reflection.RegisterWith(builder);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    spdlog::error("cannot listen on {} (address in use by another server, or not local?)",
                  flags.listen);
    return kExitStartupError;
  }
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  health->SetServingStatus("", true);
  health->SetServingStatus(kServiceName, true);
  metrics.SetReadiness(Metrics::Readiness::kServing);
  const std::string address = HostOf(flags.listen) + ":" + std::to_string(port);
  spdlog::info("serving {} head(s) on {}", heads.List().size(), address);
  if (metrics_http != nullptr) {
    // Before the listening line, so whoever waits for that line knows both ports.
    std::printf("logitserve metrics on %s:%d\n", HostOf(serving.metrics_listen).c_str(),
                metrics_http->port());
  }
  signals.MarkServing();  // from here on, the first signal drains
  // A second signal abandons in-flight work (exit 4) only if there is some; forgotten before the
  // service goes away.
  signals.SetWorkInFlight([&service] { return service.in_flight(); });
  absl::Cleanup forget_service = [&signals] { signals.SetWorkInFlight(nullptr); };
  std::printf("logitserve listening on %s\n", address.c_str());
  std::fflush(stdout);

  // Wait for SIGTERM / SIGINT (drain, exit 0) or a fatal device error (exit kExitDeviceFault).
  int signal_number = 0;
  absl::Status fatal_status;
  const absl::Duration poll_interval = absl::Milliseconds(100);
  while (true) {
    signal_number = signals.Wait(poll_interval);
    if (signal_number > 0) break;
    fatal_status = fatal.status();
    if (!fatal_status.ok()) break;
  }
  health->SetServingStatus(false);
  metrics.SetReadiness(fatal_status.ok() ? Metrics::Readiness::kDraining
                                         : Metrics::Readiness::kFailed);
  service.StartDraining();
  if (!fatal_status.ok()) {
    // In-flight work fails fast (the scheduler answers UNAVAILABLE once the backend is unhealthy);
    // a short grace lets those answers go out before the process exits for a restart.
    spdlog::critical("fatal device error: {}; NOT_SERVING, exiting for a restart",
                     std::string(fatal_status.message()));
    health->Shutdown();
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    service.StopWorkers();
    server->Wait();
    return kExitDeviceFault;
  }
  spdlog::info("received {}; draining (up to {} s)",
               signal_number == SIGTERM ? "SIGTERM" : "SIGINT", flags.drain_seconds);
  health->Shutdown();
  // Finish admitted work while still answering new calls ourselves (UNAVAILABLE: retry
  // elsewhere); grpc::Server::Shutdown would answer them CANCELLED.
  const auto drain_deadline =
      std::chrono::system_clock::now() +
      std::chrono::milliseconds(static_cast<int64_t>(flags.drain_seconds * 1000));
  while (service.in_flight() > 0 && std::chrono::system_clock::now() < drain_deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const int64_t abandoned = service.in_flight();
  if (abandoned > 0) {
    spdlog::error("drain deadline ({} s) passed with {} request(s) in flight; cancelling them",
                  flags.drain_seconds, abandoned);
  }
  spdlog::debug("shutting the server down");
  server->Shutdown(drain_deadline);
  spdlog::debug("server shut down; stopping workers");
  service.StopWorkers();
  server->Wait();
  spdlog::info("stopped");
  return abandoned > 0 ? kExitWorkAbandoned : 0;
}

}  // namespace
}  // namespace logitserve

int main(int argc, char** argv) {
  // Request buffers of 32 MiB and more (hidden states) would be mmapped and unmapped by glibc on
  // every call, faulting all their pages in again each time (measured: 2.3-2.6x the RPC overhead
  // beyond compute + transfer, docs/PERFORMANCE.md). Keep large blocks in the heap and keep up to
  // 1 GiB of freed top-of-heap memory for the next request.
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  return logitserve::Run(argc, argv);
}
