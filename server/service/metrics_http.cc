// MetricsHttpServer (declared in metrics.h): cpp-httplib kept out of every other translation unit.
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "httplib.h"
#include "server/service/metrics.h"

namespace logitserve {
namespace {

const char* ReadinessText(Metrics::Readiness readiness) {
  switch (readiness) {
    case Metrics::Readiness::kServing:
      return "ok\n";
    case Metrics::Readiness::kStarting:
      return "starting\n";
    case Metrics::Readiness::kDraining:
      return "draining\n";
    case Metrics::Readiness::kFailed:
      return "failed: fatal device error\n";
  }
  return "unknown\n";
}

}  // namespace

struct MetricsHttpServer::Impl {
  httplib::Server server;
  std::thread thread;
  std::atomic<bool> exited{false};  // listen_after_bind returned
};

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<Impl> impl, int port)
    : impl_(std::move(impl)), port_(port) {}

MetricsHttpServer::~MetricsHttpServer() {
  impl_->server.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& host_port, const Metrics* metrics) {
  const size_t colon = host_port.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(host_port.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics-listen: '", host_port, "' is not HOST:PORT (port 0..65535, 0 picks one)"));
  }
  std::string host = host_port.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);  // "[::1]" -> "::1"
  }

  auto impl = std::make_unique<Impl>();
  httplib::Server& server = impl->server;
  // Only SO_REUSEADDR: httplib's default adds SO_REUSEPORT, which would let a second server bind
  // a port already in use (by this or another logitserve) and silently split the scrapes.
  server.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  // Scrapes are rare and cheap: two threads instead of httplib's default of >= 8.
  server.new_task_queue = [] { return new httplib::ThreadPool(2); };
  server.set_read_timeout(std::chrono::seconds(5));
  server.set_write_timeout(std::chrono::seconds(5));
  server.Get("/metrics", [metrics](const httplib::Request&, httplib::Response& response) {
    response.set_content(metrics->RenderPrometheus(), "text/plain; version=0.0.4; charset=utf-8");
  });
  server.Get("/healthz", [metrics](const httplib::Request&, httplib::Response& response) {
    const bool failed = metrics->readiness() == Metrics::Readiness::kFailed;
    response.status = failed ? 503 : 200;
    response.set_content(failed ? "failed: fatal device error\n" : "ok\n", "text/plain");
  });
  server.Get("/readyz", [metrics](const httplib::Request&, httplib::Response& response) {
    const Metrics::Readiness readiness = metrics->readiness();
    response.status = readiness == Metrics::Readiness::kServing ? 200 : 503;
    response.set_content(ReadinessText(readiness), "text/plain");
  });

  int bound = port;
  if (port == 0) {
    bound = server.bind_to_any_port(host);
    if (bound < 0) bound = 0;
  } else if (!server.bind_to_port(host, port)) {
    bound = 0;
  }
  if (bound <= 0) {
    return absl::UnavailableError(absl::StrCat("--metrics-listen: cannot listen on '", host_port,
                                               "' (address in use or not local?)"));
  }
  Impl* raw = impl.get();
  raw->thread = std::thread([raw] {
    raw->server.listen_after_bind();
    raw->exited.store(true);
  });
  // httplib's stop() does nothing until the accept loop has started (is_running), so a server
  // destroyed right after Start would otherwise join a thread that never stops. The loop starts
  // at once; wait for it here (or for the thread to give up).
  while (!raw->server.is_running() && !raw->exited.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!raw->server.is_running()) {
    raw->thread.join();
    return absl::UnavailableError(
        absl::StrCat("--metrics-listen: cannot serve on '", host_port, "'"));
  }
  return std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(std::move(impl), bound));
}

}  // namespace logitserve
