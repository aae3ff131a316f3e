// logitserve: the gRPC logit-scoring server.
//
// Start-up: parse flags, create the backend, load and prepare every head, listen; only then
// report SERVING and print `logitserve listening on HOST:PORT` (one line on stdout, flushed) so
// scripts and tests learn the port. Any start-up error is logged and exits non-zero before the
// server listens. SIGTERM / SIGINT: NOT_SERVING, refuse new work, drain in-flight calls within
// --drain-seconds, exit 0. Logs go to stderr; stdout carries only the listening line.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <pthread.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/backend/backend.h"
#if LOGITSERVE_HAVE_CUDA
#include "server/backend/cuda/cuda_backend.h"
#endif
#include "server/heads/head_loader.h"
#include "server/heads/head_store.h"
#include "server/service/service.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace logitserve {
namespace {

// A [16384, 8192] bf16 hidden tensor is 256 MiB; model and reference together 512 MiB; the rest
// leaves room for target ids [16384, K] and message framing.
constexpr int64_t kDefaultMaxReceiveBytes = int64_t{576} << 20;
constexpr int kExitStartupError = 1;
constexpr int kExitNoCuda = 2;
constexpr const char* kServiceName = "logitserve.v1.Scorer";

struct Flags {
  std::string listen = "127.0.0.1:50051";
  std::string backend = "auto";
  std::vector<std::string> heads;
  std::vector<std::string> synthetic_heads;
  std::vector<int> devices;
  int threads = 0;
  int shards = 1;
  int workers = 2;
  int queue_size = 256;
  int max_top_k = 64;
  int64_t max_tokens_per_request = 65536;
  int max_target_ids_per_row = 1024;
  int64_t max_receive_message_bytes = kDefaultMaxReceiveBytes;
  double drain_seconds = 10.0;
  std::string log_level = "info";
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
                 "Serve a head from a safetensors tensor: NAME=FILE.safetensors:TENSOR "
                 "(repeatable)");
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
  app.add_option("--workers", f.workers, "Score requests computed concurrently")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  app.add_option("--queue-size", f.queue_size,
                 "Score requests waiting for a worker before RESOURCE_EXHAUSTED")
      ->check(CLI::Range(1, 1 << 20))
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
  app.add_option("--drain-seconds", f.drain_seconds,
                 "On SIGTERM/SIGINT, how long in-flight requests may take to finish")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option("--log-level", f.log_level, "trace, debug, info, warn, error, critical, off")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}))
      ->capture_default_str();
}

// Loads every head named by the flags, prepares it on the backend and adds it to the store.
absl::Status LoadHeads(const Flags& flags, Backend& backend, HeadStore& store) {
  std::vector<std::shared_ptr<HeadWeights>> loaded;
  for (const std::string& spec : flags.synthetic_heads) {
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
      return {CreateCudaBackend(options)};
    }
    if (flags.backend == "cuda") {
      return {absl::FailedPreconditionError(absl::StrCat(
                  "--backend cuda: no usable GPU: ", usable.message())),
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

// "HOST" of "HOST:PORT" ("[::1]" stays bracketed).
std::string HostOf(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  return colon == std::string::npos ? listen : listen.substr(0, colon);
}

int Run(int argc, char** argv) {
  // Block the shutdown signals before any thread exists, so every thread inherits the mask and
  // only the sigwait below ever sees them (no work in a signal handler).
  sigset_t shutdown_signals;
  sigemptyset(&shutdown_signals);
  sigaddset(&shutdown_signals, SIGTERM);
  sigaddset(&shutdown_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &shutdown_signals, nullptr);

  CLI::App app{
      "logitserve: exact full-vocabulary log-probabilities, entropy, KL and JSD over "
      "gRPC (logitserve.v1.Scorer)"};
  Flags flags;
  AddFlags(app, flags);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  auto logger = spdlog::stderr_color_mt("logitserve");
  spdlog::set_default_logger(logger);
  spdlog::set_level(spdlog::level::from_str(flags.log_level));

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
  options.workers = flags.workers;
  options.queue_size = static_cast<size_t>(flags.queue_size);
  ScorerService service(backend->get(), &heads, options);

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(flags.listen, grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(flags.max_receive_message_bytes));
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    spdlog::error("cannot listen on {}", flags.listen);
    return kExitStartupError;
  }
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  health->SetServingStatus("", true);
  health->SetServingStatus(kServiceName, true);
  const std::string address = HostOf(flags.listen) + ":" + std::to_string(port);
  spdlog::info("serving {} head(s) on {}", heads.List().size(), address);
  std::printf("logitserve listening on %s\n", address.c_str());
  std::fflush(stdout);

  int signal_number = 0;
  sigwait(&shutdown_signals, &signal_number);
  spdlog::info("received {}; draining (up to {} s)",
               signal_number == SIGTERM ? "SIGTERM" : "SIGINT", flags.drain_seconds);
  health->SetServingStatus(false);
  health->Shutdown();
  service.StartDraining();
  spdlog::debug("shutting the server down");
  server->Shutdown(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(flags.drain_seconds * 1000)));
  spdlog::debug("server shut down; stopping workers");
  service.StopWorkers();
  server->Wait();
  spdlog::info("stopped");
  return 0;
}

}  // namespace
}  // namespace logitserve

int main(int argc, char** argv) { return logitserve::Run(argc, argv); }
