// Server: one running logitserve — backend, heads, the Scorer service, the gRPC port, the
// metrics endpoint — composed from grouped options. server/main.cc turns flags into
// ServerOptions, owns the process concerns (signals, logging, exit codes) and drives this:
//
//   Create()          backend (auto / cpu / cuda), --test-fault, heads loaded and prepared, then
//                     the port bound and SERVING; any error before that is returned (nothing
//                     listens); StartupExitCode() says which exit code it deserves.
//   fatal_error()     non-OK once the backend reported a fatal device error (scheduler thread).
//   Shutdown(drain)   NOT_SERVING, admitted work finishes for up to `drain` while new calls get
//                     UNAVAILABLE, then the port closes and the workers stop; returns how many
//                     requests were still in flight (abandoned) at the deadline.
//   ShutdownAfterFatalError()  NOT_SERVING (failed), a 2 s grace for the failures in flight.
//   Wait()            blocks until the gRPC server has shut down.
//
// Thread safety: Create, Shutdown, ShutdownAfterFatalError and Wait from one (the main) thread;
// port(), in_flight() and fatal_error() from any thread. Destroy only after Shutdown returned.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/backend/backend.h"
#include "server/backend/backend_factory.h"
#include "server/heads/head_store.h"
#include "server/scheduler/scheduler.h"
#include "server/service/metrics.h"
#include "server/service/validate.h"

namespace logitserve {

class Authorizer;
class ReflectionServices;
class ScorerService;
class SharedMemoryRegistry;

// The gRPC port and what one connection may hold.
struct ListenOptions {
  std::string address = "127.0.0.1:50051";  // HOST:PORT; port 0 picks a free one
  int64_t max_receive_message_bytes = int64_t{576} << 20;
  int max_concurrent_streams = 1024;  // per connection; more wait client-side
  int keepalive_time_ms = 60000;
  int keepalive_timeout_ms = 20000;
  int keepalive_min_ping_interval_ms = 10000;
  int handshake_timeout_ms = 20000;
  int64_t grpc_memory_quota_bytes = 0;  // 0 = 2 x max_receive_message_bytes + 256 MiB
};

// The heads served from the start (head_loader.h flag syntax) and the LoadHead limit.
struct HeadOptions {
  std::vector<std::string> files;      // --head NAME=DIR | NAME=FILE.safetensors:TENSOR
  std::vector<std::string> synthetic;  // --synthetic-head NAME:vocab=V,hidden=H,seed=S[,dtype=]
  int64_t max_upload_bytes = int64_t{16} << 30;
};

// TLS / mutual TLS and bearer tokens (auth.h); empty = off.
struct SecurityOptions {
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;
  std::string auth_token_file;
  std::string admin_token_file;
};

struct MetricsOptions {
  std::string listen;  // HOST:PORT of the Prometheus endpoint; empty = off
};

struct ServerOptions {
  ListenOptions listen;
  BackendSelection backend;
  std::string test_fault;  // --test-fault (tests only); "" = none
  HeadOptions heads;
  SchedulerOptions scheduler;
  RequestLimits limits;
  int64_t stream_window_bytes = int64_t{64} << 20;
  int max_shared_memory_regions = 64;
  // ServiceOptions::max_shared_memory_channels, shared_memory_channel_spin.
  int max_shared_memory_channels = 64;
  std::chrono::microseconds shared_memory_channel_spin{200};
  SecurityOptions security;
  MetricsOptions metrics;
};

// Scheduler workers (batches computed concurrently) when --workers is 0: 2 for the CUDA backend
// (host work of one batch overlaps the GPU work of the other), 1 for the CPU backend.
int DefaultSchedulerWorkers(const std::string& backend_name);
// SchedulerOptions::idle_spin when negative (--worker-idle-spin-us -1): 200 us for the CUDA
// backend (its workers wait on the GPU, the host cores are idle), 0 for the CPU backend.
std::chrono::microseconds DefaultWorkerIdleSpin(const std::string& backend_name);

// Process exit codes of the server binary.
inline constexpr int kExitStartupError = 1;
inline constexpr int kExitNoCuda = 2;
inline constexpr int kExitDeviceFault = 3;

// The exit code a Create error deserves: kExitNoCuda when the asked-for backend cannot exist
// here, else kExitStartupError.
int StartupExitCode(const absl::Status& status);

class Server {
 public:
  static absl::StatusOr<std::unique_ptr<Server>> Create(const ServerOptions& options);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int port() const { return port_; }
  std::string address() const;  // HOST:PORT with the bound port
  int metrics_port() const;     // 0 when the metrics endpoint is off
  int64_t in_flight() const;
  absl::Status fatal_error() const;

  // NOT_SERVING and new work refused (UNAVAILABLE); idempotent. Shutdown calls it first.
  void StopServing();
  int64_t Shutdown(absl::Duration drain);
  void ShutdownAfterFatalError();
  void Wait();

 private:
  explicit Server(const ServerOptions& options);
  absl::Status Start();
  void RaiseFatal(const absl::Status& status);
  void StopServingAs(Metrics::Readiness readiness);

  const ServerOptions options_;
  std::shared_ptr<grpc::ServerCredentials> credentials_;
  std::unique_ptr<Authorizer> authorizer_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<Backend> backend_;
  HeadStore heads_;
  mutable absl::Mutex fatal_mu_;
  absl::Status fatal_ ABSL_GUARDED_BY(fatal_mu_);
  std::unique_ptr<SharedMemoryRegistry> shared_memory_;
  std::unique_ptr<ScorerService> service_;
  std::unique_ptr<MetricsHttpServer> metrics_http_;
  std::unique_ptr<ReflectionServices> reflection_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  bool serving_stopped_ = false;
};

}  // namespace logitserve
