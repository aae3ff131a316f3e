// MetricsHttpServer (declared in metrics.h): GET /metrics, /healthz and /readyz over HTTP/1.1
// from one thread.
//
// Why not a thread per connection (cpp-httplib's model): a handful of clients that send half a
// request, or hold idle keep-alive connections, occupy every worker until their timeouts and no
// scrape gets an answer. Here one thread multiplexes every connection with poll(2) on
// non-blocking sockets, so a slow client costs a file descriptor, never the thread:
//   - each connection gets kExchangeDeadline for the whole exchange (request in, answer out),
//     then it is closed, whatever it sent;
//   - at most kMaxConnections are open; a new one beyond that evicts the oldest (a scraper that
//     just connected is never starved by idle ones);
//   - a request header over kMaxRequestBytes gets 431; the answer closes the connection
//     (`Connection: close`: no keep-alive to hold).
// Rendering runs on the same thread: RenderPrometheus takes microseconds.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/base/thread_name.h"
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

using Clock = std::chrono::steady_clock;

constexpr auto kExchangeDeadline = std::chrono::seconds(5);
constexpr size_t kMaxConnections = 64;
constexpr size_t kMaxRequestBytes = 8192;

struct Connection {
  int fd = -1;
  Clock::time_point deadline;
  std::string in;
  std::string out;
  size_t sent = 0;
  bool answering = false;  // `out` holds the whole answer
};

std::string Answer(int code, absl::string_view reason, absl::string_view content_type,
                   absl::string_view body) {
  return absl::StrCat("HTTP/1.1 ", code, " ", reason, "\r\nContent-Type: ", content_type,
                      "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body);
}

// The answer to the request header `head` (request line first).
std::string Respond(absl::string_view head, const Metrics& metrics) {
  const size_t line_end = head.find("\r\n");
  const absl::string_view line = head.substr(0, line_end);
  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == absl::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == absl::string_view::npos) {
    return Answer(400, "Bad Request", "text/plain", "malformed request line\n");
  }
  const absl::string_view method = line.substr(0, sp1);
  absl::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  target = target.substr(0, target.find('?'));
  if (target != "/metrics" && target != "/healthz" && target != "/readyz") {
    return Answer(404, "Not Found", "text/plain", "not found\n");
  }
  if (method != "GET" && method != "HEAD") {
    return Answer(405, "Method Not Allowed", "text/plain", "only GET\n");
  }
  std::string answer;
  if (target == "/metrics") {
    answer =
        Answer(200, "OK", "text/plain; version=0.0.4; charset=utf-8", metrics.RenderPrometheus());
  } else if (target == "/healthz") {
    // Alive unless the device failed (the process is about to exit 3 for a restart).
    const bool failed = metrics.readiness() == Metrics::Readiness::kFailed;
    answer = failed ? Answer(503, "Service Unavailable", "text/plain",
                             ReadinessText(Metrics::Readiness::kFailed))
                    : Answer(200, "OK", "text/plain", "ok\n");
  } else {
    // Ready only while serving: starting (heads loading), draining and failed are 503.
    const Metrics::Readiness readiness = metrics.readiness();
    answer = readiness == Metrics::Readiness::kServing
                 ? Answer(200, "OK", "text/plain", ReadinessText(readiness))
                 : Answer(503, "Service Unavailable", "text/plain", ReadinessText(readiness));
  }
  if (method == "HEAD") answer.resize(answer.find("\r\n\r\n") + 4);
  return answer;
}

// A listening socket bound to host:port (SO_REUSEADDR only: never SO_REUSEPORT, which would let
// a second server share the port and silently split the scrapes); -1 and errno on failure.
int Listen(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found) != 0) {
    return -1;
  }
  int fd = -1;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    int yes = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, 128) != 0) {
      close(fd);
      fd = -1;
    }
  }
  freeaddrinfo(found);
  return fd;
}

int BoundPort(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return 0;
  if (addr.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  return 0;
}

}  // namespace

struct MetricsHttpServer::Impl {
  const Metrics* metrics = nullptr;
  int listen_fd = -1;
  int wake[2] = {-1, -1};  // the destructor writes to wake[1] to stop the loop
  std::thread thread;

  ~Impl() {
    for (int fd : {listen_fd, wake[0], wake[1]}) {
      if (fd >= 0) close(fd);
    }
  }

