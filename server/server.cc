#include "server/server.h"

#include <grpcpp/health_check_service_interface.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/base/status_macros.h"
#include "common/version/build_info.h"
#include "server/backend/fault_injection.h"
#include "server/heads/head_loader.h"
#include "server/service/auth.h"
#include "server/service/metrics.h"
#include "server/service/reflection.h"
#include "server/service/service.h"
#include "server/service/shm_registry.h"
#include "spdlog/spdlog.h"

namespace logitserve {
namespace {

constexpr const char* kServiceName = "logitserve.v1.Scorer";
constexpr const char* kHealthServiceName = "grpc.health.v1.Health";
constexpr char kExitCodePayload[] = "logitserve/exit-code";

absl::Status WithExitCode(absl::Status status, int code) {
  status.SetPayload(kExitCodePayload, absl::Cord(absl::StrCat(code)));
  return status;
}

// A start-up error as it is logged: `message` alone (the status keeps its code).
absl::Status StartupError(const absl::Status& cause, absl::string_view message) {
  return absl::Status(cause.code(), message);
}

// The connection limits and keepalive policy as server channel arguments.
void ApplyConnectionLimits(const ListenOptions& f, grpc::ServerBuilder& builder) {
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

}  // namespace

int DefaultSchedulerWorkers(const std::string& backend_name) {
  // CUDA: CudaBackend::Score runs one job at a time (it holds the ranks), so a second worker
  // never shares the GPU with the first; it merges and stages the next batch on the host while
  // the first batch's kernels run (measured on the H200: e2e / compute 0.82 -> 1.08 at 4096
  // rows, 0.83 -> 1.17 at 8192). Results are bitwise the same (cuda_server_test). CPU: one
  // batch already uses every core (--threads), so a second would only contend for them.
  return backend_name == "cuda" ? 2 : 1;
}

std::chrono::microseconds DefaultWorkerIdleSpin(const std::string& backend_name) {
  return std::chrono::microseconds(backend_name == "cuda" ? 200 : 0);
}

namespace {

// Loads every head named by the options, prepares it on the backend and adds it to the store.
absl::Status LoadHeads(const HeadOptions& heads, const std::string& test_fault, Backend& backend,
                       HeadStore& store) {
  std::vector<std::shared_ptr<HeadWeights>> loaded;
  const std::chrono::milliseconds delay = SlowLoadDelay(test_fault);
  for (const std::string& spec : heads.synthetic) {
    std::this_thread::sleep_for(delay);
    // The loader's messages already quote the flag and name the problem.
    LOGITSERVE_ASSIGN_OR_RETURN(SyntheticHeadSpec parsed, ParseSyntheticHeadSpec(spec));
    LOGITSERVE_ASSIGN_OR_RETURN(std::shared_ptr<HeadWeights> head, MakeSyntheticHead(parsed));
    loaded.push_back(std::move(head));
  }
  for (const std::string& spec : heads.files) {
    LOGITSERVE_ASSIGN_OR_RETURN(std::shared_ptr<HeadWeights> head, ParseHeadFlag(spec));
    loaded.push_back(std::move(head));
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

// "HOST" of "HOST:PORT" ("[::1]" stays bracketed).
std::string HostOf(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  return colon == std::string::npos ? listen : listen.substr(0, colon);
}

}  // namespace

int StartupExitCode(const absl::Status& status) {
  const auto code = status.GetPayload(kExitCodePayload);
  int value = kExitStartupError;
  if (code.has_value() && absl::SimpleAtoi(std::string(*code), &value)) return value;
  return kExitStartupError;
}

Server::Server(const ServerOptions& options) : options_(options) {}

Server::~Server() = default;

absl::StatusOr<std::unique_ptr<Server>> Server::Create(const ServerOptions& options) {
  std::unique_ptr<Server> server(new Server(options));
  LOGITSERVE_RETURN_IF_ERROR(server->Start());
  return server;
}

absl::Status Server::Start() {
  const ServerOptions& o = options_;
  // TLS and token files first: a bad file fails in milliseconds, before heads are loaded.
  LOGITSERVE_ASSIGN_OR_RETURN(credentials_,
                              ServerCredentialsFromFiles(o.security.tls_cert, o.security.tls_key,
                                                         o.security.tls_client_ca));
  LOGITSERVE_ASSIGN_OR_RETURN(
      authorizer_, Authorizer::FromFiles(o.security.auth_token_file, o.security.admin_token_file));
  if (!authorizer_->enabled()) spdlog::warn("no --auth-token-file: every RPC is open");
  if (authorizer_->enabled() && !o.security.tls_cert.empty()) {
    // Tokens are checked on the initial metadata, before gRPC reads a request (TLS only: gRPC
    // has no such hook for plaintext ports, where the handlers' check after the read remains).
    credentials_->SetAuthMetadataProcessor(MakeTokenAuthProcessor(authorizer_.get()));
  }
  metrics_ = std::make_unique<Metrics>();

  if (o.heads.files.empty() && o.heads.synthetic.empty()) {
    return absl::InvalidArgumentError(
        "no heads to serve: give at least one --head or --synthetic-head");
  }
  BackendSelection selection = o.backend;
  if (IsCudaTestFault(o.test_fault)) selection.cuda_test_fault = o.test_fault;
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateBackend(selection);
  if (!backend.ok()) {
    absl::Status error =
        StartupError(backend.status(), absl::StrCat("cannot create the ", o.backend.kind,
                                                    " backend: ", backend.status().message()));
    return IsBackendUnavailable(backend.status()) ? WithExitCode(error, kExitNoCuda) : error;
  }
  spdlog::info("backend {}: --threads {} (0 = all cores), --shards {}", (*backend)->name(),
               o.backend.threads, o.backend.shards);
  if (IsCudaTestFault(o.test_fault) && (*backend)->name() != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--test-fault ", o.test_fault, " needs the CUDA backend"));
  }
  if (!o.test_fault.empty() && !IsCudaTestFault(o.test_fault) &&
      SlowLoadDelay(o.test_fault).count() == 0) {
    spdlog::warn("--test-fault {}: injecting faults (tests only)", o.test_fault);
    backend = WrapWithTestFault(*std::move(backend), o.test_fault);
    if (!backend.ok()) return backend.status();
  }
  backend_ = *std::move(backend);

  if (absl::Status s = LoadHeads(o.heads, o.test_fault, *backend_, heads_); !s.ok()) {
    return StartupError(s, absl::StrCat("cannot load heads: ", s.message()));
  }

  ServiceOptions service_options;
  service_options.limits = o.limits;
  service_options.max_receive_message_bytes = o.listen.max_receive_message_bytes;
  service_options.max_head_bytes = o.heads.max_upload_bytes;
  service_options.stream_window_bytes = o.stream_window_bytes;
  service_options.scheduler = o.scheduler;
  if (service_options.scheduler.workers <= 0) {
    service_options.scheduler.workers = DefaultSchedulerWorkers(backend_->name());
  }
  if (service_options.scheduler.idle_spin.count() < 0) {
    service_options.scheduler.idle_spin = DefaultWorkerIdleSpin(backend_->name());
  }
  spdlog::info("scheduler: {} workers{}", service_options.scheduler.workers,
               o.scheduler.workers <= 0 ? " (the backend's default, --workers 0)" : "");
  // A fatal device error: NOT_SERVING, fail what is in flight, exit non-zero (main's loop).
  service_options.on_fatal = [this](const absl::Status& s) { RaiseFatal(s); };
  service_options.authorizer = authorizer_.get();
  service_options.metrics = metrics_.get();
  shared_memory_ = std::make_unique<SharedMemoryRegistry>(o.max_shared_memory_regions);
  service_options.shared_memory = shared_memory_.get();
  service_options.max_shared_memory_channels = o.max_shared_memory_channels;
  service_options.shared_memory_channel_spin = o.shared_memory_channel_spin;
  AddGaugeSources(backend_.get(), &heads_, *metrics_);
  metrics_->AddGaugeSource(
      "logitserve_scheduler_workers",
      "Batches computed concurrently (--workers, or the backend's default).",
      [workers = service_options.scheduler.workers] {
        return std::vector<Metrics::LabeledValue>{{{}, static_cast<double>(workers)}};
      });
  // Before the metrics endpoint, so scrapes (which read it) stop before the service goes away.
  service_ = std::make_unique<ScorerService>(backend_.get(), &heads_, service_options);
  metrics_->AddGaugeSource(
      "logitserve_memory_admitted_bytes",
      "Bytes counted against --memory-budget-bytes: requests in flight and unsent stream "
      "responses.",
      [service = service_.get()] {
        return std::vector<Metrics::LabeledValue>{
            {{}, static_cast<double>(service->admitted_bytes())}};
      });
  if (!o.metrics.listen.empty()) {
    LOGITSERVE_ASSIGN_OR_RETURN(metrics_http_,
                                MetricsHttpServer::Start(o.metrics.listen, metrics_.get()));
  }

  grpc::EnableDefaultHealthCheckService(true);
  reflection_ = std::make_unique<ReflectionServices>(
      std::vector<std::string>{kServiceName, kHealthServiceName});
  grpc::ServerBuilder builder;
  builder.AddListeningPort(o.listen.address, credentials_, &port_);
  // gRPC sets SO_REUSEPORT by default: a second server on a busy port would start and take a
  // share of the new connections (clients silently scored by other weights). One server per port.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  ApplyConnectionLimits(o.listen, builder);
  builder.SetMaxReceiveMessageSize(static_cast<int>(o.listen.max_receive_message_bytes));
  // What gRPC itself may hold (before any token is checked: unary messages arrive whole first).
  const int64_t quota_bytes = o.listen.grpc_memory_quota_bytes > 0
                                  ? o.listen.grpc_memory_quota_bytes
                                  : 2 * o.listen.max_receive_message_bytes + (int64_t{256} << 20);
  grpc::ResourceQuota quota("logitserve");
  quota.Resize(static_cast<size_t>(quota_bytes));
  builder.SetResourceQuota(quota);
  builder.RegisterService(service_.get());
  reflection_->RegisterWith(builder);
  server_ = builder.BuildAndStart();
  if (server_ == nullptr || port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", o.listen.address,
                     " (address in use by another server, or not local?)"));
  }
  grpc::HealthCheckServiceInterface* health = server_->GetHealthCheckService();
  health->SetServingStatus("", true);
  health->SetServingStatus(kServiceName, true);
  metrics_->SetReadiness(Metrics::Readiness::kServing);
  spdlog::info("serving {} head(s) on {}", heads_.List().size(), address());
  return absl::OkStatus();
}

std::string Server::address() const {
  return HostOf(options_.listen.address) + ":" + std::to_string(port_);
}

int Server::metrics_port() const { return metrics_http_ == nullptr ? 0 : metrics_http_->port(); }

int64_t Server::in_flight() const { return service_->in_flight(); }

void Server::RaiseFatal(const absl::Status& status) {
  absl::MutexLock lock(&fatal_mu_);
  if (fatal_.ok()) fatal_ = status;
}

absl::Status Server::fatal_error() const {
  absl::MutexLock lock(&fatal_mu_);
  return fatal_;
}

void Server::StopServing() { StopServingAs(Metrics::Readiness::kDraining); }

void Server::StopServingAs(Metrics::Readiness readiness) {
  if (serving_stopped_) return;
  serving_stopped_ = true;
  // Refuse new work first, then announce it: a client that has seen NOT_SERVING (or a 503) and
  // sends anyway must get UNAVAILABLE. In the other order a request sent on the announcement
  // could still be admitted (LifecycleE2eTest saw it on a loaded 2-core machine).
  service_->StartDraining();
  server_->GetHealthCheckService()->SetServingStatus(false);
  metrics_->SetReadiness(readiness);
}

void Server::ShutdownAfterFatalError() {
  StopServingAs(Metrics::Readiness::kFailed);
  // In-flight work fails fast (the scheduler answers UNAVAILABLE once the backend is unhealthy);
  // a short grace lets those answers go out before the process exits for a restart.
  spdlog::critical("fatal device error: {}; NOT_SERVING, exiting for a restart",
                   std::string(fatal_error().message()));
  server_->GetHealthCheckService()->Shutdown();
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  service_->StopWorkers();
}

int64_t Server::Shutdown(absl::Duration drain) {
  StopServing();
  server_->GetHealthCheckService()->Shutdown();
  // Finish admitted work while still answering new calls ourselves (UNAVAILABLE: retry
  // elsewhere); grpc::Server::Shutdown would answer them CANCELLED.
  // Admitted work is done when no request is queued or computing and no stream response is
  // unsent (both count in admitted_bytes).
  const auto drain_deadline = std::chrono::system_clock::now() + absl::ToChronoMilliseconds(drain);
  auto busy = [&] { return service_->in_flight() > 0 || service_->admitted_bytes() > 0; };
  while (busy() && std::chrono::system_clock::now() < drain_deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const int64_t abandoned = service_->in_flight();
  if (abandoned > 0) {
    spdlog::error("drain deadline ({} s) passed with {} request(s) in flight; cancelling them",
                  absl::ToDoubleSeconds(drain), abandoned);
  }
  // What is still open now holds no admitted work: unary answers on their way out (kAnswerGrace
  // lets them go) and idle calls (a client's session stream, a health Watch). gRPC's graceful
  // shutdown would wait for those until the drain deadline; they are cancelled after the grace.
  constexpr auto kAnswerGrace = std::chrono::seconds(2);
  const auto shutdown_deadline =
      std::min(drain_deadline, std::chrono::system_clock::now() + kAnswerGrace);
  spdlog::debug("shutting the server down");
  server_->Shutdown(shutdown_deadline);
  spdlog::debug("server shut down; stopping workers");
  service_->StopWorkers();
  return abandoned;
}

void Server::Wait() { server_->Wait(); }

}  // namespace logitserve