  void Loop() {
    std::vector<Connection> conns;
    std::vector<pollfd> fds;
    while (true) {
      const Clock::time_point now = Clock::now();
      // Expired exchanges end, whatever state they are in.
      for (size_t i = 0; i < conns.size();) {
        if (now >= conns[i].deadline) {
          close(conns[i].fd);
          conns[i] = std::move(conns.back());
          conns.pop_back();
        } else {
          ++i;
        }
      }
      fds.clear();
      fds.push_back({wake[0], POLLIN, 0});
      fds.push_back({listen_fd, POLLIN, 0});
      Clock::time_point next_deadline = now + kExchangeDeadline;
      for (const Connection& c : conns) {
        fds.push_back({c.fd, static_cast<short>(c.answering ? POLLOUT : POLLIN), 0});
        if (c.deadline < next_deadline) next_deadline = c.deadline;
      }
      const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next_deadline - now);
      if (poll(fds.data(), fds.size(), static_cast<int>(wait.count()) + 1) < 0 && errno != EINTR) {
        return;
      }
      if (fds[0].revents != 0) return;  // stopping
      // Existing connections first (indices match fds[2 + i]); closed ones are marked fd = -1.
      for (size_t i = 0; i < conns.size(); ++i) {
        if (fds[2 + i].revents != 0) Serve(conns[i]);
      }
      for (size_t i = 0; i < conns.size();) {
        if (conns[i].fd < 0) {
          conns[i] = std::move(conns.back());
          conns.pop_back();
        } else {
          ++i;
        }
      }
      if (fds[1].revents & POLLIN) Accept(conns);
    }
  }

  void Accept(std::vector<Connection>& conns) {
    while (true) {
      const int fd = accept4(listen_fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;  // EAGAIN: all taken (or a transient error: poll again)
      if (conns.size() >= kMaxConnections) {
        // Evict the oldest (earliest deadline): idle or slow clients cannot lock scrapers out.
        size_t oldest = 0;
        for (size_t i = 1; i < conns.size(); ++i) {
          if (conns[i].deadline < conns[oldest].deadline) oldest = i;
        }
        close(conns[oldest].fd);
        conns[oldest] = std::move(conns.back());
        conns.pop_back();
      }
      Connection c;
      c.fd = fd;
      c.deadline = Clock::now() + kExchangeDeadline;
      conns.push_back(std::move(c));
    }
  }

  // Advances one connection: reads the request header, or writes the answer. Marks it closed
  // (fd = -1) when done or broken.
  void Serve(Connection& c) {
    if (!c.answering) {
      char buffer[4096];
      const ssize_t got = recv(c.fd, buffer, sizeof(buffer), 0);
      if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) {
        Close(c);
        return;
      }
      if (got > 0) c.in.append(buffer, static_cast<size_t>(got));
      const size_t end = c.in.find("\r\n\r\n");
      if (end == std::string::npos) {
        if (c.in.size() <= kMaxRequestBytes) return;  // wait for the rest
        c.out = Answer(431, "Request Header Fields Too Large", "text/plain", "too large\n");
      } else {
        c.out = Respond(absl::string_view(c.in).substr(0, end), *metrics);
      }
      c.answering = true;
      c.in.clear();
    }
    while (c.sent < c.out.size()) {
      const ssize_t n = send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
      if (n < 0) {
        if (errno == EAGAIN || errno == EINTR) return;  // poll for POLLOUT again
        break;
      }
      c.sent += static_cast<size_t>(n);
    }
    Close(c);
  }

  static void Close(Connection& c) {
    close(c.fd);
    c.fd = -1;
  }
};

MetricsHttpServer::MetricsHttpServer(std::unique_ptr<Impl> impl, int port)
    : impl_(std::move(impl)), port_(port) {}

MetricsHttpServer::~MetricsHttpServer() {
  const char stop = 1;
  (void)!write(impl_->wake[1], &stop, 1);
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
  impl->metrics = metrics;
  impl->listen_fd = Listen(host, port);
  const int bound = impl->listen_fd >= 0 ? BoundPort(impl->listen_fd) : 0;
  if (bound <= 0) {
    return absl::UnavailableError(absl::StrCat("--metrics-listen: cannot listen on '", host_port,
                                               "' (address in use or not local?)"));
  }
  if (pipe2(impl->wake, O_CLOEXEC) != 0) {
    return absl::InternalError(absl::StrCat("--metrics-listen: pipe: ", std::strerror(errno)));
  }
  Impl* raw = impl.get();
  raw->thread = std::thread([raw] {
    NameThisThread("ls-metrics-http");
    raw->Loop();
  });
  return std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(std::move(impl), bound));
}

}  // namespace logitserve
